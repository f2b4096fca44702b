"""A public simulator of judge / oracle data with KNOWN true policy values.

Used by tests, the demo and benchmarks. Every row is one (prompt, policy) response.

Data-generating process (all draws independent unless shared as stated)
-----------------------------------------------------------------------
For prompts ``p = 1..n`` and policies ``k`` (`PolicySpec`):

* prompt effect      ``u_p ~ N(0, prompt_sd^2)``, shared by all policies (paired design);
* latent quality     ``q = u_p + quality_shift_k + e``, ``e ~ N(0, response_sd^2)``;
* response length    ``L = max(1, round(base_length * verbosity_k * exp(length_sd * z)))``,
  ``z ~ N(0, 1)``; length is independent of quality, so any association between length and
  the judge's error is pure judge bias;
* oracle label       ``Y = round(oracle_levels * Phi(q + zeta)) / oracle_levels``,
  ``zeta ~ N(0, oracle_noise_sd^2)`` (what the oracle sees and the judge does not);
  ``oracle_levels=None`` gives the continuous ``Y = Phi(q + zeta)``;
* judge score        ``S = round(judge_levels * Phi(J)) / judge_levels`` with
  ``J = judge_offset + q + length_bias * log(L / base_length) + adversarial_boost * adv_k + eta``,
  ``eta ~ N(0, judge_noise_sd^2)``. S is monotone in quality but biased upwards
  (``judge_offset``), more so for longer responses (verbosity bias grows with ``log L``), and
  fooled by adversarial policies (high judge score, low oracle label), so a calibration learned
  on the other policies does not transport to them. ``judge_levels=20`` gives at most 21 distinct
  scores (0, 0.05, ..., 1), like real judges.

Known truth
-----------
``true_values[k] = E[Y]`` for policy ``k`` is computed EXACTLY (no Monte Carlo): with
``T = q + zeta ~ N(m, s^2)``, ``m = quality_shift_k``,
``s^2 = prompt_sd^2 + response_sd^2 + oracle_noise_sd^2``:

* continuous oracle: ``E[Phi(T)] = Phi(m / sqrt(1 + s^2))``;
* discretised oracle (levels M): ``E[Y] = sum_j (j/M) P(round(M Phi(T)) = j)`` where
  ``P(round(M Phi(T)) = j) = Phi((c_{j+1} - m)/s) - Phi((c_j - m)/s)`` and
  ``c_j = Phi^{-1}((j - 1/2)/M)`` (``c_0 = -inf``, ``c_{M+1} = +inf``).

These are population (super-population) values, the estimand that confidence intervals must
cover; ``SimulatedData.oracle_all`` holds the realised Y of every row for finite-sample checks.

Label designs (``label_probability`` always holds the true inclusion probability)
-------------------------------------------------------------------------------------
* ``"mcar"``: every row is labelled independently with probability ``oracle_fraction``.
* ``"calibration_policy"``: rows of ``calibration_policy`` (the logger) are labelled with
  probability ``oracle_fraction``; every other policy gets a simple random sample of exactly
  ``min(audit_labels, n_prompts)`` labelled rows (inclusion probability ``audit_labels / n``).
* ``"stratified"``: score-stratified: each distinct judge score is a stratum with inclusion
  probability ``p(S) = min(1, oracle_fraction * w(S) / mean(w))``,
  ``w(S) = 1 + stratified_tilt * (1 - S)`` (low scores are over-sampled), the mean taken over
  all simulated rows; labels are independent Bernoulli(p(S)) given the scores.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from scipy.special import ndtr, ndtri

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, RESPONSE_ID, SCORE
from cje_engine.errors import CJEInputError

logger = logging.getLogger(__name__)

LABEL_DESIGNS = ("mcar", "calibration_policy", "stratified")
RESPONSE_LENGTH = "response_length"


@dataclass(frozen=True)
class PolicySpec:
    """One simulated policy.

    Parameters
    ----------
    name : str
    quality_shift : float
        Mean of the latent quality (on the probit scale of the oracle).
    verbosity : float
        Multiplies the typical response length (> 0).
    adversarial : bool
        Responses fool the judge: ``adversarial_boost`` is added to the judge's latent score.
    """

    name: str
    quality_shift: float = 0.0
    verbosity: float = 1.0
    adversarial: bool = False


def default_policies() -> tuple[PolicySpec, ...]:
    """Five policies shaped like the Arena sample.

    ``base`` and ``clone`` are identical (a true null difference); ``verbose`` is slightly worse
    than base but longer, ``concise`` better but shorter, so the raw judge ranks verbose above
    concise while the oracle ranks concise first; ``unhelpful`` is adversarial (judge high,
    oracle low).
    """
    return (
        PolicySpec("base", quality_shift=0.8),
        PolicySpec("clone", quality_shift=0.8),
        PolicySpec("verbose", quality_shift=0.7, verbosity=2.0),
        PolicySpec("concise", quality_shift=1.0, verbosity=0.6),
        PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True),
    )


#: The policies of `protocol_policies` whose calibration given length transports from ``base``.
PROTOCOL_TRANSPORTED = ("base", "clone", "verbose", "concise", "better", "worse")


def protocol_policies() -> tuple[PolicySpec, ...]:
    """Seven policies shaped like the paper's study (benchmarks/bench_protocol.py and its tests).

    `default_policies` plus ``better`` (better and a little longer than base) and ``worse`` (worse
    and longer): six policies whose calibration given the response length transports
    (`PROTOCOL_TRANSPORTED`) and the adversarial ``unhelpful``.
    """
    return (*default_policies()[:4],
            PolicySpec("better", quality_shift=1.1, verbosity=1.2),
            PolicySpec("worse", quality_shift=0.55, verbosity=1.5),
            default_policies()[4])


@dataclass(frozen=True)
class SimSpec:
    """Every setting of one simulation (see the module docstring for the model)."""

    n_prompts: int
    policies: tuple[PolicySpec, ...] = field(default_factory=default_policies)
    oracle_fraction: float = 0.1
    label_design: str = "mcar"
    calibration_policy: str = "base"
    audit_labels: int = 50
    seed: int = 0
    judge_levels: int = 20
    oracle_levels: int | None = 20
    prompt_sd: float = 0.8
    response_sd: float = 0.6
    oracle_noise_sd: float = 0.5
    judge_noise_sd: float = 0.4
    judge_offset: float = 0.5
    length_bias: float = 0.5
    adversarial_boost: float = 2.5
    base_length: float = 200.0
    length_sd: float = 0.5
    stratified_tilt: float = 3.0

    def validate(self) -> None:
        """Raise `CJEInputError` on inconsistent settings."""
        if int(self.n_prompts) != self.n_prompts or self.n_prompts < 1:
            raise CJEInputError(f"n_prompts must be a positive whole number, got {self.n_prompts!r}")
        if not self.policies:
            raise CJEInputError("at least one policy is needed")
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise CJEInputError(f"policy names must be unique, got {names}")
        for p in self.policies:
            if not (p.verbosity > 0 and np.isfinite(p.verbosity)):
                raise CJEInputError(f"policy {p.name!r}: verbosity must be a positive number, got {p.verbosity!r}")
            if not np.isfinite(p.quality_shift):
                raise CJEInputError(f"policy {p.name!r}: quality_shift must be finite")
        if self.label_design not in LABEL_DESIGNS:
            raise CJEInputError(f"label_design must be one of {LABEL_DESIGNS}, got {self.label_design!r}")
        if not (0 < self.oracle_fraction <= 1):
            raise CJEInputError(f"oracle_fraction must be in (0, 1], got {self.oracle_fraction!r}")
        if self.label_design == "calibration_policy" and self.calibration_policy not in names:
            raise CJEInputError(
                f"calibration_policy {self.calibration_policy!r} is not among the policies {names}"
            )
        if self.audit_labels < 0:
            raise CJEInputError(f"audit_labels must be >= 0, got {self.audit_labels!r}")
        if self.judge_levels < 2:
            raise CJEInputError(f"judge_levels must be >= 2, got {self.judge_levels!r}")
        if self.oracle_levels is not None and self.oracle_levels < 2:
            raise CJEInputError(f"oracle_levels must be >= 2 or None, got {self.oracle_levels!r}")
        for name in ("prompt_sd", "response_sd", "oracle_noise_sd", "judge_noise_sd", "length_sd"):
            if not getattr(self, name) >= 0:
                raise CJEInputError(f"{name} must be >= 0")
        if not self.base_length > 0:
            raise CJEInputError("base_length must be > 0")
        if not self.stratified_tilt >= 0:
            raise CJEInputError("stratified_tilt must be >= 0")

    @property
    def oracle_sd(self) -> float:
        """Standard deviation of the oracle's latent ``q + zeta`` within a policy."""
        return float(np.sqrt(self.prompt_sd**2 + self.response_sd**2 + self.oracle_noise_sd**2))


@dataclass(frozen=True)
class SimulatedData:
    """Output of `simulate`.

    Attributes
    ----------
    frame : pandas.DataFrame
        Canonical frame (``prompt_id``, ``policy``, ``judge_score``, ``oracle_label`` (NaN when
        unlabelled), ``label_probability`` (true inclusion probability on labelled rows, NaN
        elsewhere), ``response_id`` = ``"{policy}:{prompt_id}:0"``, ``response_length``),
        rows ordered by policy, then prompt.
    true_values : dict
        Policy -> exact E[Y] under the data-generating process.
    spec : SimSpec
    oracle_all : ndarray
        Realised oracle outcome Y of every row (aligned with ``frame``), labelled or not.
    inclusion_probability : ndarray
        True P(labelled) of every row (aligned with ``frame``).
    """

    frame: pd.DataFrame
    true_values: dict[str, float]
    spec: SimSpec
    oracle_all: np.ndarray = field(repr=False)
    inclusion_probability: np.ndarray = field(repr=False)


def true_value(quality_shift: float, spec: SimSpec) -> float:
    """Exact E[Y] of a policy with this ``quality_shift`` (formula in the module docstring)."""
    m, s = float(quality_shift), spec.oracle_sd
    if spec.oracle_levels is None:
        return float(ndtr(m / np.sqrt(1.0 + s**2)))
    M = int(spec.oracle_levels)
    if s == 0:
        return float(np.round(M * ndtr(m)) / M)
    j = np.arange(M + 1)
    edges = np.concatenate(([-np.inf], ndtri((j[1:] - 0.5) / M), [np.inf]))
    cdf = ndtr((edges - m) / s)
    return float(np.sum(j / M * np.diff(cdf)))


def simulate(
    n_prompts: int,
    policies: Sequence[PolicySpec] | None = None,
    *,
    oracle_fraction: float = 0.1,
    label_design: str = "mcar",
    calibration_policy: str = "base",
    audit_labels: int = 50,
    seed: int = 0,
    judge_levels: int = 20,
    oracle_levels: int | None = 20,
    **model: float,
) -> SimulatedData:
    """Simulate ``n_prompts * len(policies)`` rows with known true policy values.

    Parameters
    ----------
    n_prompts : int
    policies : sequence of PolicySpec, optional
        Default `default_policies()`.
    oracle_fraction : float
        Labelled share (``"mcar"``), the logger's labelled share (``"calibration_policy"``), or
        the target average share (``"stratified"``).
    label_design : {"mcar", "calibration_policy", "stratified"}
    calibration_policy : str
        The logger whose rows carry the calibration labels (``"calibration_policy"`` design).
    audit_labels : int
        Labelled rows per other policy (``"calibration_policy"`` design).
    seed : int
        Same seed and settings give an identical frame.
    judge_levels, oracle_levels : int
        Discretisation of S and Y (``oracle_levels=None``: continuous Y).
    **model
        Any other `SimSpec` field (``prompt_sd``, ``length_bias``, ``adversarial_boost``, ...).

    Returns
    -------
    SimulatedData
    """
    unknown = sorted(set(model) - set(SimSpec.__dataclass_fields__))
    if unknown:
        raise CJEInputError(f"unknown simulation setting(s): {', '.join(unknown)}")
    spec = SimSpec(
        n_prompts=n_prompts,
        policies=tuple(policies) if policies is not None else default_policies(),
        oracle_fraction=oracle_fraction,
        label_design=label_design,
        calibration_policy=calibration_policy,
        audit_labels=audit_labels,
        seed=seed,
        judge_levels=judge_levels,
        oracle_levels=oracle_levels,
        **model,
    )
    return simulate_spec(spec)


def simulate_spec(spec: SimSpec) -> SimulatedData:
    """Run the simulation described by ``spec`` (see `simulate`)."""
    spec.validate()
    n, K = int(spec.n_prompts), len(spec.policies)
    rng = np.random.default_rng(spec.seed)

    shift = np.array([p.quality_shift for p in spec.policies])
    verbosity = np.array([p.verbosity for p in spec.policies])
    adv = np.array([p.adversarial for p in spec.policies], dtype=np.float64)

    u = spec.prompt_sd * rng.standard_normal(n)
    # Policy-major layout: rows k*n .. (k+1)*n-1 belong to policy k, prompts in order.
    # Arithmetic is done in place where possible: 10 million rows are a few large arrays.
    q = rng.standard_normal((K, n))
    q *= spec.response_sd
    q += u[None, :]
    q += shift[:, None]
    q = q.ravel()
    log_len = rng.standard_normal((K, n))
    log_len *= spec.length_sd
    log_len += np.log(spec.base_length * verbosity)[:, None]
    length = np.exp(log_len, out=log_len).ravel()
    np.round(length, out=length)
    np.maximum(length, 1.0, out=length)
    y = rng.standard_normal(K * n)
    y *= spec.oracle_noise_sd
    y += q
    ndtr(y, out=y)
    if spec.oracle_levels is not None:
        y *= spec.oracle_levels
        np.round(y, out=y)
        y /= spec.oracle_levels
    j = rng.standard_normal(K * n)
    j *= spec.judge_noise_sd
    j += q
    del q
    j += spec.judge_offset
    j += spec.length_bias * np.log(length / spec.base_length)
    if adv.any():
        j += np.repeat(spec.adversarial_boost * adv, n)
    s = ndtr(j, out=j)
    s *= spec.judge_levels
    np.round(s, out=s)
    s /= spec.judge_levels

    prob = _inclusion_probability(spec, s)
    labelled = _draw_labels(spec, prob, rng)

    frame = _build_frame(spec, s, y, labelled, prob, length)
    truth = {p.name: true_value(p.quality_shift, spec) for p in spec.policies}
    logger.info(
        "simulated %d rows (%d prompts x %d policies), %d labelled, design %s",
        K * n, n, K, int(labelled.sum()), spec.label_design,
    )
    return SimulatedData(frame=frame, true_values=truth, spec=spec, oracle_all=y, inclusion_probability=prob)


def _inclusion_probability(spec: SimSpec, s: np.ndarray) -> np.ndarray:
    """True P(labelled) of every row (policy-major layout)."""
    n, K = int(spec.n_prompts), len(spec.policies)
    if spec.label_design == "mcar":
        return np.full(K * n, float(spec.oracle_fraction))
    if spec.label_design == "calibration_policy":
        audit = min(int(spec.audit_labels), n) / n
        per_policy = np.array(
            [spec.oracle_fraction if p.name == spec.calibration_policy else audit for p in spec.policies]
        )
        return np.repeat(per_policy, n)
    w = 1.0 + spec.stratified_tilt * (1.0 - s)
    return np.minimum(1.0, spec.oracle_fraction * w / w.mean())


def _draw_labels(spec: SimSpec, prob: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = int(spec.n_prompts)
    if spec.label_design != "calibration_policy":
        return rng.random(prob.size) < prob
    labelled = np.zeros(prob.size, dtype=bool)
    m = min(int(spec.audit_labels), n)
    for k, p in enumerate(spec.policies):
        block = slice(k * n, (k + 1) * n)
        if p.name == spec.calibration_policy:
            labelled[block] = rng.random(n) < spec.oracle_fraction
        elif m > 0:
            chosen = rng.choice(n, size=m, replace=False)
            labelled[k * n + chosen] = True
    return labelled


def _build_frame(
    spec: SimSpec,
    s: np.ndarray,
    y: np.ndarray,
    labelled: np.ndarray,
    prob: np.ndarray,
    length: np.ndarray,
) -> pd.DataFrame:
    n, K = int(spec.n_prompts), len(spec.policies)
    width = len(str(n - 1))
    ids = pc.utf8_lpad(pc.cast(pa.array(np.arange(n)), pa.string()), width, "0")
    prompt_ids = pc.binary_join_element_wise("p", ids, "")
    prompt_col = pa.concat_arrays([prompt_ids] * K)
    names = [p.name for p in spec.policies]
    policy_col = pa.DictionaryArray.from_arrays(
        pa.array(np.repeat(np.arange(K, dtype=np.int32), n)), pa.array(names)
    ).cast(pa.string())
    rid = pc.binary_join_element_wise(policy_col, prompt_col, pa.scalar("0"), ":")
    # Arrow strings become pandas "str" columns without copying; floats are numpy arrays.
    frame = pd.DataFrame(
        {
            PROMPT: prompt_col.to_pandas(),
            POLICY: policy_col.to_pandas(),
            SCORE: s,
            LABEL: np.where(labelled, y, np.nan),
            LABEL_PROB: np.where(labelled, prob, np.nan),
            RESPONSE_ID: rid.to_pandas(),
            RESPONSE_LENGTH: length,
        },
        copy=False,
    )
    return frame


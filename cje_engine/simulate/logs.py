"""Simulated logs with known truth for off-policy evaluation.

A logger and target policies write responses of T tokens over a small vocabulary. Per prompt x
the logger's token distribution is ``p0(.|x) = softmax(b_x)`` (``b_x`` random per prompt) and a
target's is ``p(.|x) = softmax(b_x + eta * u)``: it tilts toward tokens of high utility ``u``
(``u`` evenly spaced on [-1, 1]); ``eta`` is the size of the policy shift. Tokens are drawn
independently given the prompt, so a response is summarised by its token counts ``c`` and its
sequence log-probability is ``sum_v c_v log p(v|x)``: a sum over T tokens, so the importance
weight is a product of T per-token ratios and overlap collapses as T grows.

Judge and oracle: ``ubar = mean token utility``, a per-prompt difficulty ``d_x ~ U(-b, b)``
(shared by every policy, so it moves scores but not log-probabilities), judge noise
``e ~ U(-a, a)``, ``S = (ubar + d_x + e + c) / (2c)`` in [0, 1] with ``c = 1 + a + b``, and the
oracle label
``Y ~ Beta(kappa h(S), kappa (1 - h(S)))`` in (0, 1), so ``E[Y | S] = h(S) = 0.05 + 0.9 s^2``. Y depends on the response only through S, so a calibration
learned under the logger transports to every target (the surrogate assumption holds), the raw
judge mean is not the oracle mean (h is not the identity), and the true target value over the
simulated prompts is exact:
``V(p) = mean_x [0.05 + 0.9 (E[L^2|x] + 2 c E[L|x] + c^2) / (2c)^2]`` where ``L = ubar + d_x + e``,
``E[L|x] = mu_x + d_x``, ``E[L^2|x] = mu_x^2 + var_x / T + d_x^2 + 2 mu_x d_x + a^2/3``,
``mu_x = sum_v p(v|x) u_v`` and ``var_x`` the token-utility variance under ``p(.|x)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np
from scipy.special import log_softmax

from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.inputs import FreshData, LoggedData

if TYPE_CHECKING:
    import pandas as pd


def oracle_curve(s: np.ndarray) -> np.ndarray:
    """E[Y | S = s] in the simulation: ``0.05 + 0.9 s^2``."""
    s = np.asarray(s, dtype=float)
    return 0.05 + 0.9 * s * s


def _value(logp: np.ndarray, u: np.ndarray, length: int, d2: np.ndarray | float, d: np.ndarray | float,
           a: float, half: float) -> np.ndarray:
    """Per-prompt E[h(S) | x] for token log-probabilities ``logp`` (rows = prompts)."""
    p = np.exp(logp)
    mu = p @ u
    var = p @ (u * u) - mu * mu
    el = mu + d
    el2 = mu * mu + var / length + d2 + 2.0 * mu * d + a * a / 3.0
    es2 = (el2 + 2.0 * half * el + half * half) / (2.0 * half) ** 2
    return 0.05 + 0.9 * es2


def population_value(eta: float, *, length: int = 20, vocab_size: int = 16, prompt_spread: float = 0.3,
                     difficulty_spread: float = 0.5, judge_noise: float = 0.25, n_mc: int = 200_000,
                     seed: int = 20240601) -> float:
    """Value of the policy with tilt ``eta`` over the whole prompt distribution (not just the
    prompts of one simulated data set): the estimand for coverage studies in which every
    replicate draws new prompts. The difficulty is integrated exactly (E d = 0, E d^2 = b^2/3);
    the prompt logits by Monte Carlo over ``n_mc`` prompts (error ~1e-5)."""
    rng = np.random.default_rng(seed)
    a, b = float(judge_noise), float(difficulty_spread)
    half = 1.0 + a + b
    u = np.linspace(-1.0, 1.0, vocab_size)
    vals = []
    for start in range(0, n_mc, 50_000):
        size = min(50_000, n_mc - start)
        logits = prompt_spread * rng.normal(size=(size, vocab_size))
        vals.append(_value(log_softmax(logits + eta * u, axis=1), u, length, b * b / 3.0, 0.0, a, half))
    return float(np.mean(np.concatenate(vals)))


@dataclass(frozen=True)
class SimFresh:
    """Fresh draws from one target: prompt ids, judge scores, oracle outcomes, log-probabilities."""

    prompt_ids: np.ndarray
    scores: np.ndarray
    oracle: np.ndarray
    target_logprob: np.ndarray
    logger_logprob: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class SimulatedLogs:
    """One simulated data set (see the module docstring).

    ``truth[target]`` is the exact mean oracle value of ``target`` over the simulated prompts;
    ``truth["logger"]`` the logger's.
    """

    length: int
    prompt_ids: np.ndarray
    scores: np.ndarray
    oracle: np.ndarray
    labelled: np.ndarray
    logger_logprob: np.ndarray
    target_logprob: Mapping[str, np.ndarray]
    fresh: Mapping[str, SimFresh]
    truth: Mapping[str, float]
    etas: Mapping[str, float] = field(default_factory=dict)

    @property
    def lengths(self) -> np.ndarray:
        """Response length of every logged row (the simulation's constant length)."""
        return np.full(self.prompt_ids.shape[0], float(self.length))

    def logged_data(self, target: str) -> LoggedData:
        """The `LoggedData` of target ``target`` (unknown targets raise `CJEInputError`)."""
        if target not in self.target_logprob:
            raise CJEInputError(f"unknown target {target!r}; simulated targets: {', '.join(self.target_logprob)}")
        return LoggedData(self.prompt_ids, self.scores, self.logger_logprob, self.target_logprob[target],
                          lengths=self.lengths, source="<simulation>", target_column=f"target_policy_logprobs[{target}]")

    def fresh_data(self, target: str) -> FreshData:
        """The `FreshData` (fresh draws) of target ``target``."""
        f = self.fresh[target]
        return FreshData(f.prompt_ids, f.scores, f.target_logprob, f.lengths, source="<simulation fresh>")

    def to_frames(self, logger: str = "base") -> tuple[pd.DataFrame, pd.DataFrame]:
        """The data as tables for `cje_engine.pipeline.offpolicy.evaluate_offpolicy`.

        Returns ``(logged, fresh)``: ``logged`` has one row per logged response (``prompt_id``,
        ``policy`` = ``logger``, ``response_id``, ``judge_score``, ``oracle_label`` on the labelled
        rows, ``n_tokens``, ``base_logprob`` and ``logprob__<target>``); ``fresh`` one row per fresh
        draw (``policy`` = the target, its own ``logprob__<target>``, other logprob columns empty).
        """
        import pandas as pd

        n = self.prompt_ids.shape[0]
        logged = pd.DataFrame({
            "prompt_id": self.prompt_ids, "policy": logger,
            "response_id": [f"{logger}:{p}:0" for p in self.prompt_ids],
            "judge_score": self.scores, "oracle_label": np.where(self.labelled, self.oracle, np.nan),
            "n_tokens": np.full(n, float(self.length)), "base_logprob": self.logger_logprob,
            **{f"logprob__{t}": v for t, v in self.target_logprob.items()},
        })
        parts = []
        for t, f in self.fresh.items():
            k = np.zeros(f.prompt_ids.shape[0], dtype=int)
            seen: dict[str, int] = {}
            for i, p in enumerate(f.prompt_ids):
                k[i] = seen.get(p, 0)
                seen[p] = k[i] + 1
            parts.append(pd.DataFrame({
                "prompt_id": f.prompt_ids, "policy": t,
                "response_id": [f"{t}:{p}:{j}" for p, j in zip(f.prompt_ids, k)],
                "judge_score": f.scores, "oracle_label": np.nan, "n_tokens": f.lengths, "base_logprob": np.nan,
                **{f"logprob__{u}": (f.target_logprob if u == t else np.nan) for u in self.target_logprob},
            }))
        return logged, pd.concat(parts, ignore_index=True)


def simulate_logs(*, n_prompts: int = 1000, length: int = 20,
                  targets: Mapping[str, float] | None = None, vocab_size: int = 16,
                  prompt_spread: float = 0.3, difficulty_spread: float = 0.5, judge_noise: float = 0.25,
                  label_fraction: float = 0.25,
                  fresh_per_prompt: int = 1, label_concentration: float = 8.0, seed: int = 0) -> SimulatedLogs:
    """Simulate one logged data set, fresh draws per target, and the exact truths.

    Parameters
    ----------
    n_prompts : prompts, one logged response each
    length : tokens per response (T)
    targets : name -> tilt eta (default ``{"near_clone": 0.05, "shifted": 0.5}``)
    vocab_size, prompt_spread : vocabulary size and SD of the per-prompt logits
    difficulty_spread : half-width b of the uniform per-prompt difficulty
    judge_noise : half-width a of the uniform judge noise
    label_fraction : share of logged rows with an oracle label (missing completely at random)
    fresh_per_prompt : fresh draws per prompt and target
    label_concentration : kappa of the Beta oracle labels (larger = less label noise)
    seed : random seed (same seed, same data)
    """
    targets = dict(targets) if targets is not None else {"near_clone": 0.05, "shifted": 0.5}
    if n_prompts < 1 or length < 1 or vocab_size < 2 or fresh_per_prompt < 1:
        raise CJEInputError("n_prompts, length and fresh_per_prompt must be >= 1 and vocab_size >= 2")
    if not 0 <= label_fraction <= 1 or judge_noise < 0 or difficulty_spread < 0 or label_concentration <= 0:
        raise CJEInputError("label_fraction must lie in [0, 1], judge_noise be >= 0 and label_concentration > 0")
    if "logger" in targets:
        raise CJEInputError("'logger' is reserved for the logging policy; rename the target")
    rng = np.random.default_rng(seed)
    a, b = float(judge_noise), float(difficulty_spread)
    half = 1.0 + a + b  # c in the docstring
    u = np.linspace(-1.0, 1.0, vocab_size)
    logits = prompt_spread * rng.normal(size=(n_prompts, vocab_size))
    d = rng.uniform(-b, b, size=n_prompts)
    lp0 = log_softmax(logits, axis=1)
    lpt = {name: log_softmax(logits + eta * u, axis=1) for name, eta in targets.items()}
    pids = np.array([f"sim_{i}" for i in range(n_prompts)])

    def respond(logp: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = rng.multinomial(length, np.exp(logp[rows]))
        ubar = counts @ u / length
        s = (ubar + d[rows] + rng.uniform(-a, a, size=rows.shape[0]) + half) / (2.0 * half)
        h = oracle_curve(s)
        y = rng.beta(label_concentration * h, label_concentration * (1.0 - h))
        return counts, s, y

    def value(logp: np.ndarray) -> float:
        return float(np.mean(_value(logp, u, length, d * d, d, a, half)))

    rows = np.arange(n_prompts)
    counts, scores, oracle = respond(lp0, rows)
    logger_lp = np.sum(counts * lp0, axis=1)
    target_lp = {name: np.sum(counts * lp, axis=1) for name, lp in lpt.items()}
    labelled = rng.uniform(size=n_prompts) < label_fraction
    fresh: dict[str, SimFresh] = {}
    frows = np.repeat(rows, fresh_per_prompt)
    for name, lp in lpt.items():
        c, s, y = respond(lp, frows)
        fresh[name] = SimFresh(pids[frows], s, y, np.sum(c * lp[frows], axis=1), np.sum(c * lp0[frows], axis=1),
                               np.full(frows.shape[0], float(length)))
    truth = {name: value(lp) for name, lp in lpt.items()}
    truth["logger"] = value(lp0)
    return SimulatedLogs(length, pids, scores, oracle, labelled, logger_lp, target_lp, fresh, truth, dict(targets))

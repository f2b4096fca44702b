"""A simulator of segmented data with KNOWN per-segment truth (tests, benchmarks, docs/segments.md).

Prompts belong to segments (``segment``: a prompt attribute such as a topic); every policy answers every
prompt. For prompt ``p`` in segment ``s`` and policy ``k``:

* latent quality ``q = u_p + mu[k, s] + e``, ``u_p ~ N(0, prompt_sd^2)``, ``e ~ N(0, response_sd^2)``;
* oracle label ``Y = Phi(q + zeta)``, ``zeta ~ N(0, oracle_noise_sd^2)`` (continuous, in [0, 1]);
* judge score ``S = round(levels * Phi(q + bias[s] + eta)) / levels``, ``eta ~ N(0, judge_noise_sd^2)``:
  a judge biased by ``bias[s]`` in segment ``s`` (a calibration fitted on every segment does not
  transport to it).

Truth: ``E[Y | s, k] = Phi(mu[k, s] / sqrt(1 + prompt_sd^2 + response_sd^2 + oracle_noise_sd^2))``, exact.

Scenarios (`segment_scenario`): ``"loser"`` a policy better overall and worse in one segment,
``"opposite"`` a judge miscalibrated in opposite directions in two segments of equal size (the pooled
mean residual is about 0), ``"null"`` nothing differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.special import ndtr

SCENARIOS = ("loser", "opposite", "null")
#: Level of the studies' tests and intervals.
ALPHA = 0.05


@dataclass(frozen=True)
class SegmentSpec:
    """Settings of `simulate_segments` (see the module docstring for the model)."""

    n_prompts: int = 2000
    segments: tuple[str, ...] = ("a", "b", "c", "d")
    policies: tuple[str, ...] = ("base", "new")
    mu: tuple[tuple[float, ...], ...] = ((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0))  # [policy][segment]
    bias: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # judge bias per segment (probit scale)
    oracle_fraction: float = 0.10
    prompt_sd: float = 0.5
    response_sd: float = 0.5
    oracle_noise_sd: float = 0.3
    judge_noise_sd: float = 0.3
    levels: int = 20
    seed: int = 0


@dataclass
class SegmentData:
    """A simulated frame with its exact truth per (segment, policy)."""

    frame: pd.DataFrame
    truth: dict = field(default_factory=dict)  # (segment, policy) -> E[Y]
    spec: SegmentSpec | None = None

    def diff(self, segment: str, policy: str, baseline: str) -> float:
        """True ``policy - baseline`` in ``segment``."""
        return self.truth[(segment, policy)] - self.truth[(segment, baseline)]


def segment_scenario(name: str, *, n_prompts: int = 2000, oracle_fraction: float = 0.10, seed: int = 0,
                     effect: float = 0.35, bias: float = 0.6) -> SegmentSpec:
    """The spec of a named scenario (`SCENARIOS`).

    ``loser``: ``new`` is ``effect / 2`` better (probit) in segments a-c and ``effect`` worse in d.
    ``opposite``: the judge over-rates segment a by ``bias`` and under-rates b by ``bias`` (a and b of
    equal size, so the pooled mean residual is about 0). ``null``: nothing differs.
    """
    if name not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}; got {name!r}")
    spec = SegmentSpec(n_prompts=n_prompts, oracle_fraction=oracle_fraction, seed=seed)
    if name == "loser":
        up = effect / 2
        return SegmentSpec(**{**spec.__dict__, "mu": ((0.0,) * 4, (up, up, up, -effect))})
    if name == "opposite":
        return SegmentSpec(**{**spec.__dict__, "bias": (bias, -bias, 0.0, 0.0)})
    return spec


def true_values(spec: SegmentSpec) -> dict:
    """``(segment, policy) -> E[Y]``, exact (module docstring)."""
    s2 = spec.prompt_sd ** 2 + spec.response_sd ** 2 + spec.oracle_noise_sd ** 2
    return {(seg, pol): float(ndtr(spec.mu[k][j] / np.sqrt(1 + s2)))
            for k, pol in enumerate(spec.policies) for j, seg in enumerate(spec.segments)}


def simulate_segments(spec: SegmentSpec) -> SegmentData:
    """Simulate ``n_prompts x len(policies)`` rows (segments of equal expected size, MCAR labels)."""
    rng = np.random.default_rng(spec.seed)
    n, K, S = spec.n_prompts, len(spec.policies), len(spec.segments)
    seg = rng.integers(0, S, n)
    u = spec.prompt_sd * rng.standard_normal(n)
    mu = np.asarray(spec.mu, float)
    bias = np.asarray(spec.bias, float)
    prompt = np.repeat(np.arange(n), K)
    pol = np.tile(np.arange(K), n)
    s_row = seg[prompt]
    q = u[prompt] + mu[pol, s_row] + spec.response_sd * rng.standard_normal(n * K)
    y = ndtr(q + spec.oracle_noise_sd * rng.standard_normal(n * K))
    score = np.round(spec.levels * ndtr(q + bias[s_row] + spec.judge_noise_sd * rng.standard_normal(n * K))) / spec.levels
    labelled = rng.random(n * K) < spec.oracle_fraction
    frame = pd.DataFrame({
        "prompt_id": np.char.add("p", prompt.astype(str)),
        "policy": np.asarray(spec.policies, dtype=object)[pol],
        "judge_score": score,
        "oracle_label": np.where(labelled, y, np.nan),
        "label_probability": np.where(labelled, spec.oracle_fraction, np.nan),
        "segment": np.asarray(spec.segments, dtype=object)[s_row],
    })
    return SegmentData(frame, true_values(spec), spec)


# ------------------------------------------------------------------ the study (tests, benchmark, docs)


def study_one(scenario: str, seed: int, inference: str = "analytic", n_prompts: int = 2000, n_bootstrap: int = 200,
              **opts) -> dict:
    """One dataset's outcomes: claims, omnibus, audits and interval coverage against the truth."""
    from cje_engine.pipeline.direct import evaluate  # the pipeline never imports the simulators: no cycle

    d = simulate_segments(segment_scenario(scenario, seed=seed, n_prompts=n_prompts))
    kw = {"n_bootstrap": n_bootstrap} if inference == "bootstrap" else {}
    opts = {"segment_pooling": "eb", **opts}
    sg = evaluate(d.frame, segment_by=["segment"], inference=inference, seed=seed, alpha=ALPHA, **kw, **opts).segments
    covered = [c.ci[0] <= d.truth[(c.segment, c.policy)] <= c.ci[1] for c in sg.cells if c.ci is not None]
    pooled = [c for c in sg.cells if c.pooled is not None]
    eb_covered = [c.pooled.ci[0] <= d.truth[(c.segment, c.policy)] <= c.pooled.ci[1] for c in pooled]
    eb_width = [(c.pooled.ci[1] - c.pooled.ci[0]) / (c.ci[1] - c.ci[0]) for c in pooled]
    claims = [c for c in sg.comparisons if c.significant]
    false = [c for c in claims if np.sign(c.diff) != np.sign(d.diff(c.segment, c.policy, c.baseline))
             or d.diff(c.segment, c.policy, c.baseline) == 0]
    fcr_cov = [c.ci_fcr[0] <= d.diff(c.segment, c.policy, c.baseline) <= c.ci_fcr[1] for c in claims]
    star = sg.omnibus[0]
    return {"loser_found": any(c.segment == "d" and c.worse for c in sg.comparisons),
            "n_claims": len(claims), "n_false": len(false), "any_false": bool(false),
            "fcp": (len(fcr_cov) - sum(fcr_cov)) / len(fcr_cov) if fcr_cov else 0.0,
            "omnibus_reject": bool(star.reject), "pooled_pass": bool(star.pooled_p_value > ALPHA),
            "omnibus_any_policy": any(o.reject for o in sg.omnibus[1:]),
            "audit_family_fail": any(c.audit.p_adjusted is not None and c.audit.p_adjusted <= ALPHA for c in sg.cells),
            "covered": int(sum(covered)), "shown": len(covered),
            "eb_covered": int(sum(eb_covered)), "eb_shown": len(eb_covered), "eb_width": float(np.sum(eb_width)),
            "eb_d_covered": [c.pooled.ci[0] <= d.truth[(c.segment, c.policy)] <= c.pooled.ci[1]
                             for c in pooled if c.segment == "d" and c.policy == "new"],
            "recalibrated": sg.recalibration.applied}


def rate(x: list) -> tuple[float, float]:
    """Mean of 0/1 outcomes and its Monte Carlo SE ``sqrt(p (1 - p) / n)``."""
    a = np.asarray(x, float)
    p = float(a.mean())
    return p, float(np.sqrt(p * (1 - p) / max(a.size, 1)))


def segment_study(n: int, inference: str = "analytic", n_prompts: int = 2000, seed0: int = 0) -> dict:
    """Every figure of docs/segments.md over ``n`` datasets per scenario."""
    out = {"n": n, "inference": inference, "n_prompts": n_prompts}
    runs = {s: [study_one(s, seed0 + i, inference, n_prompts) for i in range(n)] for s in ("loser", "opposite", "null")}
    lo, op, nu = runs["loser"], runs["opposite"], runs["null"]
    out["a_power_losing_segment"] = rate([r["loser_found"] for r in lo])
    out["a_false_claim_proportion"] = float(sum(r["n_false"] for r in lo) / max(sum(r["n_claims"] for r in lo), 1))
    out["a_fcr_selected_intervals"] = rate([r["fcp"] for r in lo])
    out["b_omnibus_reject"] = rate([r["omnibus_reject"] for r in op])
    out["b_pooled_audit_pass"] = rate([r["pooled_pass"] for r in op])
    out["b_omnibus_reject_and_pooled_pass"] = rate([r["omnibus_reject"] and r["pooled_pass"] for r in op])
    out["c_any_false_claim"] = rate([r["any_false"] for r in nu])
    out["c_omnibus_false_reject"] = rate([r["omnibus_reject"] for r in nu])
    out["c_omnibus_any_policy_false_reject"] = rate([r["omnibus_any_policy"] for r in nu])
    out["c_audit_family_false_fail"] = rate([r["audit_family_fail"] for r in nu])
    cov = sum(r["covered"] for r in nu + lo)
    shown = sum(r["shown"] for r in nu + lo)
    p = cov / shown
    out["coverage_shown_intervals"] = (p, float(np.sqrt(p * (1 - p) / shown)))
    out["n_shown_intervals"] = shown
    for name, rs in (("null", nu), ("loser", lo)):
        eb_n = sum(r["eb_shown"] for r in rs)
        p = sum(r["eb_covered"] for r in rs) / max(eb_n, 1)
        out[f"eb_coverage_{name}"] = (p, float(np.sqrt(p * (1 - p) / max(eb_n, 1))))
        out[f"eb_width_ratio_{name}"] = sum(r["eb_width"] for r in rs) / max(eb_n, 1)
    out["eb_coverage_loser_segment_d_new"] = rate([x for r in lo for x in r["eb_d_covered"]])
    return out

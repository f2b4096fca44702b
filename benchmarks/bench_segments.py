"""Segments: power, omnibus rejection, false claims and coverage over simulated datasets (docs/segments.md).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_segments.py [N] [inference] [n_prompts]

Runs `cje_engine.simulate.segments` scenarios ``loser``, ``opposite`` and ``null`` N times each (default
100) through ``evaluate(..., segment_by=["segment"])`` and prints every figure with its Monte Carlo SE
(JSON on the last line). The statistics are in `study`, which the tests in tests/stats/test_segments.py
call with fewer datasets.
"""
from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np

from cje_engine import evaluate
from cje_engine.simulate.segments import segment_scenario, simulate_segments

ALPHA = 0.05


def one(scenario: str, seed: int, inference: str = "analytic", n_prompts: int = 2000, n_bootstrap: int = 200,
        **opts) -> dict:
    """One dataset's outcomes: claims, omnibus, audits and interval coverage against the truth."""
    d = simulate_segments(segment_scenario(scenario, seed=seed, n_prompts=n_prompts))
    kw = {"n_bootstrap": n_bootstrap} if inference == "bootstrap" else {}
    sg = evaluate(d.frame, segment_by=["segment"], inference=inference, seed=seed, alpha=ALPHA, **kw, **opts).segments
    covered = [c.ci[0] <= d.truth[(c.segment, c.policy)] <= c.ci[1] for c in sg.cells if c.ci is not None]
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
            "recalibrated": sg.recalibration.applied}


def rate(x: list) -> tuple[float, float]:
    """Mean of 0/1 outcomes and its Monte Carlo SE."""
    a = np.asarray(x, float)
    p = float(a.mean())
    return p, float(np.sqrt(p * (1 - p) / max(a.size, 1)))


def study(n: int, inference: str = "analytic", n_prompts: int = 2000, seed0: int = 0) -> dict:
    """Every figure of docs/segments.md over ``n`` datasets per scenario."""
    out = {"n": n, "inference": inference, "n_prompts": n_prompts}
    runs = {s: [one(s, seed0 + i, inference, n_prompts) for i in range(n)] for s in ("loser", "opposite", "null")}
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
    return out


def main(argv: list[str]) -> int:
    """Run the study and print it."""
    logging.basicConfig(level=logging.WARNING)
    n = int(argv[0]) if argv else 100
    inference = argv[1] if len(argv) > 1 else "analytic"
    n_prompts = int(argv[2]) if len(argv) > 2 else 2000
    t0 = time.perf_counter()
    res = study(n, inference, n_prompts)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    for k, v in res.items():
        print(f"{k:40s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

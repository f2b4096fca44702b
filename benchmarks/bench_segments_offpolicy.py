"""Off-policy segments on simulated logs with known per-segment truth (docs/segments.md, "Off-policy modes").

    PYTHONPATH=. .venv/bin/python benchmarks/bench_segments_offpolicy.py [N] [mode] [n_prompts_per_segment] [scenario]

Two prompt segments, each simulated by `cje_engine.simulate.logs.simulate_logs` (exact truth over its prompts):
in segment ``a`` the candidate ``t`` tilts toward high-utility tokens (eta +0.4: better than the logger), in
``b`` away from them (eta -0.4: worse). Each dataset goes through ``evaluate_offpolicy(..., segment_by=["category"])``
(analytic route, alpha 0.05); the figures: coverage of the shown segment intervals (BY level) of every cell
against its segment's truth, the losing segment claimed (BH), wrong-sign claims. Prints every figure with its
Monte Carlo SE (JSON on the last line).

Scenario ``null`` (nothing differs): the candidate has eta 0 in both segments (the logger's own distribution; its
value equals the logger's in each segment exactly). The figures: datasets with any segment claim (all false:
the family-wise false claim rate), claims, and the coverage of the shown intervals. In hybrid mode the candidate's
fresh draws are its own sample, so the comparison is a real null test; in logs-only its weights are exactly 1 and
its level is computed from the logger's numbers (a difference of 0 by construction: no claim can be made).
"""
from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np
import pandas as pd

from cje_engine.pipeline.offpolicy import evaluate_offpolicy
from cje_engine.simulate.logs import simulate_logs

ETAS = {"a": 0.4, "b": -0.4}
#: The candidate's tilt per segment in each scenario.
SCENARIOS = {"loser": ETAS, "null": {"a": 0.0, "b": 0.0}}


def dataset(seed: int, n_prompts: int, etas: dict | None = None) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Logged rows, fresh draws and the truth per (segment, policy) of one dataset (``etas``: the candidate's tilt
    per segment, `ETAS` by default)."""
    logged, fresh, truth = [], [], {}
    for j, (seg, eta) in enumerate((etas or ETAS).items()):
        sim = simulate_logs(n_prompts=n_prompts, length=4, targets={"t": eta}, seed=1000 * seed + j, label_fraction=0.25)
        lg, fr = sim.to_frames("base")
        for f in (lg, fr):
            f["prompt_id"] = seg + "-" + f["prompt_id"].astype(str)
            f["response_id"] = seg + "-" + f["response_id"].astype(str)
        lg["category"] = seg
        logged.append(lg)
        fresh.append(fr)
        truth[(seg, "base")], truth[(seg, "t")] = sim.truth["logger"], sim.truth["t"]
    return pd.concat(logged, ignore_index=True), pd.concat(fresh, ignore_index=True), truth


def study(n: int, mode: str, n_prompts: int, scenario: str = "loser") -> dict:
    """Coverage, power, wrong-sign claims and (true difference 0) false claims over ``n`` datasets."""
    covered, shown, lost, wrong, claims, false_claims, any_false = 0, 0, 0, 0, 0, 0, 0
    for i in range(n):
        logged, fresh, truth = dataset(i, n_prompts, SCENARIOS[scenario])
        false_here = 0
        seg = evaluate_offpolicy(logged, fresh, mode=mode, segment_by=["category"], inference="analytic",
                                 seed=i).to_dict()["segments"]
        for c in seg["cells"]:
            if c["ci"] is not None:
                shown += 1
                covered += int(c["ci"][0] <= truth[(c["segment"], c["policy"])] <= c["ci"][1])
        for c in seg["comparisons"]:
            if c["significant"]:
                claims += 1
                true_diff = truth[(c["segment"], "t")] - truth[(c["segment"], "base")]
                if true_diff == 0:
                    false_here += 1
                else:
                    wrong += int(np.sign(c["diff"]) != np.sign(true_diff))
            lost += int(c["segment"] == "b" and bool(c["worse"]))
        false_claims += false_here
        any_false += int(false_here > 0)
    se = lambda p, m: float(np.sqrt(p * (1 - p) / max(m, 1)))  # noqa: E731
    cov, pw, fw = covered / max(shown, 1), lost / n, any_false / n
    return {"n": n, "mode": mode, "scenario": scenario, "n_prompts_per_segment": n_prompts,
            "coverage_shown_intervals": (cov, se(cov, shown)), "n_shown_intervals": shown,
            "losing_segment_claimed": (pw, se(pw, n)), "claims": claims, "wrong_sign_claims": wrong,
            "false_claims": false_claims, "any_false_claim_familywise": (fw, se(fw, n))}


def main(argv: list[str]) -> int:
    """Run the study and print it."""
    logging.basicConfig(level=logging.WARNING)
    n = int(argv[0]) if argv else 100
    mode = argv[1] if len(argv) > 1 else "hybrid"
    n_prompts = int(argv[2]) if len(argv) > 2 else 1000
    scenario = argv[3] if len(argv) > 3 else "loser"
    t0, c0 = time.perf_counter(), time.process_time()
    res = study(n, mode, n_prompts, scenario)
    res["seconds"], res["cpu_seconds"] = round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1)
    for k, v in res.items():
        print(f"{k:32s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

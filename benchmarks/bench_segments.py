"""Segments: power, omnibus rejection, false claims and coverage over simulated datasets (docs/segments.md).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_segments.py [N] [inference] [n_prompts] [seed0]

``100 analytic 2000 5000`` is the slow test's run (tests/stats/test_segments.py, `N_SLOW` datasets from seed 5000).

Runs `cje_engine.simulate.segments` scenarios ``loser``, ``opposite`` and ``null`` N times each (default
100) through ``evaluate(..., segment_by=["segment"])`` and prints every figure with its Monte Carlo SE
(JSON on the last line). The study is `cje_engine.simulate.segments.segment_study`, which tests/stats/test_segments.py
runs with fewer datasets.
"""
from __future__ import annotations

import json
import logging
import sys
import time

from cje_engine.simulate.segments import segment_study


def main(argv: list[str]) -> int:
    """Run the study and print it."""
    logging.basicConfig(level=logging.WARNING)
    n = int(argv[0]) if argv else 100
    inference = argv[1] if len(argv) > 1 else "analytic"
    n_prompts = int(argv[2]) if len(argv) > 2 else 2000
    seed = {"seed0": int(argv[3])} if len(argv) > 3 else {}
    t0, c0 = time.perf_counter(), time.process_time()
    res = segment_study(n, inference, n_prompts, **seed)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["cpu_seconds"] = round(time.process_time() - c0, 1)
    for k, v in res.items():
        print(f"{k:40s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

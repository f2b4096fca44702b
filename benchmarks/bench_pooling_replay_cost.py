"""Cost of rerunning robust pooling in every bootstrap replicate (issue 9: no replicate > 20% slower).

Pooled design of `bench_protocol.py` (every policy labelled at random at ``--fraction``, the adversary among the
labelled), per dataset: ``bootstrap_chunk`` with the replay (``pooling_bootstrap="rerun"``) and with ``prep.replay = None`` (the former fixed-source replicates), alternated in the
same process, CPU time (``time.process_time``), best of ``--repeats``.

    nice -n 10 .venv/bin/python benchmarks/bench_pooling_replay_cost.py --n 1000 --fraction 0.05 --datasets 5 -B 1000
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_protocol as bp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--datasets", type=int, default=5)
    ap.add_argument("-B", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    from cje_engine import bootstrap_chunk, prepare

    tot_fixed = tot_replay = 0.0
    for rep in range(args.datasets):
        sim = bp.simulate_dataset(args.n, args.fraction, rep, bp.JUDGE_NOISE, "pooled")
        prep = prepare(sim.frame, covariates=["response_length"], n_bootstrap=args.B, seed=rep,
                       pooling_bootstrap="rerun")
        replay = prep.replay
        best = {"fixed": np.inf, "replay": np.inf}
        for _ in range(args.repeats):
            for name, r in (("fixed", None), ("replay", replay)):
                prep.replay = r
                t0 = time.process_time()
                bootstrap_chunk(prep, 0, args.B)
                best[name] = min(best[name], time.process_time() - t0)
        tot_fixed += best["fixed"]
        tot_replay += best["replay"]
        print(f"dataset {rep}: excluded {[e['policy'] for e in prep.excluded]}, ms/replicate fixed "
              f"{1e3 * best['fixed'] / args.B:.3f}, rerun pooling {1e3 * best['replay'] / args.B:.3f} "
              f"({best['replay'] / best['fixed']:.2f}x)")
    print(f"all: ms/replicate fixed {1e3 * tot_fixed / (args.B * args.datasets):.3f}, rerun pooling "
          f"{1e3 * tot_replay / (args.B * args.datasets):.3f} ({tot_replay / tot_fixed:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of `cje evaluate`'s progress bar: the bootstrap in 50 chunks (one per bar step) against the
engine's single call, on the same prepared data (same numbers: replicates depend on (seed, b) only).

    .venv/bin/python benchmarks/bench_cli_progress.py [--n 2000] [--b 2000]
"""
from __future__ import annotations

import argparse
import importlib
import time

import numpy as np

from cje_engine.pipeline.direct import bootstrap_chunk, finalize, prepare
from cje_engine.simulate.direct import simulate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="prompts (5 policies each)")
    ap.add_argument("--b", type=int, default=2000, help="bootstrap replicates")
    args = ap.parse_args()
    prep = prepare(simulate(args.n, seed=1).frame, covariates=["response_length"], n_bootstrap=args.b, seed=0)
    cli = importlib.import_module("flows.cli.main")
    t0 = time.process_time()
    one = bootstrap_chunk(prep, 0, args.b)
    t_one = time.process_time() - t0
    t0 = time.process_time()
    chunks = cli._bootstrap(prep)
    t_chunked = time.process_time() - t0
    same = np.array_equal(np.vstack(chunks), one)
    a, b = finalize(prep, [one]).to_dict(), finalize(prep, chunks).to_dict()
    print(f"n={args.n} prompts x 5 policies, B={args.b}")
    print(f"bootstrap, one call (engine):      CPU {t_one:.2f} s")
    print(f"bootstrap, 50 chunks (cje, bar):   CPU {t_chunked:.2f} s  ratio {t_chunked / t_one:.2f}")
    print(f"identical replicates: {same}; identical result: {a['policies'] == b['policies']}")


if __name__ == "__main__":
    main()

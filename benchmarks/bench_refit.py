"""The bootstrap's per-replicate work on the sharded path, new against old, in one process (issue 29, refit29).

Prepares a window of `bench_sharded.py --stage write` in process (`prepare_sharded`, shards split by prompt-id
range as the Ray readers split them), draws ``--replicates`` replicates' counts once (`replicate_weights`), then
times, on CPU (``time.process_time``, best of ``--repeat`` alternated rounds):

* **refit** (the work of a `replicate_refits` task): `bootstrap_replicates` on the compact view, one pass a
  replicate, against its comparator, the two calls the old code made per replicate (`replicate_view` then
  `own_label_means`, float64 weights); bit-identical replicates required;
* **histograms** (pass 3 of every shard): `shard_histograms` on the `HistogramLayout` (rows by (key, prompt),
  `numpy.take` with native indices) against the old layout (window order within a key, int32 fancy indexing);
  identical integer histograms required;

and prints a `cProfile` (CPU) of the refit. Usage::

    .venv/bin/python benchmarks/bench_refit.py --logs /tmp/speed29/logs10 --shards 4 --replicates 40
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _old_layout(kept, codes, n_policies):
    """The layout as it was built before: window order within a key (a stable radix sort of the keys only)."""
    import numpy as np

    from cje_engine.pipeline import sharded

    v = sharded.shard_view(kept)
    pol, cell, keep = sharded._shard_keys(v, codes)
    KG = n_policies * codes.n_cells
    key = (pol * codes.n_cells + cell)[keep]
    order = np.argsort(key.astype(np.int16 if KG < 2**15 else np.int64), kind="stable")
    counts = np.bincount(key, minlength=KG)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    live = np.flatnonzero(counts)
    return sharded.HistogramLayout(prompt=v.prompt[keep][order].astype(np.int32), starts=first[live].astype(np.int64),
                                   keys=live.astype(np.int64), n_keys=KG, n_ids=int(v.n_ids))


def _old_histograms(layout, codes, weights):
    """The old gather: per replicate ``row[layout.prompt]`` (int32 fancy indexing) and a sum per key group."""
    import numpy as np

    local = weights[:, codes.prompt_offset:codes.prompt_offset + layout.n_ids]
    out = np.zeros((weights.shape[0], layout.n_keys), dtype=np.int64)
    for i in range(weights.shape[0]):
        row = np.ascontiguousarray(local[i])
        out[i, layout.keys] = np.add.reduceat(row[layout.prompt], layout.starts, dtype=np.int64)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", required=True, help="folder of `bench_sharded.py --stage write`")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--replicates", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    import numpy as np

    from bench_sharded import _keys
    from cje_engine.direct.estimators import (bootstrap_replicates, bootstrap_view, compact_view, own_label_means,
                                              replicate_view)
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import shard_columns
    from flows.runtime import sharded_ray
    from flows.storage.objects import StorageConfig

    keys, n, R = _keys(args.logs), args.shards, args.replicates
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    opts = EvaluationOptions.of(None, inference="bootstrap", n_bootstrap=max(R, 50), seed=0)
    samples = [sharded_ray.sample_file(args.logs, cfg, k, sharded_ray.SAMPLES_PER_SHARD * n, None, None) for k in keys]
    splitters = sharded.range_splitters(samples, n)
    pieces = [sharded_ray.split_file(args.logs, cfg, k, i, n, None, None, None, None, splitters, shard_columns(()))
              for i, k in enumerate(keys)]
    shards = [sharded_ray._concat(*[pc[s] for pc in pieces]) for s in range(n)]
    del pieces
    sp = sharded.prepare_sharded(shards, opts, keep_terms=False)
    del shards
    d = sp.prep.design
    K = d.n_policies
    small, prompts = compact_view(bootstrap_view(d, opts.seed))
    rw = sharded.replicate_weights(opts.seed, 0, R, sp.n_prompts, prompts)
    print(f"rows {sum(k.n_rows for k in sp.kept):,}, prompts {sp.n_prompts:,}, labelled rows {d.data.n_rows:,}, "
          f"calibration rows {d.cal_rows.size:,}, compact prompts {prompts.size:,}, shards {n}, K {K}, "
          f"G {d.cells.cells.size}, replicates {R}", flush=True)

    new_lay = [sharded.shard_histogram_layout(k, (), None, c, K).layout for k, c in zip(sp.kept, sp.codes)]
    old_lay = [_old_layout(k, c, K) for k, c in zip(sp.kept, sp.codes)]
    hist = sum(sharded.shard_histograms(lay, (), None, c, 0, 0, R, sp.n_prompts, K, rw.block)
               for lay, c in zip(new_lay, sp.codes))

    def old_refit():
        out = np.empty((R, 3 * K))
        for i in range(R):
            w = rw.driver[i].astype(float)
            out[i, :2 * K] = replicate_view(small, w, hist[i].astype(float))
            out[i, 2 * K:] = own_label_means(small, w)
        return out

    def new_refit():
        return sharded.replicate_refits(small, rw.driver, 0, R, hist)

    def old_hist():
        return [_old_histograms(lay, c, rw.block) for lay, c in zip(old_lay, sp.codes)]

    def new_hist():
        return [sharded.shard_histograms(lay, (), None, c, 0, 0, R, sp.n_prompts, K, rw.block)
                for lay, c in zip(new_lay, sp.codes)]

    best: dict = {}
    results: dict = {}
    for _ in range(args.repeat):
        for name, fn in (("refit, one pass", new_refit), ("refit, two calls (old)", old_refit),
                         ("histograms, (key, prompt) layout + take", new_hist),
                         ("histograms, window-order layout (old)", old_hist)):
            c = time.process_time()
            results[name] = fn()
            best[name] = min(best.get(name, np.inf), time.process_time() - c)
    same_refit = np.array_equal(results["refit, one pass"], results["refit, two calls (old)"], equal_nan=True)
    same_hist = all(np.array_equal(a, b) for a, b in zip(results["histograms, (key, prompt) layout + take"],
                                                          results["histograms, window-order layout (old)"]))
    print(f"{'what':45s} {'CPU a replicate':>16s}")
    for name, t in best.items():
        print(f"{name:45s} {t / R * 1e3:13.2f} ms")
    print(f"refit: {best['refit, two calls (old)'] / best['refit, one pass']:.2f}x less CPU, bit-identical: {same_refit}")
    print(f"histograms: {best['histograms, window-order layout (old)'] / best['histograms, (key, prompt) layout + take']:.2f}x "
          f"less CPU, identical: {same_hist}")
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    new_refit()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
    print(s.getvalue())
    return 0 if same_refit and same_hist else 1


if __name__ == "__main__":
    sys.exit(main())

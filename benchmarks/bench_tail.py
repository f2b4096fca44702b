"""Round 18's cuts of the analytic route (issue 29, helper tail), each fast path beside its reference (main's code,
kept in the tree behind ``reference=True``) in one process, CPU seconds (`time.process_time`), outputs compared
bit for bit.

Stages:

1. ``capture``: the analytic route's Ray tasks run in this process on the log files under ``--logs`` (the
   readers' sample and split, pass 1, the driver's merge and fit, as `bench_sharded.py --stage inprocess`)
   with ``--shards`` range shards and the Gram form; pass 2's task arguments (each shard's `ShardKept`, codes,
   fit and `LabelledBasis`) are pickled to ``--items``.
2. ``pass2``: each captured shard's pass 2 (`shard_evaluation_terms`) run ``--repeat`` times, alternately the
   reference and the fast path (best of the repeats, summed over the shards); every output compared bit for bit
   (the moments, the basis sums; the diagnostic Gram sums to their derived rounding bound). Also the parts apart:
   ``Moments.of`` of each shard's unlabelled prompts' terms and ``LabelledBasis.sums`` of its labelled ones.
3. ``labels``: a label store of ``--labels`` distinct ids shaped as the 100M benchmark's under ``--store``.
4. ``index``: `build_label_index` of ``--store`` (the sampling phase's critical path), reference against fast,
   alternately; the two indexes compared field for field.
5. ``driver``: the driver's serial tail on ``--logs`` (readers and passes in this process): the calibration fit
   and the finalize timed whole, and the functions changed there (`labelled_prompt_index`, `residual_deciles`)
   reference against fast on the same arrays.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharded.py --stage write --sizes 2000000 --logs /tmp/x/logs
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tail.py capture --logs /tmp/x/logs --shards 4 --items /tmp/x/items.pkl
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tail.py pass2 --items /tmp/x/items.pkl --repeat 5
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tail.py labels --store /tmp/x/labels5m --labels 5000000
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tail.py index --store /tmp/x/labels5m --repeat 3
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_tail.py driver --logs /tmp/x/logs50 --shards 4 --repeat 3
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


from bench_response_ids import _best  # noqa: E402 (CPU s, the best of ``repeat`` calls)


def _split_in_process(args: argparse.Namespace) -> list:
    """The window of ``--logs`` read and split into ``--shards`` range shards in this process, as the flow's readers
    split it (no label store): the shards' `ShardPieces`. Sets the analytic options the stages run with."""
    from bench_sharded import _keys
    from cje_engine.pipeline import sharded
    from flows.pipelines.sharded_pass import shard_columns
    from flows.runtime import sharded_ray
    from flows.storage.objects import StorageConfig

    args.inference, args.seed, args.bootstrap = "analytic", 0, 0
    keys = _keys(args.logs)
    cfg = StorageConfig.from_env().to_dict(include_secrets=True)
    n = args.shards
    samples = [sharded_ray.sample_file(args.logs, cfg, k, sharded_ray.SAMPLES_PER_SHARD * n, None, None) for k in keys]
    splitters = sharded.range_splitters(samples, n)
    pieces = [sharded_ray.split_file(args.logs, cfg, k, i, n, None, None, None, None, splitters, shard_columns(()))
              for i, k in enumerate(keys)]
    shards = [sharded_ray.ShardPieces([p[s] for p in pieces]) for s in range(n)]
    del pieces
    return shards


def capture(args: argparse.Namespace) -> None:
    from bench_sharded import _opts
    from cje_engine.pipeline import sharded
    from flows.runtime import sharded_ray

    shards = _split_in_process(args)
    captured = []

    def mapper(fn, items):
        for i, item in enumerate(items):
            layout, flat = sharded_ray._flatten(item)
            if fn is sharded.shard_evaluation_terms:
                captured.append(item)
            yield i, sharded_ray._with_pieces(fn, layout, *flat)

    sharded.prepare_sharded(shards, _opts(args), mapper=mapper, reason="benchmark", keep_terms=False)
    with open(args.items, "wb") as fh:
        pickle.dump(captured, fh, protocol=5)
    print(f"captured {len(captured)} shards' pass-2 arguments in {args.items} ({os.path.getsize(args.items) / 2**20:.0f} MiB)")


def pass2(args: argparse.Namespace) -> None:
    import numpy as np

    from cje_engine.inference.gram import Moments
    from cje_engine.pipeline import sharded

    with open(args.items, "rb") as fh:
        items = pickle.load(fh)
    cpu = {"shard_evaluation_terms": [0.0, 0.0], "Moments.of (unlabelled)": [0.0, 0.0],
           "LabelledBasis.sums (labelled)": [0.0, 0.0]}
    prompts = labelled = 0
    for item in items:
        fast_s = ref_s = 0.0
        for _ in range(args.repeat):  # alternately: the same load for both
            r, ref = _best(lambda: sharded.shard_evaluation_terms(*item[:-1], basis=item[-1], reference=True), 1)
            f, out = _best(lambda: sharded.shard_evaluation_terms(*item[:-1], basis=item[-1]), 1)
            ref_s, fast_s = (r, f) if not ref_s else (min(ref_s, r), min(fast_s, f))
        cpu["shard_evaluation_terms"][0] += ref_s
        cpu["shard_evaluation_terms"][1] += fast_s
        for name in ("n", "s", "S", "T"):
            assert np.array_equal(getattr(ref.rest, name), getattr(out.rest, name)), name
        for name in ("n", "sum", "cross", "cubes"):
            assert np.array_equal(getattr(ref.sums, name), getattr(out.sums, name)), name
        assert np.array_equal(ref.labelled, out.labelled) and ref.count == out.count
        # the diagnostic Gram sums (`ShardedPrepared.gram`, no number of the result): to rounding
        # (a sum of n terms in another order: within 2 n eps of the sum of absolute values, <= sqrt(n sum e^2))
        n, eps = ref.count, np.finfo(float).eps
        assert np.all(np.abs(out.total - ref.total) <= 2 * n * eps * np.sqrt(n * np.diag(ref.gram)))
        d = np.sqrt(np.diag(ref.gram))
        assert np.all(np.abs(out.gram - ref.gram) <= 2 * n * eps * np.outer(d, d))
        # the parts apart, on the same arrays
        kept = sharded.shard_evaluation_terms(*item[:-1], basis=None, reference=True)
        rest = _rest_terms(item, kept)
        prompts += rest.shape[0] + kept.labelled.size
        labelled += kept.labelled.size
        r, a = _best(lambda: Moments.of(rest, reference=True), args.repeat)
        f, b = _best(lambda: Moments.of(rest), args.repeat)
        assert np.array_equal(a.T, b.T) and np.array_equal(a.S, b.S)
        cpu["Moments.of (unlabelled)"][0] += r
        cpu["Moments.of (unlabelled)"][1] += f
        r, a = _best(lambda: item[-1].sums(kept.labelled, kept.labelled_terms, reference=True), args.repeat)
        f, b = _best(lambda: item[-1].sums(kept.labelled, kept.labelled_terms), args.repeat)
        assert np.array_equal(a.cubes, b.cubes) and np.array_equal(a.cross, b.cross) and np.array_equal(a.sum, b.sum)
        cpu["LabelledBasis.sums (labelled)"][0] += r
        cpu["LabelledBasis.sums (labelled)"][1] += f
    print(f"{len(items)} shards, {prompts:,} prompts ({labelled:,} labelled); load {os.getloadavg()[0]:.2f}; "
          f"CPU s, best of {args.repeat}, summed over the shards; every output bit for bit the reference's")
    print(f"{'function':34s} {'reference (main)':>17s} {'fast':>8s} {'ratio':>6s}")
    for name, (r, f) in cpu.items():
        print(f"{name:34s} {r:17.3f} {f:8.3f} {r / max(f, 1e-9):6.2f}")


def _rest_terms(item, kept):
    """The unlabelled prompts' terms of a captured shard (its terms without the labelled prompts' rows)."""
    import numpy as np

    from cje_engine.pipeline import sharded

    full = sharded.shard_evaluation_terms(*item[:-2], True, None, reference=True).terms
    lab = np.searchsorted(np.asarray(item[3].ranks(np.arange(full.shape[0]))), kept.labelled)
    rest = np.ones(full.shape[0], dtype=bool)
    rest[lab] = False
    return full[rest]


def labels(args: argparse.Namespace) -> None:
    """A label store of ``--labels`` distinct ids shaped as the 100M benchmark's (`bench_sharded.py --label-store`:
    "b<block>-<policy>:p<prompt>:0", 5% of 5 policies x 1M prompts a block), one version."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from flows.storage.labels import LabelStore
    from flows.storage.objects import Storage, StorageConfig

    rng = np.random.default_rng(0)
    n = args.labels
    pick = np.sort(rng.choice(np.int64(n) * 20, n, replace=False))  # of 20x as many (policy, prompt) pairs
    block, rest = np.divmod(pick, 5_000_000)
    pol, prompt = np.divmod(rest, 1_000_000)
    names = np.array(["base", "clone", "parallel_universe_prompt", "premium", "unhelpful"])
    ids = pc.binary_join_element_wise(pa.array(np.char.add("b", block.astype(str))), pa.array(names[pol]),
                                      pa.array(np.char.add(np.char.add("p", np.char.zfill(prompt.astype(str), 6)),
                                                           ":0")), "-")
    ids = pc.replace_substring(ids, "-p", ":p")
    table = pa.table({"response_id": ids, "oracle_label": rng.integers(0, 21, n) / 20.0,
                      "label_probability": np.full(n, 0.05)})
    version = LabelStore(Storage.for_uri(args.store, StorageConfig.from_env())).append(table, "bench_tail")
    print(f"{n:,} labels in {args.store} (version {version}); e.g. {ids[0].as_py()}")


def index(args: argparse.Namespace) -> None:
    """`build_label_index` on ``--store``, alternately the reference (main's code: ``reference=True``) and the fast
    path, ``--repeat`` times: CPU seconds of each (best), the two indexes compared field for field."""
    import numpy as np

    from flows.runtime.label_index import build_label_index

    ref_s = fast_s = float("inf")
    for _ in range(args.repeat):
        r, (a, ai) = _best(lambda: build_label_index(args.store, {}, reference=True), 1)
        f, (b, bi) = _best(lambda: build_label_index(args.store, {}), 1)
        ref_s, fast_s = min(ref_s, r), min(fast_s, f)
    assert a.table.equals(b.table) and np.array_equal(a.fp, b.fp) and np.array_equal(a.bits, b.bits)
    assert a.shared == b.shared and {k: ai[k] for k in ("n_label_rows", "n_flagged")} == {
        k: bi[k] for k in ("n_label_rows", "n_flagged")}
    print(f"build_label_index of {ai['n_label_rows']:,} labels; load {os.getloadavg()[0]:.2f}; CPU s, best of "
          f"{args.repeat}; the same index")
    print(f"{'function':34s} {'reference (main)':>17s} {'fast':>8s} {'ratio':>6s}")
    print(f"{'build_label_index':34s} {ref_s:17.3f} {fast_s:8.3f} {ref_s / max(fast_s, 1e-9):6.2f}")


def driver(args: argparse.Namespace) -> None:
    """The driver's serial tail on the files under ``--logs`` (readers and passes in this process, as `capture`):
    the calibration fit (`fit_calibration`) and the finalize timed whole (this branch's code), and beside each the
    functions this branch changed there, reference (main's code) against fast on the same arrays, ``--repeat``
    times alternately (best): `labelled_prompt_index` of the fit's labelled rows and `residual_deciles` of every
    policy's labelled rows (as `summarize_direct` calls it). The outputs compared bit for bit."""
    import numpy as np

    from bench_sharded import _opts
    from cje_engine.audit import residual_deciles
    from cje_engine.pipeline import sharded
    from cje_engine.pipeline.calibration import fit_calibration, labelled_prompt_index
    from flows.runtime import sharded_ray

    shards = _split_in_process(args)
    cpu: dict = {}

    def mapper(fn, items):
        for i, item in enumerate(items):
            layout, flat = sharded_ray._flatten(item)
            yield i, sharded_ray._with_pieces(fn, layout, *flat)

    def timed_fit(data, opts, rows):
        lab = data.prompt[np.flatnonzero(data.labelled)]
        r, a = _best(lambda: labelled_prompt_index(lab, data.n_prompts, reference=True), args.repeat)
        f, b = _best(lambda: labelled_prompt_index(lab, data.n_prompts), args.repeat)
        assert a[0] == b[0] and a[1].dtype == b[1].dtype and np.array_equal(a[1], b[1])
        cpu["labelled_prompt_index"] = (r, f)
        c = time.process_time()
        out = fit_calibration(data, opts, rows)
        cpu["fit_calibration (whole, this branch)"] = (None, time.process_time() - c)
        return out

    sp = sharded.prepare_sharded(shards, _opts(args), mapper=mapper, reason="benchmark", keep_terms=False,
                                 fit=timed_fit)
    c = time.process_time()
    sp.finalize([])
    cpu["finalize (whole, this branch)"] = (None, time.process_time() - c)
    prep = sp.prep
    d, lab = prep.design.data, prep.design.lab_rows
    pol = d.policy[lab]
    r_s = f_s = 0.0
    for k in range(prep.design.n_policies):
        rows = lab[pol == k]
        score, resid, w = d.score[rows], d.label[rows] - prep.f[rows], d.label_weight[rows]
        r, a = _best(lambda: residual_deciles(score, resid, w, reference=True), args.repeat)
        f, b = _best(lambda: residual_deciles(score, resid, w), args.repeat)
        assert a == b
        r_s, f_s = r_s + r, f_s + f
    cpu["residual_deciles (every policy)"] = (r_s, f_s)
    print(f"driver tail, {len(shards[0].refs)} files, {lab.size:,} labelled rows, {d.n_prompts:,} prompts; load "
          f"{os.getloadavg()[0]:.2f}; CPU s (best of {args.repeat} where beside a reference); the same outputs")
    print(f"{'function':38s} {'reference (main)':>17s} {'fast':>8s} {'ratio':>6s}")
    for name, (r, f) in cpu.items():
        print(f"{name:38s} {'' if r is None else f'{r:17.3f}':>17s} {f:8.3f} "
              f"{'' if r is None else f'{r / max(f, 1e-9):6.2f}':>6s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["capture", "pass2", "labels", "index", "driver"])
    p.add_argument("--store", default=str(HERE / "_work" / "tail_labels"), help="label store (labels, index)")
    p.add_argument("--labels", type=int, default=5_000_000, help="labels the store gets (labels)")
    p.add_argument("--logs", default=str(HERE / "_work" / "sharded"))
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--items", default=str(HERE / "_work" / "pass2_items.pkl"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    {"capture": capture, "pass2": pass2, "labels": labels, "index": index, "driver": driver}[args.stage](args)


if __name__ == "__main__":
    main()

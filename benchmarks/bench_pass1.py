"""Pass 1 of the sharded row pass (`reduce_shard`, issue 29, round 18) on one shard of the 100M layout, beside the
same function of another tree (main) in the same run: CPU seconds (`time.process_time`) of the task as a Ray worker
runs it (the shard's pieces rebuilt the way `flows.runtime.sharded_ray._with_pieces` does, then pass 1), each code
in its own fresh process (``cold``: its first call, as a task in a new worker; ``warm``: the median of the next
``--calls``), the processes alternated ``--repeat`` times; and the summaries' digest, which must be equal.

    PYTHONPATH=$PWD python benchmarks/bench_pass1.py --base /work/main [--rows 3850000] [--repeat 3] [--calls 3]
        [--shuffle] [--parts]

The shard: ``--rows`` rows in ``--pieces`` packed pieces (`pack_piece`) of which ``--blocks * --policies`` hold
rows, each one policy of a block of prompts (ids ``b<block>-p<6 digits>``, 10-11 bytes: the 100M benchmark's
files of one policy of 1M prompts each, split into 26 shards by range), 21 judge scores, 5% labels; the rest of
the pieces empty, as a file whose prompts fall in other shards gives. Prints a JSON table."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_pieces(rows: int, n_pieces: int, blocks: int, n_policies: int, seed: int, shuffle: bool = False) -> list:
    """The shard's pieces (see the module docstring), packed by the running tree's `pack_piece`; ``shuffle``: each
    piece's prompts in a random order (a file not sorted by prompt)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
    from cje_engine.pipeline import sharded

    rng = np.random.default_rng(seed)
    n_prompts = rows // n_policies
    per_block = [n_prompts // blocks] * blocks
    per_block[-1] += n_prompts - sum(per_block)
    stride = max(n_pieces // (blocks * n_policies), 1)
    held = {}
    for b in range(blocks):
        first = 1_000_000 - per_block[0] if b == 0 else 0  # the shard's range: the end of a block, then on
        for k in range(n_policies):
            held[(b * n_policies + k) * stride] = (b, k, first)
    pieces = []
    for f in range(max(n_pieces, len(held))):
        if f in held:
            b, k, first = held[f]
            n = per_block[b]
            at = np.arange(first, first + n)
            if shuffle:
                at = np.random.default_rng(seed + f).permutation(at)
            ids = pc.binary_join_element_wise(f"b{12 + b}-p", pc.utf8_lpad(pa.array(at).cast(pa.string()), 6, "0"), "")
            lab = rng.random(n) < 0.05
            table = pa.table({
                PROMPT: ids,
                POLICY: pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([f"policy_{k}"])),
                SCORE: rng.integers(0, 21, n) / 20, LABEL: pa.array(np.where(lab, rng.random(n), np.nan),
                                                                    from_pandas=True),
                LABEL_PROB: pa.array(np.where(lab, 0.05, np.nan), from_pandas=True),
                sharded.ROW: pa.array((f << 40) + np.sort(rng.choice(5 * n, n, replace=False)), pa.int64())})
        else:
            table = pa.table({PROMPT: pa.array([], pa.string()),
                              POLICY: pa.DictionaryArray.from_arrays(pa.array([], pa.int8()), pa.array(["policy_0"])),
                              SCORE: pa.array([], pa.float64()), LABEL: pa.array([], pa.float64()),
                              LABEL_PROB: pa.array([], pa.float64()), sharded.ROW: pa.array([], pa.int64())})
        pieces.append(sharded.pack_piece(table.replace_schema_metadata({sharded.RANGE_META: b"1"})))
    return pieces


def digest(summary) -> str:
    """A hash of every array and number of a `ShardSummary` and its kept codes."""
    import numpy as np

    h = hashlib.sha256()
    for f in ("n_rows", "policies", "n_ids", "id_range", "score_min", "score_max"):
        h.update(repr(getattr(summary, f)).encode())
    for f in ("cell_score", "cell_X", "counts", "n_prompts", "score_sum"):
        a = np.ascontiguousarray(getattr(summary, f))
        h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
    for k in sorted(summary.labelled):
        a = np.ascontiguousarray(summary.labelled[k])
        h.update(f"{k}{a.dtype}{a.shape}".encode() + a.tobytes())
    for f in ("prompt", "policy", "cell", "lab_pos", "lab_row"):
        a = getattr(summary.kept, f)
        h.update(f"{a.dtype}".encode() + a.tobytes())
    return h.hexdigest()[:16]


def child(args: argparse.Namespace) -> dict:
    """One tree's pass 1 in this process: the first call and ``calls`` more (CPU seconds)."""
    from cje_engine.pipeline import sharded

    pieces = make_pieces(args.rows, args.pieces, args.blocks, args.policies, args.seed, args.shuffle)
    fn = sharded.reduce_shard
    build = getattr(fn, "from_pieces", None) or sharded.unpack_pieces  # as `_with_pieces` hands the shard

    def once():
        c = time.process_time()
        out = fn(build(*pieces))
        return time.process_time() - c, out

    cold, out = once()
    warm = [once()[0] for _ in range(args.calls)]
    parts = {}
    if args.parts and hasattr(sharded, "packed_rows"):  # pass 1's steps apart: the best of ``calls`` each
        import numpy as np
        import pyarrow as pa

        def best(name, f):
            b = float("inf")
            for _ in range(max(args.calls, 1)):
                c = time.process_time()
                f()
                b = min(b, time.process_time() - c)
            parts[name] = b

        shard = build(*pieces)
        best("packed_rows", lambda: sharded.packed_rows(shard))
        held = [p for p in pieces if p.num_rows]
        col = pa.chunked_array([c for p in held for c in p.table[sharded.PROMPT].chunks])
        best("sorted_codes (prompt)", lambda: sharded.sorted_codes(col))
        r = sharded.packed_rows(shard)
        ids = sharded.unique_ints(r.prompt[r.lab].astype(np.int64))
        best("_folds (labelled prompts)", lambda: sharded._folds(r.prompt_ids.take(pa.array(ids)), 5))
    return {"cold": cold, "warm": statistics.median(warm) if warm else None, "digest": digest(out),
            "rows": out.n_rows, "ids": out.n_ids, "parts": parts}


def alternate_trees(script: str, argv: list[str] | None, base: str, repeat: int) -> tuple[dict, dict, dict]:
    """Run ``script --child`` (with ``argv``, the parent's arguments) in a fresh process per tree, this tree's and
    ``base``'s alternated ``repeat`` times, each with its tree's code on ``PYTHONPATH``: (each child's JSON by tree,
    the medians of its ``cold`` and ``warm`` CPU seconds, its distinct ``digest`` values) (bench_pass2.py too)."""
    trees = {"this": str(ROOT), "base": str(Path(base).resolve())}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    for _ in range(repeat):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, str(Path(script).resolve()), *passed, "--child"], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in ("cold", "warm")}
           for name, rs in runs.items()}
    digests = {name: sorted({r["digest"] for r in rs}) for name, rs in runs.items()}
    return runs, med, digests


def parse_and_alternate(p: argparse.ArgumentParser, argv: list[str] | None, script: str, child) -> tuple:
    """``p``'s arguments with ``--base``, ``--repeat``, ``--calls`` (and the hidden ``--child``) added, and either
    None after printing ``child(args)``'s JSON (in a child) or `alternate_trees`' result (in the parent)."""
    p.add_argument("--base", default="/work/main", help="the comparator's tree (its code on PYTHONPATH)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return args, None
    return args, alternate_trees(script, argv, args.base, args.repeat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=3_850_000, help="a shard of 100M rows in 26 shards")
    p.add_argument("--pieces", type=int, default=100, help="a piece from every file's reader")
    p.add_argument("--blocks", type=int, default=2, help="blocks of prompts the shard's range spans")
    p.add_argument("--policies", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="each piece's prompts in a random order")
    p.add_argument("--parts", action="store_true", help="also time pass 1's steps apart (best of --calls)")
    args, alternated = parse_and_alternate(p, argv, __file__, child)
    if alternated is None:
        return 0
    runs, med, digests = alternated
    shards_100m = 1e8 / args.rows
    print(json.dumps({
        "rows": args.rows, "ids": runs["this"][0]["ids"], "pieces": args.pieces, "shuffle": args.shuffle,
        "repeat": args.repeat,
        "load": os.getloadavg()[0], "cpu_s_median": med,
        "cpu_s_per_100M_rows": {name: {k: round(v * shards_100m, 1) for k, v in m.items()} for name, m in med.items()},
        "ratio_base_over_this": {k: round(med["base"][k] / med["this"][k], 2) for k in ("cold", "warm")},
        "parts_cpu_s_median": {name: {k: round(statistics.median(r.get("parts", {}).get(k, 0.0) for r in rs), 4)
                                      for k in rs[0].get("parts", {})} for name, rs in runs.items()},
        "same_summary": digests["this"] == digests["base"] and len(digests["this"]) == 1, "digests": digests,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pass 2 of the sharded row pass (`shard_evaluation_terms`, issue 29) on captured shards, beside the same function
of another tree (main) in the same run: CPU seconds (`time.process_time`) of each shard's task in its own fresh
process (``cold``: the first call, as a task in a new worker; ``warm``: the median of the next ``--calls``), the
trees' processes alternated ``--repeat`` times; and a digest of every output (the moments, the basis sums, the
labelled prompts' codes, the diagnostic totals), which must be equal.

    PYTHONPATH=$PWD python benchmarks/bench_tail.py capture --logs DIR --shards 3 --items /tmp/items.pkl
    PYTHONPATH=$PWD python benchmarks/bench_pass2.py --items /tmp/items.pkl --base /work/main [--repeat 3] [--parts]

The items are the pass-2 task arguments of the Gram form (`bench_tail.py capture`: each shard's `ShardKept`, codes,
fit and `LabelledBasis`), pickled once: both trees read the same bytes. Prints a JSON table."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pass1 import parse_and_alternate  # noqa: E402 - this script's folder, whichever tree its code is from


def digest(out) -> str:
    """A hash of every array and number of a `ShardTerms` of the Gram form."""
    import numpy as np

    h = hashlib.sha256(repr(out.count).encode())
    arrays = [out.total, out.gram, out.labelled]
    if out.rest is not None:
        arrays += [np.asarray(out.rest.n), out.rest.s, out.rest.S, out.rest.T]
    if out.sums is not None:
        arrays += [np.asarray(out.sums.n), out.sums.sum, out.sums.cross, out.sums.cubes]
    if out.labelled_terms is not None:
        arrays.append(out.labelled_terms)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
    return h.hexdigest()[:16]


def child(args: argparse.Namespace) -> dict:
    """This tree's pass 2 on every captured shard in this process: first calls, then ``calls`` more (CPU s)."""
    import pickle

    from cje_engine.pipeline import sharded

    with open(args.items, "rb") as fh:
        items = pickle.load(fh)

    def once(item):
        c = time.process_time()
        out = sharded.shard_evaluation_terms(*item[:-1], basis=item[-1])
        return time.process_time() - c, out

    cold, digests = 0.0, []
    for item in items:
        t, out = once(item)
        cold += t
        digests.append(digest(out))
    warm = [sum(once(item)[0] for item in items) for _ in range(args.calls)]
    parts = {}
    if args.parts:  # the labelled prompts' basis sums apart (`LabelledBasis.sums`): the best of ``calls``, summed
        for item in items:
            got = sharded.shard_evaluation_terms(*item[:-1], basis=None)
            best = float("inf")
            for _ in range(max(args.calls, 1)):
                c = time.process_time()
                item[-1].sums(got.labelled, got.labelled_terms)
                best = min(best, time.process_time() - c)
            parts["LabelledBasis.sums"] = parts.get("LabelledBasis.sums", 0.0) + best
            if hasattr(sharded, "_row_terms"):  # the rows' per-prompt terms apart (`_row_terms`, since round 22)
                import numpy as np
                shard, cov, pols, codes, F_all, cal_row, cal_f, plug, n_k = item[:9]
                v = sharded.shard_view(shard, cov, pols)
                pol, every = sharded._row_policies(v.policy, codes.policy_code)
                keep = None if every else pol >= 0
                for fn in (sharded._row_terms, sharded._row_terms_reference):  # the reference: main's way
                    best = float("inf")
                    for _ in range(max(args.calls, 1)):
                        c = time.process_time()
                        at = sharded._cal_positions(v, cal_row) if np.size(cal_row) else None
                        fn(v, pol, keep, codes, F_all, at, cal_f, plug, n_k)
                        best = min(best, time.process_time() - c)
                    parts[fn.__name__] = parts.get(fn.__name__, 0.0) + best
    return {"cold": cold, "warm": statistics.median(warm) if warm else None, "digest": ",".join(digests),
            "shards": len(items), "parts": parts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", required=True, help="pass-2 arguments pickled by bench_tail.py capture")
    p.add_argument("--parts", action="store_true", help="also time LabelledBasis.sums apart (best of --calls)")
    args, alternated = parse_and_alternate(p, argv, __file__, child)
    if alternated is None:
        return 0
    runs, med, digests = alternated
    print(json.dumps({
        "items": args.items, "shards": runs["this"][0]["shards"], "repeat": args.repeat, "load": os.getloadavg()[0],
        "cpu_s_median": med, "ratio_base_over_this": {k: round(med["base"][k] / med["this"][k], 2) for k in ("cold", "warm")},
        "parts_cpu_s_median": {name: {k: round(statistics.median(r.get("parts", {}).get(k, 0.0) for r in rs), 3)
                                      for k in rs[0].get("parts", {})} for name, rs in runs.items()},
        "same_output": digests["this"] == digests["base"] and len(digests["this"]) == 1, "digests": digests,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sharded row pass on Ray: shards read and reduced where they are read (issue 29).

`read_shards` runs one task per log file that reads it (`flows.storage.logs.read_window`, local or S3) and
splits its rows by prompt (`cje_engine.pipeline.sharded.split_by_shard`) into one object per shard its ids touch, packed
(`cje_engine.pipeline.sharded.pack_piece`: the labels of the labelled rows only, the places as steps, the score as
codes): a shard is its pieces (`ShardPieces`), unpacked and concatenated inside each task that reads it; the rows go from the readers to the
cluster's object store once, never through the driver. `ray_mapper` is the engine's `Mapper` on Ray: one task per
shard, results yielded as they arrive (the engine merges them so that the order does not matter), a worker
lost mid-pass retried by Ray (`max_retries`): the task is a pure function of its shard, so its retry gives
the same numbers. The memory each task asks for is derived from the data (`task_memory`).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

from flows.runtime.timeouts import ray_get_timeout

log = logging.getLogger(__name__)

#: Rows a shard should hold at most (the number of shards is at least the rows over this).
ROWS_PER_SHARD = 4_000_000
#: Bytes of task memory asked per row of a shard in the reduce and evaluation passes (its Arrow columns,
#: the arrays of `cje_engine.pipeline.sharded.shard_rows` and their temporaries; measured ~110 B at 1M rows).
BYTES_PER_ROW = 160
#: Largest histogram block one task returns (replicates x K x G x 8 bytes): it sets the replicate chunk.
HISTOGRAM_BLOCK_BYTES = 64 * 2**20

DEFAULT_MAX_RETRIES = 3


def n_shards_for(n_rows: int, cpus: int) -> int:
    """Shards for a window of ``n_rows``: no shard above `ROWS_PER_SHARD` rows, and a multiple of the CPUs (one
    a CPU at least), so that every round of a pass keeps every CPU busy (3 shards on 2 CPUs take two rounds of
    a third of the rows each; 4 take two rounds of a quarter)."""
    cpus = max(1, int(cpus))
    return cpus * max(1, math.ceil(math.ceil(n_rows / ROWS_PER_SHARD) / cpus))


def task_memory(rows: int, n_prompts: int = 0, replicates: int = 0, n_policies: int = 0, n_cells: int = 0) -> int:
    """Bytes a shard task asks Ray for: its rows' arrays plus, in the bootstrap pass, one prompt-weight
    vector (8 B a prompt) and its block of histograms (replicates x K x G x 8 B, returned as int64)."""
    return int(64 * 2**20 + BYTES_PER_ROW * rows + 8 * n_prompts + 8 * replicates * n_policies * n_cells)


def weights_task_memory(n_prompts: int) -> int:
    """Bytes a `cje_engine.pipeline.sharded.replicate_weights` task asks Ray for: one replicate's draws and their
    counts (int64, 16 B a prompt) and its chunk's block of counts with the driver's part of it (each at most
    `cje_engine.pipeline.sharded.WEIGHTS_BLOCK_BYTES`, doubled for a chunk widened past uint8)."""
    from cje_engine.pipeline.sharded import WEIGHTS_BLOCK_BYTES

    return int(64 * 2**20 + 16 * n_prompts + 4 * WEIGHTS_BLOCK_BYTES)


def refit_task_memory(n_labelled: int, n_policies: int = 0, n_cells: int = 0, replicates: int = 0) -> int:
    """Bytes a `cje_engine.pipeline.sharded.replicate_refits` task asks Ray for: its view, counts and the shards'
    histogram blocks are read from the object store (zero-copy); per replicate one float64 weight a labelled prompt
    (at most one a labelled row) and about a dozen float64 temporaries a labelled row (the calibration rows'
    weights, out-of-fold values, the labelled rows' weights and residual terms, the fold sums' values): 128 B a
    labelled row; and the chunk's histograms summed over the shards, int64 then float64 (16 B a (policy, cell) key
    and replicate of a chunk of at most ``replicates``)."""
    return int(64 * 2**20 + 128 * n_labelled + 16 * n_policies * n_cells * replicates)


def refit_view_task_memory(n_labelled: int) -> int:
    """Bytes a `cje_engine.pipeline.sharded.refit_view` task asks Ray for: the design rebuilt from the labelled rows'
    columns (its integer codes widened: 24 B a row), its cell index (~16 B and `numpy.unique`'s sort), the
    calibration plan (~90 B), the bootstrap view and the compact one (~80 B): at most ~240 B a labelled row held at
    once (measured with tracemalloc at 0.3M labelled rows: a peak of 143 B a row in monotone mode, 175 B in
    two-stage), 256 B asked."""
    return int(64 * 2**20 + 256 * n_labelled)


def bootstrap_task_memory(sp: Any) -> dict[str, int]:
    """Bytes each bootstrap task of a `cje_engine.pipeline.sharded.ShardedPrepared` asks Ray for, by the task's
    function name (for `ray_mapper`'s ``memory``): the weights (`weights_task_memory`), the refits' view
    (`refit_view_task_memory`) and the refits (`refit_task_memory`, a chunk of at most the replicates of one
    weights block, the callers' chunks being at most `replicate_chunk`'s)."""
    from cje_engine.pipeline.sharded import WEIGHTS_BLOCK_BYTES

    d = sp.prep.design
    K, G, n_lab = d.n_policies, d.cells.cells.size, d.data.n_rows
    reps = max(1, min(WEIGHTS_BLOCK_BYTES // max(sp.n_prompts, 1), HISTOGRAM_BLOCK_BYTES // max(8 * K * G, 1)))
    return {"replicate_weights": weights_task_memory(sp.n_prompts), "refit_view": refit_view_task_memory(n_lab),
            "replicate_refits": refit_task_memory(n_lab, K, G, reps)}


def replicate_chunk(n_replicates: int, n_policies: int, n_cells: int) -> int:
    """Replicates per histogram task: as many as keep its returned block under `HISTOGRAM_BLOCK_BYTES`."""
    per = max(1, 8 * n_policies * n_cells)
    return max(1, min(n_replicates, HISTOGRAM_BLOCK_BYTES // per))


#: Prompt ids each file's reader samples for the shards' ranges (times the number of shards).
SAMPLES_PER_SHARD = 16
#: Row places are ``file index << ROW_BITS`` plus the row in the file.
ROW_BITS = 40


def sample_file(uri: str, cfg_dict: dict, key: str, k: int, policies: list[str] | None, mapping: dict | None,
                with_bounds: bool = False) -> list[str] | tuple[list[str], tuple | None]:
    """``k`` evenly spaced distinct prompt ids of one log file (that column only): a reader's sample from which the
    driver cuts the shards' prompt-id ranges (`cje_engine.pipeline.sharded.range_splitters`). The response-id
    buckets need no sample (`id_fingerprint`). ``with_bounds``: (the sample, the file's least and greatest prompt
    id, `cje_engine.pipeline.sharded.id_bounds`), from which the driver knows the shards the file's reader
    returns pieces of (`cje_engine.pipeline.sharded.file_shards`)."""
    from cje_engine.pipeline.sharded import id_bounds, sample_prompt_ids
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    table = read_window(st, [key], columns=["prompt_id"], policies=policies, mapping=mapping, check_unique=False)
    sample = sample_prompt_ids(table["prompt_id"], k)
    return (sample, id_bounds(table["prompt_id"])) if with_bounds else sample


def sample_picks(footers: Sequence[Any] | None, n_files: int) -> list[tuple[int, bool]]:
    """The files `read_shards` samples, in order, as ``(file, read)``: ``read`` when the file's prompt-id bounds
    are read with its sample (its footer does not say them: `flows.storage.logs.Footer.bounds_known`); of the
    files whose footers say the same bounds, the first only (its sample stands for theirs), and none of a file
    without rows or of null ids only. ``footers`` None: every file, read."""
    if footers is None:
        return [(i, True) for i in range(n_files)]
    picks: list[tuple[int, bool]] = []
    seen: set = set()
    for i, f in enumerate(footers):
        if not f.bounds_known:
            picks.append((i, True))
        elif f.bounds is not None and f.bounds[0] is not None and f.bounds not in seen:
            seen.add(f.bounds)
            picks.append((i, False))
    return picks


from cje_engine.data.columns import one_chunk  # noqa: E402
from flows.storage.fingerprints import id_fingerprint, repeated_fingerprints  # noqa: E402 - also its callers'

#: Column of a response-id bucket: the id's `id_fingerprint`.
FINGERPRINT = "_fp"
#: A bucket of fingerprints alone is shipped in runs by the fingerprint's top `run_bits` bits (`bucket_runs`,
#: `response_id_buckets`), which its check task sorts one at a time: a sort of ~0.4M ids stays ~25% cheaper an id
#: than one of 25M (the cache), and a run's repeated halves are few. The bits a bucket's pieces are in runs by are in
#: their schema metadata (`RUN_BITS_KEY`, `run_bits`); pieces without it are cut by `SUB_BITS`.
SUB_BITS = 3
#: Runs of a bucket (`run_bits`): 2^`RUN_BITS_PER_BUCKET` a bucket.
RUN_BITS_PER_BUCKET = 6
RUN_BITS_KEY = b"cje.run_bits"
#: Metadata of a piece of fingerprints alone in order of their buckets, then of their runs (`bucket_runs`; a sorted
#: piece is too): a check task takes its bucket's slice of it by a search (`check_response_ids`' ``bucket``), not a
#: pass over every id.
BUCKET_RUNS_KEY = b"cje.bucket_runs"


def run_bits(n_buckets: int) -> int:
    """Bits of the fingerprint's top that cut each of ``n_buckets`` buckets (ranges of the fingerprints,
    `bucket_of`) into ~2^`RUN_BITS_PER_BUCKET` runs (`response_id_buckets`): the bits that tell the buckets
    apart plus 6 (64 runs a bucket: at 100M rows in 4 buckets, runs of ~0.4M ids, each sorted ~25% cheaper an id
    than one of ~3M), at most 24 (the check sorts the 32 bits below them, `repeated_fingerprints`)."""
    return min(24, max(0, int(n_buckets) - 1).bit_length() + RUN_BITS_PER_BUCKET)


def bucket_of(fp, n_buckets: int):
    """The bucket (0..``n_buckets`` - 1) of each fingerprint (uint64 array): ``floor(high * n / 2^32)`` of its
    high half, one multiply a row. Non-decreasing in the fingerprint, so each bucket is a range of fingerprints:
    a sorted array's buckets are its slices between `bucket_starts`. Every copy of an id has its fingerprint, so
    its bucket."""
    import numpy as np

    b = fp >> np.uint64(32)
    b *= np.uint64(n_buckets)
    b >>= np.uint64(32)
    return b


def bucket_starts(n_buckets: int):
    """The least fingerprint of each bucket of `bucket_of` (uint64, ``n_buckets``): ``ceil(b 2^32 / n) << 32``. A
    sorted array's bucket ``b`` is its slice from the ``searchsorted`` of entry ``b`` to that of ``b + 1`` (the
    last bucket to the end)."""
    import numpy as np

    n = int(n_buckets)
    return np.array([(-(-(b << 32) // n)) << 32 for b in range(n)], dtype=np.uint64)


def bucket_runs(fp, n_buckets: int):
    """The fingerprints ``fp`` (uint64) in order of their bucket (`bucket_of`), then of their run (their top
    `run_bits` bits), in their order within a run: what a check task needs of a reader's piece (a bucket a slice
    between `bucket_starts` by a search, each run a slice, `_repeated_by_file`) without a sort of every bit. The key
    (bucket, run) in 16 bits (up to 32 buckets) is ordered by numpy's stable sort of 16-bit keys, a radix sort:
    8.3 ms of CPU for 1M fingerprints in 4 buckets (11.9 ms in 6) against 50.9 ms by ``numpy.sort`` on this
    service's machines (AMD EPYC, where numpy's sort is not vectorised; `benchmarks/bench_sorts.py`). More
    buckets: sorted. The top bits never decrease along the result (a bucket is a range of the fingerprints), so
    any of its runs is one slice too."""
    import numpy as np

    n = int(n_buckets)
    bits = run_bits(n)
    if n < 1 or ((n - 1) << bits) >> 16:  # the key would not fit in 16 bits
        return np.sort(fp)
    key = np.right_shift(fp, np.uint64(64 - bits))  # the run
    if n & (n - 1):  # buckets not ranges of the run bits (a bucket's bounds inside a run): the bucket first
        key |= bucket_of(fp, n) << np.uint64(bits)
    return fp[np.argsort(key.astype(np.uint16), kind="stable")]


def bucket_spans(groups: Sequence[Any]) -> tuple[list[tuple[int, int]], list[int]]:
    """(each group's buckets as ``(first, stop)``, in order; each bucket's group's place in that list) of buckets
    of groups ``groups`` (one a bucket): `bundle_places`' bundles, whose buckets must be consecutive (so a reader's
    object of a group is one slice of its sorted fingerprints, `split_file`; else `ValueError`), and which object a
    bucket's check task takes."""
    _, places = bundle_places(groups)
    of_bucket = [g for g, _ in places]
    spans: list[tuple[int, int]] = []
    for b, g in enumerate(of_bucket):
        if g == len(spans):  # a group's first bucket (`bundle_places` numbers them in that order)
            spans.append((b, b + 1))
        elif g == len(spans) - 1:
            spans[g] = (spans[g][0], b + 1)
        else:
            raise ValueError(f"bucket_spans: the buckets of group {groups[b]!r} are not consecutive ({list(groups)!r})")
    return spans, of_bucket


def response_id_buckets(table, n_buckets: int, ids: bool = True, places: bool = True,
                        runs: Callable | None = None, groups: Sequence[Any] | None = None) -> list:
    """The ``response_id`` column of a file's rows (with their `id_fingerprint` and window place `ROW`) split into
    ``n_buckets`` by the fingerprint: every copy of an id lands in the same bucket, whatever file or shard it is
    in; no sample of the ids is needed for it. ``ids=False``: the buckets hold the fingerprints and places only
    (16 bytes a row, no string; `check_response_ids` then names the rows whose fingerprint repeats and
    `read_shards` fetches only their ids, `response_ids_at`); ``ids=False, places=False``: the fingerprints alone
    (8 bytes a row: what `split_file` ships; a file's rows are found again by their fingerprints,
    `response_ids_with`), in order of their bucket and their run, the fingerprint's top `run_bits` bits
    (`bucket_runs`), which its check task sorts one at a time. The buckets are ranges of the fingerprints
    (`bucket_of`). ``runs``: how 1-byte keys are ordered (`_byte_runs`; the reference's `_byte_runs_reference`).
    ``groups`` (fingerprints alone; one a bucket, each group's buckets consecutive, `bucket_spans`): one table a
    group, the slice of its buckets (a check task takes its own bucket's part, `check_response_ids`' ``bucket``),
    not one a bucket."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.pipeline.sharded import ROW

    rid = table["response_id"].cast(pa.string())
    if FINGERPRINT in table.column_names:  # computed by the reader before the label join, which used it too
        fp = np.asarray(one_chunk(table[FINGERPRINT]).to_numpy(), dtype=np.uint64)
    else:
        fp = id_fingerprint(rid)
    if not ids and not places:
        # in order of their buckets and runs (`bucket_runs`), so each bucket is a slice and in runs: its check task
        # sorts a run at a time (`_repeated_by_file`), told the bits by the pieces' metadata
        fp = bucket_runs(fp, n_buckets)
        cut = np.searchsorted(fp, bucket_starts(n_buckets))
        cut = np.append(cut, fp.size)
        meta = {RUN_BITS_KEY: str(run_bits(n_buckets)).encode(), BUCKET_RUNS_KEY: b"1"}
        spans = [(b, b + 1) for b in range(n_buckets)] if groups is None else bucket_spans(groups)[0]
        return [pa.table({FINGERPRINT: pa.array(fp[cut[a]:cut[z]])}).replace_schema_metadata(meta) for a, z in spans]
    if groups is not None:
        raise ValueError("response_id_buckets: groups of buckets are of fingerprints alone (ids=False, places=False)")
    # the bucket from the high half: floor(high * n / 2^32), one multiply (a 64-bit modulo a row costs more): ranges
    # of the fingerprints, the buckets of fingerprints alone above
    bucket = bucket_of(fp, n_buckets)
    bucket = bucket.astype(np.uint8 if n_buckets <= 256 else np.int64)
    if n_buckets <= 256:
        order, bounds = (runs or _byte_runs)(bucket)
        bounds = bounds[:n_buckets + 1]
    else:
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(n_buckets + 1))
    if not ids:
        row = table[ROW]
        row = np.asarray(row.combine_chunks() if isinstance(row, pa.ChunkedArray) else row, dtype=np.int64)
        fp, row = fp[order], row[order]
        return [pa.table({FINGERPRINT: pa.array(fp[bounds[b]:bounds[b + 1]]),
                          ROW: pa.array(row[bounds[b]:bounds[b + 1]])}) for b in range(n_buckets)]
    taken = pa.table({"response_id": rid, FINGERPRINT: pa.array(fp), ROW: table[ROW]}).take(pa.array(order))
    return [taken.slice(bounds[b], bounds[b + 1] - bounds[b]) for b in range(n_buckets)]


def response_id_buckets_reference(table, n_buckets: int, ids: bool = True, places: bool = True) -> list:
    """`response_id_buckets` with its 1-byte keys ordered as it first did (numpy's stable argsort, the bounds by a
    search of the sorted keys: `_byte_runs_reference`): the tests' reference."""
    return response_id_buckets(table, n_buckets, ids, places, runs=_byte_runs_reference)


def _byte_runs(key):
    """(the stable order of the 1-byte ``key``, the first place of each key value 0..256 in it): numpy's
    ``argsort(key, kind="stable")`` and ``searchsorted`` of the sorted keys, by Arrow's stable sort of the keys (a
    counting sort, ~half numpy's radix sort's CPU) and their counts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    order = np.asarray(pc.array_sort_indices(pa.array(key)).to_numpy()).view(np.int64)
    bounds = np.zeros(257, dtype=np.int64)
    np.cumsum(np.bincount(key, minlength=256), out=bounds[1:])
    return order, bounds


def _byte_runs_reference(key):
    """`_byte_runs` by numpy: the stable argsort of the keys and a search of the sorted keys for each value's first
    place."""
    import numpy as np

    order = np.argsort(key, kind="stable")
    return order, np.searchsorted(key[order], np.arange(257))


def split_file(uri: str, cfg_dict: dict, key: str, file_index: int, n_shards: int, columns: list[str] | None,
               policies: list[str] | None, mapping: dict | None, prepare_rows: Callable | None = None,
               splitters: list[str] | None = None, keep: Sequence[str] | None = None, prepare_arg: Any = None,
               n_buckets: int | None = None, shards: Sequence[int] | None = None, groups: Sequence[Any] | None = None,
               bucket_groups: Sequence[Any] | None = None):
    """Read one log file on a worker and return its rows per shard (packed for the object store,
    `cje_engine.pipeline.sharded.pack_piece`; the info's ``piece_bytes`` their bytes), its response ids per bucket
    (`response_id_buckets`: their fingerprints alone, 8 B a row) and a small dict about the file
    (``num_returns = len(shards) + n_buckets + 1``; ``n_buckets`` None: ``n_shards``, `response_id_buckets`).
    ``shards``: the shards whose pieces it returns, in order (those of the file's prompt-id range,
    `cje_engine.pipeline.sharded.file_shards`; None: all ``n_shards``); ``groups`` (one a shard of ``shards``):
    the pieces of one group returned as one object, a `cje_engine.pipeline.sharded.PieceBundle` (in order of the
    groups' first shard, ``num_returns = len(set(groups)) + n_buckets + 1``; a bundle's pieces in order of their
    shards: `read_shards` groups them by the node their shards' passes run on); a row of another shard raises
    `ValueError`
    (`cje_engine.pipeline.sharded.split_by_shard`). ``bucket_groups`` (one a bucket, each group's buckets
    consecutive): the buckets of one group returned as one object (`response_id_buckets`' ``groups``; in order of
    the groups' first bucket, ``len(set(bucket_groups))`` objects in place of ``n_buckets`` in ``num_returns``).
    Each row's window place is ``file_index << 40`` plus its row in the file (file order, then row order).
    ``splitters``: the shards' prompt-id ranges (`split_by_shard`; None: by hash); the response ids are bucketed by
    their fingerprint (`response_id_buckets`).
    ``prepare_rows(table, key)``: what the caller does to a file's rows before they are split (the
    evaluate flow: join the label store's labels, derive covariates, check columns) and returns
    ``(table, info)``; ``prepare_arg`` (not None): its third argument (`read_shards` hands it as a top-level
    argument, so Ray resolves a reference of it on the worker, zero-copy). The shards' rows leave ``response_id``
    behind (the passes do not read it); ``keep``: the
    only columns they keep (those of it the file has, after ``prepare_rows``, in the order of ``keep``; None: every
    column); without ``columns`` and ``prepare_rows`` only those (and the response id) are read, and without
    ``columns`` only those and what a ``prepare_rows`` with a ``read_columns(names)`` needs of the file
    (`flows.pipelines.sharded_pass.FileRows.read_columns`; every column when it returns None)."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.data.frame import POLICY
    from cje_engine.pipeline.sharded import ROW, RowsOutsideShards, bundle_pieces, pack_piece, split_by_shard
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    from cje_engine.errors import CJEInputError

    n_buckets = n_shards if n_buckets is None else int(n_buckets)
    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    wanted = columns
    if columns is None and prepare_rows is None and keep is not None:  # only what the shards keep is read
        wanted = list(dict.fromkeys([*keep, "response_id"]))
    select = None
    needs = getattr(prepare_rows, "read_columns", None)
    if columns is None and keep is not None and needs is not None:
        # only what ``prepare_rows`` needs (`flows.pipelines.sharded_pass.FileRows.read_columns`; None: a column of
        # it is missing, every column read as before) and what the shards keep, of the file's columns
        def select(names: list[str]) -> list[str] | None:
            need = None if "dt" in names else needs(names)  # a ``dt`` column of the file's own: read as before
            return None if need is None else [*need, *keep, "response_id"]
    # the policy read from the Parquet dictionary pages and kept dictionary-encoded through the shuffle (1 byte a
    # row, `compact_policy`; pass 1 codes it from its few distinct values, `cje_engine.pipeline.sharded.sorted_codes`)
    try:
        table = read_window(st, [key], columns=wanted, policies=policies, mapping=mapping, check_unique=False,
                            dictionary=(POLICY,), select=select)
    except CJEInputError:
        if wanted is columns:
            raise
        # a kept column this file lacks (read_window names it): the whole file, as without ``keep``
        table = read_window(st, [key], columns=columns, policies=policies, mapping=mapping, check_unique=False,
                            dictionary=(POLICY,))
    if "dt" in table.column_names:
        table = table.drop_columns(["dt"])
    info = {"key": key, "rows": table.num_rows}
    if "response_id" in table.column_names:  # fingerprinted once: the label join and the buckets use them
        table = table.append_column(FINGERPRINT, pa.array(id_fingerprint(table["response_id"])))
    if prepare_rows is not None:
        table, more = (prepare_rows(table, st.url(key)) if prepare_arg is None
                       else prepare_rows(table, st.url(key), prepare_arg))
        info.update(more)
    start = file_index << ROW_BITS
    table = table.append_column(ROW, pa.array(np.arange(start, start + table.num_rows, dtype=np.int64)))
    if "response_id" in table.column_names:
        # fingerprints only: 8 B a row; one object a group of buckets (the checks' node), a put costing ~0.65 ms
        rids = response_id_buckets(table, n_buckets, ids=False, places=False, groups=bucket_groups)
        table = table.drop_columns([c for c in ("response_id", FINGERPRINT) if c in table.column_names])
    else:
        n_rids = n_buckets if bucket_groups is None else len(bucket_spans(bucket_groups)[0])
        rids = [pa.table({FINGERPRINT: pa.array([], pa.uint64())})] * n_rids
        if FINGERPRINT in table.column_names:  # ``prepare_rows`` dropped the ids: their fingerprints go too
            table = table.drop_columns([FINGERPRINT])
    if keep is not None:
        table = table.select([c for c in dict.fromkeys([*keep, ROW]) if c in table.column_names])
    table = compact_policy(table)
    # each piece as it crosses the object store: the labels of the labelled rows only, the row places as steps, the
    # score as codes into its few values (`pack_piece`; `_concat` unpacks them in the task that reads the shard)
    try:
        parts = split_by_shard(table, n_shards, splitters=splitters, shards=shards)
    except RowsOutsideShards as exc:  # (raised only when ``shards`` are asked)
        # the file's prompt-id range was known before the read, from its Parquet footer's statistics or its sample
        # (`read_shards`): rows outside it (statistics a writer got wrong) are refused, naming the file
        raise CJEInputError("prompt ids outside the range the file's Parquet footer statistics give (row-group min "
                            f"and max; {exc}): rewrite the file with correct statistics or without them",
                            source=st.url(key), column="prompt_id") from None
    pieces = [pack_piece(t) for t in parts]
    del parts
    info["piece_bytes"] = sum(p.nbytes for p in pieces)
    info["piece_bytes_of"] = [p.nbytes for p in pieces]  # of each of ``shards``: where the shards' tasks run
    info["node"] = _this_node()
    if groups is not None:
        if len(groups) != len(pieces):
            raise ValueError(f"split_file: {len(groups)} groups for {len(pieces)} pieces")
        n_bundles, places = bundle_places(groups)
        members: list[list] = [[] for _ in range(n_bundles)]
        for p, (b, _) in zip(pieces, places):
            members[b].append(p)
        pieces = [bundle_pieces(m) for m in members]
    return (*pieces, *rids, info)


def bundle_places(groups: Sequence[Any]) -> tuple[int, list[tuple[int, int]]]:
    """(bundles, each piece's (bundle, place in it)) of pieces of groups ``groups``: a bundle a group, in order of
    its first piece, holding its pieces in their order: how `split_file` bundles a reader's pieces and how
    `read_shards` finds each shard's piece in them."""
    bundle = {g: b for b, g in enumerate(dict.fromkeys(groups))}
    filled = [0] * len(bundle)
    places = []
    for g in groups:
        b = bundle[g]
        places.append((b, filled[b]))
        filled[b] += 1
    return len(bundle), places


def _this_node() -> str | None:
    """The Ray node this task runs on (None outside a Ray worker): its pieces are in that node's object store."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no runtime context: not on Ray
        return None


def shard_homes(touched: Sequence[Sequence[int]], infos: Sequence[dict], n_shards: int) -> list[str | None]:
    """Each shard's node: the one whose object store holds most bytes of its pieces (the readers' infos: their
    ``node`` and ``piece_bytes_of`` their shards ``touched``); None when its pieces hold no byte or say no node."""
    homes: list[str | None] = []
    by_shard: list[dict] = [{} for _ in range(n_shards)]
    for t, info in zip(touched, infos):
        node = info.get("node")
        for s, b in zip(t, info.get("piece_bytes_of", ())):
            if node is not None and b:
                by_shard[s][node] = by_shard[s].get(node, 0) + int(b)
    for d in by_shard:
        homes.append(max(sorted(d), key=lambda n: d[n]) if d else None)
    return homes


def compact_policy(table):
    """``table`` with its policy column dictionary-encoded with the smallest index type that holds its dictionary
    (1 byte a row for up to 127 policies, instead of a string a row; a ``prepare_rows`` that returned strings is
    encoded here): what the shards carry through the object store."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from cje_engine.data.frame import POLICY

    if POLICY not in table.column_names:
        return table
    col = table[POLICY]
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col.cast(pa.string()))
    elif col.type.value_type != pa.string():
        col = col.cast(pa.dictionary(col.type.index_type, pa.string()))
    if isinstance(col, pa.ChunkedArray):
        size = max((len(c.dictionary) for c in col.chunks), default=0)
    else:
        size = len(col.dictionary)
    index = pa.int8() if size < 2**7 else pa.int16() if size < 2**15 else pa.int32()
    if col.type.index_type != index:
        col = narrow_dictionary(col, index)
    return table.set_column(table.column_names.index(POLICY), pa.field(POLICY, col.type), col)


def narrow_dictionary(col, index):
    """A dictionary column (values ``string``) with its indices narrowed to the integer type ``index`` (which holds
    every index: `compact_policy` picked it from the dictionaries' sizes): each chunk's indices converted by numpy
    and put beside the same dictionary, ~4x less CPU than Arrow's cast of the column (which also unifies nothing
    here); a chunk with null indices by Arrow's cast (`narrow_dictionary_reference`). The same column."""
    import numpy as np
    import pyarrow as pa

    target = pa.dictionary(index, pa.string())
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out = []
    for c in chunks:
        if c.null_count or c.indices.null_count:
            out.append(c.cast(target))
            continue
        idx = np.asarray(c.indices.to_numpy(zero_copy_only=True)).astype(index.to_pandas_dtype())
        out.append(pa.DictionaryArray.from_arrays(pa.array(idx), c.dictionary, safe=False))
    if isinstance(col, pa.ChunkedArray):
        return pa.chunked_array(out, type=target)
    return out[0]


def narrow_dictionary_reference(col, index):
    """`narrow_dictionary` by Arrow's cast: its reference."""
    import pyarrow as pa

    return col.cast(pa.dictionary(index, pa.string()))


#: Fingerprints a response-id bucket holds at most (`response_id_bucket_count`): 8 B each, its check task's high
#: halves and their sort ~16 B more (~0.8 GiB a task at the most).
RESPONSE_IDS_PER_BUCKET = 32_000_000


def response_id_bucket_count(n_rows: int, cpus: int) -> int:
    """Response-id buckets (`check_response_ids` tasks) of a window of ``n_rows``: none above
    `RESPONSE_IDS_PER_BUCKET` ids, a multiple of the CPUs (one a CPU at least), never more than needed: each reader
    returns one object a bucket and each check task gets one from every reader, so fewer, larger buckets cut the
    objects Ray serializes, puts and gets (at 100M rows on 2 CPUs: 4 buckets, 4 x 100 objects, against 26 x 100
    with one a shard)."""
    cpus = max(1, int(cpus))
    return cpus * max(1, math.ceil(math.ceil(max(0, int(n_rows)) / RESPONSE_IDS_PER_BUCKET) / cpus))


#: Rows of a response-id bucket up to which `check_response_ids` packs the row into the sorted fingerprint.
_PACKED_ROWS = 2**32


def check_response_ids(*pieces, bucket: tuple[int, int] | None = None) -> dict | None:
    """One bucket of response ids from every file (`response_id_buckets`): None when they are distinct, else
    the first repeated id (the smallest in code-point order) and the window places of its rows (at most 5).

    The ids' fingerprints are sorted (integers: their high 32 bits packed with the row), not the ids: only the
    ids whose half-fingerprint repeats (every copy of a repeated id, and ~n^2 / 2^33 others) are then compared as
    strings (`flows.storage.logs.first_duplicate`), so a shared fingerprint of two different ids costs a string
    comparison, never a miss or a false alarm.

    Buckets of fingerprints and places without their ids (``response_id_buckets(..., ids=False)``, 16 B a row):
    None when no whole 64-bit fingerprint repeats, else ``{"candidates": [window places]}``, every row whose
    fingerprint repeats (every copy of a repeated id among them); the caller fetches those rows' ids
    (`response_ids_at`) and checks them as strings here (`resolve_candidates`).

    Buckets of fingerprints alone (``response_id_buckets(..., ids=False, places=False)``, what `split_file` ships;
    the ``i``-th piece is the ``i``-th file's): None when no whole fingerprint repeats, else ``{"candidates":
    {file index: [fingerprints]}}``, the repeated fingerprints of each file that has one; the caller finds every
    row of those files with those fingerprints (`response_ids_with`) and checks their ids as strings here
    (`resolve_fingerprints`): every copy of a repeated id is among them. ``bucket`` (``(b, n_buckets)``, of such
    pieces): only their fingerprints of bucket ``b`` (`bucket_of`) are checked, a piece holding several buckets
    (`response_id_buckets`' ``groups``): a slice by a search where the piece says it is in bucket order
    (`BUCKET_RUNS_KEY`), else the fingerprints `bucket_of` puts there."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from cje_engine.pipeline.sharded import ROW
    from flows.storage.logs import first_duplicate

    if pieces and all(p.column_names == [FINGERPRINT] for p in pieces):
        return _repeated_by_file(pieces, bucket)
    if bucket is not None:
        raise ValueError("check_response_ids: a bucket of pieces of fingerprints alone only")
    table = pa.concat_tables([p for p in pieces if p.num_rows] or [pieces[0]])
    n = table.num_rows
    if n < 2:
        return None
    if "response_id" not in table.column_names:
        at = repeated_fingerprints(np.asarray(table[FINGERPRINT].combine_chunks().to_numpy(), dtype=np.uint64))
        if at.size == 0:
            return None
        rows = np.asarray(table[ROW].combine_chunks().to_numpy(), dtype=np.int64)[at]
        return {"candidates": np.sort(rows).tolist()}
    fp = (np.asarray(table[FINGERPRINT].combine_chunks().to_numpy(), dtype=np.uint64)
          if FINGERPRINT in table.column_names else id_fingerprint(table["response_id"]))
    if n < _PACKED_ROWS:  # one sort of (high half of the fingerprint, row): the rows of a repeated half come out
        packed = (fp >> np.uint64(32)) << np.uint64(32)
        packed |= np.arange(n, dtype=np.uint64)
        packed.sort()
        high = packed >> np.uint64(32)
        same = np.flatnonzero(high[1:] == high[:-1])
        maybe = np.unique(np.concatenate([same, same + 1]))  # positions in the sorted order
        rows = (packed[maybe] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    else:
        ordered = np.sort(fp)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        rows = np.flatnonzero(np.isin(fp, repeated))
    if rows.size == 0:
        return None
    maybe = table.take(pa.array(np.sort(rows)))
    dup = first_duplicate(maybe["response_id"])
    if dup is None:  # fingerprints (or their halves) shared by different ids only
        return None
    rows = maybe.filter(pc.equal(maybe["response_id"], dup))[ROW].to_pylist()
    return {"response_id": dup, "rows": sorted(rows)[:5], "count": len(rows)}


def response_ids_at(uri: str, cfg_dict: dict, key: str, positions: Sequence[int], policies: list[str] | None,
                    mapping: dict | None) -> list[str]:
    """The ``response_id`` of one log file at ``positions`` (rows of the file as `split_file` read them: the same
    policy filter and mapping; ``prepare_rows`` keeps the row order), for `resolve_candidates`."""
    import numpy as np
    import pyarrow as pa

    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    table = read_window(st, [key], columns=["response_id"], policies=policies, mapping=mapping, check_unique=False)
    return table["response_id"].cast(pa.string()).take(pa.array(np.asarray(positions, dtype=np.int64))).to_pylist()


def _repeated_by_file(pieces, bucket: tuple[int, int] | None = None) -> dict | None:
    """`check_response_ids` of buckets of fingerprints alone: the repeated fingerprints, by the file (the piece)
    they are in; ``bucket``: of that bucket's fingerprints only."""
    import numpy as np

    # each piece's fingerprints as they are in the object store (zero-copy), never concatenated
    fps = [np.asarray(one_chunk(p[FINGERPRINT]).to_numpy(), dtype=np.uint64) if p.num_rows
           else np.empty(0, dtype=np.uint64) for p in pieces]
    if bucket is not None:
        fps = [_of_bucket(a, p, *bucket) for a, p in zip(fps, pieces)]
    if sum(a.size for a in fps) < 2:
        return None
    # the bits the readers cut their runs by (`response_id_buckets`' metadata; pieces without it: `SUB_BITS`)
    bits = max([int((p.schema.metadata or {}).get(RUN_BITS_KEY, b"0")) for p in pieces] or [0]) or SUB_BITS
    shift = np.uint64(64 - bits)
    runs = [_in_runs(a, shift) for a in fps]
    skip = 0
    if all(runs):  # every piece in runs by the top bits (`response_id_buckets`): one run of every piece at a time
        # the runs the pieces hold only (a bucket's: a range of the fingerprints, `bucket_of`)
        first = min(int(a[0] >> shift) for a in fps if a.size)
        last = max(int(a[-1] >> shift) for a in fps if a.size)
        bounds = np.arange(first, last + 2, dtype=np.uint64) << shift
        cut = [np.searchsorted(a, bounds) if a.size else np.zeros(bounds.size, dtype=np.int64) for a in fps]
        for a, c in zip(fps, cut):
            c[-1] = a.size  # (the last bound, past the last run: 2^bits << (64 - bits) wraps to 0)
        groups = [[a[c[j]:c[j + 1]] for a, c in zip(fps, cut)] for j in range(bounds.size - 1)]
        skip = bits  # a run's top bits are equal: its sort key is the 32 bits below them
    else:
        groups = [fps]
    found: dict[int, set] = {}
    for parts in groups:
        at = repeated_fingerprints(parts, skip_bits=skip)
        if at.size == 0:
            continue
        starts = np.cumsum([0] + [a.size for a in parts])
        file_of = np.searchsorted(starts, at, side="right") - 1
        for f, r in zip(file_of.tolist(), at.tolist()):
            found.setdefault(int(f), set()).add(int(parts[f][r - starts[f]]))
    if not found:
        return None
    return {"candidates": {f: sorted(v) for f, v in sorted(found.items())}}


def _of_bucket(a, piece, b: int, n_buckets: int):
    """The fingerprints ``a`` (of ``piece``) of bucket ``b`` of ``n_buckets`` (`bucket_of`): a slice between the
    bucket's starts where the piece's metadata says they are in bucket order (`BUCKET_RUNS_KEY`), else those
    `bucket_of` puts there (in their order)."""
    import numpy as np

    if not 0 <= b < n_buckets:
        raise ValueError(f"bucket {b} not in 0..{n_buckets - 1}")
    if (piece.schema.metadata or {}).get(BUCKET_RUNS_KEY) == b"1":
        starts = bucket_starts(n_buckets)
        lo = int(np.searchsorted(a, starts[b]))
        hi = a.size if b + 1 == n_buckets else int(np.searchsorted(a, starts[b + 1]))
        return a[lo:hi]
    return a[bucket_of(a, n_buckets) == np.uint64(b)]


def _in_runs(a, shift):
    """Whether the fingerprints ``a`` are in runs by their bits above ``shift`` (each run's top bits not below the
    previous run's): sorted, as `response_id_buckets` ships them (one comparison a pair, ~half the CPU of the
    shifted one), or else by the shifted comparison (pieces in runs but not sorted)."""
    import numpy as np

    if a.size < 2 or bool(np.greater_equal(a[1:], a[:-1]).all()):
        return True
    return bool(((a[1:] >> shift) >= (a[:-1] >> shift)).all())


def response_ids_with(uri: str, cfg_dict: dict, key: str, fingerprints: Sequence[int], policies: list[str] | None,
                      mapping: dict | None) -> tuple[list[int], list[str], list[int]]:
    """The rows of one log file whose ``response_id`` has one of ``fingerprints`` (`id_fingerprint` of the id as
    read, as `split_file` computes it): (their positions in the file as `split_file` read it, their ids, their
    fingerprints), for `resolve_fingerprints`. The same read as `split_file`'s (policy filter, mapping;
    ``prepare_rows`` keeps the rows, their order and their ids)."""
    import numpy as np
    import pyarrow as pa

    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    table = read_window(st, [key], columns=["response_id"], policies=policies, mapping=mapping, check_unique=False)
    rid = table["response_id"].cast(pa.string())
    fp = id_fingerprint(rid)
    at = np.flatnonzero(np.isin(fp, np.asarray(list(fingerprints), dtype=np.uint64)))
    return at.tolist(), rid.take(pa.array(at)).to_pylist(), fp[at].tolist()


def resolve_fingerprints(candidates: Sequence[dict], rows_of: Callable[[int, list[int]], tuple]) -> list[dict]:
    """Every bucket's repeated fingerprints by file (`check_response_ids` of buckets of fingerprints alone) checked
    as strings: the buckets' findings (`check_response_ids` of the rows with those fingerprints, their ids and
    window places). ``rows_of(file index, fingerprints)``: the file's rows with those fingerprints
    (`response_ids_with`; called once a file that has candidates)."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.pipeline.sharded import ROW

    wanted: dict[int, set] = {}
    for bucket in candidates:
        for f, fps in bucket.items():
            wanted.setdefault(int(f), set()).update(int(v) for v in fps)
    rows: dict[int, list] = {}
    for f, fps in sorted(wanted.items()):
        pos, ids, fp = rows_of(f, sorted(fps))
        rows[f] = list(zip(pos, ids, fp))
    found = []
    for bucket in candidates:
        ids, places = [], []
        for f, fps in sorted(bucket.items()):
            keep = set(int(v) for v in fps)
            for pos, rid, fp in rows[int(f)]:
                if int(fp) in keep:
                    ids.append(rid)
                    places.append((int(f) << ROW_BITS) | int(pos))
        if not ids:
            continue
        hit = check_response_ids(pa.table({"response_id": pa.array(ids, pa.string()),
                                           ROW: pa.array(np.asarray(places, dtype=np.int64))}))
        if hit is not None:
            found.append(hit)
    return found


def resolve_candidates(candidates: Sequence[Sequence[int]], ids_of: Callable[[int, list[int]], list[str]]
                       ) -> list[dict]:
    """Every bucket's candidate rows (`check_response_ids` on fingerprints) checked as strings: the buckets'
    findings (`check_response_ids` of each bucket's candidates with their ids). ``ids_of(file index, positions)``
    gives the ids of a file's rows (`response_ids_at`; called once a file that has candidates)."""
    import numpy as np
    import pyarrow as pa

    from cje_engine.pipeline.sharded import ROW

    mask = (1 << ROW_BITS) - 1
    by_file: dict[int, set] = {}
    for rows in candidates:
        for r in rows:
            by_file.setdefault(int(r) >> ROW_BITS, set()).add(int(r) & mask)
    ids: dict[int, str] = {}
    for f, pos in sorted(by_file.items()):
        pos = sorted(pos)
        for p, rid in zip(pos, ids_of(f, pos)):
            ids[(f << ROW_BITS) | p] = rid
    found = []
    for rows in candidates:
        if not rows:
            continue
        table = pa.table({"response_id": pa.array([ids[int(r)] for r in rows], pa.string()),
                          ROW: pa.array(np.asarray(rows, dtype=np.int64))})
        hit = check_response_ids(table)
        if hit is not None:
            found.append(hit)
    return found


def duplicate_response_id_error(found: dict, keys: Sequence[str], source: str):
    """The `CJEInputError` (exit 2) naming a repeated ``response_id`` and the files and rows it is in."""
    from cje_engine.errors import CJEInputError

    where = ", ".join(f"{keys[r >> ROW_BITS]} row {r & ((1 << ROW_BITS) - 1)}" for r in found["rows"])
    return CJEInputError(f"response_id {found['response_id']!r} appears more than once in the window "
                         f"({found['count']} rows: {where}); response ids must be unique", source=source,
                         column="response_id")


def _itself(x: Any) -> Any:
    """``x`` (`read_shards`' ``concat``: the shard's table `_with_pieces` built)."""
    return x


def _concat(*parts):
    """One shard's table from its pieces of every file (in file order: window order; `split_file`'s packed pieces
    unpacked, `cje_engine.pipeline.sharded.unpack_pieces`; plain tables zero-copy)."""
    from cje_engine.pipeline.sharded import unpack_pieces

    return unpack_pieces(*parts)


class ShardPieces:
    """A shard as the object references of its pieces, one from every reader of a file that touches it (at least
    one), in file order: what
    `read_shards` returns for each shard. `ray_mapper` hands them to its tasks as top-level arguments (so Ray
    resolves them, zero-copy from the object store) and the task concatenates them (`_concat`): the rows are
    put in the object store once, by the readers, never copied into a second, concatenated object."""

    def __init__(self, refs: Sequence[Any], node: str | None = None, at: Sequence[int | None] | None = None) -> None:
        self.refs = tuple(refs)
        #: Each reference's piece in it: None, the object is the piece; ``j``, piece ``j`` of a
        #: `cje_engine.pipeline.sharded.PieceBundle` (a reader's pieces of one node's shards, `split_file`'s
        #: ``groups``: one object a node for its pieces, not one a piece). None: every object is its piece.
        self.at = tuple(at) if at is not None else (None,) * len(self.refs)
        if len(self.at) != len(self.refs):
            raise ValueError(f"ShardPieces: {len(self.at)} places for {len(self.refs)} references")
        #: The Ray node whose object store holds most bytes of its pieces (`read_shards`' ``locality``, `shard_homes`;
        #: None: none named): a task of the shard asks for it (`ray_mapper`, a soft node affinity), so that its pieces
        #: are not copied between nodes.
        self.node = node

    def __repr__(self) -> str:
        return f"ShardPieces({len(self.refs)} pieces)"


def shard_nodes(n_shards: int, nodes: Sequence[tuple[str, float]]) -> list[str]:
    """Each shard's node: the shards (ranges of prompt ids of about equal rows, in order) cut into one run of
    consecutive shards a node, in proportion to the nodes' CPUs (``nodes``: (node id, CPUs))."""
    total = sum(c for _, c in nodes)
    out, acc = [], 0.0
    bounds = []
    for _, c in nodes:
        acc += c
        bounds.append(acc / total * n_shards)
    j = 0
    for s in range(n_shards):
        while j < len(nodes) - 1 and s + 0.5 > bounds[j]:
            j += 1
        out.append(nodes[j][0])
    return out


def _cluster_nodes() -> list[tuple[str, float]]:
    """The cluster's alive nodes with CPUs: (node id, CPUs), in node-id order."""
    import ray

    return sorted((n["NodeID"], float(n["Resources"].get("CPU", 0))) for n in ray.nodes()
                  if n.get("Alive") and n["Resources"].get("CPU", 0) > 0)


def _affinity(node: str | None) -> dict:
    """Ray task options running a task on ``node`` while it is alive (soft: elsewhere when it is gone)."""
    if node is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


def item_home(item: Sequence[Any], homes: Mapping[str, str | None]) -> str | None:
    """The node a task of ``item`` (its arguments) runs on: the one its `ShardPieces` name, or the one the tasks
    that made its kept fields ran on (``homes``: a reference's hex id -> node, `ray_mapper`; ids, so that the map
    holds no object alive), when they name one node only; else None (anywhere: Ray's choice). Pass 2 takes pass 1's
    kept codes of its shard, not its pieces: unpinned, Ray's spillback ran some of its tasks where the codes are not
    (150 of 980 MB moved at 100M rows on two nodes; RESULTS.md, "Session 32: the flow measured warm")."""
    found = {x.node for x in item if isinstance(x, ShardPieces)}
    if homes:
        import ray

        found.update(homes[x.hex()] for x in item if isinstance(x, ray.ObjectRef) and x.hex() in homes)
    return found.pop() if len(found) == 1 else None


def _with_pieces(fn: Callable, layout: tuple, *args: Any) -> Any:
    """``fn`` on its arguments with every shard rebuilt from its pieces: ``layout`` gives, per argument of
    ``fn``, None (taken as it is) or, for the objects that follow, each one's piece (`ShardPieces.at`: None, the
    object itself; ``j``, piece ``j`` of a bundle), concatenated (`_concat`; or, for a ``fn`` with a
    ``from_pieces``, such as `cje_engine.pipeline.sharded.reduce_shard`, handed to it as they are)."""
    build = getattr(fn, "from_pieces", None) or _concat
    out, i = [], 0
    for spec in layout:
        if spec is None:
            out.append(args[i])
            i += 1
        else:
            out.append(build(*[a if j is None else a.piece(j) for a, j in zip(args[i:i + len(spec)], spec)]))
            i += len(spec)
    return fn(*out)


def _keeping(fn: Callable, fields: tuple, layout: tuple, *args: Any) -> tuple:
    """``fn``'s result (its shard rebuilt from its pieces, `_with_pieces`) and, apart, each of its ``fields`` (set
    to None in the result): the task's ``1 + len(fields)`` returns, so that the fields stay in the object store and
    only their references reach the driver (`ray_mapper`)."""
    res = _with_pieces(fn, layout, *args)
    kept = []
    for name in fields:
        kept.append(getattr(res, name))
        setattr(res, name, None)
    return (res, *kept)


def _kept_fields(fn: Callable) -> tuple:
    """``fn.kept_field`` as a tuple of field names (a name or a tuple of them; none: empty)."""
    field = getattr(fn, "kept_field", None)
    if not field:
        return ()
    return (field,) if isinstance(field, str) else tuple(field)


def _flatten(item: Sequence[Any]) -> tuple[tuple, list]:
    """(layout, arguments) of one task: each `ShardPieces` of ``item`` spread into its references."""
    layout, args = [], []
    for x in item:
        if isinstance(x, ShardPieces):
            layout.append(x.at)
            args.extend(x.refs)
        else:
            layout.append(None)
            args.append(x)
    return tuple(layout), args


def read_shards(uri: str, cfg_dict: dict, keys: Sequence[str], n_shards: int, *, columns: list[str] | None = None,
                policies: list[str] | None = None, mapping: dict | None = None, prepare_rows: Callable | None = None,
                rows_hint: int = 0, max_retries: int = DEFAULT_MAX_RETRIES, with_info: bool = False,
                keep: Sequence[str] | None = None, concat: bool = False, prepare_arg: Any = None,
                every_piece: bool = False, locality: bool = True, footers: Sequence[Any] | None = None):
    """The window's shards: per shard a `ShardPieces` (its pieces from every file's reader, in the cluster's
    object store; `ray_mapper` rebuilds the shard's `pyarrow.Table` in each task), or with ``concat`` the
    reference of one concatenated table (a task per shard: a second copy of the rows in the store).

    The shards hold ranges of prompt ids, cut from a sample of the files' ids (`sample_file`), so the
    engine codes prompts without their ids on the driver (`cje_engine.pipeline.sharded.prepare_sharded`).
    ``footers`` (the files' `flows.storage.logs.Footer`, with the prompt ids' bounds where their statistics say
    them; None: none known): a file whose footer bounds its ids is not read for its bounds, and of the files whose
    footers give the same bounds one only is sampled (each policy's file of the same prompts, the usual layout,
    gives the same sample): the shards' balance, never a number, depends on the sample (`sample_picks`).
    The window's response ids are checked unique on the workers (by bucket of response-id fingerprint, across
    files and shards): a repeated id raises `CJEInputError` naming it and its files and rows.

    ``keys``: the window's log files in window order; ``rows_hint``: the window's rows when known (for the
    tasks' memory); ``prepare_rows``, ``keep``, ``prepare_arg``: see `split_file` (the evaluate flow's
    ``prepare_arg`` is the reference of its label index, `flows.runtime.label_index`). With ``with_info`` also
    the list of every file's info dict (small: fetched to the driver).

    A reader returns the pieces of the shards its file's prompt-id range touches only (its least and greatest id
    come with its sample: `cje_engine.pipeline.sharded.file_shards`), and a shard takes those pieces only, in file
    order: the same non-empty pieces in the same order as when every reader returns a piece of every shard
    (``every_piece``, the reference), so the same numbers, with far fewer objects where files are roughly in
    prompt order (a file of a block of prompts touches 2-3 of 26 shards); files whose prompts span every shard
    give every piece, as with ``every_piece``.

    ``locality`` (on a cluster of several nodes): the shards are cut into runs of consecutive shards, one a node
    (`shard_nodes`), and a reader whose shards are all in one node's run runs there; each shard then names the node
    that holds most bytes of its pieces (`shard_homes`, from the readers' infos; `ShardPieces.node`), where its
    passes' tasks run (`ray_mapper`): its pieces are not copied between nodes, and the nodes' work stays about
    even. Soft: a node lost, its tasks run elsewhere.
    """
    import ray

    from cje_engine.pipeline.sharded import file_shards, range_splitters

    per_file = max(1, rows_hint // max(len(keys), 1))
    sample = ray.remote(sample_file).options(max_retries=max_retries, memory=task_memory(per_file // 2),
                                             name="cje_shard_sample")
    picks = sample_picks(footers, len(keys))
    got = ray.get([sample.remote(uri, cfg_dict, keys[i], SAMPLES_PER_SHARD * n_shards, policies, mapping, read)
                   for i, read in picks], timeout=ray_get_timeout())
    got = [g if read else (g, None) for (_, read), g in zip(picks, got)]  # (sample, its bounds when read)
    bounds = [f.bounds if f.bounds_known else None for f in footers] if footers is not None else [None] * len(keys)
    for (i, read), (_, b) in zip(picks, got):
        if read:
            bounds[i] = b
    splitters = range_splitters([s for s, _ in got], n_shards)
    # each reader returns the pieces of the shards its file's prompt-id range touches only (a file of a block of
    # prompts: 2-3 of 26), and each shard takes the pieces of the files that touch it, in file order
    touched = [list(range(n_shards))] * len(keys) if every_piece else file_shards(bounds, splitters, n_shards)
    log.info("prompt ids of %d of %d file(s) sampled (%d bounded by their footers): %d shard ranges, %d pieces",
             len(picks), len(keys), len(keys) - sum(r for _, r in picks), n_shards, sum(len(t) for t in touched))
    from flows.runtime.ray_fanout import cluster_cpus

    n_buckets = response_id_bucket_count(rows_hint, cluster_cpus())
    split = ray.remote(split_file)
    split_opts = {"max_retries": max_retries, "memory": task_memory(2 * per_file), "name": "cje_shard_read"}
    if prepare_rows is not None:
        # Put once: passed by value, Ray would serialize it again for every file's task (large shared data, such
        # as the label index, goes by reference instead: ``prepare_arg``).
        prepare_rows = ray.put(prepare_rows)
    node_of_shard = shard_nodes(n_shards, nodes) if locality and not every_piece and len(
        nodes := _cluster_nodes()) > 1 else None
    reader_node = [None] * len(keys)
    if node_of_shard is not None:
        for i, t in enumerate(touched):
            on = {node_of_shard[s] for s in t}
            reader_node[i] = on.pop() if len(on) == 1 else None
    # a reader's pieces in one object a node (`split_file`'s ``groups``: the node of each piece's shard), not one a
    # piece: a put costs the reader ~0.65 ms of CPU whatever its size, and a task reads its piece of the object
    group_of = node_of_shard or [None] * n_shards  # (no node named: every_piece, or one node)
    groups = [None if every_piece else [group_of[s] for s in t] for t in touched]
    layouts = [None if g is None else bundle_places(g) for g in groups]
    n_objects = [len(t) if lay is None else lay[0] for t, lay in zip(touched, layouts)]
    # the response-id buckets' checks spread over the nodes as the shards are (`shard_nodes`): each node's readers'
    # pieces of the other nodes' buckets cross, (nodes - 1) / nodes of the fingerprints, and no more (unpinned,
    # Ray's spillback moved 600 of 800 MB at 100M rows on two nodes; RESULTS.md, "Session 32: the flow measured
    # warm"); a reader returns one object of a node's buckets (`bucket_spans`), not one a bucket
    node_of_bucket = shard_nodes(n_buckets, nodes) if node_of_shard is not None else [None] * n_buckets
    bucket_groups = list(range(n_buckets)) if every_piece else node_of_bucket  # (every_piece: one object a bucket)
    spans, bucket_object = bucket_spans(bucket_groups)
    n_rids = len(spans)
    returns = [split.options(num_returns=n_objects[i] + n_rids + 1, **split_opts,
                             **_affinity(reader_node[i])).remote(
        uri, cfg_dict, k, i, n_shards, columns, policies, mapping, prepare_rows, splitters, keep, prepare_arg,
        n_buckets, touched[i], groups[i], bucket_groups) for i, k in enumerate(keys)]
    of_shard: list[list] = [[] for _ in range(n_shards)]  # each shard's pieces (object, its piece), in file order
    for i, refs in enumerate(returns):
        places = [(k, None) for k in range(len(touched[i]))] if layouts[i] is None else layouts[i][1]
        for s, (b, j) in zip(touched[i], places):
            of_shard[s].append((refs[b], j))
    buckets = [refs[n_objects[i]:n_objects[i] + n_rids] for i, refs in enumerate(returns)]
    # a bucket's task reads its pieces in place (the object store) and holds a run's high halves and their sort (8
    # B an id of the run; of the whole bucket when its pieces are not in runs, and the flags): 20 B an id of the
    # bucket asked (`task_memory` of an eighth of its ids)
    check = ray.remote(check_response_ids)
    check_opts = {"max_retries": max_retries, "name": "cje_response_ids",
                  "memory": task_memory(rows_hint // n_buckets // 8)}
    checks = [check.options(**check_opts, **_affinity(node_of_bucket[b])).remote(
        *[p[bucket_object[b]] for p in buckets], bucket=(b, n_buckets)) for b in range(n_buckets)]
    results = [c for c in ray.get(checks, timeout=ray_get_timeout()) if c is not None]
    found = [c for c in results if "candidates" not in c]
    candidates = [c["candidates"] for c in results if "candidates" in c]
    if candidates:  # repeated fingerprints (a repeated id, or rarely two ids sharing one): compare their ids
        fetch = ray.remote(response_ids_with).options(max_retries=max_retries, name="cje_response_ids_with",
                                                      memory=task_memory(per_file))

        def rows_of(f: int, fingerprints: list[int]) -> tuple:
            return ray.get(fetch.remote(uri, cfg_dict, keys[f], fingerprints, policies, mapping),
                           timeout=ray_get_timeout())

        found += resolve_fingerprints(candidates, rows_of)
    if found:
        raise duplicate_response_id_error(min(found, key=lambda c: c["rows"][0]), keys, uri)
    infos = ray.get([p[-1] for p in returns], timeout=ray_get_timeout()) if (
        with_info or node_of_shard is not None) else None
    home = shard_homes(touched, infos, n_shards) if node_of_shard is not None else [None] * n_shards
    if node_of_shard is not None:
        log.info("locality: %d of %d readers on their shards' node; %d of %d shards homed", sum(
            n is not None for n in reader_node), len(keys), sum(h is not None for h in home), n_shards)
    if concat:
        join = ray.remote(_with_pieces)  # the shard's table (`_concat`) of its pieces (`ShardPieces.at`)
        opts = {"max_retries": max_retries, "memory": task_memory(2 * rows_hint // n_shards), "name": "cje_shard_concat"}
        refs = [join.options(**opts, **_affinity(home[s])).remote(
            _itself, (tuple(j for _, j in of_shard[s]),), *[r for r, _ in of_shard[s]]) for s in range(n_shards)]
    else:
        refs = [ShardPieces([r for r, _ in of_shard[s]], home[s], [j for _, j in of_shard[s]]) for s in range(n_shards)]
    if not with_info:
        return refs
    return refs, infos


def ray_mapper(*, memory: Callable[[str], int] | int = 0, max_retries: int = DEFAULT_MAX_RETRIES,
               ) -> Callable[[Callable, Sequence[tuple]], Iterable[tuple[int, Any]]]:
    """The engine's `cje_engine.pipeline.sharded.Mapper` on Ray: one task per item, ``(index, result)``
    yielded as the tasks finish (each bounded by `flows.runtime.timeouts.ray_get_timeout`).

    ``memory``: bytes each task asks for, or a function of the pass's function name giving them (derived
    from the data by the caller, `task_memory`). A worker lost mid-task is retried ``max_retries`` times.
    A `ShardPieces` among an item's arguments reaches ``fn`` as its shard's table (`_with_pieces`); its task runs on
    the node that holds the pieces when it says so (`ShardPieces.node`, a soft node affinity), and a task whose
    arguments hold kept fields of an earlier task of this mapper on the node that task was asked for (`item_home`).
    A function with a ``kept_field`` (`cje_engine.pipeline.sharded.reduce_shard`: pass 1's codes of the shard;
    a name or a tuple of names) returns each such field as another object left in the object store: the driver
    gets the result with the field set to its reference, which a later pass takes as a top-level argument (Ray
    resolves it on the worker, zero-copy; lost with a node, Ray rebuilds it by running the task again, a pure
    function). The mapper's ``put`` (`ray.put`) puts an object shared by many tasks in the object store once
    (`cje_engine.pipeline.sharded.ShardedPrepared.replicates`: the refits' view).
    """
    import ray

    homes: dict[str, str | None] = {}  # each kept field's reference (hex id) -> the node its task was asked to run on

    def mapper(fn: Callable, items: Sequence[tuple]) -> Iterable[tuple[int, Any]]:
        mem = memory(fn.__name__) if callable(memory) else memory
        opts = {"max_retries": max_retries, "retry_exceptions": False, "name": f"cje_{fn.__name__}"}
        if mem:
            opts["memory"] = int(mem)
        refs, kept = [], {}
        fields = _kept_fields(fn)
        plain, pieced, keeping = ray.remote(fn), ray.remote(_with_pieces), ray.remote(_keeping)
        for item in items:
            layout, args = _flatten(item)
            node = item_home(item, homes)  # the node of the shard's pieces, or of its kept fields
            where = _affinity(node)
            if fields:
                ref, *kept_refs = keeping.options(**opts, num_returns=1 + len(fields), **where).remote(
                    fn, fields, layout, *args)
                kept[ref] = kept_refs
                for k in kept_refs:  # a later pass's task on them runs where they are (`item_home`)
                    homes[k.hex()] = node
                refs.append(ref)
            elif any(x is not None for x in layout):
                refs.append(pieced.options(**opts, **where).remote(fn, layout, *args))
            else:
                refs.append(plain.options(**opts, **where).remote(*item))
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        limit = ray_get_timeout()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=limit)
            if not done:
                raise TimeoutError(f"Ray tasks cje_{fn.__name__}: {len(pending)} of {len(refs)} did not finish "
                                   f"within {limit:g} s")
            for ref in done:
                res = ray.get(ref)
                for name, kept_ref in zip(fields, kept.get(ref, ())):
                    setattr(res, name, kept_ref)
                yield index[ref], res

    mapper.put = ray.put
    return mapper

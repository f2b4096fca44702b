"""The sharded row pass: a Direct evaluation whose rows never meet in one process.

The statistics depend on the unlabelled rows only through per-(policy, cell) counts, per-prompt evaluation
terms and, in the bootstrap, per-replicate weighted (policy, cell) histograms (docs/scaling.md). So the rows
are split into shards by prompt (`shard_of`: a stable hash of the prompt id, so every row of a prompt is in
one shard whatever file or day it came from) and each shard is reduced where it is held, in three passes:

1. `reduce_shard`: its distinct prompt ids, per-(policy, fine cell) counts (a fine cell is a distinct
   (score, covariates) pair), per-policy row, prompt and score totals, and its labelled rows, which travel
   to the driver. `merge_summaries` gives every prompt its global code (rank of its id, as the single-process
   path codes them), the cells and counts of every calibration mode, and an `EvalData` of the labelled rows.
   The driver fits the calibration from those exactly as the single-process path does.
2. `shard_evaluation_terms`: the evaluation part of the influence terms per prompt (the same bits per
   prompt as the single-process path: a prompt's rows are in one shard, in the same order), and their sums,
   squares and cross-products over policies. Over the driver's budget (or ``keep_terms=False``) the others
   arrive as moments of orders 1-3 and the prompts with a labelled row as the sums of their basis rows, built on
   the shard from its part of the fit's per-labelled-row arrays (`LabelledBasis`, sent with the task): the
   driver's `GramTerms` (`cje_engine.inference.gram`, result ``inference.row_pass.influence = "gram"``).
3. `shard_histograms`: per bootstrap replicate ``b`` the shard's weighted (policy, cell) histogram under the
   prompt weights of ``(seed, b)``; whole numbers, so their sum over shards is exact in any order and the
   driver's replicates are bit-identical to the single-process ones (layout B). The weights of a chunk of
   replicates are drawn once for every shard (`replicate_weights`, one-byte counts left where they were drawn);
   each shard sums its slice of them from its `HistogramLayout` (`shard_histogram_block`), and one task a chunk
   sums the shards' blocks and refits from the counts at the labelled prompts (`replicate_refits`, on the compact
   view `refit_view` builds once from the labelled rows' columns): `ShardedPrepared.replicates`.

Every function here is pure: a shard is a `pyarrow.Table` of canonical columns plus `ROW` (the row's place
in the whole window, to keep the single-process row order); the Ray readers ship its pieces packed (`pack_piece`)
and each task rebuilds the table (`unpack_pieces`). Where the shards live and how the passes are run
(in process, on Ray workers) is the caller's: `prepare_sharded` takes a `Mapper`. Segments (``segment_by``) are
reduced on the shards too (`cje_engine.pipeline.sharded_segments`); logs-only and hybrid have no sharded path
(`check_sharded_mode`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.calibration import registry
from cje_engine.calibration.calibrators import Cells, make_cells
from cje_engine.data.columns import one_chunk
from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE, EvalData, fold_of
from cje_engine.data.ints import unique_ints, unique_inverse
from cje_engine.data.strings import BYTE_MASKS, byte_words, fixed_width
from cje_engine.direct.estimators import (bootstrap_counts, bootstrap_replicates, bootstrap_view, bootstrap_weights,
                                          calibration_term, compact_view, level_set_shares,
                                          fold_jackknife, influence_with_evaluation_terms)
from cje_engine.errors import CJEInputError
from cje_engine.direct.verified import own_label_influence
from cje_engine.inference.gram import BasisSums, GramTerms, Moments, SummedBasis
from cje_engine.options import EvaluationOptions

# The driver's modules (the calibration fit, `Prepared`, the result's model, the segments' driver side) are imported
# where the driver uses them: a Ray worker of the passes imports this module without them (with them scipy.stats and
# the result's pydantic models: ~0.7 s of CPU a fresh worker, two a run). `test_worker_imports` keeps it so.

log = logging.getLogger(__name__)

#: Column of a shard's table: the row's place in the whole window (file order, then row order in the file).
ROW = "_row"

#: ``Mapper(fn, items)`` runs ``fn(*item)`` for every item and yields ``(index of the item, result)`` in any
#: order (`serial_map` in process; `flows.runtime.ray_fanout` on Ray workers).
Mapper = Callable[[Callable, Sequence[tuple]], Iterable[tuple[int, Any]]]


#: Labelled rows on the driver from which `_release` also runs a full garbage collection (~0.08 s of CPU a call
#: in a driver that imported Ray and the engine, whatever the window's size; below, the driver is small).
RELEASE_COLLECT_MIN_LABELLED = 1_000_000


def _release(collect: bool = True) -> None:
    """Hand the driver's freed memory back to the OS between the merge's steps (glibc keeps freed heap pages
    resident otherwise, and the next step's large arrays would come on top of them); no-op off glibc.
    ``collect``: first a full garbage collection (cycles holding arrays), for the large drivers only."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: glibc's `mallopt` parameters (``malloc.h``): the free top of the heap past which `free` shrinks it, and the size
#: from which an allocation is a mapping of its own.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: While `heap_kept` runs: allocations up to this size come from the heap, and freed they stay there for the next.
HEAP_KEPT_BYTES = 1 << 30
#: glibc's own ceilings of the two thresholds on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX`` and twice it): where its
#: dynamic thresholds stand once a process has freed an array of 32 MiB, and where `heap_kept` leaves them.
MMAP_THRESHOLD_MAX = 32 << 20
#: The `heap_kept` calls running now, in any thread; the first one in sets the heap's thresholds and numpy's huge
#: pages, the last one out restores them (`_heap_kept_enter`, `_heap_kept_leave`, under `_heap_kept_lock`).
_heap_kept_depth = [0]
#: What the first call in found: whether glibc took the thresholds, numpy's huge-page setting before.
_heap_kept_state: dict[str, Any] = {"kept": False, "huge": None}
_heap_kept_lock = threading.Lock()


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False off glibc (or if refused)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(ctypes.c_int(param), ctypes.c_int(value)))
    except (OSError, AttributeError):
        return False


def _madvise_hugepage(enabled: bool) -> bool | None:
    """Set whether numpy asks the kernel for transparent huge pages for its large arrays (``madvise``); the
    previous setting, None where numpy has no such switch."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # pragma: no cover - numpy 1.x
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            return None
    return bool(_set_madvise_hugepage(enabled))


def heap_kept(fn: Callable | None = None, *, trim: bool = True) -> Callable:
    """Decorate ``fn`` to run with glibc's heap keeping the large arrays it frees for its next ones
    (``@heap_kept`` or ``@heap_kept(trim=False)``).

    glibc gives every allocation past its mmap threshold (at most 32 MiB) a mapping of its own and unmaps it when
    freed: each of the driver's 5M-row temporaries (a float64 column of the labelled rows is 40 MB) then comes as
    fresh pages from the kernel, each page zeroed at its first touch, a system CPU cost as large as half the
    user CPU of the calibration fit's rounds (0.3-1.0 s of system CPU against 1.3 s of user at 5M labels). While
    ``fn`` runs, allocations up to `HEAP_KEPT_BYTES` come from the heap and freed ones stay in it (the trim
    threshold as high) for the next of the same size; `_release`'s ``malloc_trim`` still hands the free pages back
    between the driver's steps, and on return both thresholds are left at glibc's ceilings (where its dynamic ones
    stand after a large free) and the heap is trimmed (``trim``; not at the end of `prepare_sharded`, whose free
    pages `ShardedPrepared.finalize` reuses next). Only the allocator's choices change: every array
    holds what it held, every number is the same. Nested calls run as they are; off glibc a no-op. Thread-safe:
    the calls running at once in several threads share one scope (a lock around entering and leaving), set by the
    first to enter and restored by the last to leave (trimming if its ``trim`` says so), whatever their order.

    numpy's request of transparent huge pages for its large arrays (``madvise``) is off meanwhile too: with the
    kernel's ``defrag`` at ``madvise`` (Debian's default) each huge page is compacted for at the fault, in the
    faulting process (0.3-0.9 s of system CPU more in the fit at 5M labels on a loaded VM, varying with the other
    processes' memory); the heap's reused pages are already resident. Restored on return.

    Parameters
    ----------
    fn : callable, optional
        The function to wrap (its name, docstring and signature are kept); None: a decorator with ``trim``.
    trim : bool
        Trim the heap when ``fn`` returns (`_release`, without a garbage collection).

    Returns
    -------
    callable
        ``fn`` run with the heap kept."""
    import functools

    if fn is None:
        return functools.partial(heap_kept, trim=trim)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _heap_kept_enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _heap_kept_leave(trim)

    return run


def _heap_kept_enter() -> None:
    """A `heap_kept` call starts: the first one running (in any thread) keeps the heap and turns numpy's huge pages
    off, remembering how they were; the others find them so. Under `_heap_kept_lock`: two threads entering at once
    must not both take the settings as they found them (the second would find the first's, and restore those)."""
    with _heap_kept_lock:
        if not _heap_kept_depth[0]:
            kept = _mallopt(_M_MMAP_THRESHOLD, HEAP_KEPT_BYTES)
            if kept:
                _mallopt(_M_TRIM_THRESHOLD, HEAP_KEPT_BYTES)
            _heap_kept_state.update(kept=kept, huge=_madvise_hugepage(False))
        _heap_kept_depth[0] += 1


def _heap_kept_leave(trim: bool) -> None:
    """A `heap_kept` call ends: the last one running restores what the first found, then trims the heap if its own
    ``trim`` says so (outside the lock: a trim takes time and changes no setting). Under `_heap_kept_lock`: a call
    leaving while another thread's call still runs leaves the settings to it, and a call entering meanwhile waits until
    the restore is done (else the restore would undo its settings)."""
    with _heap_kept_lock:
        _heap_kept_depth[0] -= 1
        if _heap_kept_depth[0]:
            return
        kept, huge = _heap_kept_state["kept"], _heap_kept_state["huge"]
        if huge is not None:
            _madvise_hugepage(huge)
        if kept:
            _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
            _mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
    if kept and trim:
        _release(collect=False)


def heap_frozen(fn: Callable) -> Callable:
    """Decorate ``fn`` to run with the objects that exist when it starts left out of Python's garbage collections
    (`gc.freeze`, undone when it returns or raises): the driver's full collections between the merge's steps
    (`_release`) and the interpreter's own then scan what the call made, not the flow's ~10^5-10^6 imported and
    Prefect objects (~0.1 s a full collection after the flow's imports alone). Under an outer freeze (a decorated
    caller: `flows.pipelines.sharded_pass.compute_sharded` around `prepare_sharded`), ``fn`` runs as it is.

    Parameters
    ----------
    fn : callable
        The function to wrap (its name, docstring and signature are kept).

    Returns
    -------
    callable
        ``fn`` run frozen."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        import gc

        if gc.get_freeze_count():
            return fn(*args, **kwargs)
        gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.unfreeze()

    return run


def _note(stage: str) -> None:
    """Log (DEBUG) the driver's resident memory now and its peak so far after ``stage``, and of it now the
    process's own heap (``RssAnon``) and the shared object-store pages it has touched (``RssShmem``: a Ray
    driver's ``ray.put`` and zero-copy ``ray.get`` map the node's object store, and those pages stay in its RSS
    after the object is freed) (Linux; for the benchmarks' memory profile of the driver)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    try:
        import resource

        with open("/proc/self/status") as fh:
            status = {k: v for k, _, v in (line.partition(":") for line in fh)}
        kib = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssShmem") if k in status}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError, ImportError, KeyError, IndexError):
        return
    log.debug("driver RSS %.2f GiB (peak %.2f GiB; heap %.2f, object store %.2f GiB) after %s",
              kib.get("VmRSS", 0) / 2**20, peak / 2**20, kib.get("RssAnon", 0) / 2**20, kib.get("RssShmem", 0) / 2**20,
              stage)


def serial_map(fn: Callable, items: Sequence[tuple]) -> Iterable[tuple[int, Any]]:
    """The in-process `Mapper`: ``fn(*item)`` for each item, in order."""
    for i, item in enumerate(items):
        yield i, fn(*item)


def shard_of(prompt_ids: Sequence[str] | np.ndarray | pa.Array, n_shards: int) -> np.ndarray:
    """Stable shard of each prompt id: a keyed blake2b hash of the id modulo ``n_shards``.

    Keyed (person ``cje-shard``) so that shards are independent of the cross-fitting folds (`fold_of`).
    """
    ids = prompt_ids.to_pylist() if isinstance(prompt_ids, (pa.Array, pa.ChunkedArray)) else list(prompt_ids)
    out = np.empty(len(ids), dtype=np.uint64)
    fresh = hashlib.blake2b(digest_size=8, person=b"cje-shard").copy
    digests = []
    for s in ids:
        h = fresh()
        h.update(str(s).encode("utf-8", "surrogatepass"))
        digests.append(h.digest())
    if ids:
        out[:] = np.frombuffer(b"".join(digests), dtype=">u8")
    return (out % np.uint64(n_shards)).astype(np.int64)


#: Schema metadata key of a shard split by prompt-id range (`split_by_shard` with ``splitters``).
RANGE_META = b"cje.shard_range"


class RowsOutsideShards(ValueError):
    """`split_by_shard` was asked for some shards only and the table has rows of others: the caller's idea of the
    table's shards (`file_shards` of a file's prompt-id range from its Parquet footer's statistics or its sample)
    is wrong. A caller that knows where the range came from catches this type and names the file
    (`flows.runtime.sharded_ray.split_file`).

    Parameters
    ----------
    outside : sequence of int
        The shards of the rows that are not among those asked (increasing).
    asked : sequence of int
        The shards asked (``shards`` of `split_by_shard`).

    Attributes
    ----------
    outside, asked : list of int
        As given.
    """

    def __init__(self, outside: Sequence[int], asked: Sequence[int]) -> None:
        self.outside = [int(s) for s in outside]
        self.asked = [int(s) for s in asked]
        super().__init__(f"split_by_shard: rows of shard(s) {self.outside[:5]}{'...' if len(self.outside) > 5 else ''}"
                         f" outside the shards asked ({self.asked[:5]}{'...' if len(self.asked) > 5 else ''})")


def split_by_shard(table: pa.Table, n_shards: int, row_offset: int = 0,
                   splitters: Sequence[str] | None = None, shards: Sequence[int] | None = None) -> list[pa.Table]:
    """The rows of ``table`` per shard, each with its `ROW` (``row_offset`` + its place in ``table`` unless the
    table has one): what a reader of one file hands to the shards.

    Without ``splitters`` a prompt's shard is `shard_of` its id (a hash). With ``splitters`` (``n_shards - 1``
    sorted prompt ids, `range_splitters`) shard ``s`` holds the ids in ``[splitters[s-1], splitters[s])``:
    shards by range, so a prompt's global code is its shard's offset plus its rank in the shard and the ids
    never travel to the driver (`prepare_sharded`); the shards' tables say so in their schema metadata.

    ``shards``: the only shards whose pieces are returned (increasing; None: all ``n_shards``), those the file's
    prompt-id range touches (`file_shards`); each piece is the one of that shard without ``shards``, row for row.
    A row of another shard raises `RowsOutsideShards` (a `ValueError`). With ``splitters`` every id is searched
    among them (`range_shard`: a file in prompt-id order one splitter at a time among its ids), and a table of one
    shard's ids is returned whole (`split_by_shard_reference`: the same pieces).
    """
    table, wanted = _split_rows(table, n_shards, row_offset, shards)
    if splitters is None:
        shard, span, outside = _hash_shards(table, n_shards, wanted, shards is not None)
    else:
        if len(splitters) != n_shards - 1:
            raise ValueError(f"{len(splitters)} splitters for {n_shards} shards")
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), RANGE_META: b"1"})
        # every row's shard (`range_shard`: a null id in shard 0), whose least and greatest are the table's span
        # (`bounds_shards` of its `id_bounds`, found without a comparison of strings a row: ~0.04 s of CPU a 1M-row
        # file, against ~0.007 s for the shards of every row); `split_by_shard_reference` searched the span's
        # splitters only, the same shards
        shard = range_shard(table[PROMPT], list(splitters))
        span = (int(shard.min()), int(shard.max())) if shard.size else None
        if span is not None and span[0] == span[1]:
            shard = None  # every row in one shard: the table is its piece
        outside = np.setdiff1d(np.arange(span[0], span[1] + 1), wanted) if span and shards is not None \
            else np.empty(0)
    return _pieces(table, shard, span, outside, wanted, n_shards)


def _pieces(table: pa.Table, shard: np.ndarray | None, span: tuple[int, int] | None, outside: np.ndarray,
            wanted: list[int], n_shards: int, first: int = 0) -> list[pa.Table]:
    """`split_by_shard`'s pieces of ``wanted`` from each row's shard (``shard`` minus ``first``; None: every row in
    ``span[0]``); rows of shards ``outside`` those asked raise `RowsOutsideShards`."""
    if outside.size:
        raise RowsOutsideShards(outside.tolist(), wanted)
    if shard is None:  # one shard: the table is its piece, the others are empty
        return [table if s == span[0] else table.slice(0, 0) for s in wanted]
    if n_shards <= 2**16:  # 1- or 2-byte keys: numpy's stable sort of them is a radix sort (the same order)
        shard = shard.astype(np.uint8 if n_shards <= 2**8 else np.uint16)
    edges = np.asarray(wanted + [wanted[-1] + 1] if wanted else [0], dtype=np.int64) - first
    if shard.size < 2 or bool(np.all(shard[1:] >= shard[:-1])):
        # the rows are in shard order already (a file in prompt-id order, split by range): slices, no copy
        taken = table
        at = np.searchsorted(shard, edges)
    else:
        order = np.argsort(shard, kind="stable")
        at = np.searchsorted(shard[order], edges)
        taken = table.take(pa.array(order))
    return [taken.slice(at[j], at[j + 1] - at[j]) for j in range(len(wanted))]


def _split_rows(table: pa.Table, n_shards: int, row_offset: int, shards: Sequence[int] | None
                ) -> tuple[pa.Table, list[int]]:
    """`split_by_shard`'s table with its rows' window places (`ROW`, from ``row_offset`` unless it has them) and the
    shards asked (``shards`` checked increasing, of ``n_shards``; None: all)."""
    if ROW not in table.column_names:
        table = table.append_column(ROW, pa.array(np.arange(row_offset, row_offset + table.num_rows, dtype=np.int64)))
    wanted = list(range(n_shards)) if shards is None else [int(s) for s in shards]
    if any(b <= a for a, b in zip(wanted, wanted[1:])) or (wanted and not 0 <= wanted[0] <= wanted[-1] < n_shards):
        raise ValueError(f"split_by_shard: shards {wanted} are not increasing shards of {n_shards}")
    return table, wanted


def _hash_shards(table: pa.Table, n_shards: int, wanted: list[int], asked: bool
                 ) -> tuple[np.ndarray, tuple[int, int] | None, np.ndarray]:
    """Without splitters: every row's shard by its prompt id's hash (`shard_of`), their least and greatest, and the
    shards of rows outside ``wanted`` (when ``asked``: the caller named the shards)."""
    uniq = pc.unique(table[PROMPT])
    code = pc.index_in(table[PROMPT], value_set=uniq)
    shard = shard_of(uniq, n_shards)[np.asarray(code)]
    span = (int(shard.min()), int(shard.max())) if shard.size else None
    outside = np.setdiff1d(np.unique(shard), wanted) if asked else np.empty(0)
    return shard, span, outside


def split_by_shard_reference(table: pa.Table, n_shards: int, row_offset: int = 0,
                             splitters: Sequence[str] | None = None, shards: Sequence[int] | None = None) -> list[pa.Table]:
    """`split_by_shard` as it was (the span of the table's shards from its `id_bounds`, then `range_shard`
    of the ids among the splitters of that span): the tests' reference."""
    table, wanted = _split_rows(table, n_shards, row_offset, shards)
    first = 0  # the shard of code 0
    if splitters is None:
        shard, span, outside = _hash_shards(table, n_shards, wanted, shards is not None)
    else:
        if len(splitters) != n_shards - 1:
            raise ValueError(f"{len(splitters)} splitters for {n_shards} shards")
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), RANGE_META: b"1"})
        # the shards of the table's least and greatest ids (`range_shard` is monotone in the id): every row's shard
        # is between them, and is `lo` plus the splitters of [lo, hi) at most its id
        span = bounds_shards(id_bounds(table[PROMPT]), splitters)
        if span is None:
            shard = np.zeros(0, dtype=np.int64)
        elif span[0] == span[1]:
            shard = None  # every row in one shard: nothing to search
        else:
            lo, hi = span
            shard = range_shard(table[PROMPT], list(splitters)[lo:hi])
            first = lo
        outside = np.setdiff1d(np.arange(span[0], span[1] + 1), wanted) if span and shards is not None \
            else np.empty(0)
    return _pieces(table, shard, span, outside, wanted, n_shards, first)


def id_bounds(ids: pa.Array | pa.ChunkedArray) -> tuple[str | None, str | None, bool] | None:
    """(least id, greatest id, any null) of a prompt-id column as strings, in `range_shard`'s order (UTF-8 bytes:
    code points); None when it has no row. (None, None, True) when every id is null.

    Ids of one width of at least 8 bytes (a file's often are): their first 8 bytes as a big-endian word, read in
    place (`cje_engine.data.strings.fixed_width`), give the least and greatest; only the ids of those words are
    compared (by bytes 8-15, then as strings): ~8 ms a 1M-row file of ids in order, against ~25-43 ms for Arrow's
    ``min_max``, which copies the running maximum at each greater id. Other ids, or ids sharing their first 8
    bytes (more than 1 in 64), are compared by ``min_max`` as they were. `id_bounds_reference` is the plain
    computation."""
    if len(ids) == 0:
        return None
    ids = ids.cast(pa.string())
    nulls = bool(ids.null_count)
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    found: list[str] = []
    for chunk in chunks:
        if chunk.null_count:
            chunk = chunk.drop_null()
        if len(chunk) == 0:
            continue
        fixed = fixed_width(chunk)
        if fixed is None or fixed.width < 8:  # the words would cost a gather of every id: Arrow's comparison
            found.extend(pc.min_max(chunk).values())
            continue
        probe = fixed.word_view(0)[[0, len(chunk) // 2, -1]]
        if probe[0] == probe[1] == probe[2]:  # first, middle and last id share their first 8 bytes: many do
            found.extend(pc.min_max(chunk).values())
            continue
        w0 = fixed.word(0).byteswap(inplace=True)
        ends = [np.flatnonzero(w0 == pick(w0)) for pick in (np.min, np.max)]  # the least (greatest) first 8 bytes
        if sum(at.size for at in ends) > len(chunk) // 64:  # ids sharing their first 8 bytes: all compared
            found.extend(pc.min_max(chunk).values())
            continue
        for pick, at in zip((np.min, np.max), ends):
            tied = chunk.take(pa.array(at))
            w1 = _PrefixWords(tied).word(1)
            found.extend(pc.min_max(tied.filter(pa.array(w1 == pick(w1)))).values())  # ... and the next 8
    if not found:
        return None, None, nulls
    mm = pc.min_max(pa.array([f.as_py() for f in found], pa.string()))
    return mm["min"].as_py(), mm["max"].as_py(), nulls


def id_bounds_reference(ids: pa.Array | pa.ChunkedArray) -> tuple[str | None, str | None, bool] | None:
    """`id_bounds` the plain way: Arrow's ``min_max`` of every id."""
    if len(ids) == 0:
        return None
    ids = ids.cast(pa.string())
    mm = pc.min_max(ids)
    return mm["min"].as_py(), mm["max"].as_py(), bool(ids.null_count)


def bounds_shards(bounds: tuple[str | None, str | None, bool] | None, splitters: Sequence[str]
                  ) -> tuple[int, int] | None:
    """(first, last) shard under ``splitters`` (`range_shard`) of the ids within ``bounds`` (`id_bounds`): every
    id between the least and the greatest is in one of them (a null id is in shard 0); None: no id."""
    if bounds is None:
        return None
    lo_id, hi_id, nulls = bounds
    if lo_id is None:
        return (0, 0)
    lo, hi = (int(x) for x in range_shard(pa.array([lo_id, hi_id], pa.string()), splitters))
    return (0 if nulls else lo, hi)


def file_shards(bounds: Sequence[tuple | None], splitters: Sequence[str], n_shards: int) -> list[list[int]]:
    """For each file (its `id_bounds`), the shards whose pieces its reader returns (`split_by_shard`'s
    ``shards``): those of its prompt-id range (`bounds_shards`), and, for the first file, every shard no file's
    range touches (so that every shard has a piece: the empty piece it had from the first file when every reader
    returned every shard, and the same concatenation, `unpack_pieces`). A file without rows returns none."""
    out: list[list[int]] = []
    hit = np.zeros(n_shards, dtype=bool)
    for b in bounds:
        span = bounds_shards(b, splitters)
        if span is None:
            out.append([])
            continue
        out.append(list(range(span[0], span[1] + 1)))
        hit[span[0]:span[1] + 1] = True
    if out and not hit.all():
        out[0] = sorted(set(out[0]) | set(np.flatnonzero(~hit).tolist()))
    return out


class _PrefixWords:
    """Big-endian ``uint64`` words of the UTF-8 bytes of each string of ``ids`` (``pyarrow.string``, no nulls):
    ``word(i)`` is bytes ``8i..8i+7`` of each string, zero-padded (`cje_engine.data.strings.byte_words`, the
    loads `flows.storage.fingerprints.id_fingerprint` makes too), of every string or of the strings at ``rows``.

    For two ids whose words differ, the first differing word's order is the strings' (its first differing byte is
    a real byte of both, or the padding of the shorter, a prefix of the other); equal words say nothing (``"a"``
    and ``"a\\0"``, or ids sharing those bytes)."""

    def __init__(self, ids: pa.Array) -> None:
        self.ids = ids
        self._bytes = None
        # strings all of one length: a word of every string is a strided copy of the data (no copy of the data, no
        # gather by offset, no mask; `cje_engine.data.strings.fixed_width`)
        self.fixed = fixed_width(ids)

    @property
    def bytes(self):
        """The ids' `cje_engine.data.strings.ByteWords` (made at the first use)."""
        if self._bytes is None:
            self._bytes = byte_words(self.ids, pad=24)  # a load of word 0 or 1 stays inside
        return self._bytes

    def word(self, i: int, rows: np.ndarray | None = None) -> np.ndarray:
        """Word ``i`` (0 or 1) of every string (``rows`` None) or of the strings at ``rows``."""
        if self.fixed is not None and self.fixed.width >= 8 * (i + 1):  # every byte of the word is the string's own
            return (self.fixed.word(8 * i) if rows is None else self.fixed.word_view(8 * i)[rows]).byteswap(
                inplace=True)
        bw = self.bytes
        start = bw.start if rows is None else bw.start[rows]
        length = bw.length if rows is None else bw.length[rows]
        out = bw.words[start + 8 * i if i else start]
        length = np.minimum(length - 8 * i if i else length, 8)  # (np.clip: ~10x the CPU of these two)
        if i:
            np.maximum(length, 0, out=length)
        out &= BYTE_MASKS[length]
        return out.byteswap(inplace=True)


def _count_at_most(cut: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``numpy.searchsorted(cut, key, side="right")``, the keys equal to a cut) (``cut`` sorted): for each key, the
    cuts <= it, and the positions (increasing) of the keys whose greatest cut <= them is equal to them. Keys in order
    (a file in prompt-id order): one search a cut among the keys, not one a key among the cuts, and the equal keys a
    range of them a distinct cut; else a gather of each key's greatest cut from the cuts (`_count_at_most_reference`:
    the gathers and the comparison of every key with a cut below it)."""
    if key.size > 1 and bool((key[1:] >= key[:-1]).all()):
        first = np.searchsorted(key, cut, side="left")  # key[i] >= cut[k] exactly for i >= first[k]
        count = np.repeat(np.arange(cut.size + 1, dtype=np.int64), np.diff(first, prepend=0, append=key.size))
        u = np.unique(cut)
        a, b = np.searchsorted(key, u, side="left"), np.searchsorted(key, u, side="right")
        ranges = [np.arange(x, y, dtype=np.int64) for x, y in zip(a.tolist(), b.tolist()) if y > x]
        return count, np.concatenate(ranges) if ranges else np.empty(0, dtype=np.int64)
    count = np.searchsorted(cut, key, side="right")
    below = np.empty(cut.size + 1, dtype=cut.dtype)  # each key's greatest cut <= it (a key below every cut: none)
    below[1:] = cut
    below[0] = 0
    eq = below[count] == key
    eq &= count > 0
    return count, np.flatnonzero(eq)


def _count_at_most_reference(cut: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_count_at_most` the obvious way: a binary search a key among the cuts, then the keys whose greatest cut
    <= them equals them by gathers."""
    count = np.searchsorted(cut, key, side="right")
    tied = np.flatnonzero(count > 0)
    return count, tied[cut[count[tied] - 1] == key[tied]]


def _search_words(cut: np.ndarray, key: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi)`` narrowed to the splitters of each run ``[lo, hi)`` whose word ``cut`` equals ``key`` (the
    splitters of a run share their previous words, so their ``cut`` are sorted): a binary search a row among its
    run, run by run (the runs are few: splitters sharing a prefix)."""
    new_lo, new_hi = lo.copy(), hi.copy()
    for j in np.unique(lo):
        rows = np.flatnonzero(lo == j)
        sub = cut[int(j):int(hi[rows[0]])]
        new_hi[rows] = j + np.searchsorted(sub, key[rows], side="right")
        new_lo[rows] = j + np.searchsorted(sub, key[rows], side="left")
    return new_lo, new_hi


def range_shard(ids: pa.Array | pa.ChunkedArray, splitters: Sequence[str]) -> np.ndarray:
    """Shard of each id under sorted ``splitters``: how many splitters are <= it (``numpy.searchsorted(splitters,
    id, side="right")``; UTF-8 bytes compare in code-point order, Python's order of `str`); no Python string a row.

    One binary search a row among the splitters' first 8 bytes (`_prefix_words`); the ids whose first word equals
    some splitters' are searched among those by bytes 8-15, and those tied again compared as strings with the
    tied splitters only (one vectorized Arrow comparison a tied splitter, over its tied ids).
    `range_shard_reference` is the slow obvious computation (a comparison a splitter, over every id)."""
    ids = ids.cast(pa.string())
    if isinstance(ids, pa.ChunkedArray):
        if ids.num_chunks > 1:  # chunk by chunk (an id's shard is of the id alone): no copy of the column
            return np.concatenate([range_shard(c, splitters) for c in ids.chunks])
        ids = ids.chunk(0) if ids.num_chunks else pa.array([], pa.string())
    cuts = list(splitters)
    if not cuts or len(ids) == 0:
        return np.zeros(len(ids), dtype=np.int64)
    if any(b > a for a, b in zip(cuts[1:], cuts)):
        raise ValueError("range_shard: the splitters are not sorted")
    if ids.null_count:  # a null is below every splitter (`range_shard_reference`: a comparison with null is false)
        return range_shard_reference(ids, cuts)
    words, cut_words = _PrefixWords(ids), _PrefixWords(pa.array(cuts, pa.string()))
    w0, c0 = words.word(0), cut_words.word(0)
    # splitters whose first word is <= the id's: all below the id but those whose first word is the id's (``tied``)
    lo, tied = _count_at_most(c0, w0)
    if tied.size:
        hi = lo[tied]
        lo1, hi1 = _search_words(cut_words.word(1), words.word(1, tied), np.searchsorted(c0, w0[tied]), hi)
        again = np.flatnonzero(lo1 < hi1)
        if again.size:  # the same 16 bytes as some splitters: compared as strings with those
            sub = ids.take(pa.array(tied[again]))
            run = lo1[again]
            add = np.zeros(again.size, dtype=np.int64)
            for j in np.unique(run):
                rows = np.flatnonzero(run == j)
                part = sub.take(pa.array(rows)) if rows.size < again.size else sub
                for k in range(int(j), int(hi1[again[rows[0]]])):
                    ge = pc.greater_equal(part, pa.scalar(cuts[k], pa.string()))
                    add[rows] += np.asarray(ge.to_numpy(zero_copy_only=False), dtype=np.int64)
            lo1[again] += add
        lo[tied] = lo1
    return lo.astype(np.int64, copy=False)


def range_shard_reference(ids: pa.Array | pa.ChunkedArray, splitters: Sequence[str]) -> np.ndarray:
    """`range_shard` the slow obvious way: one vectorized Arrow comparison a splitter, over every id (a null id
    is below every splitter)."""
    ids = ids.cast(pa.string())
    shard = np.zeros(len(ids), dtype=np.int64)
    for cut in splitters:
        ge = pc.greater_equal(ids, pa.scalar(cut, pa.string())).fill_null(False)
        shard += np.asarray(ge.to_numpy(zero_copy_only=False) if isinstance(ge, pa.Array) else
                            ge.combine_chunks().to_numpy(zero_copy_only=False), dtype=np.int64)
    return shard


#: Distinct scores of a piece up to which `pack_piece` ships its score as codes into their values (2 bytes a row
#: at most, instead of 8).
PACK_SCORE_VALUES = 2**16
#: Rows of a piece whose distinct scores `pack_piece` counts first: more than `PACK_SCORE_VALUES` among them and
#: the score is shipped plain without hashing the rest.
PACK_SCORE_PROBE = 2048


@dataclass
class PackedPiece:
    """A reader's piece of a shard in the form it crosses the object store (`pack_piece`; `unpack_pieces` gives
    back the table every pass reads, the same values in every column a pass reads).

    What an unlabelled row does not need is not shipped: the label and its probability only for the labelled
    rows (their positions in the piece, with the values); the window place `ROW` as its steps from the previous
    row (a piece's rows are in window order; 1-2 bytes a row); the score, when the piece has few distinct
    values, as codes into them (1-2 bytes a row); every other column as it is."""

    table: pa.Table  # the piece without LABEL, LABEL_PROB and ROW; SCORE as codes when ``score_values``
    schema: pa.Schema  # the piece's schema as `split_by_shard` gave it (columns in order, metadata)
    row_first: int  # `ROW` of its first row
    row_step: np.ndarray | None  # (n,) unsigned: ROW minus the previous row's (0 first); None: ``row`` shipped
    row: np.ndarray | None  # (n,) int64: ROW as it is (steps too wide), else None
    score_values: np.ndarray | None  # float64 values the codes index (bit patterns kept), None: SCORE plain
    lab_pos: np.ndarray  # (L,) uint32/int64: positions of the rows whose label is a number
    label: np.ndarray | None  # (L,) float64: their labels (None: no LABEL column)
    label_prob: np.ndarray | None  # (L,) float64: their LABEL_PROB (NaN: null; None: no such column)

    @property
    def num_rows(self) -> int:
        """Rows of the piece."""
        return self.table.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (what it puts in the object store, but for a small header)."""
        arrays = (self.row_step, self.row, self.score_values, self.lab_pos, self.label, self.label_prob)
        return int(self.table.nbytes + sum(a.nbytes for a in arrays if a is not None))

    def __getstate__(self) -> dict:
        """Pickled (the object store, a `PieceBundle`) with its table's columns as numpy views of its own rows
        (`table_state`)."""
        state = dict(self.__dict__)
        state["table"] = table_state(self.table)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["table"] = table_of_state(state["table"])
        self.__dict__.update(state)


@dataclass
class _Column:
    """A column of a table for pickling (`table_state`): its Arrow type and each chunk as ``(kind, *parts)``:
    ``("s", offsets from 0, bytes)`` a string chunk, ``("d", indices, dictionary)`` a dictionary chunk, ``("p",
    values)`` a chunk of numbers, each numpy (a view of the chunk's own rows: out of band, no copy before the object
    store); ``("a", chunk)`` any other chunk (one with nulls, or of another type) as Arrow pickles it (its whole
    buffers: pyarrow pickles a slice's parents whole)."""

    type: pa.DataType
    chunks: list


def _chunk_state(c: pa.Array) -> tuple:
    """One chunk of `_Column`."""
    t = c.type
    if c.null_count:
        return ("a", c)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        width = np.int64 if pa.types.is_large_string(t) else np.int32
        _, off_buf, data_buf = c.buffers()
        if len(c) == 0 or off_buf is None:
            return ("s", np.zeros(len(c) + 1, dtype=width), np.empty(0, dtype=np.uint8))
        off = np.frombuffer(off_buf, dtype=width)[c.offset:c.offset + len(c) + 1]
        lo, hi = int(off[0]), int(off[-1])
        data = np.frombuffer(data_buf, dtype=np.uint8)[lo:hi] if data_buf is not None and hi > lo \
            else np.empty(0, dtype=np.uint8)
        return ("s", off - off.dtype.type(lo), data)
    if pa.types.is_dictionary(t) and pa.types.is_integer(t.index_type) and not c.indices.null_count:
        return ("d", np.asarray(c.indices.to_numpy(zero_copy_only=True)), c.dictionary)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return ("p", np.asarray(c.to_numpy(zero_copy_only=True)))
    return ("a", c)


def _chunk_of_state(t: pa.DataType, state: tuple) -> pa.Array:
    """The chunk of `_chunk_state`: its buffers taken as they are (zero-copy)."""
    kind = state[0]
    if kind == "s":
        off, data = state[1], state[2]
        cls = pa.LargeStringArray if pa.types.is_large_string(t) else pa.StringArray
        return cls.from_buffers(off.size - 1, pa.py_buffer(off), pa.py_buffer(data))
    if kind == "d":
        return pa.DictionaryArray.from_arrays(pa.array(state[1], type=t.index_type), state[2], ordered=t.ordered,
                                              safe=False)
    if kind == "p":
        return pa.array(state[1], type=t)
    return state[1]


def table_state(table: pa.Table) -> tuple:
    """A table for pickling: (its schema, a `_Column` a column), every chunk of strings, dictionary codes or numbers
    without nulls as numpy views of its own rows. Pickled as they are, pyarrow ships a slice's parent buffers whole
    (a piece of a file: the file's); Ray's reducer ships the slice, but rebases a string array's offsets by Arrow
    compute on every put (a subtract to int64 and a cast back, ~5 ns a row); here by numpy, ~10x less.
    `table_of_state` rebuilds the same table (zero-copy of the buffers)."""
    return table.schema, [_Column(col.type, [_chunk_state(c) for c in col.chunks]) for col in table.columns]


def table_of_state(state: Any) -> pa.Table:
    """The table of `table_state` (a plain table, as it is)."""
    if isinstance(state, pa.Table):
        return state
    schema, cols = state
    arrays = [pa.chunked_array([_chunk_of_state(col.type, c) for c in col.chunks], type=col.type) for col in cols]
    return pa.Table.from_arrays(arrays, schema=schema)


#: Alignment of each buffer in a `PieceBundle` (bytes: Arrow's own).
BUNDLE_ALIGN = 64


@dataclass
class PieceBundle:
    """Several pieces of one reader (`bundle_pieces`) in one object: each piece's pickle (protocol 5) with its
    buffers out of band, all of them in one byte array. One object in the store instead of a piece each (a put
    costs ~0.65 ms of CPU whatever its size: ~25 ms of a reader's CPU a file of 26 pieces, `bench_bundles.py`); a
    task unpickles only the piece it reads (`piece`), its arrays views of the bundle's bytes (zero-copy)."""

    metas: list  # a piece's pickle without its buffers (bytes)
    spans: list  # a piece's buffers: [(offset, bytes), ...] in ``data``
    data: np.ndarray  # uint8: every buffer, each at a multiple of `BUNDLE_ALIGN`

    def __len__(self) -> int:
        return len(self.metas)

    def piece(self, j: int) -> Any:
        """Piece ``j`` (its arrays views of ``data``)."""
        return pickle.loads(self.metas[j], buffers=[self.data[o:o + n] for o, n in self.spans[j]])


def bundle_pieces(pieces: Sequence[Any]) -> PieceBundle:
    """A `PieceBundle` of ``pieces`` (any picklable objects: `PackedPiece` or tables)."""
    metas, bufs = [], []
    for p in pieces:
        mine: list = []
        metas.append(pickle.dumps(p, protocol=5, buffer_callback=mine.append))
        bufs.append([b.raw() for b in mine])
    spans, at = [], 0
    for mine in bufs:
        row = []
        for b in mine:
            at = -(-at // BUNDLE_ALIGN) * BUNDLE_ALIGN
            row.append((at, b.nbytes))
            at += b.nbytes
        spans.append(row)
    data = np.empty(at, dtype=np.uint8)
    for mine, row in zip(bufs, spans):
        for b, (o, n) in zip(mine, row):
            data[o:o + n] = np.frombuffer(b, dtype=np.uint8)
    return PieceBundle(metas, spans, data)


def _float_column(table: pa.Table, name: str) -> np.ndarray:
    """A column as float64 the way the passes read it (`shard_rows`: nulls are NaN)."""
    col = table[name]
    return np.asarray(col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array) else
                      col.combine_chunks().to_numpy(zero_copy_only=False) if col.num_chunks else [], dtype=float)


def _labelled(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of the rows of ``table`` whose LABEL is a number (not null, not NaN), as
    `_labelled_reference` gives them: of a float64 column, from each chunk's values and validity bits in place (no
    float copy of the column with its nulls as NaN)."""
    col = table[LABEL]
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if not pa.types.is_float64(col.type):
        return _labelled_reference(table)
    pos, vals, base = [], [], 0
    for c in chunks:
        n = len(c)
        if n == 0 or c.null_count == n:
            base += n
            continue
        validity, data = c.buffers()
        if data is None:
            return _labelled_reference(table)
        v = np.frombuffer(data, dtype=np.float64, count=c.offset + n)[c.offset:]
        ok = np.isnan(v)
        np.logical_not(ok, out=ok)
        if c.null_count:
            ok &= np.unpackbits(np.frombuffer(validity, dtype=np.uint8), count=c.offset + n,
                                bitorder="little")[c.offset:].view(bool)
        at = np.flatnonzero(ok)
        pos.append(at + base if base else at)
        vals.append(v[at])
        base += n
    if not pos:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    return (pos[0], vals[0]) if len(pos) == 1 else (np.concatenate(pos), np.concatenate(vals))


def _labelled_reference(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """`_labelled` by the column as float64 with its nulls as NaN (`_float_column`): its reference."""
    label = _float_column(table, LABEL)
    lab = np.flatnonzero(~np.isnan(label))
    return lab, label[lab]


def _unsigned(top: int) -> type | None:
    """The smallest unsigned type holding ``0..top`` (None: wider than 32 bits)."""
    return np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32 if top < 2**32 else None


#: Odd 64-bit multipliers `_table_codes` tries, in turn, for a slot a value without two values in one slot.
_SLOT_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                     0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def _table_codes(parts: Sequence[np.ndarray], values: np.ndarray) -> np.ndarray | None:
    """The position in ``values`` (distinct uint64, at most 256) of each of the uint64 ``parts`` (one array of uint8
    codes, the parts' in order), or None when some of them is not among ``values`` (or no multiplier of
    `_SLOT_MULTIPLIERS` gives each value its own slot).

    Each value is given a slot by its top bits after a multiply (``(x * m) >> (64 - b)``, 2^b slots, ~8 K^2 for K
    values): a code a row is a gather from a small table of the slots' codes, checked by a gather of the slots'
    values (every row's value must be its slot's: no hash table a row, ~half the CPU of Arrow's dictionary
    encoding of the scores)."""
    k = int(values.size)
    if k == 0 or k > 256:
        return None
    b = min(16, max(10, 2 * k.bit_length() + 3))
    shift = np.uint64(64 - b)
    for m in _SLOT_MULTIPLIERS:
        slot = ((values * np.uint64(m)) >> shift).astype(np.int64)
        if np.unique(slot).size == k:
            break
    else:
        return None
    code = np.zeros(1 << b, dtype=np.uint8)
    code[slot] = np.arange(k, dtype=np.uint8)
    # a slot no value has holds ``values[0]``, which is not in that slot: a row hashed there fails the check
    value = np.full(1 << b, values[0], dtype=np.uint64)
    value[slot] = values
    out = []
    for bits in parts:  # a part (a chunk of the column) at a time: no copy of the column into one
        at = bits * np.uint64(m)
        at >>= shift
        at = at.view(np.int64)
        check = np.take(value, at)
        check ^= bits
        if check.any():  # a row's value is not among ``values``
            return None
        out.append(np.take(code, at))
    return out[0] if len(out) == 1 else np.concatenate(out)


def _score_codes(table: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """(codes, values) of a float64 score column without nulls with at most `PACK_SCORE_VALUES` distinct values
    (distinct by bit pattern: ``-0.0`` and ``0.0``, every NaN kept as it is), else None: `_score_codes_reference`'s.
    The values in order of their first row (Arrow's dictionary encoding's order). When every score of the piece is
    among those of its first `PACK_SCORE_PROBE` rows (at most 256 of them), their order is that of the first rows and
    the codes come from a table of slots (`_table_codes`), without a hash a row; else by the reference."""
    col = table[SCORE]
    if not pa.types.is_float64(col.type) or col.null_count or table.num_rows == 0:
        return None
    chunks = [c for c in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]) if len(c)]
    parts = [np.asarray(c.to_numpy()).view(np.uint64) for c in chunks]
    n_head = min(PACK_SCORE_PROBE, table.num_rows)
    head, k = [], 0
    while sum(h.size for h in head) < n_head:  # the first rows, from the first parts
        head.append(parts[k][:n_head])
        k += 1
    head = head[0] if len(head) == 1 else np.concatenate(head)[:n_head]
    head, first = np.unique(head, return_index=True)
    if head.size > PACK_SCORE_VALUES:
        return None
    values = head[np.argsort(first)]  # in order of their first row
    codes = _table_codes(parts, values)
    if codes is None:
        return _score_codes_reference(table)
    return codes, values.view(np.float64).copy()


def _score_codes_reference(table: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """`_score_codes` by Arrow's dictionary encoding of the scores' bit patterns (one hash a row): its reference."""
    col = table[SCORE]
    if not pa.types.is_float64(col.type) or col.null_count or table.num_rows == 0:
        return None
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    bits = np.asarray(col.to_numpy()).view(np.uint64)
    if np.unique(bits[:PACK_SCORE_PROBE]).size > PACK_SCORE_VALUES:
        return None
    enc = pc.dictionary_encode(pa.array(bits))  # one hash pass
    if len(enc.dictionary) > PACK_SCORE_VALUES:
        return None
    codes = np.asarray(enc.indices.to_numpy()).astype(_unsigned(len(enc.dictionary) - 1))
    return codes, np.asarray(enc.dictionary.to_numpy()).view(np.float64).copy()


def pack_piece(table: pa.Table) -> PackedPiece:
    """A piece of `split_by_shard` (its `ROW` increasing) as it crosses the object store (`PackedPiece`)."""
    drop = [c for c in (LABEL, LABEL_PROB, ROW) if c in table.column_names]
    row = np.asarray(one_chunk(table[ROW]).to_numpy(), dtype=np.int64)  # a reader's one chunk: no copy
    step = np.diff(row, prepend=row[:1])
    kind = np.uint8 if row.size == 0 else _unsigned(int(step.max())) if int(step.min()) >= 0 else None
    if LABEL in table.column_names:
        lab, label = _labelled(table)
    else:
        lab, label = np.empty(0, dtype=np.int64), None
    prob = _float_column(table.select([LABEL_PROB]).take(pa.array(lab)), LABEL_PROB) \
        if LABEL_PROB in table.column_names else None  # of the labelled rows only
    coded = _score_codes(table) if SCORE in table.column_names else None
    body = table.drop_columns(drop)
    if coded is not None:
        body = body.set_column(body.column_names.index(SCORE), SCORE, pa.array(coded[0]))
    return PackedPiece(table=body, schema=table.schema, row_first=int(row[0]) if row.size else 0,
                       row_step=step.astype(kind) if kind is not None else None,
                       row=None if kind is not None else row, score_values=None if coded is None else coded[1],
                       lab_pos=lab.astype(_unsigned(max(table.num_rows - 1, 0)) or np.int64), label=label,
                       label_prob=prob)


def unpack_piece(piece: PackedPiece) -> pa.Table:
    """The table of a `PackedPiece`: its columns in the order and with the metadata of the piece it was packed
    from; `ROW` and SCORE as they were, LABEL float64 (NaN where unlabelled: the passes read a null label as NaN)
    and LABEL_PROB float64 (its values at the labelled rows, NaN elsewhere: the passes read it there only)."""
    n = piece.num_rows
    cols = {}
    if piece.row is not None:
        cols[ROW] = pa.array(piece.row)
    else:
        row = np.cumsum(piece.row_step, dtype=np.int64)
        row += piece.row_first
        cols[ROW] = pa.array(row)
    lab = piece.lab_pos.astype(np.int64)
    for name, values in ((LABEL, piece.label), (LABEL_PROB, piece.label_prob)):
        if values is not None:
            full = np.full(n, np.nan)
            full[lab] = values
            cols[name] = pa.array(full)
    if piece.score_values is not None:
        codes = one_chunk(piece.table[SCORE])  # a piece's one chunk: no copy
        cols[SCORE] = pa.array(piece.score_values[np.asarray(codes.to_numpy())])
    arrays, fields = [], []
    for f in piece.schema:
        if f.name in cols:
            arrays.append(cols[f.name])
            fields.append(pa.field(f.name, cols[f.name].type))
        else:
            arrays.append(piece.table[f.name])
            fields.append(f)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=piece.schema.metadata))


def unpack_pieces(*pieces: Any) -> pa.Table:
    """One shard's table from its pieces (tables or `PackedPiece`, in window order; the plain tables zero-copy)."""
    tables = [unpack_piece(p) if isinstance(p, PackedPiece) else p for p in pieces]
    kept = [t for t in tables if t.num_rows]
    return pa.concat_tables(kept, promote_options="default") if kept else tables[0]


#: Rows a reader's sample looks at, per id it returns (`sample_prompt_ids`): the rest are not sorted.
SAMPLE_ROWS_PER_ID = 64


def sample_prompt_ids(ids: pa.Array | pa.ChunkedArray, k: int) -> list[str]:
    """``k`` evenly spaced ids of the sorted distinct ``ids`` (a reader's sample for `range_splitters`); of a
    file of more than `SAMPLE_ROWS_PER_ID` ``* k`` rows, of that many evenly spaced rows only (the shards'
    ranges need quantiles, not every id: their balance, never a number, depends on them)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if k > 0 and len(ids) > SAMPLE_ROWS_PER_ID * k:
        ids = ids.take(pa.array(np.linspace(0, len(ids) - 1, SAMPLE_ROWS_PER_ID * k).astype(np.int64)))
    uniq = pc.unique(ids.cast(pa.string()))
    uniq = uniq.take(pc.sort_indices(uniq))
    if len(uniq) == 0 or k <= 0:
        return []
    at = np.unique(np.linspace(0, len(uniq) - 1, min(k, len(uniq))).round().astype(np.int64))
    return uniq.take(pa.array(at)).to_pylist()


def range_splitters(samples: Iterable[Sequence[str]], n_shards: int) -> list[str]:
    """``n_shards - 1`` sorted prompt ids cutting the pooled ``samples`` into equal parts (the shards' ranges for
    `split_by_shard`); repeated when the samples have fewer distinct ids (some shards are then empty)."""
    pooled = sorted({x for s in samples for x in s})
    if n_shards <= 1:
        return []
    if not pooled:
        return [""] * (n_shards - 1)
    at = [min(len(pooled) - 1, (i * len(pooled)) // n_shards) for i in range(1, n_shards)]
    return [pooled[i] for i in at]


#: Bytes of an id up to which `sorted_codes` orders it by integers (its first two big-endian 8-byte words and, for
#: the ids that need it, its length); longer ids are compared as strings among those sharing their first 16 bytes.
WORD_KEY_BYTES = 16


def sorted_codes(column: pa.Array | pa.ChunkedArray, keys: bool = False) -> tuple[np.ndarray, "pa.Array | KeyIds"]:
    """(codes, sorted distinct values) of a string column: ``pandas.factorize(values, sort=True)``'s, without a
    Python string a row and without hashing the strings (`sorted_codes_reference` hashes them in Arrow).

    Each id is read as an order-preserving integer key (`fill_id_words`: its first 16 UTF-8 bytes as two
    big-endian words, zero padded; then, where two ids' words can tie, its length (an id ending in NUL bytes:
    ``"a"`` and ``"a\\0"``) and, for an id longer than 16 bytes, its rank among the longer ids, which are few,
    compared as strings), so the bytes' order, which is code-point order, Python's order of `str` and pandas', is
    the order of integers, each coded densely (`dense_rank`); the distinct ids are rebuilt from their words.
    A dictionary-encoded column (the policy as the sharded readers ship it) is coded from its dictionaries' values
    (`dictionary_codes`); a column with nulls, not of strings, or of mostly long ids goes the reference's way.
    ``keys``: the distinct ids, where they would be rebuilt from their words, returned as those words (`KeyIds`:
    the ids built only where read, the same strings)."""
    if pa.types.is_dictionary(column.type) or column.null_count or not (
            pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return sorted_codes_reference(column)
    chunks = [c for c in (column.chunks if isinstance(column, pa.ChunkedArray) else [column]) if len(c)]
    n = sum(len(c) for c in chunks)
    if n == 0:
        return np.empty(0, dtype=np.int64), pa.array([], pa.string())
    w0, w1 = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64)
    size = np.empty(n, dtype=np.uint8)  # bytes, 17 for any longer
    nul, lo = False, 0
    for c in chunks:
        nul |= fill_id_words(c, w0[lo:lo + len(c)], w1[lo:lo + len(c)], size[lo:lo + len(c)])
        lo += len(c)
    long = size > WORD_KEY_BYTES
    n_long = int(np.count_nonzero(long))
    if n_long * 4 > n:  # mostly long ids: the strings hashed once beat a string compare among many ties
        return sorted_codes_reference(column)
    key, u0 = dense_rank(w0)
    del w0
    span, u1, exact = u0.size, None, True
    if w1.any():
        c1, u1 = dense_rank(w1)
        key, span, fit = _combine(key, span, c1, u1.size)
        exact &= fit
        del c1
    del w1
    if n_long:  # the tie: the length (<= 16) below every longer id, then the longer ids' rank among them
        tie = size.astype(np.int64)
        codes_long, _ = sorted_codes_reference(_rows_of(column, np.flatnonzero(long)))
        tie[long] += codes_long
        key, span, _ = _combine(key, span, tie, WORD_KEY_BYTES + 2 + int(codes_long.max()))
        exact = False
        del tie
    elif nul:
        key, span, fit = _combine(key, span, size, WORD_KEY_BYTES + 1)
        exact &= fit
    codes, ukeys = dense_rank(key, span, inplace=True)
    del key
    if exact:
        if keys:
            return codes, KeyIds(ukeys, u0, u1, nul, column, codes)
        ids = _ids_of_keys(ukeys, u0, u1, nul)
        if ids is not None:
            return codes, ids
    first = np.empty(ukeys.size, dtype=np.int64)
    first[codes[::-1]] = np.arange(n - 1, -1, -1)  # a row of each distinct id (the first)
    return codes, _rows_of(column, first)


@dataclass
class KeyIds:
    """`sorted_codes`' sorted distinct ids kept as their integer keys (``keys=True``): each id built from its words
    (`_ids_of_keys`, the strings `sorted_codes` returns) only where read, as pass 1 of a range shard reads a few
    (its labelled prompts' ids, its first and last), not every one."""

    ukeys: np.ndarray  # the distinct keys, sorted
    u0: np.ndarray
    u1: np.ndarray | None
    nul: bool
    column: Any  # the coded column and its codes: the ids taken from it when their bytes pass 2 GiB
    codes: np.ndarray

    def __len__(self) -> int:
        return int(self.ukeys.size)

    def take(self, at: np.ndarray | pa.Array) -> pa.Array:
        """The ids at ``at`` (positions among the sorted distinct ids) as one `pyarrow.string` array."""
        at = np.asarray(at, dtype=np.int64)
        ids = _ids_of_keys(self.ukeys[at], self.u0, self.u1, self.nul)
        if ids is None:  # more than 2 GiB: a row of each from the column
            first = np.empty(self.ukeys.size, dtype=np.int64)
            first[self.codes[::-1]] = np.arange(self.codes.size - 1, -1, -1)
            ids = _rows_of(self.column, first[at])
        return ids

    def array(self) -> pa.Array:
        """Every id (`sorted_codes`' array)."""
        return self.take(np.arange(len(self)))


def _ids_of_keys(ukeys: np.ndarray, u0: np.ndarray, u1: np.ndarray | None, nul: bool) -> pa.Array | None:
    """The ids of ``sorted_codes``'s distinct keys (no id longer than 16 bytes, no key re-coded), from their
    words: ``key = (rank in u0 * len(u1) + rank in u1) * 17 + length`` (the length only when ``nul``, else the
    bytes up to the last non-NUL one). None: more than 2 GiB of bytes (the caller takes them from the column)."""
    nu = ukeys.size
    k = ukeys
    if nul:
        k, length = np.divmod(k, WORD_KEY_BYTES + 1)
    words = np.zeros((nu, 2), dtype=">u8")
    if u1 is not None:
        k, r1 = np.divmod(k, u1.size)
        words[:, 1] = u1[r1]
    words[:, 0] = u0[k]
    raw = words.view(np.uint8).reshape(nu, WORD_KEY_BYTES)
    if not nul:  # no id ends in NUL: its length is where its last non-NUL byte is
        length = np.full(nu, WORD_KEY_BYTES, dtype=np.int64)
        length -= _trailing_zero_bytes(words[:, 1].astype(np.uint64))
        short = length == 8
        length[short] -= _trailing_zero_bytes(words[short, 0].astype(np.uint64))
    ends = np.cumsum(length)
    if nu and int(ends[-1]) >= 2**31:
        return None
    offsets = np.zeros(nu + 1, dtype=np.int32)
    offsets[1:] = ends
    one = int(length[0]) if nu else 0
    if nu and not np.any(length - one):
        data = np.ascontiguousarray(raw[:, :one])
    else:
        data = np.ascontiguousarray(raw[np.arange(WORD_KEY_BYTES) < length[:, None]])
    return pa.Array.from_buffers(pa.string(), nu, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _trailing_zero_bytes(w: np.ndarray) -> np.ndarray:
    """Zero bytes at the low end of each ``uint64`` (8 for 0), int64."""
    low = w & (~w + np.uint64(1))  # the lowest set bit (0 for 0)
    low -= np.uint64(1)  # the bits below it (all 64 for 0)
    return (np.bitwise_count(low) // 8).astype(np.int64)


def _rows_of(column: pa.Array | pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    """The values of ``column`` at ``rows`` as one `pyarrow.string` array."""
    out = column.take(pa.array(rows))
    if isinstance(out, pa.ChunkedArray):
        out = out.combine_chunks() if out.num_chunks else pa.array([], column.type)
    return out.cast(pa.string())


def _combine(key: np.ndarray, size: int, code: np.ndarray, n: int) -> tuple[np.ndarray, int, bool]:
    """(``key * n + code``, its span, whether ``key`` was kept as it came): one order-preserving key of a pair of
    dense codes (``key < size``, ``code < n``), ``key`` re-coded densely first when the product would leave
    int64."""
    kept = size * n < 2**62
    if not kept:
        key, u = dense_rank(key)
        size = u.size
    key = key.astype(np.int64, copy=False)
    key *= n
    key += code
    return key, size * n, kept


#: Key range up to which `dense_rank` ranks by a flag a value (O(values + range)) rather than by a hash.
DENSE_RANK_SPAN = 1 << 26


def dense_rank(values: np.ndarray, span: int | None = None, inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each value among the sorted distinct ``values``, int64; the sorted distinct values):
    ``pandas.factorize(values, sort=True)`` of an integer array. ``span`` (the values known to lie in
    ``[0, span)``): ranked by flagging the values present and counting them, when ``span`` is at most
    `DENSE_RANK_SPAN` and a few times the number of values (``inplace``: the ranks written over ``values``, an
    int64 array); else by the values' runs or a hash (`_hash_rank`)."""
    if values.size == 0:
        return np.empty(0, dtype=np.int64), values[:0].copy()
    if span is not None and span <= DENSE_RANK_SPAN and span <= 8 * values.size + 4096:
        seen = np.zeros(span, dtype=bool)
        seen[values] = True
        if seen.all():  # every value of the span present (a shard's ids' word pairs often are): each its own rank
            codes = values if inplace and values.dtype == np.int64 else values.astype(np.int64)
            return codes, np.arange(span, dtype=np.int64)
        rank = np.cumsum(seen, dtype=np.int64)
        rank -= 1
        if inplace and values.dtype == np.int64:
            np.take(rank, values, out=values, mode="clip")  # every value is a valid index: in place
            return values, np.flatnonzero(seen)
        return rank[values], np.flatnonzero(seen)
    head = np.empty(values.size, dtype=bool)  # runs of one value (the ids' first word along a sorted file)
    head[0] = True
    np.not_equal(values[1:], values[:-1], out=head[1:])
    starts = np.flatnonzero(head)
    if starts.size * 4 <= values.size:  # the runs' values ranked, their ranks repeated along the runs
        codes, uniques = _hash_rank(values[starts])
        return np.repeat(codes, np.diff(starts, append=values.size)), uniques
    del head, starts
    got = _span_rank(values)
    return got if got is not None else _hash_rank(values)


def _span_rank(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """`dense_rank` of integers that, less their smallest and shifted right past the low bits they all share,
    lie in a small range (`DENSE_RANK_SPAN`, a few times their number): ranked by flagging them (no hash). The
    ids' second words are such (``"123"`` then zero bytes: a range of ~0x090909 once shifted). None: too wide."""
    if values.dtype.kind not in "iu" or values.dtype.itemsize > 8:
        return None
    lo = np.asarray(values.min()).astype(np.uint64)[()]  # signed: its bits modulo 2^64
    with np.errstate(over="ignore"):  # signed values: the unsigned difference wraps, as intended
        width = int(np.asarray(values.max()).astype(np.uint64)[()] - lo)  # modulo 2^64: the exact distance
    if values.dtype.itemsize == 8:  # int64's bits as uint64 are its values modulo 2^64: one pass, no copy first
        d = np.subtract(values.view(np.uint64), lo)  # the distance from the smallest, modulo 2^64
    else:
        d = values.astype(np.uint64)  # a copy (narrower ints: each widened, modulo 2^64)
        d -= lo  # the distance from the smallest, modulo 2^64
    shared = np.bitwise_or.reduce(d)
    shift = 0 if shared == 0 else int(np.bitwise_count((shared & (~shared + np.uint64(1))) - np.uint64(1)))  # low 0s
    span = (width >> shift) + 1
    if span > DENSE_RANK_SPAN or span > 8 * values.size + 4096:
        return None
    if shift:
        d >>= np.uint64(shift)
    d = d.view(np.int64)  # below `DENSE_RANK_SPAN`: the same numbers, an index without a conversion
    seen = np.zeros(span, dtype=bool)
    seen[d] = True
    rank = np.cumsum(seen, dtype=np.int64)
    rank -= 1
    np.take(rank, d, out=d, mode="clip")  # every distance is a valid index: element by element, in place
    present = np.flatnonzero(seen)
    codes = d
    uniques = present.astype(np.uint64)
    uniques <<= np.uint64(shift)
    uniques += lo  # modulo 2^64: back to the values' bits
    return codes, uniques.astype(values.dtype, copy=False)


def _hash_rank(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`dense_rank` by a hash: ``pandas.factorize`` (codes in order of appearance), its distinct values sorted,
    the codes mapped to their ranks in place."""
    codes, uniques = pd.factorize(values)
    codes = codes.astype(np.int64, copy=False)
    order = np.argsort(uniques, kind="stable")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    np.take(rank, codes, out=codes, mode="clip")  # every code is a valid index: element by element, in place
    return codes, np.asarray(uniques)[order]


def _fixed_words(data_buf: pa.Buffer, base: int, n: int, each: int, w0: np.ndarray, w1: np.ndarray) -> None:
    """`fill_id_words` of ``n`` values of ``each`` (1-16) bytes from ``base`` in ``data_buf``: a big-endian word
    read at every value's first (and ninth) byte, the bytes of the next value cut off; the last values, whose
    16 bytes would pass the buffer's end, from a padded copy."""
    buf = np.frombuffer(data_buf, dtype=np.uint8)
    safe = min(n, max(0, (buf.size - base - WORD_KEY_BYTES) // each + 1))
    tail = np.zeros((n - safe) * each + WORD_KEY_BYTES, dtype=np.uint8)
    tail[:(n - safe) * each] = buf[base + safe * each:base + n * each]
    for w, at, keep in ((w0, 0, min(each, 8)), (w1, 8, each - 8)):
        if keep <= 0:
            w[:] = 0
            continue
        if safe:
            w[:safe] = np.ndarray((safe,), dtype=">u8", buffer=buf, offset=base + at, strides=(each,))
        if n > safe:
            w[safe:] = np.ndarray((n - safe,), dtype=">u8", buffer=tail, offset=at, strides=(each,))
        if keep < 8:
            w &= np.uint64(~((1 << (8 * (8 - keep))) - 1) & (2**64 - 1))


def fill_id_words(chunk: pa.Array, w0: np.ndarray, w1: np.ndarray, size: np.ndarray) -> bool:
    """Fill ``w0``, ``w1`` (``uint64``) and ``size`` (``uint8``) with each value of a string array without nulls:
    its UTF-8 bytes 0-7 and 8-15 as big-endian words (zero padded) and its length in bytes (17 for any longer);
    True when some value's last byte is NUL (then two values may share their words). Values of one length (a
    file's ids often are) are read as a matrix of their bytes; others by `cje_engine.data.strings.byte_words`."""
    n = len(chunk)
    _, off_buf, data_buf = chunk.buffers()
    width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
    off = np.frombuffer(off_buf, dtype=width)[chunk.offset:chunk.offset + n + 1]
    base, total = int(off[0]), int(off[-1] - off[0])
    data = np.frombuffer(data_buf, dtype=np.uint8)[base:base + total] if total else np.empty(0, dtype=np.uint8)
    each = total // n if n else 0
    if (n and 0 < each <= WORD_KEY_BYTES and total == n * each and sys.byteorder == "little"
            and not np.any(np.diff(off) - each)):
        _fixed_words(data_buf, base, n, each, w0, w1)
        size[:] = each
        return not np.all(data[each - 1::each])
    if n and total == 0:  # every value empty
        w0[:] = 0
        w1[:] = 0
        size[:] = 0
        return False
    bw = byte_words(chunk, pad=16)
    np.take(bw.words, bw.start, out=w0)
    w0 &= BYTE_MASKS[np.minimum(bw.length, 8)]
    np.take(bw.words, bw.start + 8, out=w1)
    w1 &= BYTE_MASKS[np.clip(bw.length - 8, 0, 8)]
    w0.byteswap(inplace=True)
    w1.byteswap(inplace=True)
    np.minimum(bw.length, WORD_KEY_BYTES + 1, out=size, casting="unsafe")
    ends = bw.start + bw.length - 1
    return bool(total and np.any(data[ends[bw.length > 0]] == 0))


def sorted_codes_reference(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """`sorted_codes` computed in Arrow (a hash of the column, then a sort of its distinct values only): the
    reference of its integer keys, and its way for what they do not cover (nulls, other types, mostly long ids).

    The distinct values are sorted by their UTF-8 bytes, which is code-point order, Python's order of `str`, so
    the codes are pandas'; the values come back as `pyarrow.string`. A column with nulls (or not of strings)
    goes through pandas. A dictionary-encoded column is coded from its dictionaries' values (`dictionary_codes`)."""
    if pa.types.is_dictionary(column.type):
        if not column.null_count and pa.types.is_string(column.type.value_type):
            return dictionary_codes(column)
        column = column.cast(column.type.value_type)  # pandas would sort a categorical by its dictionary order
    if column.null_count or not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        codes, uniques = pd.factorize(column.to_pandas(), sort=True)
        return codes.astype(np.int64), pa.array(np.asarray(uniques, dtype=object), pa.string())
    enc = pc.dictionary_encode(column)  # one hash pass: every chunk's indices into one dictionary
    if isinstance(enc, pa.ChunkedArray):
        chunks = enc.chunks
        if not chunks:
            return np.empty(0, dtype=np.int64), pa.array([], pa.string())
        if any(not c.dictionary.equals(chunks[0].dictionary) for c in chunks[1:]):
            enc = pc.dictionary_encode(column.combine_chunks())
            chunks = [enc]
    else:
        chunks = [enc]
    uniq = chunks[0].dictionary.cast(pa.string())
    order = np.asarray(pc.sort_indices(uniq), dtype=np.int64)
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    idx = np.concatenate([np.asarray(c.indices.to_numpy()) for c in chunks])
    return rank[idx], uniq.take(pa.array(order))


def dictionary_codes(column: pa.DictionaryArray | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """`sorted_codes` of a dictionary-encoded string column without nulls: every chunk's dictionary (a chunk may
    have its own, and may hold values no row of it uses: a slice keeps its file's) ranked among the sorted union
    of the dictionaries' values, each row's index mapped through its chunk's ranks (a gather of small integers),
    then only the values some row uses kept (pandas' uniques)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    dicts = [c.dictionary.cast(pa.string()) for c in chunks]
    allv = pc.unique(pa.concat_arrays(dicts)) if dicts else pa.array([], pa.string())
    allv = allv.take(pc.sort_indices(allv))  # UTF-8 bytes: code-point order, as pandas sorts str
    codes = np.empty(sum(len(c) for c in chunks), dtype=np.int64)
    used = np.zeros(len(allv), dtype=bool)
    lo = 0
    for c, d in zip(chunks, dicts):
        if not len(c):
            continue
        where = np.asarray(pc.index_in(d, value_set=allv), dtype=np.int64)  # every value is in ``allv``
        if where.size == 1:  # one value (a reader's piece of one policy): every row's code, no gather
            codes[lo:lo + len(c)] = where[0]
            used[where[0]] = True
            lo += len(c)
            continue
        idx = np.asarray(c.indices.to_numpy(zero_copy_only=False))
        np.take(where, idx, out=codes[lo:lo + idx.size])  # written in place: no copy a chunk, no concatenation
        used[where[np.bincount(idx, minlength=where.size) > 0]] = True
        lo += idx.size
    if used.all():
        return codes, allv
    rank = np.cumsum(used) - 1
    return rank[codes], allv.filter(pa.array(used))


@dataclass
class ShardRows:
    """One shard's rows as arrays, in window order (`shard_rows`)."""

    row: np.ndarray  # (n,) place in the window
    prompt_ids: pa.Array  # sorted distinct prompt ids
    prompt: np.ndarray  # (n,) index into ``prompt_ids``
    policies: tuple  # sorted distinct policy names
    policy: np.ndarray  # (n,) index into ``policies``
    score: np.ndarray
    label: np.ndarray  # NaN: unlabelled
    label_weight: np.ndarray  # 1 / P(labelled) on labelled rows, 0 elsewhere
    X: np.ndarray  # (n, p) covariates


def shard_rows(table: pa.Table, covariates: Sequence[str] = (), policies: Sequence[str] | None = None) -> ShardRows:
    """A shard's table (canonical columns, validated upstream, plus `ROW`) as arrays in window order.

    The conversions are those of `EvalData.from_frame` (float scores and labels, ``1 / label_prob`` as the
    label weight, 1 where the probability is missing), so every row gets the same numbers here as there.
    """
    for col in (PROMPT, POLICY, SCORE, ROW, *covariates):
        if col not in table.column_names:
            raise CJEInputError(f"shard has no column {col!r} (columns: {', '.join(table.column_names)})", column=col)
    if policies is not None:
        table = table.filter(pc.is_in(table[POLICY], value_set=pa.array(list(policies), pa.string())))
    row = np.asarray(table[ROW].to_numpy(), dtype=np.int64)
    if row.size > 1 and not np.all(row[1:] >= row[:-1]):  # a shard's pieces come in window order: no sort then
        order = np.argsort(row, kind="stable")
        table = table.take(pa.array(order))
        row = row[order]
    prompt_codes, prompt_ids = sorted_codes(table[PROMPT])
    pol_codes, pol_uniques = sorted_codes(table[POLICY])
    n = table.num_rows
    label = (np.asarray(table[LABEL].to_numpy(zero_copy_only=False), dtype=float) if LABEL in table.column_names
             else np.full(n, np.nan))
    weight = np.zeros(n)
    lab = np.flatnonzero(~np.isnan(label))
    if LABEL_PROB in table.column_names:
        prob = np.asarray(table[LABEL_PROB].to_numpy(zero_copy_only=False), dtype=float)[lab]
        prob[np.isnan(prob)] = 1.0
        weight[lab] = 1.0 / prob
    else:
        weight[lab] = 1.0
    X = np.empty((n, len(covariates)))
    for j, c in enumerate(covariates):
        X[:, j] = np.asarray(table[c].to_numpy(zero_copy_only=False), dtype=float)
    return ShardRows(row=row, prompt_ids=prompt_ids, prompt=prompt_codes, policies=tuple(pol_uniques.to_pylist()),
                     policy=pol_codes,
                     score=np.asarray(table[SCORE].to_numpy(zero_copy_only=False), dtype=float),
                     label=label, label_weight=weight, X=X)


def _policy_runs(policy: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(policy, start, stop) of each run of one policy along a shard's rows (a reader's piece holds one policy),
    in row order; None when there are `POLICY_RUNS` or more (then the per-row ways are cheaper)."""
    if not policy.size:
        return []
    cut = np.flatnonzero(policy[1:] != policy[:-1])
    if cut.size >= POLICY_RUNS:
        return None
    starts = [0, *(cut + 1).tolist()]
    return [(int(policy[a]), a, b) for a, b in zip(starts, starts[1:] + [policy.size])]


def _prompts_per_policy(policy: np.ndarray, prompt: np.ndarray, n_policies: int, n_ids: int,
                        runs: list | None = None) -> np.ndarray:
    """Distinct prompts of each policy among rows of (policy code, prompt code), codes dense: one flag per
    (policy, prompt) set and counted (O(rows + policies x prompts); the number of distinct pairs, exactly).
    ``runs`` (`_policy_runs`): the flags set a run of one policy at a time (no key a row)."""
    if n_policies * n_ids >= 2**31 or policy.size * 4 < n_policies * n_ids:  # sparse: by a sort
        pairs = unique_ints(policy.astype(np.int64) * (n_ids + 1) + prompt)
        return np.bincount(pairs // (n_ids + 1), minlength=n_policies)
    if runs is not None:
        flags = np.zeros((n_policies, n_ids), dtype=bool)
        for k, a, b in runs:
            flags[k][prompt[a:b]] = True
        return np.count_nonzero(flags, axis=1).astype(np.int64)
    seen = np.zeros(n_policies * n_ids, dtype=bool)
    key = policy.astype(np.int64) * n_ids
    key += prompt
    seen[key] = True
    return np.count_nonzero(seen.reshape(n_policies, n_ids), axis=1).astype(np.int64)


@dataclass
class ShardSummary:
    """What pass 1 returns from a shard (`reduce_shard`): O(cells + labels), never its rows, and its prompt ids
    only when the shard is not one of a split by range (`split_by_shard` with splitters)."""

    n_rows: int
    prompt_ids: pa.Array | None  # sorted distinct prompt ids (None: a range shard, they stay on the worker)
    policies: tuple
    cell_score: np.ndarray  # (Gs,) fine cells: distinct (score, covariates), sorted
    cell_X: np.ndarray  # (Gs, p)
    counts: np.ndarray  # (len(policies), Gs) rows per (policy, fine cell)
    n_prompts: np.ndarray  # (len(policies),) distinct prompts per policy
    score_sum: np.ndarray  # (len(policies),)
    score_min: float
    score_max: float
    labelled: dict  # the labelled rows: row, prompt (local), policy, cell, score, X, label, weight, fold
    n_ids: int = 0  # distinct prompt ids
    id_range: tuple = (None, None)  # its smallest and largest prompt id (None: no rows)
    kept: Any = None  # the shard's `ShardKept` (or, on Ray, its object reference: it stays on the cluster)


@dataclass
class ShardKept:
    """Pass 1's codes of a shard's rows (window order), kept where the shard is for passes 2 and 3, so that they
    neither read the shard's table again nor hash its prompt ids again (`shard_view`): ~9 bytes a row.

    On Ray `reduce_shard` returns it as a second object that stays in the cluster's object store
    (`flows.runtime.sharded_ray.ray_mapper`, ``kept_field``); in process it rides on the `ShardSummary`."""

    prompt: np.ndarray  # (n,) int32: index into the shard's sorted distinct prompt ids
    policy: np.ndarray  # (n,) int8/int16: index into the shard's sorted policies
    cell: np.ndarray  # (n,) int32: the row's fine cell (index into the summary's ``cell_score``)
    lab_pos: np.ndarray  # (L,) int64: positions of the labelled rows (label not NaN), increasing
    lab_row: np.ndarray  # (L,) int64: their window rows (`ROW`), increasing
    n_ids: int  # the shard's distinct prompt ids

    @property
    def n_rows(self) -> int:
        """Rows of the shard."""
        return int(self.prompt.size)


@dataclass
class ShardView:
    """What passes 2 and 3 read of a shard (`shard_view`), from its table or from its `ShardKept`."""

    prompt: np.ndarray  # (n,) local prompt code (rank among the shard's ids)
    policy: np.ndarray  # (n,) local policy code
    cell: np.ndarray  # (n,) local fine cell
    lab_pos: np.ndarray  # positions of the labelled rows
    lab_row: np.ndarray  # their window rows
    n_ids: int


def _small_int(n: int) -> type:
    """The smallest signed integer type holding ``0..n``."""
    return np.int8 if n < 2**7 else np.int16 if n < 2**15 else np.int32 if n < 2**31 else np.int64


def shard_view(shard: Any, covariates: Sequence[str] = (), policies: Sequence[str] | None = None) -> ShardView:
    """A shard's codes for passes 2 and 3: from its `ShardKept` (pass 1's, as they are), or from its table
    (the shard read and coded again: `shard_rows` and `make_cells`, as pass 1 codes it; the reference)."""
    if isinstance(shard, ShardKept):
        return ShardView(shard.prompt, shard.policy, shard.cell, shard.lab_pos, shard.lab_row, shard.n_ids)
    r = shard_rows(shard, covariates, policies)
    _, fine = make_cells(r.score, r.X)
    lab = np.flatnonzero(~np.isnan(r.label))
    return ShardView(r.prompt, r.policy, fine, lab, r.row[lab], len(r.prompt_ids))


@dataclass
class PackedShard:
    """A shard as its readers' pieces (`PackedPiece` or tables, in window order), not concatenated: what a mapper
    hands `reduce_shard` (its ``from_pieces``), which reads the packed pieces as they are (`packed_rows`) instead
    of rebuilding the table (`table`, `unpack_pieces`) it reads otherwise."""

    pieces: tuple

    def table(self) -> pa.Table:
        """The shard's table (`unpack_pieces`)."""
        return unpack_pieces(*self.pieces)


def packed_shard(*pieces: Any) -> PackedShard:
    """A `PackedShard` of ``pieces`` (in window order)."""
    return PackedShard(tuple(pieces))


@dataclass
class Pass1Rows:
    """What pass 1 reads of a shard (`reduce_shard`): its rows' codes in window order, its fine cells, and the
    labelled rows' values; from its table (`table_rows`: `shard_rows` and `make_cells`, the reference) or from
    its packed pieces (`packed_rows`), the same arrays either way."""

    n: int
    prompt_ids: Any  # sorted distinct prompt ids (`packed_rows`: maybe as `KeyIds`)
    prompt: np.ndarray  # (n,) index into ``prompt_ids``
    policies: tuple
    policy: np.ndarray  # (n,) index into ``policies``
    score: np.ndarray  # (n,) float64
    cells: Any  # the fine cells (`make_cells`)
    cell: np.ndarray  # (n,) each row's fine cell
    lab: np.ndarray  # (L,) int64: positions of the labelled rows (label not NaN), increasing
    lab_row: np.ndarray  # (L,) int64: their window rows
    lab_label: np.ndarray  # (L,) their labels
    lab_weight: np.ndarray  # (L,) 1 / P(labelled) (1 where missing)
    lab_X: np.ndarray  # (L, p) their covariates


def table_rows(table: pa.Table, covariates: Sequence[str] = (), policies: Sequence[str] | None = None) -> Pass1Rows:
    """`Pass1Rows` of a shard's table: `shard_rows` and `make_cells` (the reference of `packed_rows`)."""
    r = shard_rows(table, covariates, policies)
    cells, cell = make_cells(r.score, r.X)
    lab = np.flatnonzero(~np.isnan(r.label))
    return Pass1Rows(n=int(r.row.size), prompt_ids=r.prompt_ids, prompt=r.prompt, policies=r.policies,
                     policy=r.policy, score=r.score, cells=cells, cell=cell, lab=lab, lab_row=r.row[lab],
                     lab_label=r.label[lab], lab_weight=r.label_weight[lab], lab_X=r.X[lab])


def _piece_rows(p: PackedPiece) -> np.ndarray:
    """`ROW` of a packed piece's rows (int64)."""
    if p.row is not None:
        return p.row
    row = np.cumsum(p.row_step, dtype=np.int64)
    row += p.row_first
    return row


def _rows_at(p: PackedPiece, pos: np.ndarray, reference: bool = False) -> np.ndarray:
    """`ROW` of a packed piece's rows at ``pos`` (increasing, int64): its steps summed between them (one pass over
    the piece's 1-2 byte steps, no int64 array of every row's place); ``reference``: ``_piece_rows(p)[pos]``."""
    if reference or p.row is not None or not pos.size:
        return _piece_rows(p)[pos]
    bounds = np.empty(pos.size, dtype=np.int64)  # segments [0, pos0], (pos0, pos1], ...: each one's steps summed
    bounds[0] = 0
    np.add(pos[:-1], 1, out=bounds[1:])
    out = np.add.reduceat(p.row_step[:int(pos[-1]) + 1], bounds, dtype=np.int64)
    np.cumsum(out, out=out)
    out += p.row_first
    return out


def _piece_cells(pieces: Sequence[PackedPiece], n: int) -> tuple[Any, np.ndarray, np.ndarray] | None:
    """(cells, cell of each row, score of each row) of pieces whose scores are codes into their values:
    `make_cells` of their scores (no covariates) from the pieces' value tables, never a hash of the rows. Each
    value of a table is classed as pandas classes the rows' scores (equal floats one class, ``-0.0`` with
    ``0.0``; a class's score that of its first row); None when a value is NaN (the reference then decides)."""
    tables = [p.score_values for p in pieces]
    sizes = np.array([t.size for t in tables], dtype=np.int64)
    allv = np.concatenate(tables) if tables else np.empty(0)
    if np.isnan(allv).any():
        return None
    klass, uniq = pd.factorize(allv, sort=True)  # the classes of the values, in the order of the scores
    G = int(uniq.size)
    at = np.concatenate([[0], np.cumsum(sizes)])
    score = np.empty(n)
    cell = np.empty(n, dtype=np.int64)
    lo = 0
    for p, a in zip(pieces, at):
        codes = np.asarray(one_chunk(p.table[SCORE]))  # one chunk: zero-copy
        hi = lo + codes.size
        idx = cell[lo:hi]
        idx[...] = codes  # the small codes widened once, in the cells' place: both gathers index by them
        np.take(p.score_values, idx, out=score[lo:hi])
        # in place; "clip" is never used: the gather above (mode "raise") refused any code outside the values
        np.take(klass[a:a + p.score_values.size], idx, out=idx, mode="clip")
        lo = hi
    # a class's score: its first row's (a class of one bit pattern: that value, whatever row is first)
    bits = allv.view(np.uint64)
    first_bits = np.full(G, -1, dtype=np.int64)
    rep = np.empty(G)
    many = np.zeros(G, dtype=bool)
    for i in range(allv.size):
        k = klass[i]
        if first_bits[k] == -1:
            first_bits[k] = i
            rep[k] = allv[i]
        elif bits[i] != bits[first_bits[k]]:
            many[k] = True
    if many.any():
        first = np.empty(G, dtype=np.int64)
        first[cell[::-1]] = np.arange(n - 1, -1, -1)
        rep[many] = score[first[many]]
    cells = Cells(rep, np.empty((G, 0)), *np.unique(rep, return_inverse=True))
    return cells, cell, score


def packed_rows(shard: PackedShard, covariates: Sequence[str] = (), policies: Sequence[str] | None = None
                ) -> Pass1Rows | None:
    """`Pass1Rows` of a shard from its packed pieces as they are (no table rebuilt: the labels of the labelled
    rows only, the scores' cells from the pieces' value tables, `_piece_cells`): the arrays `table_rows` gives of
    `PackedShard.table`, bit for bit. None when the pieces are not all packed with coded scores, are out of window
    order, hold a policy outside ``policies``, or the pass has covariates (then the table is read)."""
    pieces = [p for p in shard.pieces if p.num_rows]
    if covariates or not pieces or not all(isinstance(p, PackedPiece) and p.score_values is not None
                                           for p in pieces):
        return None
    last = None
    for p in pieces:
        if p.row is not None:
            row = p.row
            if row.size > 1 and not np.all(row[1:] >= row[:-1]):
                return None  # out of window order: the table path sorts them
            first, final = int(row[0]), int(row[-1])
        else:  # steps are never negative: in order within the piece, its last place their sum past the first
            first = p.row_first
            final = first + int(p.row_step.sum(dtype=np.int64))
        if last is not None and first < last:
            return None
        last = final
    try:
        prompt_col = pa.chunked_array([c for p in pieces for c in p.table[PROMPT].chunks])  # zero-copy
        policy_col = pa.chunked_array([c for p in pieces for c in p.table[POLICY].chunks])
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
        return None  # the pieces' types differ: the table path promotes them
    pol_codes, pol_uniques = sorted_codes(policy_col)
    pols = tuple(pol_uniques.to_pylist())
    if policies is not None and not set(pols) <= set(policies):
        return None
    n = sum(p.num_rows for p in pieces)
    got = _piece_cells(pieces, n)
    if got is None:
        return None
    cells, cell, score = got
    prompt_codes, prompt_ids = sorted_codes(prompt_col, keys=True)  # ids built only where read
    labs, lab_rows, labels, weights = [], [], [], []
    lo = 0
    for p in pieces:
        if p.label is not None and p.lab_pos.size:
            pos = p.lab_pos.astype(np.int64)
            labs.append(pos + lo)
            lab_rows.append(_rows_at(p, pos))
            labels.append(p.label)
            if p.label_prob is None:
                weights.append(np.ones(pos.size))
            else:
                prob = p.label_prob.copy()
                prob[np.isnan(prob)] = 1.0
                weights.append(1.0 / prob)
        lo += p.num_rows
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.empty(0, dtype=dt))
    lab = cat(labs, np.int64)
    return Pass1Rows(n=n, prompt_ids=prompt_ids, prompt=prompt_codes, policies=pols, policy=pol_codes, score=score,
                     cells=cells, cell=cell, lab=lab, lab_row=cat(lab_rows, np.int64), lab_label=cat(labels, float),
                     lab_weight=cat(weights, float), lab_X=np.empty((lab.size, 0)))


def reduce_shard(table: pa.Table | PackedShard, covariates: Sequence[str] = (), policies: Sequence[str] | None = None,
                 n_folds: int | None = None) -> ShardSummary:
    """Pass 1 on one shard: counts, totals and the labelled rows (see the module docstring).

    ``table``: the shard's table, or its pieces (`PackedShard`: read as they are, `packed_rows`, where they
    allow it). The labelled rows travel with their fold (`fold_of` their prompt id, ``n_folds``: default the
    options') and 4-byte codes, so no prompt id travels with them; a shard of a split by range keeps its ids.
    """
    r = None
    if isinstance(table, PackedShard):
        r = packed_rows(table, covariates, policies)
        nonempty = [p for p in table.pieces if p.num_rows]
        meta = (nonempty[0] if nonempty else table.pieces[0]).schema.metadata if table.pieces else None
        if r is None:
            table = table.table()
            meta = table.schema.metadata
    else:
        meta = table.schema.metadata
    if r is None:
        r = table_rows(table, covariates, policies)
    Kl = len(r.policies)
    cells, cell = r.cells, r.cell
    G = cells.size
    # a NaN score's cell is -1 (the table path): the per-row key's way then, as it always counted it
    runs = _policy_runs(r.policy) if not cell.size or cell.min() >= 0 else None
    n_ids = len(r.prompt_ids)
    if runs is None:
        key = r.policy * G
        key += cell
        counts = np.bincount(key, minlength=Kl * G).reshape(Kl, G)
        del key
    else:  # a run of one policy at a time: its cells counted (integers: the same counts)
        counts = np.zeros((Kl, G), dtype=np.int64)
        for k, a, b in runs:
            counts[k] += np.bincount(cell[a:b], minlength=G)
    n_prompts = _prompts_per_policy(r.policy, r.prompt, Kl, n_ids, runs)
    lab = r.lab
    lab_prompt = r.prompt[lab]
    folds = n_folds if n_folds is not None else EvaluationOptions.of(None).n_folds
    # one hash per labelled prompt (not per labelled row): the fold is a function of the prompt id
    lab_ids, lab_at = unique_inverse(lab_prompt)
    fold = _folds(r.prompt_ids.take(pa.array(lab_ids)), folds).astype(np.int8)[lab_at]
    ranged = bool(meta and meta.get(RANGE_META) == b"1")
    ids = r.prompt_ids
    ends = ids.take(pa.array([0, n_ids - 1])) if n_ids else None  # the first and last id
    if isinstance(ids, KeyIds) and not ranged:
        ids = ids.array()
    kept = ShardKept(prompt=r.prompt.astype(np.int32 if n_ids < 2**31 else np.int64),
                     policy=r.policy.astype(_small_int(Kl)), cell=cell.astype(np.int32 if G < 2**31 else np.int64),
                     lab_pos=lab, lab_row=r.lab_row, n_ids=n_ids)
    return ShardSummary(
        n_rows=r.n, prompt_ids=None if ranged else ids, policies=r.policies,
        cell_score=cells.score, cell_X=cells.X, counts=counts, n_prompts=n_prompts,
        score_sum=_policy_sums(r.score, kept.policy, Kl, runs=runs),
        score_min=float(r.score.min()) if r.n else np.inf,
        score_max=float(r.score.max()) if r.n else -np.inf,
        labelled={"row": r.lab_row, "prompt": lab_prompt.astype(np.int32), "policy": r.policy[lab].astype(np.int32),
                  "cell": cell[lab].astype(np.int32), "score": r.score[lab], "X": r.lab_X, "label": r.lab_label,
                  "weight": r.lab_weight, "fold": fold},
        n_ids=n_ids, id_range=(ends[0].as_py(), ends[1].as_py()) if n_ids else (None, None),
        kept=kept)


#: Runs of one policy along a shard's rows up to which passes 1 and 2 work a run at a time (`_policy_runs`: pass 1's
#: counts and `_policy_sums`, pass 2's `_contributions`), not with a key, mask or gather of every row.
POLICY_RUNS = 4096


def _policy_sums(score: np.ndarray, policy: np.ndarray, n_policies: int, reference: bool = False,
                 runs: list | None = None) -> np.ndarray:
    """``score[policy == k].sum()`` for every policy ``k`` (numpy's pairwise sum of each policy's scores in row
    order, as the mean sums them). Where the rows come in few runs of one policy (a reader's piece holds one
    policy), each policy's runs are summed as one slice, or their slices joined, instead of a mask of every row
    a policy: the same values in the same order, one contiguous array each, the same bits. ``reference``: the
    masks."""
    if not reference and policy.size:
        runs = _policy_runs(policy) if runs is None else runs
        if runs is not None:
            parts: list[list] = [[] for _ in range(n_policies)]
            for k, a, b in runs:
                parts[k].append(score[a:b])
            return np.array([(r[0] if len(r) == 1 else np.concatenate(r) if r else score[:0]).sum() for r in parts])
    return np.array([score[policy == k].sum() for k in range(n_policies)])


#: `reduce_shard`'s summary field a mapper may keep where the task ran (`flows.runtime.sharded_ray.ray_mapper`
#: returns it as a second object, left in the cluster's object store, and puts its reference in the field).
reduce_shard.kept_field = "kept"
#: How a mapper may hand `reduce_shard` a shard it holds as pieces (`flows.runtime.sharded_ray._with_pieces`).
reduce_shard.from_pieces = packed_shard


def shard_prompt_ids(table: pa.Table, covariates: Sequence[str] = (), policies: Sequence[str] | None = None
                     ) -> pa.Array:
    """A shard's sorted distinct prompt ids (those `reduce_shard` codes): what the driver ranks when the shards
    were not split by range (`global_prompt_codes`)."""
    return shard_rows(table, covariates, policies).prompt_ids


@dataclass
class ShardCodes:
    """What the driver sends a shard after the merge: its prompts' global codes and, for its fine cells and
    policies, their global (policy, cell) codes in the chosen calibration mode.

    A shard of a split by range gets no array of prompt codes: its prompts' codes are ``prompt_offset`` plus
    their rank in the shard (`ranks`)."""

    prompt_rank: np.ndarray | None  # (shard's prompts,) global prompt code of each (None: ``prompt_offset`` + rank)
    policy_code: np.ndarray  # (shard's policies,) global policy code (-1: not evaluated)
    cell_code: np.ndarray  # (shard's fine cells,) global cell code in the chosen mode
    n_cells: int  # G of the chosen mode
    prompt_offset: int = 0  # global code of the shard's first prompt when ``prompt_rank`` is None

    def ranks(self, local: np.ndarray) -> np.ndarray:
        """Global prompt codes (int64) of the shard's prompts ``local`` (their index in its sorted ids)."""
        if self.prompt_rank is not None:
            return self.prompt_rank[local]
        return np.asarray(local, dtype=np.int64) + self.prompt_offset


@dataclass
class Merged:
    """The driver's merge of every shard's summary (`merge_summaries`)."""

    data: EvalData  # the labelled rows (window order), global prompt and policy codes; no prompt ids
    rows: dict  # mode -> `estimators.row_cells` tuple (cells, labelled rows' cell and key, every row's counts)
    cell_maps: dict  # mode -> per shard: fine cell -> global cell
    policy_maps: list  # per shard: local policy -> global code
    prompt_ranks: list  # per shard: local prompt -> global code (None: ``prompt_offsets`` + local rank)
    totals: RowTotals
    n_prompts: int
    n_rows: int
    prompt_offsets: list = field(default_factory=list)  # per shard: global code of its first prompt
    lab_rows: np.ndarray | None = None  # window row of each labelled row of ``data`` (its order)
    lab_shard: np.ndarray | None = None  # shard of each labelled row of ``data`` (int32)


def global_prompt_codes(ids: Sequence[pa.Array]) -> tuple[list[np.ndarray], int]:
    """Each shard's prompts' global codes: the rank of the id among all shards' ids (sorted as
    ``pandas.factorize(sort=True)`` sorts them: by code point). Raises when a prompt is in two shards."""
    sizes = [len(a) for a in ids]
    allids = pa.concat_arrays([a.cast(pa.string()) for a in ids]) if ids else pa.array([], pa.string())
    order = np.asarray(pc.sort_indices(allids))
    if order.size > 1:
        s = allids.take(pa.array(order))
        dup = np.flatnonzero(np.asarray(pc.equal(s.slice(1), s.slice(0, len(s) - 1)).fill_null(False)))
        if dup.size:
            raise CJEInputError(f"prompt {s[int(dup[0])].as_py()!r} is in two shards: shards must split by prompt",
                                column=PROMPT)
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [rank[bounds[i]:bounds[i + 1]] for i in range(len(ids))], int(order.size)


def ranges_in_order(summaries: Sequence[ShardSummary]) -> bool:
    """True when every shard's prompt ids lie above the previous non-empty shard's (shards split by range, in
    order): then a prompt's global code is its shard's offset plus its rank there, and no id need travel."""
    last = None
    for s in summaries:
        if not s.n_ids:
            continue
        lo, hi = s.id_range
        if last is not None and not last < lo:
            return False
        last = hi
    return True


def prompt_coding(summaries: Sequence[ShardSummary]) -> tuple[list, list[int], int]:
    """(per shard: its prompts' global codes or None, per shard: the offset of its first prompt, prompts).

    Shards in range order (`ranges_in_order`) need only their counts: code = offset + rank in the shard, the
    single-process coding. Otherwise every shard's ``prompt_ids`` are ranked together (`global_prompt_codes`)."""
    if ranges_in_order(summaries):
        offsets = np.concatenate([[0], np.cumsum([s.n_ids for s in summaries])]).astype(np.int64)
        return [None] * len(summaries), [int(o) for o in offsets[:-1]], int(offsets[-1])
    if any(s.prompt_ids is None for s in summaries):
        raise ValueError("shards out of range order need their prompt ids (shard_prompt_ids)")
    ranks, n = global_prompt_codes([s.prompt_ids for s in summaries])
    return ranks, [0] * len(summaries), n


def _take_labelled(summaries: Sequence[ShardSummary], key: str, keep: np.ndarray, fn: Callable | None = None
                   ) -> np.ndarray:
    """One labelled-row field of every shard, concatenated (through ``fn(shard index, values)``), taken at
    ``keep``; the shards' copies are released as they are read."""
    parts = []
    for i, s in enumerate(summaries):
        v = s.labelled.pop(key)
        parts.append(fn(i, v) if fn is not None else v)
    out = np.concatenate(parts) if parts else np.empty(0)
    del parts
    return out[keep]


def merge_summaries(summaries: Sequence[ShardSummary], opts: EvaluationOptions) -> Merged:
    """Pass 1's merge: global codes, cells and counts of every calibration mode, the labelled rows' `EvalData`.

    Integer counts add exactly; the labelled rows are put back in window order, so every fit on them is the
    single-process one. The summaries' labelled rows are consumed (moved into the merge a field at a time).
    """
    summaries = list(summaries)
    seen = sorted({p for s in summaries for p in s.policies})
    policies = list(opts.policies) if opts.policies else seen
    missing = [p for p in policies if p not in seen]
    if missing:
        raise CJEInputError(f"policy {missing[0]!r} was requested but has no rows (policies present: "
                            f"{', '.join(seen)})", column=POLICY)
    look = {p: i for i, p in enumerate(policies)}
    policy_maps = [np.array([look.get(p, -1) for p in s.policies], dtype=np.int64) for s in summaries]
    ranks, offsets, n_prompts = prompt_coding(summaries)
    K = len(policies)
    p = len(opts.covariates)
    score = np.concatenate([s.cell_score for s in summaries]) if summaries else np.empty(0)
    X = np.concatenate([s.cell_X.reshape(s.cell_score.size, p) for s in summaries]) if summaries else np.empty((0, p))
    bounds = np.concatenate([[0], np.cumsum([s.cell_score.size for s in summaries])]).astype(int)
    # window order of the labelled rows of the evaluated policies
    lab_row = np.concatenate([s.labelled["row"] for s in summaries]) if summaries else np.empty(0, np.int64)
    lab_policy = np.concatenate([policy_maps[i][s.labelled["policy"]] for i, s in enumerate(summaries)])
    order = np.argsort(lab_row, kind="stable")
    keep = order[lab_policy[order] >= 0]
    del order
    lab_row, lab_policy = lab_row[keep], lab_policy[keep]
    lab_shard = np.concatenate([np.full(s.labelled["row"].size, i, dtype=np.int32)
                                for i, s in enumerate(summaries)])[keep]
    for s in summaries:
        s.labelled.pop("row")
        s.labelled.pop("policy")

    def code(i: int, local: np.ndarray) -> np.ndarray:
        return ranks[i][local] if ranks[i] is not None else local.astype(np.int64) + offsets[i]

    lab_prompt = _take_labelled(summaries, "prompt", keep, code)
    lab_fine = _take_labelled(summaries, "cell", keep, lambda i, c: bounds[i] + c.astype(np.int64))
    rows, cell_maps = {}, {}
    for entry in registry.entries():
        cells, gcell = make_cells(score, X if entry.uses_covariates else None)
        G = cells.size
        small = np.int32 if K * G < 2**31 else np.int64
        counts = np.zeros(K * G)
        for i, s in enumerate(summaries):
            pol = np.repeat(policy_maps[i], s.cell_score.size)
            cc = np.tile(gcell[bounds[i]:bounds[i + 1]], len(s.policies))
            ok = pol >= 0
            counts += np.bincount(pol[ok] * G + cc[ok], weights=s.counts.ravel()[ok], minlength=K * G)
        row_cell = gcell[lab_fine].astype(small)
        rows[entry.name] = (cells, row_cell, lab_policy.astype(small) * small(G) + row_cell,
                            counts.reshape(K, G))
        cell_maps[entry.name] = [gcell[bounds[i]:bounds[i + 1]] for i in range(len(summaries))]
    del lab_fine
    n_lab = keep.size
    data = EvalData(
        prompt_ids=np.broadcast_to(np.array("", dtype="<U1"), (n_prompts,)),  # ids stay on the shards
        prompt=lab_prompt, policies=tuple(policies), policy=lab_policy,
        score=_take_labelled(summaries, "score", keep), label=_take_labelled(summaries, "label", keep),
        label_weight=_take_labelled(summaries, "weight", keep),
        X=_take_labelled(summaries, "X", keep, lambda i, x: x.reshape(x.shape[0], p)).reshape(n_lab, p),
        covariate_names=tuple(opts.covariates), fold=_take_labelled(summaries, "fold", keep).astype(np.int64),
        n_folds=opts.n_folds, label_scale=opts.label_scale, score_scale=opts.score_scale)
    totals = _row_totals(summaries, policy_maps, K)
    return Merged(data, rows, cell_maps, policy_maps, ranks, totals, n_prompts, int(totals.n_rows.sum()),
                  prompt_offsets=offsets, lab_rows=lab_row, lab_shard=lab_shard)


#: Labelled prompt ids turned into Python strings at a time by `_folds`.
FOLD_CHUNK = 1 << 18


def _folds(ids: pa.Array, n_folds: int) -> np.ndarray:
    """`fold_of` of Arrow ids, a chunk at a time (never every labelled id as a Python object at once): each id's
    UTF-8 bytes taken as they are (`pyarrow.binary`: no `str` decoded and encoded again), the same blake2b."""
    if len(ids) == 0:
        return np.empty(0, dtype=np.int64)
    fresh = hashlib.blake2b(digest_size=8).copy
    hashes = np.empty(len(ids), dtype=np.uint64)
    for lo in range(0, len(ids), FOLD_CHUNK):
        digests = []
        append = digests.append
        for value in ids.slice(lo, FOLD_CHUNK).cast(pa.binary()).to_pylist():
            h = fresh()
            h.update(value)
            append(h.digest())
        hashes[lo:lo + len(digests)] = np.frombuffer(b"".join(digests), dtype=">u8")
    return (hashes % np.uint64(n_folds)).astype(np.int64)


def folds_reference(ids: pa.Array, n_folds: int) -> np.ndarray:
    """`_folds` the plain way: `fold_of` of the ids as Python strings."""
    return fold_of(ids.to_pylist(), n_folds)


def _row_totals(summaries: Sequence[ShardSummary], policy_maps: list, K: int) -> RowTotals:
    """Every row's per-policy totals, added over the shards in shard order."""
    from cje_engine.pipeline.policies import RowTotals

    n_rows, n_prompts, score_sum = np.zeros(K, np.int64), np.zeros(K, np.int64), np.zeros(K)
    for s, pm in zip(summaries, policy_maps):
        ok = pm >= 0
        np.add.at(n_rows, pm[ok], s.counts.sum(1)[ok])
        np.add.at(n_prompts, pm[ok], s.n_prompts[ok])
        np.add.at(score_sum, pm[ok], s.score_sum[ok])
    lo = min((s.score_min for s in summaries), default=np.nan)
    hi = max((s.score_max for s in summaries), default=np.nan)
    return RowTotals(n_rows=n_rows, n_prompts=n_prompts, score_sum=score_sum, score_min=float(lo), score_max=float(hi))


def _shard_keys(v: ShardView, codes: ShardCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global policy, global cell, kept) of a shard's rows under ``codes``."""
    pol = codes.policy_code[v.policy]
    keep = pol >= 0
    return pol, codes.cell_code[v.cell], keep


@dataclass
class ShardTerms:
    """Pass 2 of one shard (`shard_evaluation_terms`): the evaluation terms of its prompts and their Gram form."""

    terms: np.ndarray | None  # (shard's prompts, K) per-prompt evaluation terms (None: not kept)
    count: int  # prompts
    total: np.ndarray  # (K,) sum over its prompts
    gram: np.ndarray  # (K, K) sum of products over its prompts
    labelled: np.ndarray | None = None  # Gram form: global codes of its prompts with a labelled row (sorted)
    labelled_terms: np.ndarray | None = None  # Gram form: (labelled prompts, K) their terms
    rest: Moments | None = None  # Gram form: moments (orders 1-3) of the other prompts' terms
    sums: BasisSums | None = None  # Gram form with the driver's `LabelledBasis`: its labelled prompts' basis sums


def shard_evaluation_terms(shard: Any, covariates: Sequence[str], policies: Sequence[str] | None,
                           codes: ShardCodes, F_all: np.ndarray, cal_row: np.ndarray, cal_f: np.ndarray,
                           plug: np.ndarray, n_k: np.ndarray, keep_terms: bool = True,
                           basis: "LabelledBasis | None" = None, reference: bool = False) -> ShardTerms:
    """Pass 2 on one shard: every row's calibrated value (the full fit at its cell; out of fold on the
    calibration rows ``cal_row`` of the shard, values ``cal_f``) and its evaluation term
    ``(f - theta_k) / n_k`` summed per prompt (`estimators.evaluation_terms`, the same bits per prompt as the
    single-process path), with their sums and cross-products over policies. ``keep_terms=False`` (the Gram
    form): only the prompts with a labelled row keep their terms; the others are returned as their moments
    (`cje_engine.inference.gram.Moments`), O(K^3) whatever the shard's size. With ``basis`` (the shard's part of
    the driver's `GramBuilder`, `GramBuilder.part`) the labelled prompts' terms are reduced here to their basis
    sums (`LabelledBasis.sums`: the numbers the driver would compute, bit for bit) and not returned.

    ``shard``: pass 1's `ShardKept` of the shard (its codes, not read or hashed again) or its table
    (`shard_view`: the same codes, computed again).

    The Gram form's moments and basis sums are reduced by the fast paths (`Moments.of`, `LabelledBasis.sums`: the
    same bits); the shard's diagnostic totals (``total``, ``gram``: `ShardedPrepared.gram`, no number of the
    result) are then the sums of its two parts, equal to the sums over every prompt to rounding. ``reference``:
    everything as first written (one more pass over every prompt's terms; the benchmarks' and tests' comparator)."""
    v = shard_view(shard, covariates, policies)
    pol, every = _row_policies(v.policy, codes.policy_code, reference)
    keep = None if every else pol >= 0
    K = plug.size
    cal_pos = _cal_positions(v, cal_row) if cal_row.size else None  # the calibration rows' places in the shard
    terms = (_row_terms_reference if reference else _row_terms)(v, pol, keep, codes, F_all, cal_pos, cal_f, plug, n_k)
    if keep_terms or reference:
        out = ShardTerms(terms if keep_terms else None, int(terms.shape[0]), terms.sum(0), terms.T @ terms)
    else:
        out = ShardTerms(None, int(terms.shape[0]), np.zeros(K), np.zeros((K, K)))
    if not keep_terms:
        lab_pos = v.lab_pos if every else v.lab_pos[keep[v.lab_pos]]
        if reference:
            lab = unique_ints(v.prompt[lab_pos].astype(np.int64))
            rest = np.ones(terms.shape[0], dtype=bool)
            rest[lab] = False
        else:  # the labelled prompts marked, not sorted: the same increasing codes
            rest = np.ones(terms.shape[0], dtype=bool)
            rest[v.prompt[lab_pos]] = False
            lab = np.flatnonzero(~rest)
        out.labelled = codes.ranks(lab)
        if reference:
            out.labelled_terms = terms[lab]
            out.rest = Moments.of(terms[rest], reference)
        else:  # the same rows copied by `numpy.take` / `numpy.compress` on axis 0 (~3x less CPU than indexing)
            out.labelled_terms = np.take(terms, lab, axis=0)
            out.rest = Moments.of(np.compress(rest, terms, axis=0))
        if not reference:  # the diagnostic totals from the two parts (no more pass over every prompt)
            out.total = out.rest.s + out.labelled_terms.sum(0)
            out.gram = out.rest.S + out.labelled_terms.T @ out.labelled_terms
        if basis is not None:
            at = None
            if not reference and every:  # each labelled and calibration row's prompt's place among ``lab``
                place = np.empty(terms.shape[0], dtype=np.int64)
                place[lab] = np.arange(lab.size)
                at = (place[v.prompt[lab_pos]], place[v.prompt[cal_pos]] if cal_pos is not None else None)
                del place
            out.sums = basis.sums(out.labelled, out.labelled_terms, reference, at=at)
            out.labelled_terms = None
    return out


def _cal_positions(v: ShardView, cal_row: np.ndarray) -> np.ndarray:
    """The positions in the shard of its calibration rows ``cal_row`` (window rows; each must be a labelled row
    of the shard, else ValueError)."""
    at = np.searchsorted(v.lab_row, cal_row)
    if at.max() >= v.lab_row.size or not np.array_equal(v.lab_row[at], cal_row):
        raise ValueError("a calibration row sent to this shard is not in it")
    return v.lab_pos[at]


def _row_terms_reference(v: ShardView, pol: np.ndarray, keep: np.ndarray | None, codes: ShardCodes,
                         F_all: np.ndarray, cal_pos: np.ndarray | None, cal_f: np.ndarray, plug: np.ndarray,
                         n_k: np.ndarray) -> np.ndarray:
    """Pass 2's per-prompt evaluation terms (n_ids, K) of a shard as first written: every row's calibrated value
    ``f`` (the fit at its cell, ``cal_f`` on the calibration rows, at positions ``cal_pos`` (`_cal_positions`;
    None: none)), then `_evaluation_terms` of the evaluated rows (``keep``: None, every row). `_row_terms`'
    reference."""
    f = np.asarray(F_all)[codes.cell_code][v.cell]  # the fit at the shard's fine cells, then one gather a row
    if cal_pos is not None:
        f[cal_pos] = cal_f
    if keep is None:  # every row's policy is evaluated (the usual case): the rows as they are, no copy
        return _evaluation_terms(v.prompt, pol, f, plug, n_k, v.n_ids)
    return _evaluation_terms(v.prompt[keep], pol[keep], f[keep], plug, n_k, v.n_ids)


def _row_terms(v: ShardView, pol: np.ndarray, keep: np.ndarray | None, codes: ShardCodes, F_all: np.ndarray,
               cal_pos: np.ndarray | None, cal_f: np.ndarray, plug: np.ndarray, n_k: np.ndarray) -> np.ndarray:
    """`_row_terms_reference`'s terms, bit for bit. Where every row is evaluated and the rows come in few runs of
    one policy (`_policy_runs`), each row's contribution ``(f - plug[k]) / n_k[k]`` is gathered from its policy's
    table of the same two operations on the fit at the shard's cells (the same operations on the same values:
    the same bits), the calibration rows' then written over with those of their ``cal_f``, and the bincount key
    ``prompt * K + k`` built a run at a time: no array of every row's ``f``, one pass less over the rows."""
    runs = None if keep is not None or not pol.size else _policy_runs(pol)
    if runs is None:
        return _row_terms_reference(v, pol, keep, codes, F_all, cal_pos, cal_f, plug, n_k)
    K, n = plug.size, v.cell.size
    fit = np.asarray(F_all)[codes.cell_code]  # the fit at the shard's fine cells
    contrib = np.empty(n)
    key = np.empty(n, dtype=np.int64)
    table = np.empty(fit.shape)
    for k, a, b in runs:
        np.subtract(fit, plug[k], out=table)  # `_contributions`' two operations, on the cells' values
        np.divide(table, n_k[k], out=table)
        # "wrap": unbuffered, each cell in -1..G-1 (pass 1's; a NaN score's -1 the last, as the gather of f)
        np.take(table, v.cell[a:b], out=contrib[a:b], mode="wrap")
        np.multiply(v.prompt[a:b], K, out=key[a:b], dtype=np.int64)
        key[a:b] += k
    if cal_pos is not None:
        at = cal_pos
        f = np.empty(at.size, dtype=fit.dtype)
        f[...] = cal_f  # as `_row_terms_reference` writes them into its ``f``
        k = pol[at]
        x = np.empty(at.size)
        np.subtract(f, plug[k], out=x)
        np.divide(x, n_k[k], out=x)
        contrib[at] = x
    return np.bincount(key, weights=contrib, minlength=v.n_ids * K).reshape(v.n_ids, K)


def _row_policies(local: np.ndarray, policy_code: np.ndarray, reference: bool = False) -> tuple[np.ndarray, bool]:
    """(each row's global policy code, whether every one is evaluated) from its local code ``local`` and the
    shard's table ``policy_code`` (-1: not evaluated). Every local policy is some row's (pass 1's sorted distinct
    policies), so the table decides "every row": then, when the table is the identity, the local codes are the
    global ones (no gather), else the table in the rows' small type is gathered; ``reference``: the table's own
    type gathered and every row compared (the same codes)."""
    table = np.asarray(policy_code)
    if reference or not table.size or not (table >= 0).all():
        pol = table[local]
        return pol, bool((pol >= 0).all())
    if np.array_equal(table, np.arange(table.size)):
        return local, True
    return table.astype(_small_int(int(table.max())))[local], True


def _contributions(f: np.ndarray, policy: np.ndarray, plug: np.ndarray, n_k: np.ndarray,
                   reference: bool = False) -> np.ndarray:
    """Every row's ``(f - plug[k]) / n_k[k]`` (k its policy): where the rows come in few runs of one policy (a
    reader's piece holds one), a run at a time with its policy's two numbers (the same two operations on the same
    values: the same bits), instead of two gathers of every row's; ``reference``: the gathers."""
    runs = None if reference or not policy.size else _policy_runs(policy)
    if runs is not None:
        out = np.empty(f.shape)
        for k, a, b in runs:
            np.subtract(f[a:b], plug[k], out=out[a:b])
            np.divide(out[a:b], n_k[k], out=out[a:b])
        return out
    contrib = np.subtract(f, plug[policy])
    np.divide(contrib, n_k[policy], out=contrib)
    return contrib


def _evaluation_terms(prompt: np.ndarray, policy: np.ndarray, f: np.ndarray, plug: np.ndarray, n_k: np.ndarray,
                      n_prompts: int) -> np.ndarray:
    """`estimators.evaluation_terms`'s plug-in columns (n_prompts, K), the same bits (each term ``(f - theta_k) /
    n_k`` computed alike, each bin summed in row order by ``numpy.bincount``), without its augmented copy."""
    K = plug.size
    contrib = _contributions(f, policy, plug, n_k)
    key = np.multiply(prompt, K, dtype=np.int64)
    key += policy
    return np.bincount(key, weights=contrib, minlength=n_prompts * K).reshape(n_prompts, K)


def shard_histograms(shard: Any, covariates: Sequence[str], policies: Sequence[str] | None,
                     codes: ShardCodes, seed: int, start: int, stop: int, n_prompts: int, n_policies: int,
                     weights: np.ndarray | None = None) -> np.ndarray:
    """Pass 3 on one shard: the weighted (policy, cell) histogram of replicates ``start..stop-1``, shape
    (stop - start, K * G), int64. The prompt weights are whole numbers, so the histograms of the shards add up
    exactly to the single-process one, in any order.

    ``weights`` None: every replicate's weights regenerated here from ``(seed, b)`` (`bootstrap_weights`, all
    the window's prompts) and gathered per row (the reference). Else ``shard`` is the shard's
    `HistogramLayout` (`shard_histogram_layout`) and ``weights`` the replicates' prompt counts drawn once for
    every shard (`replicate_weights`: (stop - start, n_prompts), small unsigned integers): the shard takes its
    prompts' columns (a range shard its contiguous slice ``offset .. offset + n``) and sums them per (policy,
    cell) in integers. ``shard`` otherwise: its `ShardKept` or its table (`shard_view`)."""
    if weights is not None:
        return _layout_histograms(shard, codes, weights, start, stop)
    v = shard_view(shard, covariates, policies)
    pol, cell, keep = _shard_keys(v, codes)
    key = (pol * codes.n_cells + cell)[keep]
    prompt = codes.ranks(v.prompt[keep])
    KG = n_policies * codes.n_cells
    out = np.empty((stop - start, KG), dtype=np.int64)
    for i, b in enumerate(range(start, stop)):
        w = bootstrap_weights(seed, b, n_prompts)
        out[i] = np.bincount(key, weights=w[prompt], minlength=KG)
    return out


@dataclass
class HistogramLayout:
    """A shard's rows arranged for pass 3 (`shard_histogram_layout`): their local prompt codes grouped by global
    (policy, cell) key (ascending within a key), and where each key's group starts; 4 bytes a row. Built once
    per shard and kept where the shard is (on Ray, in the object store) for every chunk of replicates."""

    prompt: np.ndarray  # (kept rows,) local prompt code, grouped by key, ascending within a group
    starts: np.ndarray  # (keys with rows,) first position of each non-empty key's group
    keys: np.ndarray  # (keys with rows,) the key (policy * G + cell) of each group
    n_keys: int  # K * G
    n_ids: int  # the shard's prompts


@dataclass
class LayoutBuilt:
    """What `shard_histogram_layout` returns: the layout (on Ray its reference: it stays in the object store)."""

    rows: int  # the layout's rows
    layout: Any


def shard_histogram_layout(shard: Any, covariates: Sequence[str], policies: Sequence[str] | None,
                           codes: ShardCodes, n_policies: int) -> LayoutBuilt:
    """A shard's `HistogramLayout` under the merge's ``codes`` (from its `ShardKept` or its table)."""
    v = shard_view(shard, covariates, policies)
    pol, cell, keep = _shard_keys(v, codes)
    KG = n_policies * codes.n_cells
    key = (pol * codes.n_cells + cell)[keep]
    prompt = v.prompt[keep]
    # rows ordered by (key, prompt): a key's group reads its prompts' counts in ascending order, a forward sweep
    # through the shard's slice of a replicate (its sums are integers: exact in any order). A stable counting
    # order of the keys (a radix sort when they fit 16 bits), then a stable sort of ``key * n_ids + prompt`` in
    # that order: a key's rows come in window order, i.e. one ascending run of prompts a file, which the stable
    # (merge) sort takes as runs (3.5x faster than one sort of the pairs on 10 files' runs, 1.4x on random order)
    order = np.argsort(key.astype(np.int16 if KG < 2**15 else np.int64), kind="stable")
    pair = key.astype(np.int64)
    pair *= max(int(v.n_ids), 1)
    pair += prompt
    pair = pair[order]
    order = order[np.argsort(pair, kind="stable")]
    del pair
    counts = np.bincount(key, minlength=KG)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    live = np.flatnonzero(counts)
    small = np.int32 if v.n_ids < 2**31 else np.int64
    out = HistogramLayout(prompt=prompt[order].astype(small), starts=first[live].astype(np.int64),
                          keys=live.astype(np.int64), n_keys=KG, n_ids=int(v.n_ids))
    return LayoutBuilt(int(key.size), out)


#: `shard_histogram_layout`'s field a mapper may keep where the task ran (the layout itself: ~4 bytes a row).
shard_histogram_layout.kept_field = "layout"


def _layout_histograms(layout: HistogramLayout, codes: ShardCodes, weights: np.ndarray, start: int, stop: int
                       ) -> np.ndarray:
    """`shard_histograms` from a layout and the replicates' prompt counts of the whole window: per replicate one
    gather of the shard's counts (1-2 bytes a prompt: the shard's slice stays in cache) and a sum per key group
    in int64 (exact)."""
    weights = np.asarray(weights)
    if weights.shape[0] != stop - start:
        raise ValueError(f"weights of {weights.shape[0]} replicates for replicates {start}..{stop - 1}")
    if codes.prompt_rank is None:  # a range shard: its prompts are a contiguous block of global codes
        local = weights[:, codes.prompt_offset:codes.prompt_offset + layout.n_ids]
    else:
        local = weights[:, codes.prompt_rank]
    if local.shape[1] != layout.n_ids:
        raise ValueError(f"weights of {weights.shape[1]} prompts do not cover the shard's {layout.n_ids} prompts "
                         f"from code {codes.prompt_offset}")
    out = np.zeros((stop - start, layout.n_keys), dtype=np.int64)
    if layout.prompt.size == 0:
        return out
    # `numpy.take` with native (intp) indices: it would convert int32 ones on every call; converted once a task
    # here (8 bytes a row for the task's length), the layout stays 4 bytes a row where it is kept. Every index
    # is below ``n_ids`` (a rank among the shard's prompts, checked above), so mode "clip" never clips: it only
    # lets ``take`` write into ``taken`` unbuffered
    idx = layout.prompt.astype(np.intp)
    taken = np.empty(idx.size, dtype=local.dtype)
    for i in range(stop - start):
        np.take(np.ascontiguousarray(local[i]), idx, out=taken, mode="clip")
        out[i, layout.keys] = np.add.reduceat(taken, layout.starts, dtype=np.int64)
    return out


@dataclass
class ReplicateWeights:
    """Replicates ``start..stop-1``'s prompt counts (`replicate_weights`), drawn once for every shard."""

    start: int
    stop: int
    driver: np.ndarray  # (stop - start, len(prompts)) the counts at the driver's prompts (`compact_view`)
    block: Any  # (stop - start, n_prompts) every prompt's counts (on Ray: its object reference)


def replicate_weights(seed: int, start: int, stop: int, n_prompts: int, prompts: np.ndarray) -> ReplicateWeights:
    """The prompt counts of replicates ``start..stop-1`` (`bootstrap_counts`: `bootstrap_weights`' draws, as small
    unsigned integers; the chunk's type is the smallest holding its largest count), for every shard's histograms,
    and apart those at ``prompts`` for the refits (`replicate_refits`)."""
    block = np.empty((stop - start, n_prompts), dtype=np.uint8)
    for i, b in enumerate(range(start, stop)):
        row = bootstrap_counts(seed, b, n_prompts)
        if row.dtype.itemsize > block.dtype.itemsize:  # a count above the type's largest: widen the chunk
            block = block.astype(row.dtype)
        block[i] = row
    return ReplicateWeights(start, stop, block[:, prompts], block)


#: `replicate_weights`' fields a mapper may keep where the task ran: every prompt's counts (~1 byte a prompt and
#: replicate), read by the shards' tasks, and the counts at the refits' prompts, read by the refit task; the
#: driver gets neither (their references).
replicate_weights.kept_field = ("block", "driver")


def replicate_refits(view: Any, counts: np.ndarray, start: int, stop: int, *histograms: np.ndarray) -> np.ndarray:
    """Replicates ``start..stop-1`` (3K columns each) refitted from the labelled rows: `bootstrap_replicates` on
    the compact view ``view`` (`compact_view`, `refit_view`'s) with the chunk's counts at its prompts (``counts``,
    `replicate_weights`' ``driver`` part) and the chunk's (policy, cell) histograms: one int64 block, or each
    shard's block (`shard_histogram_block`), summed here in the order given (whole numbers: exact in any order,
    then converted to float64 exactly). A pure function of its arguments: on Ray one task a chunk
    (`ShardedPrepared.replicates`) whose view, counts and shards' blocks are references resolved on the worker, so
    none of them passes through the driver; a retry gives the same bits."""
    if not histograms:
        raise ValueError("replicate_refits needs the chunk's histograms")
    total = np.array(histograms[0], dtype=np.int64)  # a copy: the blocks may be read-only (the object store)
    for h in histograms[1:]:
        total += h
    return bootstrap_replicates(view, start, stop, total.astype(float), weights=counts)


@dataclass
class RefitRows:
    """What the refits' compact view is built from (`refit_rows` on the driver, `refit_view` where it runs): the
    design's labelled rows, the columns a `BootstrapView` reads of them only, each in the smallest integer type
    holding it (its own type in ``dtypes``, restored by `refit_view`); the calibration mode, cells and counts.
    ~26 bytes a labelled row (the `CalibrationPlan` and the views built from it: 140-180 with their temporaries)."""

    mode: str
    n_knots: int
    seed: int
    n_prompts: int
    policies: tuple
    covariate_names: tuple
    n_folds: int
    label_scale: Any
    score_scale: Any
    cells: Any  # the design's `Cells` (O(cells))
    counts: np.ndarray  # (K, G) rows per (policy, cell)
    prompt: np.ndarray  # (n,) each labelled row's global prompt code
    policy: np.ndarray
    row_cell: np.ndarray  # (n,) its cell in ``cells``
    label: np.ndarray
    label_weight: np.ndarray
    fold: np.ndarray
    dtypes: dict  # field -> its dtype in the design (``prompt``, ``policy``, ``fold``, ``cal_rows``, ``lab_rows``)
    cal_rows: np.ndarray | None  # the calibration rows (None: every row)
    lab_rows: np.ndarray | None  # the labelled rows (None: every row)


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` (integers) in the smallest signed integer type holding its values (``a`` itself when it is one)."""
    if a.size == 0:
        return a
    t = _small_int(max(int(a.max()) + 1, -int(a.min())))
    return a if a.dtype == t else a.astype(t)


def _every_row(idx: np.ndarray, n: int) -> bool:
    """Whether a design's increasing row indices ``idx`` (`numpy.flatnonzero`'s) are every row ``0..n-1``."""
    return idx.size == n and (n == 0 or (int(idx[0]) == 0 and int(idx[-1]) == n - 1))


def refit_rows(design: Any, seed: int) -> RefitRows:
    """The design's `RefitRows` for bootstrap seed ``seed``: what `refit_view` needs to build, away from the driver,
    the compact view `compact_view(bootstrap_view(design, seed))` gives. The driver's own arrays where they
    are already small (labels, label weights, cells), narrowed copies of its integer codes (~6 bytes a row)."""
    d, ci = design.data, design.cells
    n = d.n_rows
    return RefitRows(
        mode=design.mode, n_knots=design.n_knots, seed=int(seed), n_prompts=d.n_prompts, policies=d.policies,
        covariate_names=d.covariate_names, n_folds=d.n_folds, label_scale=d.label_scale, score_scale=d.score_scale,
        cells=ci.cells, counts=ci.counts, prompt=_narrow(d.prompt), policy=_narrow(d.policy), row_cell=ci.row_cell,
        label=d.label, label_weight=d.label_weight, fold=_narrow(d.fold),
        dtypes={"prompt": d.prompt.dtype.str, "policy": d.policy.dtype.str, "fold": d.fold.dtype.str,
                "cal_rows": design.cal_rows.dtype.str, "lab_rows": design.lab_rows.dtype.str},
        cal_rows=None if _every_row(design.cal_rows, n) else _narrow(design.cal_rows),
        lab_rows=None if _every_row(design.lab_rows, n) else _narrow(design.lab_rows))


@dataclass
class RefitView:
    """What `refit_view` returns: the refits' compact view and the prompts it reads (sorted global codes, int32
    where they fit), on Ray both left in the object store (the driver gets their references)."""

    n_prompts: int  # len(prompts)
    view: Any
    prompts: Any


def refit_view(rows: RefitRows) -> RefitView:
    """The compact view of the refits (`compact_view` of `bootstrap_view`) and its prompts, built from ``rows``
    (`refit_rows`) where this runs: the design rebuilt (the driver's arrays in their own types, its cell index
    recomputed as `make_design` computes it), then its `CalibrationPlan` and view: array for array those the
    driver would build (`test_the_refit_view_is_the_drivers`), so the refits are the same bits. On Ray one task a
    bootstrap (`ShardedPrepared.replicates`): the plan and views (~150 bytes a labelled row and their
    temporaries) are built on a worker and stay in the object store; the driver sends ``rows`` (~26 bytes a
    labelled row) once."""
    from cje_engine.direct.estimators import design_from_parts

    n = rows.label.size
    dt = rows.dtypes
    p = len(rows.covariate_names)
    data = EvalData(
        prompt_ids=np.broadcast_to(np.array("", dtype="<U1"), (rows.n_prompts,)),  # ids stay on the shards
        prompt=rows.prompt.astype(dt["prompt"]),
        policies=tuple(rows.policies), policy=rows.policy.astype(dt["policy"]),
        score=np.broadcast_to(np.float64(0.0), (n,)),  # not read by a refit (the cells carry the scores)
        label=rows.label, label_weight=rows.label_weight, X=np.broadcast_to(np.zeros(p), (n, p)),
        covariate_names=tuple(rows.covariate_names), fold=rows.fold.astype(dt["fold"]), n_folds=rows.n_folds,
        label_scale=rows.label_scale, score_scale=rows.score_scale)
    G = rows.cells.size
    small = rows.row_cell.dtype.type
    row_key = data.policy.astype(small) * small(G) + rows.row_cell  # as `row_cells` codes it
    every = np.arange(n)
    cal = (every if rows.cal_rows is None else rows.cal_rows).astype(dt["cal_rows"], copy=False)
    lab = (every if rows.lab_rows is None else rows.lab_rows).astype(dt["lab_rows"], copy=False)
    design = design_from_parts(data, rows.mode, cal, lab, (rows.cells, rows.row_cell, row_key, rows.counts),
                               rows.n_knots)
    small_view, prompts = compact_view(bootstrap_view(design, rows.seed))
    prompts = prompts.astype(np.int32 if rows.n_prompts < 2**31 else np.int64)
    return RefitView(int(prompts.size), small_view, prompts)


#: `refit_view`'s fields a mapper may keep where the task ran (the view, read by every refit task; the prompts,
#: read by every `replicate_weights` task): the driver gets their references.
refit_view.kept_field = ("view", "prompts")


@dataclass
class HistogramBlock:
    """One shard's (policy, cell) histograms of replicates ``start..stop-1`` (`shard_histogram_block`)."""

    start: int
    stop: int
    block: Any  # (stop - start, K * G) int64 (on Ray its reference: it stays in the object store)


def shard_histogram_block(layout: HistogramLayout, codes: ShardCodes, weights: np.ndarray, start: int, stop: int
                          ) -> HistogramBlock:
    """Pass 3 on one shard from its `HistogramLayout` and the chunk's prompt counts (`replicate_weights`' block):
    `shard_histograms`' sums, returned as a `HistogramBlock` whose block a mapper may keep where it was summed
    (on Ray the chunk's refit task reads every shard's block from the object store and sums them there:
    `replicate_refits`)."""
    return HistogramBlock(start, stop, _layout_histograms(layout, codes, weights, start, stop))


#: `shard_histogram_block`'s field a mapper may keep where the task ran.
shard_histogram_block.kept_field = "block"


#: Bytes of one chunk's prompt counts (`replicate_weights`' block): it sets the replicates drawn per task.
WEIGHTS_BLOCK_BYTES = 256 * 2**20
#: Chunks of replicates whose weights are drawn ahead of the histograms (object-store memory: this many blocks).
WEIGHTS_IN_FLIGHT = 4
#: Chunks whose refits (`replicate_refits`) may run or wait while the next chunk's histograms are summed (their
#: counts at the refits' prompts are held meanwhile: ~1 byte a labelled prompt and replicate each, in the object
#: store on Ray, else on the driver).
REFITS_IN_FLIGHT = 2


@dataclass
class ShardedPrepared:
    """A Direct evaluation prepared from shards (`cje_engine.pipeline.prepared.Prepared`).

    ``prep`` is Direct's prepared state on the labelled rows with every row's counts, totals and evaluation
    terms merged in: `finalize` is Direct's. The replicates fan out over the shards (`shard_histogram_block`) and
    are refitted by tasks of ``mapper`` (`replicate_refits`); ``mapper`` and ``shards`` stay with the driver (not
    pickled).
    """

    prep: Prepared
    shards: list  # per shard, what ``mapper`` hands `shard_histograms` as its table (a table or a reference)
    codes: list  # per shard, its `ShardCodes`
    n_prompts: int
    mapper: Any = field(default=serial_map, repr=False)
    influence: str = "per_prompt"  # "per_prompt": kept; "gram": only their sums and cross-products
    gram: dict = field(default_factory=dict)  # the merged Gram form of the evaluation terms
    reason: str = "requested"  # why the sharded path was taken (the result's ``inference.row_pass``)
    segments: Any = None  # options.segment_by: the shards' segment counts (`sharded_segments.SegmentCounts`)
    kept: list = field(default_factory=list, repr=False)  # per shard, pass 1's `ShardKept` (or its reference)
    fast_histograms: bool = True  # replicates from weights drawn once per chunk (False: every shard draws them)
    _layouts: Any = field(default=None, repr=False)  # per shard, its `HistogramLayout` (or its reference)
    _refit: Any = field(default=None, repr=False)  # the refits' `RefitView` (on Ray: references), built once

    @property
    def options(self) -> EvaluationOptions:
        """The evaluation's options."""
        return self.prep.options

    def check_bootstrap_memory(self) -> None:
        """Direct's memory check of the replicate matrix."""
        self.prep.check_bootstrap_memory()

    def bootstrap_source(self) -> "ShardedPrepared":
        """This state: its replicates fan out over the shards themselves (call `replicates` in the driver)."""
        return self

    def histograms(self, start: int, stop: int) -> np.ndarray:
        """Replicates ``start..stop-1``'s (policy, cell) histograms summed over the shards (exact, any order)."""
        opts, d = self.prep.options, self.prep.design
        items = [(t, tuple(opts.covariates), opts.policies, c, opts.seed, start, stop, self.n_prompts,
                  d.n_policies) for t, c in zip(self.kept or self.shards, self.codes)]
        total = None
        for _, h in self.mapper(shard_histograms, items):
            total = h.copy() if total is None else total + h  # int64: exact in any order
        return total.astype(float)

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Bootstrap replicates ``start..stop-1``: bit-identical to the single-process `bootstrap_chunk`.

        Each chunk's prompt weights are drawn once (`replicate_weights`, a task of ``mapper``; its block of every
        prompt's counts and its counts at the labelled prompts stay where they were drawn), every shard sums its
        slice of them per (policy, cell) from its `HistogramLayout` (`shard_histogram_block`, its block left where
        it was summed), and one task of ``mapper`` a chunk sums the shards' blocks and refits from the labelled
        rows with the counts at their prompts (`replicate_refits` on the compact view, which `refit_view` builds
        once, as a task of ``mapper``, from the labelled rows' `RefitRows`). On Ray the driver sends the labelled
        rows' few columns once and otherwise only submits tasks: no view, no plan, no weights and no histogram
        is built in, written from or read into its memory (a driver's ``ray.put`` and ``ray.get`` map the node's
        object store, and the pages they touch stay in its RSS). ``fast_histograms=False``: every shard draws
        every replicate's weights itself and the driver refits from the full view (`histograms`, the
        reference)."""
        opts = self.prep.options
        if not self.fast_histograms:
            view = bootstrap_view(self.prep.design, opts.seed)
            _note("bootstrap view")
            return bootstrap_replicates(view, start, stop, self.histograms(start, stop))
        refit = self.refit_view()
        layouts = self.histogram_layouts()
        step = max(1, min(stop - start, WEIGHTS_BLOCK_BYTES // max(self.n_prompts, 1)))
        bounds = [(a, min(a + step, stop)) for a in range(start, stop, step)]
        out = np.empty((stop - start, 3 * self.prep.design.n_policies))
        K = self.prep.design.n_policies

        def refit_chunk(a: int, b: int, counts: Any, blocks: list) -> None:
            for _, reps in self.mapper(replicate_refits, [(refit.view, counts, a, b, *blocks)]):
                out[a - start:b - start] = reps

        # a chunk's refits run (in process: in a thread; on Ray: as a task, waited on by a thread) while the shards
        # sum the next chunk's histograms (each chunk's rows written to its own place: any order)
        remote = getattr(self.mapper, "put", None) is not None
        with ThreadPoolExecutor(max_workers=REFITS_IN_FLIGHT if remote else 1, thread_name_prefix="cje-refit") as pool:
            pending: list = []
            for w0 in range(0, len(bounds), WEIGHTS_IN_FLIGHT):
                window = bounds[w0:w0 + WEIGHTS_IN_FLIGHT]
                for _, rw in self.mapper(replicate_weights, [(opts.seed, a, b, self.n_prompts, refit.prompts)
                                                               for a, b in window]):
                    items = [(lay, c, rw.block, rw.start, rw.stop) for lay, c in zip(layouts, self.codes)]
                    blocks: list = [None] * len(items)
                    for i, h in self.mapper(shard_histogram_block, items):
                        blocks[i] = h.block  # shard order (the sums are exact in any order)
                    items = None
                    while len(pending) >= REFITS_IN_FLIGHT:  # bound the chunks waiting for a refit
                        pending.pop(0).result()  # (and raise a refit's error here)
                    pending.append(pool.submit(refit_chunk, rw.start, rw.stop, rw.driver, blocks))
                    rw = blocks = None
                log.debug("replicates %d..%d of %d..%d: histograms summed", window[0][0], window[-1][1] - 1, start,
                          stop - 1)
                _note(f"histograms of replicates {window[0][0]}..{window[-1][1] - 1}")
            for f in pending:
                f.result()
        _note(f"replicates {start}..{stop - 1}")
        return out

    def refit_view(self) -> RefitView:
        """The refits' `RefitView` (built on the first call, as a task of ``mapper`` from `refit_rows`; on Ray its
        view and prompts are references: they stay in the object store until `finalize`)."""
        if self._refit is None:
            rows = refit_rows(self.prep.design, self.prep.options.seed)
            _note("refit rows")
            for _, res in self.mapper(refit_view, [(rows,)]):
                self._refit = res
            rows = None
            _release()
            _note("refit view")
        return self._refit

    def histogram_layouts(self) -> list:
        """Every shard's `HistogramLayout` (built on the first call, with ``mapper``; on Ray their references)."""
        if self._layouts is None:
            opts = self.prep.options
            items = [(t, tuple(opts.covariates), opts.policies, c, self.prep.design.n_policies)
                     for t, c in zip(self.kept or self.shards, self.codes)]
            layouts: list = [None] * len(items)
            for i, res in self.mapper(shard_histogram_layout, items):
                layouts[i] = res.layout
            self._layouts = layouts
        return self._layouts

    @heap_kept
    def finalize(self, chunks: Sequence[np.ndarray]):
        """Direct's finalize on the merged state; the result's ``inference`` says the path it took."""
        from cje_engine.pipeline import sharded_segments
        from cje_engine.result.model import RowPass

        self._refit = None  # the refits' view and prompts (on Ray: released from the object store)
        result = self.prep.finalize(chunks)
        _note("finalize")
        if self.segments is not None:  # the segment x policy cells, reduced on the shards too
            sharded_segments.summarize_sharded_segments(self, result, prepare_sharded)
        result.model.inference.row_pass = RowPass(path="sharded", shards=len(self.shards), influence=self.influence,
                                                  reason=self.reason)
        return result


#: Bytes of per-prompt influence terms the driver may hold (``CJE_MAX_DRIVER_TERMS_BYTES`` overrides it).
DRIVER_TERMS_BYTES = 4 * 2**30


def terms_bytes(n_prompts: int, n_policies: int) -> int:
    """Bytes of the per-prompt influence arrays the driver holds at the peak of `finalize`: ``total`` and
    ``calibration`` (2K columns each), ``audit`` (K), the extended ``total`` and ``calibration`` (4K each)
    and one (prompts, 4K) temporary of the covariance: 19K float64 a prompt."""
    return int(8 * 19 * n_policies * n_prompts)


def terms_budget_bytes(budget: int | None = None) -> int:
    """The driver's budget for per-prompt terms: ``budget``, else ``CJE_MAX_DRIVER_TERMS_BYTES``, else
    `DRIVER_TERMS_BYTES`."""
    return int(os.environ.get("CJE_MAX_DRIVER_TERMS_BYTES", DRIVER_TERMS_BYTES)) if budget is None else int(budget)


def check_terms_memory(n_prompts: int, n_policies: int, budget: int | None = None) -> None:
    """Raise `CJEInputError` before pass 2 when per-prompt terms were asked for (``keep_terms=True``) and
    would not fit the driver's budget (`terms_budget_bytes`); the Gram form (``keep_terms=False``, the
    default above the budget) does not need them."""
    budget = terms_budget_bytes(budget)
    need = terms_bytes(n_prompts, n_policies)
    if need > budget:
        raise CJEInputError(
            f"the per-prompt influence terms of {n_prompts:,} prompts x {n_policies} policies need "
            f"{need / 2**30:.1f} GiB on the driver, over its budget of {budget / 2**30:.1f} GiB "
            "(CJE_MAX_DRIVER_TERMS_BYTES); leave keep_terms unset (or False) for the Gram form, which does not "
            "need them", option="row_pass")


@heap_frozen
@heap_kept(trim=False)  # its free pages reused by the finalize that follows (which trims)
def prepare_sharded(shards: Sequence[Any], options: EvaluationOptions | None = None, *,
                    mapper: Mapper = serial_map, keep_terms: bool | None = None, reason: str = "requested",
                    terms_budget: int | None = None, fit: Callable | None = None, **kwargs: Any) -> ShardedPrepared:
    """Prepare a Direct evaluation from shards of rows split by prompt (`split_by_shard`).

    Parameters
    ----------
    shards : sequence
        One entry per shard: a `pyarrow.Table` of its rows, or whatever ``mapper`` resolves to one (a Ray
        object reference).
    options : EvaluationOptions, optional (or keyword options)
    mapper : Mapper
        Runs the per-shard passes (default: in process, in order).
    terms_budget : int, optional
        Bytes of per-prompt influence terms the driver may hold (`check_terms_memory`; default
        `DRIVER_TERMS_BYTES` or ``CJE_MAX_DRIVER_TERMS_BYTES``).
    reason : str
        Why the sharded path is taken (recorded in the result's ``inference.row_pass``).
    keep_terms : bool, optional
        True: bring every prompt's evaluation terms to the driver (the result keeps per-prompt influence
        terms, as the single-process path does; refused over the budget). False: the Gram form
        (`cje_engine.inference.gram.GramTerms`: the labelled prompts' terms plus the moments of the rest; the
        driver's memory does not grow with the prompts; the result's ``inference.row_pass.influence`` is
        ``gram``). None (default): per-prompt terms when they fit the budget, else the Gram form.
    fit : callable, optional
        ``fit(data, options, rows) -> (Fit, selection, excluded)`` on the merged labelled rows (default
        `cje_engine.pipeline.calibration.fit_calibration`: mode selection and robust pooling); the segment cells
        fit the run's mode only (`cje_engine.pipeline.sharded_segments`).
    """
    from cje_engine.pipeline import sharded_segments
    from cje_engine.pipeline.calibration import fit_calibration
    from cje_engine.pipeline.direct import Prepared

    opts = EvaluationOptions.of(options, **kwargs)
    if opts.inference == "bootstrap" and opts.pooling_bootstrap == "rerun" and opts.calibration_policies:
        raise CJEInputError("pooling_bootstrap='rerun' is not available on the sharded path", option="pooling_bootstrap")
    cov, pols = tuple(opts.covariates), opts.policies
    shards = list(shards)
    summaries: list = [None] * len(shards)
    for i, s in mapper(reduce_shard, [(t, cov, pols, opts.n_folds) for t in shards]):
        summaries[i] = s
    s = None
    if not ranges_in_order(summaries) and any(x.prompt_ids is None for x in summaries):
        # shards of a range split out of order (or overlapping): rank their ids on the driver
        for i, ids in mapper(shard_prompt_ids, [(t, cov, pols) for t in shards]):
            summaries[i].prompt_ids = ids
    _note("pass 1")
    # pass 1's codes of every shard (references on Ray: they stay in the cluster) for passes 2 and 3
    kept = [x.kept for x in summaries]
    if any(k is None for k in kept):
        kept = []
    for x in summaries:
        x.kept = None
    merged = merge_summaries(summaries, opts)
    summaries = None  # their labelled rows moved into the merge; the rest released before the fit
    lab_window_rows, lab_shard = merged.lab_rows, merged.lab_shard
    merged.lab_rows = merged.lab_shard = None
    if keep_terms is None:
        keep_terms = terms_bytes(merged.n_prompts, len(merged.data.policies)) <= terms_budget_bytes(terms_budget)
        log.info("influence terms: %s (%d prompts)", "per prompt" if keep_terms else "Gram form", merged.n_prompts)
    elif keep_terms:
        check_terms_memory(merged.n_prompts, len(merged.data.policies), terms_budget)
    data = merged.data
    _check_labels(data, merged.totals)
    collect = data.n_rows >= RELEASE_COLLECT_MIN_LABELLED
    _release(collect)
    _note("merge")
    fit, selection, excluded = (fit or fit_calibration)(data, opts, dict(merged.rows))
    # the calibration plan cached on the design (~70 B a labelled row) is rebuilt, identical, if a bootstrap
    # replicate needs it; the analytic route does not
    fit.release()  # the plan, and the sources' audits' residual terms and prompt index: ~100 B a labelled row
    _release(collect)
    _note("calibration fit")
    design = fit.design
    mode = design.mode
    G = design.cells.cells.size
    counts = design.cells.counts
    n_k = counts.sum(1)
    K = design.n_policies
    cr = design.cal_rows
    f = fit.f
    stats = fit.stats  # `estimators.cell_policy_stats`: the single-process path's bits
    plug = stats[:K]
    codes = [ShardCodes(merged.prompt_ranks[i], merged.policy_maps[i], merged.cell_maps[mode][i], G,
                        merged.prompt_offsets[i]) for i in range(len(shards))]
    # the calibration rows of each shard: their window row and out-of-fold value
    cal_rows_window = lab_window_rows[cr]
    shard_of_row = lab_shard[cr]
    # the Gram form: each shard's labelled prompts reduced to sums in its pass-2 task, from its part of the
    # builder's per-row arrays (no basis rows kept, none built on the driver)
    builder = None if keep_terms else GramBuilder(design, f, fit.full, stats, n_k, lab_shard, len(shards))
    del lab_shard
    items = []
    for i, t in enumerate(kept or shards):
        sel = shard_of_row == i
        items.append((t, cov, pols, codes[i], fit.F_all, cal_rows_window[sel], fit.f_cal[sel], plug, n_k, keep_terms,
                      None if keep_terms else builder.parts[i]))
    del cal_rows_window, shard_of_row, lab_window_rows, sel
    merged.rows = None  # every mode's row coding: the chosen one lives on in the design
    total = np.zeros((merged.n_prompts, 2 * K)) if keep_terms else None
    gram = {"count": 0, "sum": np.zeros(K), "gram": np.zeros((K, K))}
    parts: list = [None] * len(shards)
    for i, res in mapper(shard_evaluation_terms, items):
        if keep_terms:
            if codes[i].prompt_rank is None:
                total[codes[i].prompt_offset:codes[i].prompt_offset + res.terms.shape[0], :K] = res.terms
            else:
                total[codes[i].prompt_rank, :K] = res.terms
            res.terms = None
        else:
            builder.add(i, res)
        parts[i] = res
    items = None
    for res in parts:  # in shard order: the same sums whatever the order of arrival
        gram["count"] += res.count
        gram["sum"] += res.total
        gram["gram"] += res.gram
    _release(collect)
    _note("pass 2")
    if keep_terms:
        total[:, K:] = total[:, :K]
        infl = influence_with_evaluation_terms(design, f, fit.full, stats, total, n_k)
    else:
        infl = builder.finish()
        builder = None
    _note("influence terms")
    jk = fold_jackknife(design, fit.models)
    log.info("prepared %d rows on %d shards (%d prompts, %d labelled rows on the driver), mode=%s",
             merged.n_rows, len(shards), merged.n_prompts, data.n_rows, mode)
    prep = Prepared(opts, design, selection, f, fit.full, stats, infl, jk, fit.models, excluded, None,
                    rows=merged.totals)
    sp = ShardedPrepared(prep, shards, codes, merged.n_prompts, mapper, "per_prompt" if keep_terms else "gram",
                         gram, reason, kept=kept)
    if opts.segment_by:  # each row's segment, counted on the shards (errors here, before any bootstrap)
        sp.segments = sharded_segments.count_segments(sp, ROW)
    return sp


#: Bytes of labelled prompts' basis rows built at a time (`GramBuilder`): a block of them, reduced to sums.
BASIS_BLOCK_BYTES = 16 * 2**20


@dataclass
class LabelledBasis:
    """One shard's part of `GramBuilder`: what the basis rows of its labelled prompts are built from (its labelled
    rows' prompts, policies, label-residual and own-label contributions; its calibration rows' prompts, level-set
    blocks and corrected residuals; the fit's level-set weights), so that pass 2 reduces them to their sums where
    the shard's terms are (`shard_evaluation_terms`), in the blocks and order the driver would use: the same bits.
    """

    K: int
    groups: np.ndarray  # (K, 5): policy k's e, c, r, audit and own dimensions
    block: int  # labelled prompts a block of basis rows
    gone: np.ndarray  # policies without labels (their residual and audit columns NaN)
    own_gone: np.ndarray  # (K,) bool: the same for the own-label column
    rho_cal: np.ndarray  # (K, level-set blocks)
    rho_audit: np.ndarray  # (K, level-set blocks)
    m: float
    prompt_lab: np.ndarray  # (the shard's labelled rows,) global prompt code
    lab_pol: np.ndarray
    res_contrib: np.ndarray
    own_contrib: np.ndarray
    prompt_cal: np.ndarray  # (the shard's calibration rows,) global prompt code
    b_cal: np.ndarray
    resid_cal: np.ndarray

    def sums(self, P: np.ndarray | None, terms: np.ndarray | None, reference: bool = False,
             at: tuple | None = None) -> BasisSums:
        """The `BasisSums` of the shard's labelled prompts ``P`` (global codes, sorted) with evaluation terms
        ``terms`` (P, K): their basis rows built and reduced a block of prompts at a time (`BASIS_BLOCK_BYTES`).

        ``P`` is checked against the driver's labelled rows' prompts by their positions in it (strictly
        increasing, every row's prompt found, every prompt hit: the reference sorts the rows' prompts again), and
        the rows' NaN and infinite parts replaced where there are any (`_nan_to_num`); ``reference``: as first
        written (`numpy.nan_to_num` over every part, `BasisSums.add`'s reference). The same bits.

        ``at``: (places in ``P`` of the labelled rows' prompts, of the calibration rows' (None: not known)) as the
        shard knows them (`shard_evaluation_terms`), taken for ``numpy.searchsorted``'s where they give the
        driver's prompts (``P`` strictly increasing: each value's one place, the same positions), else searched."""
        sums = BasisSums(5 * self.K, self.groups)
        if P is None or not P.size:
            return sums
        if reference:
            if not np.array_equal(unique_ints(self.prompt_lab), P):
                raise ValueError("a shard's labelled prompts are not the driver's")
            loc_l = np.searchsorted(P, self.prompt_lab)
            loc_c = np.searchsorted(P, self.prompt_cal)

            def add(*args: Any) -> None:  # the rows as first built, added as first written
                sums.add(self._rows(*args, reference=True), reference=True)
        else:
            loc_l = _places(P, self.prompt_lab, at[0] if at is not None else None)
            hit = np.zeros(P.size, dtype=bool)
            ok = P.size == 1 or bool(np.all(P[1:] > P[:-1]))
            if ok and loc_l.size:
                ok = int(loc_l.max()) < P.size and np.array_equal(P[loc_l], self.prompt_lab)
                hit[loc_l[loc_l < P.size]] = True
            if not (ok and hit.all()):
                raise ValueError("a shard's labelled prompts are not the driver's")
            del hit
            loc_c = _places(P, self.prompt_cal, at[1] if at is not None else None)
            # each block built as its transpose (contiguous columns), then its rows once (`_rows_t`)
            from cje_engine.inference.gram import transposed

            def add(*args: Any) -> None:
                rows_t = self._rows_t(*args)
                sums.add(transposed(rows_t), rows_t=rows_t)
        for a in range(0, P.size, self.block):
            b = min(a + self.block, P.size)
            if a == 0 and b == P.size:
                add(terms, None, None, loc_l, loc_c)
                continue
            kl = np.flatnonzero((loc_l >= a) & (loc_l < b))
            kc = np.flatnonzero((loc_c >= a) & (loc_c < b))
            add(terms[a:b], kl, kc, loc_l[kl] - a, loc_c[kc] - a)
        return sums

    def _rows(self, e: np.ndarray, sl: np.ndarray | None, sc: np.ndarray | None, ll: np.ndarray, lc: np.ndarray,
              reference: bool = False) -> np.ndarray:
        """The basis rows of a block of labelled prompts (their terms ``e``; the shard's labelled rows ``sl`` and
        calibration rows ``sc``, None: all, at block positions ``ll``, ``lc``), as `labelled_influence_parts`
        writes them."""
        K = self.K
        n = e.shape[0]
        fix = (lambda x: np.nan_to_num(x, copy=False)) if reference else _nan_to_num

        def at(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
            return a if idx is None else a[idx]

        base = np.empty((n, 5 * K))
        base[:, :K] = e
        residual, calibration, audit = base[:, 2 * K:3 * K], base[:, K:2 * K], base[:, 3 * K:4 * K]
        key = ll.astype(np.int64) * K
        key += at(self.lab_pol, sl)
        residual[...] = np.bincount(key, weights=at(self.res_contrib, sl), minlength=n * K).reshape(n, K)
        residual[:, self.gone] = np.nan
        b_cal, resid = at(self.b_cal, sc), at(self.resid_cal, sc)
        for k in range(K):
            calibration[:, k] = np.bincount(lc, weights=self.rho_cal[k][b_cal] * resid / self.m, minlength=n)
            audit[:, k] = np.bincount(lc, weights=self.rho_audit[k][b_cal] * resid / self.m, minlength=n)
        fix(calibration)
        np.subtract(residual, audit, out=audit)
        audit[:, self.gone] = np.nan
        fix(audit)
        fix(residual)
        own = np.bincount(key, weights=at(self.own_contrib, sl), minlength=n * K).reshape(n, K)
        own[:, self.own_gone] = np.nan
        base[:, 4 * K:] = fix(own)
        return base

    def _rows_t(self, e: np.ndarray, sl: np.ndarray | None, sc: np.ndarray | None, ll: np.ndarray,
                lc: np.ndarray) -> np.ndarray:
        """`_rows`' transpose (5K, n), C-contiguous: each column of the basis rows written as one contiguous row
        (the per-policy sums by ``numpy.bincount`` over the key ``policy * n + position`` instead of ``position * K
        + policy``: each bin the same weights added in the same order, the same bits), where `_rows` writes its
        columns across the rows."""
        K = self.K
        n = e.shape[0]

        def at(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
            return a if idx is None else a[idx]

        base = np.empty((5 * K, n))
        base[:K] = e.T
        calibration, residual, audit, own = base[K:2 * K], base[2 * K:3 * K], base[3 * K:4 * K], base[4 * K:]
        key = at(self.lab_pol, sl).astype(np.int64) * n
        key += ll
        residual[...] = np.bincount(key, weights=at(self.res_contrib, sl), minlength=K * n).reshape(K, n)
        residual[self.gone] = np.nan
        b_cal, resid = at(self.b_cal, sc), at(self.resid_cal, sc)
        for k in range(K):
            calibration[k] = np.bincount(lc, weights=self.rho_cal[k][b_cal] * resid / self.m, minlength=n)
            audit[k] = np.bincount(lc, weights=self.rho_audit[k][b_cal] * resid / self.m, minlength=n)
        _nan_to_num(calibration)
        np.subtract(residual, audit, out=audit)
        audit[self.gone] = np.nan
        _nan_to_num(audit)
        _nan_to_num(residual)
        own[...] = np.bincount(key, weights=at(self.own_contrib, sl), minlength=K * n).reshape(K, n)
        own[self.own_gone] = np.nan
        _nan_to_num(own)
        return base


def _places(P: np.ndarray, values: np.ndarray, hint: np.ndarray | None) -> np.ndarray:
    """``numpy.searchsorted(P, values)`` (int64) of a strictly increasing ``P``, taken from ``hint`` (int64
    places) when ``P`` there holds ``values``: then each is its value's one place in ``P``, what the search finds.
    Else (no hint, one of another size, out of range, or a value not at its place) the search."""
    if (hint is not None and hint.dtype == np.int64 and hint.shape == values.shape
            and (not hint.size or (int(hint.min()) >= 0 and int(hint.max()) < P.size
                                   and np.array_equal(P[hint], values)))
            and (P.size < 2 or bool(np.all(P[1:] > P[:-1])))):
        return hint
    return np.searchsorted(P, values)


def _nan_to_num(x: np.ndarray) -> np.ndarray:
    """``numpy.nan_to_num(x, copy=False)`` (NaN 0, infinities the largest finite numbers), the same values,
    with the replacements made only where an entry is not finite (one mask; `numpy.nan_to_num` builds three
    over the whole array and writes through each). Returns ``x``."""
    bad = ~np.isfinite(x)
    if bad.any():
        x[bad] = np.nan_to_num(x[bad])
    return x


def labelled_basis_task_bytes(n_labelled: int) -> int:
    """Bytes a pass-2 task holds beyond its rows' arrays to reduce ``n_labelled`` labelled rows' basis sums
    (`LabelledBasis.sums`): its part's arrays (prompt, policy and two contributions a labelled row, prompt, block and
    residual a calibration row: at most 56 B), their block positions, masks and the sort of the labelled prompts
    (~56 B more), and a block of basis rows with its per-policy copies and products (5 x `BASIS_BLOCK_BYTES`)."""
    return int(112 * n_labelled + 5 * BASIS_BLOCK_BYTES)


class GramBuilder:
    """Direct's influence terms in the Gram form (`cje_engine.inference.gram`) from pass 2's parts, as they arrive.

    Each labelled prompt's basis vector ``[e | c | r | audit | own]`` (5K numbers: evaluation terms, calibration
    part of the plug-in, label-residual part of the augmented level, audit term, own-label term; the last four the
    values of `labelled_influence_parts` and `verified.own_label_influence` on the labelled prompts, bit for bit)
    is built a shard's part at a time, a block of its prompts at a time (`BASIS_BLOCK_BYTES`), and reduced at once
    to its sums, cross-products and per-policy third moments (`BasisSums`): the rows are never all held. What a
    shard's rows are built from is its `LabelledBasis` (``parts[i]``): sent with its pass-2 task, the shard builds
    and reduces them itself (`shard_evaluation_terms`) while the others run, and the driver only adds the sums;
    else the driver builds them as the part arrives (`add`). Every other prompt enters through the moments of its
    ``e``. The shards' sums are added in shard order (`finish`): the same numbers whatever the order of arrival
    or where they were reduced. ``total = [e + c | e + r]``, ``calibration = [c | r]``; a column NaN for lack of
    labels is NaN for every prompt (in the column map).

    Parameters
    ----------
    design, f, full, stats, n_k
        The fitted design, calibrated values of its (labelled) rows, the full calibrator, `cell_policy_stats`
        and rows per policy.
    lab_shard : ndarray (int32)
        The shard of each row of ``design.data`` (the merge's ``lab_shard``).
    n_shards : int
    """

    def __init__(self, design: Any, f: np.ndarray, full: Any, stats: np.ndarray, n_k: np.ndarray,
                 lab_shard: np.ndarray, n_shards: int) -> None:
        d = design.data
        K = self.K = design.n_policies
        plug, aug = stats[:K], stats[K:]
        lab, cr = design.lab_rows, design.cal_rows
        lw = _take(d.label_weight, lab)
        lab_pol = _take(d.policy, lab)
        y = _take(d.label, lab)
        den = np.bincount(lab_pol, weights=lw, minlength=K)
        per_lab = {}
        with np.errstate(invalid="ignore", divide="ignore"):
            per_lab["res_contrib"] = lw * ((y - _take(f, lab)) - (aug - plug)[lab_pol]) / den[lab_pol]  # labelled_influence_parts
            means = np.bincount(lab_pol, weights=lw * y, minlength=K) / den  # own_label_influence
            per_lab["own_contrib"] = lw * (y - means[lab_pol]) / den[lab_pol]
        gone = np.flatnonzero(den <= 0)
        own_gone = den <= 0
        ls = level_set_shares(design, full, f[cr])
        G = design.cells.cells.size
        lab_counts = np.bincount(lab_pol.astype(np.int64) * G + _take(design.cells.row_cell, lab),
                                 weights=lw, minlength=K * G).reshape(K, G)
        del lw, y
        with np.errstate(invalid="ignore", divide="ignore"):
            lab_share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
        rho_cal = _level_set_weights(ls, design.cells.counts / n_k[:, None])
        rho_audit = _level_set_weights(ls, lab_share)
        per_lab["lab_pol"] = lab_pol
        per_lab["prompt_lab"] = _take(d.prompt, lab)
        per_cal = {"prompt_cal": _take(d.prompt, cr), "b_cal": ls.b_cal, "resid_cal": ls.resid_cal}
        D = 5 * K
        groups = np.arange(D).reshape(5, K).T  # policy k: its e, c, r, audit and own dimensions
        self.groups = groups
        block = max(1, BASIS_BLOCK_BYTES // (8 * D))
        # each shard's rows of every per-row array, taken an array at a time (the whole array then released)
        rows_l = _rows_by_shard(_take(lab_shard, lab), n_shards)
        rows_c = _rows_by_shard(_take(lab_shard, cr), n_shards)
        # the codes sent in their smallest integer type (indices and keys only: the same values, fewer bytes)
        small = {"lab_pol": _small_int(K), "prompt_lab": _small_int(d.n_prompts), "prompt_cal": _small_int(d.n_prompts),
                 "b_cal": _small_int(ls.n_blocks)}
        split = {}
        for rows, arrays in ((rows_l, per_lab), (rows_c, per_cal)):
            for name in list(arrays):
                a = arrays.pop(name)
                split[name] = [a[r].astype(small[name], copy=False) if name in small else a[r] for r in rows]
                del a
        m = ls.m
        ls = None
        self.gone = gone
        self.parts: list = [LabelledBasis(K, groups, block, gone, own_gone, rho_cal, rho_audit, m,
                                          **{name: v[i] for name, v in split.items()}) for i in range(n_shards)]
        self.rest: list = [None] * n_shards
        self.sums: list = [None] * n_shards

    def add(self, i: int, res: ShardTerms) -> None:
        """Take shard ``i``'s part: its labelled prompts' basis sums, reduced on the shard (``res.sums``) or here
        from their terms (released); its ``rest`` moments kept."""
        self.rest[i] = res.rest
        if res.sums is not None:
            self.sums[i] = res.sums
        else:
            self.sums[i] = self.parts[i].sums(res.labelled, res.labelled_terms)
        res.labelled_terms = res.sums = None
        self.parts[i] = None

    def finish(self) -> dict[str, GramTerms]:
        """The influence terms (``total``, ``calibration``, ``audit``, ``own``) from every shard's sums, added in
        shard order."""
        K = self.K
        rest, sums = Moments.zero(K), BasisSums(5 * K, self.groups)
        for r, b in zip(self.rest, self.sums):
            rest = rest + r
            sums.merge(b)
        gone = self.gone
        eye, zero = np.eye(K), np.zeros((K, K))
        e, c, r, au, ow = (np.vstack([eye if j == i else zero for j in range(5)]) for i in range(5))  # (5K, K) each
        maps = {"total": np.hstack([e + c, e + r]), "calibration": np.hstack([c, r]), "audit": au.copy(),
                "own": ow.copy()}
        maps["total"][:, K + gone] = np.nan
        maps["calibration"][:, K + gone] = np.nan
        maps["audit"][:, gone] = np.nan
        maps["own"][:, gone] = np.nan
        basis = SummedBasis(sums, rest)
        return {name: GramTerms(basis, M) for name, M in maps.items()}


def _rows_by_shard(shard: np.ndarray, n_shards: int) -> list[np.ndarray]:
    """The positions of each shard's entries in ``shard`` (each shard's in increasing order)."""
    return [np.flatnonzero(shard == i) for i in range(n_shards)]


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]``, without a copy when ``idx`` is every row in order (the sharded driver's data holds the labelled
    rows only: its labelled rows are all of them, and so are its calibration rows without calibration policies)."""
    if idx.size == a.shape[0] and (idx.size == 0 or (idx[0] == 0 and idx[-1] == idx.size - 1)):
        return a
    return a[idx]


def _level_set_weights(ls: Any, share: np.ndarray) -> np.ndarray:
    """``rho_k`` of `estimators.calibration_term` for every row ``k`` of ``share`` (K', n_blocks), the same bits."""
    out = np.empty((share.shape[0], ls.n_blocks))
    for k in range(share.shape[0]):
        p_k = (np.bincount(ls.bj, weights=share[k] * (1 - ls.t), minlength=ls.n_blocks)
               + np.bincount(ls.bj1, weights=share[k] * ls.t, minlength=ls.n_blocks))
        with np.errstate(invalid="ignore", divide="ignore"):
            out[k] = np.where(ls.q > 0, p_k / ls.q, 0.0)
    return out


def gram_influence(design: Any, f: np.ndarray, full: Any, stats: np.ndarray, parts: Sequence[ShardTerms],
                   n_k: np.ndarray, lab_shard: np.ndarray) -> dict[str, GramTerms]:
    """`GramBuilder` over every part (in shard order): Direct's influence terms in the Gram form."""
    builder = GramBuilder(design, f, full, stats, n_k, lab_shard, len(parts))
    for i, res in enumerate(parts):
        builder.add(i, res)
    return builder.finish()


def labelled_influence_parts(design: Any, f: np.ndarray, full: Any, stats: np.ndarray, n_k: np.ndarray, *,
                             calibration: np.ndarray, residual: np.ndarray, audit: np.ndarray) -> None:
    """The calibration, label-residual and audit parts of Direct's influence terms (each (prompts, K), NaN as
    0), written into the given views: the values of `estimators.influence_with_evaluation_terms`'s
    ``calibration[:, :K]``, ``calibration[:, K:]`` and ``audit`` after `numpy.nan_to_num`, bit for bit, without
    its (prompts, 2K) arrays (the Gram basis of `gram_influence` is built in place with it)."""
    d = design.data
    K = design.n_policies
    n_p = d.n_prompts
    plug, aug = stats[:K], stats[K:]
    lab = design.lab_rows
    lw = d.label_weight[lab]
    lab_pol = d.policy[lab]
    den = np.bincount(lab_pol, weights=lw, minlength=K)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_contrib = lw * ((d.label[lab] - f[lab]) - (aug - plug)[lab_pol]) / den[lab_pol]
    key = d.prompt[lab].astype(np.int64) * K
    key += lab_pol
    residual[...] = np.bincount(key, weights=lab_contrib, minlength=n_p * K).reshape(n_p, K)
    del key, lab_contrib
    gone = np.flatnonzero(den <= 0)
    residual[:, gone] = np.nan
    cells, counts = design.cells.cells, design.cells.counts
    f_cal = f[design.cal_rows]
    calibration_term(design, full, counts / n_k[:, None], f_cal, out=calibration)
    np.nan_to_num(calibration, copy=False)
    G = cells.size
    lab_counts = np.bincount(lab_pol.astype(np.int64) * G + design.cells.row_cell[lab], weights=lw,
                             minlength=K * G).reshape(K, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
    calibration_term(design, full, lab_share, f_cal, out=audit)
    np.subtract(residual, audit, out=audit)
    audit[:, gone] = np.nan
    np.nan_to_num(audit, copy=False)
    np.nan_to_num(residual, copy=False)


def _check_labels(data: EvalData, totals: RowTotals) -> None:
    """The whole-window checks of `cje_engine.data.io` that need every row: labels and distinct scores."""
    if data.n_rows == 0:
        raise CJEInputError("no row has an oracle label; calibration needs labelled rows with at least two "
                            "distinct label values", column=LABEL)
    if data.label.min() == data.label.max():
        raise CJEInputError(f"all {data.n_rows} labelled rows have the same oracle label {data.label[0]:g}; "
                            "calibration needs at least two distinct label values", column=LABEL)
    if totals.score_min == totals.score_max:
        raise CJEInputError(f"every judge score is {totals.score_min:g}; the judge scores carry no information",
                            column=SCORE)


#: The evaluation modes the sharded row pass has (docs/scaling.md, "Modes and segments").
SHARDED_MODES = ("direct",)
#: Why logs-only and hybrid have none: the result's ``inference.row_pass.reason`` of their runs.
OFFPOLICY_UNSHARDED = ("its estimators need every logged row in one process (the importance-weight calibration, "
                       "SIMCal, and the stacked estimators are refitted on each row's own weight in every bootstrap "
                       "resample: no per-shard count or histogram carries them exactly)")


def check_sharded_mode(mode: str, what: str = "row_pass") -> None:
    """Raise `CJEInputError` naming ``mode`` when it has no sharded row pass (`SHARDED_MODES`); ``what``
    starts the message (the key or parameter that asked for it)."""
    if mode not in SHARDED_MODES:
        raise CJEInputError(f"{what}: sharded is not available in mode {mode!r}: {OFFPOLICY_UNSHARDED}; use "
                            "row_pass: auto or single (the single path)", option="row_pass")

"""The sharded row pass on Ray: shards read and reduced where they are read (issue 29).

`read_shards` runs one task per log file that reads it (`flows.storage.logs.read_window`, local or S3) and
splits its rows by prompt (`cje_engine.pipeline.sharded.split_by_shard`) into one object per shard, then one
task per shard that concatenates its pieces: the rows go from the readers to the shards' objects in the
cluster's object store, never through the driver. `ray_mapper` is the engine's `Mapper` on Ray: one task per
shard, results yielded as they arrive (the engine merges them so that the order does not matter), a worker
lost mid-pass retried by Ray (`max_retries`): the task is a pure function of its shard, so its retry gives
the same numbers. The memory each task asks for is derived from the data (`task_memory`).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Sequence

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
    """Shards for a window of ``n_rows``: one a CPU at least, and no shard above `ROWS_PER_SHARD` rows."""
    return max(1, cpus, math.ceil(n_rows / ROWS_PER_SHARD))


def task_memory(rows: int, n_prompts: int = 0, replicates: int = 0, n_policies: int = 0, n_cells: int = 0) -> int:
    """Bytes a shard task asks Ray for: its rows' arrays plus, in the bootstrap pass, one prompt-weight
    vector (8 B a prompt) and its block of histograms (replicates x K x G x 8 B, returned as int64)."""
    return int(64 * 2**20 + BYTES_PER_ROW * rows + 8 * n_prompts + 8 * replicates * n_policies * n_cells)


def replicate_chunk(n_replicates: int, n_policies: int, n_cells: int) -> int:
    """Replicates per histogram task: as many as keep its returned block under `HISTOGRAM_BLOCK_BYTES`."""
    per = max(1, 8 * n_policies * n_cells)
    return max(1, min(n_replicates, HISTOGRAM_BLOCK_BYTES // per))


def split_file(uri: str, cfg_dict: dict, key: str, file_index: int, n_shards: int, columns: list[str] | None,
               policies: list[str] | None, mapping: dict | None, prepare_rows: Callable | None = None):
    """Read one log file on a worker and return its rows per shard, then a small dict about the file
    (``num_returns = n_shards + 1``). Each row's window place is ``file_index << 40`` plus its row in the
    file (file order, then row order). ``prepare_rows(table, key)``: what the caller does to a file's rows
    before they are split (the evaluate flow: join the label store's labels, derive covariates, check
    columns) and returns ``(table, info)``."""
    from cje_engine.pipeline.sharded import split_by_shard
    from flows.storage.logs import read_window
    from flows.storage.objects import Storage, StorageConfig

    st = Storage.for_uri(uri, StorageConfig.from_dict(cfg_dict))
    table = read_window(st, [key], columns=columns, policies=policies, mapping=mapping, check_unique=False)
    if "dt" in table.column_names:
        table = table.drop_columns(["dt"])
    info = {"key": key, "rows": table.num_rows}
    if prepare_rows is not None:
        table, more = prepare_rows(table, st.url(key))
        info.update(more)
    return (*split_by_shard(table, n_shards, row_offset=file_index << 40), info)


def _concat(*parts):
    """One shard's table from its pieces of every file."""
    import pyarrow as pa

    kept = [p for p in parts if p.num_rows]
    return pa.concat_tables(kept, promote_options="default") if kept else parts[0]


def read_shards(uri: str, cfg_dict: dict, keys: Sequence[str], n_shards: int, *, columns: list[str] | None = None,
                policies: list[str] | None = None, mapping: dict | None = None, prepare_rows: Callable | None = None,
                rows_hint: int = 0, max_retries: int = DEFAULT_MAX_RETRIES, with_info: bool = False):
    """Object references of the window's shards (one `pyarrow.Table` each, in the cluster's object store).

    ``keys``: the window's log files in window order; ``rows_hint``: the window's rows when known (for the
    tasks' memory); ``prepare_rows``: see `split_file`. With ``with_info`` also the list of every file's
    info dict (small: fetched to the driver).
    """
    import ray

    per_file = max(1, rows_hint // max(len(keys), 1))
    split = ray.remote(split_file).options(num_returns=n_shards + 1, max_retries=max_retries,
                                           memory=task_memory(2 * per_file), name="cje_shard_read")
    pieces = [split.remote(uri, cfg_dict, k, i, n_shards, columns, policies, mapping, prepare_rows)
              for i, k in enumerate(keys)]
    concat = ray.remote(_concat).options(max_retries=max_retries, memory=task_memory(2 * rows_hint // n_shards),
                                         name="cje_shard_concat")
    refs = [concat.remote(*[p[s] for p in pieces]) for s in range(n_shards)]
    if not with_info:
        return refs
    return refs, ray.get([p[n_shards] for p in pieces], timeout=ray_get_timeout())


def ray_mapper(*, memory: Callable[[str], int] | int = 0, max_retries: int = DEFAULT_MAX_RETRIES,
               ) -> Callable[[Callable, Sequence[tuple]], Iterable[tuple[int, Any]]]:
    """The engine's `cje_engine.pipeline.sharded.Mapper` on Ray: one task per item, ``(index, result)``
    yielded as the tasks finish (each bounded by `flows.runtime.timeouts.ray_get_timeout`).

    ``memory``: bytes each task asks for, or a function of the pass's function name giving them (derived
    from the data by the caller, `task_memory`). A worker lost mid-task is retried ``max_retries`` times.
    """
    import ray

    def mapper(fn: Callable, items: Sequence[tuple]) -> Iterable[tuple[int, Any]]:
        mem = memory(fn.__name__) if callable(memory) else memory
        opts = {"max_retries": max_retries, "retry_exceptions": False, "name": f"cje_{fn.__name__}"}
        if mem:
            opts["memory"] = int(mem)
        remote = ray.remote(fn).options(**opts)
        refs = [remote.remote(*item) for item in items]
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        limit = ray_get_timeout()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=limit)
            if not done:
                raise TimeoutError(f"Ray tasks cje_{fn.__name__}: {len(pending)} of {len(refs)} did not finish "
                                   f"within {limit:g} s")
            for ref in done:
                yield index[ref], ray.get(ref)

    return mapper

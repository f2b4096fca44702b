"""The evaluate flow's sharded row pass (issue 29): which path a run takes, and the sharded path itself.

`row_pass_for` picks the path: ``row_pass="sharded"`` or ``"single"`` forces one; ``"auto"`` takes the
sharded path for a Direct window (segmented or not) whose Parquet files reach `SHARDED_MIN_BYTES` or whose rows (their
footers) reach `SHARDED_MIN_ROWS`, and the single path in logs-only and hybrid mode (their estimators need every logged row; ``"sharded"`` with them is refused
by `check_row_pass` before Prefect or Ray start). `compute_sharded` reads
every file on a Ray worker, joins the label store's labels and derives covariates there
(`FileRows`: each file probes the label index built once a run on a worker, `flows.runtime.label_index`),
splits the rows by prompt into shards (`flows.runtime.sharded_ray.read_shards`) and
runs `cje_engine.pipeline.sharded.prepare_sharded` with the Ray mapper: the flow's driver holds the labelled
rows, counts per (policy, cell) and the per-prompt evaluation terms, never the rows.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import pyarrow as pa

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, SCORE
from cje_engine.errors import CJEInputError
from cje_engine.pipeline import sharded
from flows.runtime import ray_fanout, sharded_ray
from flows.runtime.label_index import LabelIndex

log = logging.getLogger(__name__)

#: ``row_pass="auto"``: the sharded path from this many bytes of Parquet in the window (~45M rows of the
#: simulator's schema at 116 MiB per 10M rows; the single path's driver needs ~165 B a row, docs/scaling.md).
SHARDED_MIN_BYTES = 512 * 2**20

ROW_PASSES = ("auto", "single", "sharded")
BASE_COLUMNS = ("prompt_id", "policy", "judge_score", "response_id")


def check_row_pass(requested: str, mode: str) -> None:
    """Raise `CJEInputError` (exit 2) when ``row_pass`` is unknown or asks the sharded path of a mode without one
    (`cje_engine.pipeline.sharded.check_sharded_mode`): the flows' parameter check, before Prefect or Ray."""
    if requested not in ROW_PASSES:
        raise CJEInputError(f"row_pass must be one of {', '.join(ROW_PASSES)}, got {requested!r}", option="row_pass")
    if requested == "sharded":
        sharded.check_sharded_mode(mode)


#: ``row_pass="auto"``: the sharded path also from this many rows in the window (the files' Parquet footers), whatever
#: their bytes: the bytes a row vary with the columns and their compression (the simulator's logs without inline
#: labels are ~3 B a row: 512 MiB would be ~170M rows, far beyond the single driver's ~165 B a row).
SHARDED_MIN_ROWS = 45_000_000


def row_pass_for(requested: str, mode: str, files: Sequence[dict], rows: int | None = None) -> tuple[str, str]:
    """(path, reason): ``"single"`` or ``"sharded"`` for a run of ``mode`` over ``files`` (their ``size``) of
    ``rows`` rows (None: unknown; `window_footers`). ``auto`` takes the single path in a mode without a sharded one
    (logs-only, hybrid) and says why."""
    check_row_pass(requested, mode)
    size = sum(int(f.get("size") or 0) for f in files)
    if requested == "sharded":
        return "sharded", "requested (row_pass: sharded)"
    if requested == "single":
        return "single", "requested (row_pass: single)"
    if mode not in sharded.SHARDED_MODES:
        return "single", f"mode {mode!r} has no sharded row pass: {sharded.OFFPOLICY_UNSHARDED} (row_pass: auto)"
    if size >= SHARDED_MIN_BYTES:
        return "sharded", f"{size / 2**20:.0f} MiB of logs >= {SHARDED_MIN_BYTES / 2**20:.0f} MiB (row_pass: auto)"
    if rows is not None and rows >= SHARDED_MIN_ROWS:
        return "sharded", f"{rows:,} rows of logs >= {SHARDED_MIN_ROWS:,} (row_pass: auto)"
    return "single", f"{size / 2**20:.0f} MiB of logs < {SHARDED_MIN_BYTES / 2**20:.0f} MiB (row_pass: auto)"


def single_row_pass(reason: str) -> RowPass:
    """The result's ``inference.row_pass`` of a run on the single path (one process, per-prompt terms)."""
    from cje_engine.result.model import RowPass  # here: a read task imports this module for `FileRows`

    return RowPass(path="single", shards=1, influence="per_prompt", reason=reason)


class FileRows:
    """What a read task does to one file's rows before they are split (picklable: shipped to the workers):
    join the label store's labels (`flows.runtime.label_index.LabelIndex.join`: `flows.storage.labels.join_labels`'
    rows and counts, at a cost in proportion to the file), derive covariates
    (`flows.pipelines.preflight.derive_covariates`) and check the columns (``extra``: the segment columns),
    naming the file. The labels come with each call: the index a read task got by reference
    (`flows.runtime.sharded_ray.read_shards`' ``prepare_arg``)."""

    def __init__(self, covariates: Sequence[str], extra: Sequence[str] = ()) -> None:
        self.covariates = tuple(covariates)
        self.extra = tuple(extra)

    def read_columns(self, names: Sequence[str]) -> list[str] | None:
        """The columns of a log file of column ``names`` (canonical) that its rows need here: the base columns, its
        inline label columns, the covariates (a missing one's source column when it is derived,
        `flows.pipelines.preflight.derive_covariates`) and ``extra``; None when one of them is missing: every column
        is then read, as without this choice, so that the call names the missing one with every column found.
        What `flows.runtime.sharded_ray.split_file` reads of a file (with the shards' columns), not every column."""
        from flows.pipelines.preflight import DERIVED
        from flows.storage.labels import LABEL_COLUMNS

        have = set(names)
        out = [*BASE_COLUMNS, *(c for c in LABEL_COLUMNS if c in have)]
        for col in dict.fromkeys(list(BASE_COLUMNS) + list(self.covariates) + list(self.extra)):
            if col in have:
                out.append(col)
            elif col in self.covariates and DERIVED.get(col) in have:
                out.append(DERIVED[col])
            else:
                return None
        return list(dict.fromkeys(out))

    def __call__(self, table: pa.Table, source: str, labels: LabelIndex | None = None) -> tuple[pa.Table, dict]:
        """The file's rows ready for the shards, and its counts (rows, labels per policy, join counts);
        ``labels``: the label store's index (None: no label store)."""
        from flows.pipelines import preflight
        from flows.storage.labels import join_counts

        info: dict[str, Any] = {}
        if labels is not None:
            table = labels.join(table)
            info.update(join_counts(table))
            if "label_conflict" in table.column_names:
                table = table.drop_columns(["label_conflict"])
        table = preflight.derive_covariates(table, self.covariates, source)
        for col in dict.fromkeys(list(BASE_COLUMNS) + list(self.covariates) + list(self.extra)):
            if col not in table.column_names:
                found = [c for c in table.column_names if c != sharded_ray.FINGERPRINT]  # the reader's, not the logs'
                raise CJEInputError(f"column is missing from the logs (found: {', '.join(found)})",
                                    source=source, column=col)
        info["policies"] = policy_counts(table)
        return table, info


def policy_counts(table: pa.Table) -> dict:
    """``{policy: {"rows": non-null policies, "labelled": non-null oracle labels}}`` of a file's rows, in order of
    the policies' first row (`policy_counts_reference`'s group-by). A file of one policy (its policy column
    dictionary-encoded, as the readers read it, one value in every dictionary and no null: the simulator's and most
    logs' layout) is counted from its null counts, without a group-by (~0.008 s of CPU a 1M-row file); a policy
    column in chunks of differing dictionaries (a file of several row groups) is grouped on its unified dictionary
    (the group-by refuses differing dictionaries)."""
    lab = table[LABEL] if LABEL in table.column_names else None
    col = table[POLICY] if POLICY in table.column_names else None
    if table.num_rows and col is not None and pa.types.is_dictionary(col.type) and not col.null_count:
        chunks = [c for c in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]) if len(c)]
        if all(len(c.dictionary) == 1 and not c.dictionary.null_count for c in chunks):
            values = {c.dictionary[0].as_py() for c in chunks}
            if len(values) == 1:
                return {values.pop(): {"rows": int(table.num_rows),
                                       "labelled": int(len(lab) - lab.null_count) if lab is not None else 0}}
    return policy_counts_reference(table)


def policy_counts_reference(table: pa.Table) -> dict:
    """`policy_counts` by a group-by of the policy (`FileRows`' as first written, which refused a dictionary-encoded
    policy in chunks of differing dictionaries: those are grouped on their unified dictionary), in one thread: in
    order of the policies' first row (Arrow's threaded group-by of several chunks orders them as its threads
    finish: two calls on one table once gave ``b, a`` and ``a, b``)."""
    lab = table[LABEL] if LABEL in table.column_names else None
    sub = table.select([POLICY] + ([LABEL] if lab is not None else []))
    if pa.types.is_dictionary(sub.schema.field(POLICY).type):
        sub = sub.unify_dictionaries()
    g = sub.group_by(POLICY, use_threads=False).aggregate([(POLICY, "count")] + ([(LABEL, "count")] if lab else []))
    return {p: {"rows": int(r), "labelled": int(n)} for p, r, n in zip(
        g[POLICY].to_pylist(), g[f"{POLICY}_count"].to_pylist(),
        g[f"{LABEL}_count"].to_pylist() if lab else [0] * g.num_rows)}


def shard_columns(covariates: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The columns the shards keep (the rest of a file's row is dropped by its reader, before the shuffle): what
    the passes read (prompt, policy, score, label and its probability), the covariates and ``extra`` (the
    segment columns)."""
    return list(dict.fromkeys([PROMPT, POLICY, SCORE, LABEL, LABEL_PROB, *covariates, *extra]))


def merge_file_infos(infos: Sequence[dict]) -> dict:
    """The flow's counts (`flows.pipelines.evaluate.validate`'s shape) from every file's info."""
    per: dict[str, dict[str, int]] = {}
    for info in infos:
        for p, c in info.get("policies", {}).items():
            acc = per.setdefault(p, {"rows": 0, "labelled": 0})
            acc["rows"] += c["rows"]
            acc["labelled"] += c["labelled"]
    return {"n_rows": sum(c["rows"] for c in per.values()), "n_labelled": sum(c["labelled"] for c in per.values()),
            "policies": per}


#: Bytes of zstd Parquet a row assumed when a file's footer cannot be read (the simulator's schema with inline
#: labels: ~12 B; without them ~3 B, so the estimate errs towards fewer shards).
PARQUET_BYTES_PER_ROW = 12


def window_footers(logs_uri: str, cfg: Any, files: Sequence[dict], mapping: dict | None = None
                   ) -> tuple[int, list | None]:
    """(rows, footers) of the window: its rows and each file's `flows.storage.logs.Footer` (its rows and its
    prompt ids' bounds where its statistics say them; ``mapping``: the evaluation's ``columns:``), read once a run
    (`flows.storage.logs.parquet_footers`). The rows size the shards (`flows.runtime.sharded_ray.n_shards_for`)
    and the readers' memory; the bounds spare the readers' sample a read (`flows.runtime.sharded_ray.read_shards`).
    When a footer cannot be read: the rows from the files' bytes (`PARQUET_BYTES_PER_ROW`) and no footer. A size
    alone misjudged a window: 100M rows in 312 MB without inline labels (3.1 B a row) read as 26M rows, 8 shards
    of 12.5M rows instead of 26 of ~3.8M."""
    from flows.storage.logs import parquet_footers
    from flows.storage.objects import Storage

    footers = parquet_footers(Storage.for_uri(logs_uri, cfg), [f["key"] for f in files], column=PROMPT,
                              mapping=mapping)
    if footers is not None:
        return int(sum(f.rows for f in footers)), footers
    return int(sum(int(f.get("size") or 0) for f in files) / PARQUET_BYTES_PER_ROW), None


@sharded.heap_frozen  # the run's objects out of the collections: its finalize and bootstrap too
def compute_sharded(plan: Any, cfg: Any, files: list[dict], labels: Any, reason: str,
                    logger: Any = log, footers: tuple[int, list | None] | None = None) -> tuple[dict, dict, Any]:
    """The sharded path of a run: (counts, join counts, result). Shards are read, joined and reduced on Ray;
    the bootstrap's histograms too (`cje_engine.pipeline.sharded.ShardedPrepared.replicates`). ``footers``: the
    window's rows and footers when the caller has read them already (`window_footers`), else they are read here.
    ``labels``: None (no label store) or the store's `flows.runtime.label_index.PendingLabelIndex`, its build
    submitted to Ray and not awaited: the readers sample the prompt ids meanwhile, then every reader gets the
    index from the object store (this process never holds it). A failed build (a damaged label store) is raised
    as its own error (`CJEInputError` naming the object), whatever the readers' failure it caused."""
    opts = plan.opts
    cfg_dict = cfg.to_dict(include_secrets=True)
    keys = [f["key"] for f in files]
    rows_hint, footed = footers if footers is not None else window_footers(plan.logs_uri, cfg, files, plan.columns)
    n_shards = sharded_ray.n_shards_for(rows_hint, ray_fanout.cluster_cpus())
    t0 = time.perf_counter()
    try:
        refs, infos = sharded_ray.read_shards(plan.logs_uri, cfg_dict, keys, n_shards, columns=None,
                                              policies=plan.read_policies, mapping=plan.columns,
                                              prepare_rows=FileRows(plan.covariates, plan.extra_columns),
                                              rows_hint=rows_hint, with_info=True,
                                              keep=shard_columns(plan.covariates, plan.extra_columns),
                                              prepare_arg=None if labels is None else labels.ref,
                                              footers=footed)
    except BaseException:
        if labels is not None and labels.ref is not None:
            labels.info()  # the build's own error, if it failed (the readers' error is then its echo)
        raise
    log.info("%d file(s) read, joined and split into %d shard(s) in %.2f s", len(keys), n_shards,
             time.perf_counter() - t0)
    counts = merge_file_infos(infos)
    shipped = sum(int(i.get("piece_bytes", 0)) for i in infos)
    log.info("the shards' pieces in the object store: %.2f GB, %.1f B a row (packed: `sharded.pack_piece`)",
             shipped / 1e9, shipped / max(counts["n_rows"], 1))
    if counts["n_rows"] == 0:
        raise CJEInputError(f"no log rows in {len(files)} partition file(s) of {plan.logs_uri}", source=plan.logs_uri)
    if counts["n_labelled"] == 0:
        raise CJEInputError("no row of the window has an oracle label", source=plan.logs_uri, column="oracle_label")
    per_task = sharded_ray.task_memory(counts["n_rows"] // n_shards)
    # per pass where it differs from a shard task's: pass 2 in the Gram form also reduces the shard's labelled
    # prompts' basis rows (`sharded.LabelledBasis`), the bootstrap's weights (known after pass 1)
    memory: dict = {"shard_evaluation_terms": per_task + sharded.labelled_basis_task_bytes(
        -(-counts["n_labelled"] // n_shards))}
    mapper = sharded_ray.ray_mapper(memory=lambda name: memory.get(name, per_task))
    sp = sharded.prepare_sharded(refs, opts, mapper=mapper, reason=reason)
    memory.update(sharded_ray.bootstrap_task_memory(sp))
    logger.info("row pass: sharded (%s): %d rows in %d shard(s) read and reduced on Ray in %.2f s; the driver "
                "holds %d labelled rows", reason, counts["n_rows"], n_shards, time.perf_counter() - t0,
                sp.prep.design.data.n_rows)
    chunks = []
    if opts.inference == "bootstrap":
        sp.check_bootstrap_memory()
        B = int(opts.n_bootstrap)
        d = sp.prep.design
        step = sharded_ray.replicate_chunk(B, d.n_policies, d.cells.cells.size)
        t1 = time.perf_counter()
        chunks = [sp.replicates(a, min(a + step, B)) for a in range(0, B, step)]
        logger.info("%d replicates from the shards' histograms in %d chunk(s) in %.2f s", B, len(chunks),
                    time.perf_counter() - t1)
    join = {k: sum(int(i.get(k, 0)) for i in infos) for k in
            ("n_inline_labels", "n_inline_overridden", "n_conflicting_rows")}
    t2 = time.perf_counter()
    result = sp.finalize(chunks)
    log.info("finalized in %.2f s", time.perf_counter() - t2)
    return counts, join, result

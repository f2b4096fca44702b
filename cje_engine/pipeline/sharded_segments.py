"""Segments (``segment_by``) on the sharded row pass: the segment x policy cells reduced on the shards.

The segmented evaluation (`cje_engine.pipeline.segments`, docs/segments.md) evaluates every segment x policy
cell as a virtual policy of its own, with the run's calibration mode (or the segment as a covariate when the
omnibus test fails). Its statistics depend on the rows through the same things as the run's (per-(policy,
cell) counts, per-prompt evaluation terms, per-replicate histograms), now per virtual policy, so the sharded
path computes them the same way, on the shards:

1. `shard_segments` (one task per shard): the shard's segment names, rows per (segment, policy) and labels per
   segment, and its labelled rows' segments. `merge_segments` gives the window's sorted segment names (the
   single path's `segment_rows` codes), its counts and every labelled row's segment in the driver's order.
2. `segments.plan_from_counts`: the rule of `segments.plan_segments` (shown or pooled into ``other``) on those counts.
3. The cells: `prepare_sharded` again on the same shards, each row recoded on its worker
   (`SegmentRecode`: policy -> ``policy\\x1fgroup``, plus the segment one-hot covariates when recalibrating),
   with the run's mode fitted (no mode selection, no robust pooling: `segments.segment_prepared`'s fit), and
   its bootstrap replicates from the shards' histograms (bit-identical).
4. `segments.summarize_segments` with that plan and that cell pass: the block is the single path's.

The segment is a per-row column, as on the single path: a prompt's rows may lie in different segments (its
rows are in one shard whatever their segments; the prompt stays the cluster of every cell).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.data.frame import LABEL, POLICY
from cje_engine.errors import CJEInputError
from cje_engine.pipeline.calibration import fit_mode
from cje_engine.pipeline.segments import (SegmentRows, plan_from_counts, recalibration_mode, segment_rows,
                                         summarize_segments)

log = logging.getLogger(__name__)

#: Separator of a virtual (policy, segment group) policy's name (`segments.virtual_data`'s).
VIRTUAL = "\x1f"
#: ``Mapper(fn, items)``: `cje_engine.pipeline.sharded.Mapper` (runs ``fn(*item)`` per item, yields (index, result)).
Mapper = Callable[[Callable, Sequence[tuple]], Any]
#: Largest block of histograms (replicates x cells x 8 bytes) the segment cells' bootstrap asks at a time.
HISTOGRAM_BLOCK_BYTES = 64 * 2**20


@dataclass
class ShardSegments:
    """Pass 1 of the segments on one shard (`shard_segments`): counts, never rows."""

    names: tuple  # sorted distinct segment names of the shard's evaluated rows
    policies: tuple  # sorted distinct policy names
    rows: np.ndarray  # (len(names), len(policies)) rows per (segment, policy)
    labels: np.ndarray  # (len(names),) labelled rows per segment
    lab_row: np.ndarray  # window row (`cje_engine.pipeline.sharded.ROW`) of each labelled row
    lab_segment: np.ndarray  # its segment (index into ``names``)


def _evaluated(table: pa.Table, policies: Sequence[str] | None) -> pa.Table:
    """The rows of the evaluated policies (every row when ``policies`` is None), as `sharded.shard_rows` keeps them."""
    if policies is None:
        return table
    return table.filter(pc.is_in(table[POLICY], value_set=pa.array(list(policies), pa.string())))


def _policy_text(table: pa.Table) -> pa.ChunkedArray:
    """The policy column as strings (the readers ship it dictionary-encoded; pandas would sort a categorical by
    its dictionary's order, not by the names)."""
    col = table[POLICY]
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def _labelled(table: pa.Table) -> np.ndarray:
    """Rows with an oracle label (`sharded.shard_rows`' conversion: NaN or null is unlabelled)."""
    if LABEL not in table.column_names:
        return np.zeros(table.num_rows, dtype=bool)
    return ~np.isnan(np.asarray(table[LABEL].to_numpy(zero_copy_only=False), dtype=float))


def _segments_of(table: pa.Table, columns: Sequence[str]) -> SegmentRows:
    """`segments.segment_rows` of a shard's rows (the single path's text of each row's segment)."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise CJEInputError(f"segment_by column {missing[0]!r} is not a column of the input "
                            f"(columns: {', '.join(table.column_names)})", column=missing[0], option="segment_by")
    return segment_rows(table.select(list(columns)).to_pandas(), columns)


def shard_segments(table: pa.Table, columns: Sequence[str], policies: Sequence[str] | None, row_column: str
                   ) -> ShardSegments:
    """Pass 1 on one shard: its segments' names, rows per (segment, policy), labels per segment and the segment
    of each labelled row (with its window row, column ``row_column``: `cje_engine.pipeline.sharded.ROW`)."""
    table = _evaluated(table, policies)
    seg = _segments_of(table, columns)
    pol, pol_names = pd.factorize(_policy_text(table).to_pandas(), sort=True)
    S, P = len(seg.names), len(pol_names)
    lab = _labelled(table)
    rows = np.bincount(seg.code * P + pol, minlength=S * P).reshape(S, P)
    row = np.asarray(table[row_column].to_numpy(), dtype=np.int64)
    return ShardSegments(names=seg.names, policies=tuple(str(p) for p in pol_names), rows=rows,
                         labels=np.bincount(seg.code[lab], minlength=S), lab_row=row[lab],
                         lab_segment=seg.code[lab])


@dataclass
class SegmentCounts:
    """The window's segments (`merge_segments`): what the driver holds of them (O(segments x policies + labels))."""

    columns: tuple
    names: tuple  # sorted segment names (`segments.segment_rows`' codes)
    rows: np.ndarray  # (segments, K) rows per (segment, evaluated policy)
    labels: np.ndarray  # (segments,) labels per segment
    lab_segment: np.ndarray  # segment of each labelled row, in the order of the run's labelled rows (its EvalData)


def merge_segments(parts: Sequence[ShardSegments], columns: Sequence[str], policies: Sequence[str]) -> SegmentCounts:
    """The window's segment counts from every shard's (integer sums: exact in any order); ``policies``: the run's
    evaluated policies in its order."""
    names = tuple(sorted({n for p in parts for n in p.names}))  # code point order, as pandas.factorize(sort=True)
    look = {n: i for i, n in enumerate(names)}
    pol_look = {p: i for i, p in enumerate(policies)}
    K = len(policies)
    rows = np.zeros((len(names), K), dtype=np.int64)
    labels = np.zeros(len(names), dtype=np.int64)
    lab_row, lab_seg = [], []
    for p in parts:
        s_map = np.array([look[n] for n in p.names], dtype=np.int64)
        k_map = np.array([pol_look.get(q, -1) for q in p.policies], dtype=np.int64)
        ok = k_map >= 0
        np.add.at(rows, (s_map[:, None], k_map[None, ok]), p.rows[:, ok])
        np.add.at(labels, s_map, p.labels)
        lab_row.append(p.lab_row)
        lab_seg.append(s_map[p.lab_segment])
    rows_all = np.concatenate(lab_row) if lab_row else np.empty(0, np.int64)
    seg_all = np.concatenate(lab_seg) if lab_seg else np.empty(0, np.int64)
    order = np.argsort(rows_all, kind="stable")  # the run's labelled rows are in window order
    return SegmentCounts(tuple(columns), names, rows, labels, seg_all[order])


def count_segments(sp: Any, row_column: str) -> SegmentCounts:
    """Pass 1 of the segments over the shards of ``sp`` (a `cje_engine.pipeline.sharded.ShardedPrepared`), merged;
    checked against the run's labelled rows. ``row_column``: the shards' window-row column."""
    opts = sp.options
    d = sp.prep.design.data
    columns = tuple(opts.segment_by)
    parts: list = [None] * len(sp.shards)
    for i, res in sp.mapper(shard_segments, [(t, columns, opts.policies, row_column) for t in sp.shards]):
        parts[i] = res
    counts = merge_segments(parts, columns, d.policies)
    if counts.lab_segment.size != d.n_rows:
        raise ValueError(f"segments: {counts.lab_segment.size} labelled rows counted on the shards, "
                         f"{d.n_rows} on the driver")
    return counts


@dataclass(frozen=True)
class SegmentRecode:
    """What a worker does to a shard's rows before a pass of the segment cells (picklable): each evaluated
    row's policy becomes its cell's virtual policy ``policy\\x1fgroup`` (`segments.virtual_data`'s names), the
    rows of other policies a name no cell has; with ``onehot`` the segment one-hot covariates are appended
    (groups 1..G-1, `segments.segment_prepared`'s recalibration covariates)."""

    columns: tuple
    groups: dict  # segment name -> shown group
    policies: tuple  # evaluated policies, the run's order
    n_groups: int
    onehot: tuple = ()  # covariate names of groups 1..G-1, or () without recalibration

    def __call__(self, table: pa.Table) -> pa.Table:
        """The shard's table recoded (row order and every other column kept)."""
        seg = _segments_of(table, self.columns)
        g = np.array([self.groups.get(n, -1) for n in seg.names], dtype=np.int64)[seg.code] if seg.names \
            else np.empty(0, np.int64)
        pol, pol_names = pd.factorize(_policy_text(table).to_pandas(), sort=True)
        look = {p: i for i, p in enumerate(self.policies)}
        k = np.array([look.get(str(p), -1) for p in pol_names], dtype=np.int64)[pol] if len(pol_names) \
            else np.empty(0, np.int64)
        G = self.n_groups
        ok = (k >= 0) & (g >= 0)
        vocab = [f"{p}{VIRTUAL}{j}" for p in self.policies for j in range(G)] + [VIRTUAL]
        idx = np.where(ok, k * G + g, len(vocab) - 1)
        new = pa.array(vocab, pa.string()).take(pa.array(idx))
        table = table.set_column(table.column_names.index(POLICY), POLICY, new)
        for j, name in enumerate(self.onehot, start=1):
            if name in table.column_names:
                raise CJEInputError(f"the logs have a column {name!r}, the name of a segment covariate of the "
                                    "recalibration by segment; rename it", column=name, option="segment_by")
            table = table.append_column(name, pa.array((g == j).astype(float)))
        return table


def recoding_mapper(mapper: Mapper, recode: Callable[[pa.Table], pa.Table]) -> Mapper:
    """``mapper`` whose tasks first recode their shard (``recode(table)``) on the worker: the shard stays where
    it is (a Ray reference is still a top-level argument) and the pass's name is kept."""

    def mapped(fn: Callable, items: Sequence[tuple]):
        def call(recoder, table, *rest):
            # pass 1's kept codes (`sharded.ShardKept`) are of the recoded shard already
            return fn(recoder(table) if isinstance(table, pa.Table) else table, *rest)

        call.__name__ = call.__qualname__ = fn.__name__
        if getattr(fn, "kept_field", None):
            call.kept_field = fn.kept_field
        return mapper(call, [(recode, *item) for item in items])

    if getattr(mapper, "put", None) is not None:
        mapped.put = mapper.put
    return mapped


def _recalibration(prep: Any, group_names: list[str], recalibrate: bool) -> tuple[str, tuple, dict]:
    """(mode, segment covariate names, the result's ``recalibration`` block): `segments.segment_prepared`'s."""
    d = prep.design.data
    G = len(group_names)
    mode = prep.design.mode
    recal = {"applied": False, "reason": "the omnibus calibration test over all labels did not fail",
             "mode": mode, "covariates": list(d.covariate_names)}
    if not recalibrate:
        return mode, (), recal
    new_mode, why = recalibration_mode(int(prep.design.cal_rows.size), d.X.shape[1] + G - 1)
    if new_mode is None or G < 2:
        recal["reason"] = ("the omnibus calibration test failed but the segment cannot be a covariate: "
                           + (why or "a single segment"))
        return mode, (), recal
    extra = tuple(f"segment={n}" for n in group_names[1:])
    return new_mode, extra, {"applied": True, "reason": "the omnibus calibration test over all labels failed: the "
                                                        "segment levels use a calibration with the segment as a "
                                                        "covariate", "mode": new_mode,
                             "covariates": list(d.covariate_names) + list(extra)}


def _sources(prep: Any, names: Sequence[str], cells: np.ndarray) -> tuple[str, ...] | None:
    """The run's calibration sources as virtual policies (None: every labelled row), as the single path."""
    opts = prep.options
    excluded = {e["policy"] for e in prep.excluded}
    if opts.calibration_policies is None and not excluded:
        return None
    base = prep.design.data.policies
    allowed = set(opts.calibration_policies or base) - excluded
    return tuple(n for n, (k, _) in zip(names, cells) if base[k] in allowed)


class ShardedCellPass:
    """`segments.summarize_segments`' cell pass on the shards: the segment x policy cells prepared by ``prepare``
    (`cje_engine.pipeline.sharded.prepare_sharded`) on the recoded shards of ``sp`` and their bootstrap replicates
    from the shards' histograms."""

    def __init__(self, sp: Any, counts: SegmentCounts, remap: np.ndarray, prepare: Callable) -> None:
        self.sp, self.counts, self.remap, self.prepare = sp, counts, remap, prepare

    def __call__(self, prep: Any, group: np.ndarray, group_names: list[str], recalibrate: bool
                 ) -> tuple[Any, np.ndarray, dict, np.ndarray | None]:
        """(the cells' prepared state, cells' (policy, group), recalibration block, replicates or None)."""
        sp, opts, d = self.sp, prep.options, prep.design.data
        G, K = len(group_names), len(d.policies)
        mode, extra, recal = _recalibration(prep, group_names, recalibrate)
        by_group = np.zeros((G, K), dtype=np.int64)
        np.add.at(by_group, self.remap, self.counts.rows)
        k, g = np.nonzero(by_group.T > 0)  # (policy, group) in policy * G + group order, as `virtual_data`
        cells = np.stack([k, g], axis=1).astype(np.int64)
        names = tuple(f"{d.policies[a]}{VIRTUAL}{b}" for a, b in cells)
        sources = _sources(prep, names, cells)
        trust = opts.trust_transport
        if trust and "*" not in trust:
            trust = tuple(n for n in names if n.split(VIRTUAL)[0] in trust)
        vopts = dataclasses.replace(opts, policies=names, baseline=None, trust_transport=trust, segment_by=(),
                                    calibration_policies=sources, covariates=tuple(d.covariate_names) + extra,
                                    pooling_bootstrap="fixed")
        recode = SegmentRecode(self.counts.columns, {n: int(self.remap[i]) for i, n in enumerate(self.counts.names)},
                               tuple(d.policies), G, extra)

        def fit_cells(data, o, rows):  # the run's mode on the run's sources: `segment_prepared`'s fit
            return fit_mode(data, mode, sources, rows[mode]), prep.selection, []

        vsp = self.prepare(sp.shards, vopts, mapper=recoding_mapper(sp.mapper, recode), fit=fit_cells,
                              keep_terms=None if sp.influence == "per_prompt" else False, reason=sp.reason)
        reps = None
        if opts.inference == "bootstrap":
            B = int(opts.n_bootstrap)
            cells_G = vsp.prep.design.cells.cells.size
            step = max(1, min(B, HISTOGRAM_BLOCK_BYTES // max(1, 8 * len(names) * cells_G)))
            reps = np.vstack([vsp.replicates(a, min(a + step, B)) for a in range(0, B, step)])
        log.info("segments: %d cells of %d segment group(s) x %d policies prepared on %d shard(s)%s", len(names), G,
                 K, len(sp.shards), f", {opts.n_bootstrap} replicates" if reps is not None else "")
        return vsp.prep, cells, recal, reps


def summarize_sharded_segments(sp: Any, result: Any, prepare: Callable) -> None:
    """Put the ``segments`` block of ``sp``'s run (a `cje_engine.pipeline.sharded.ShardedPrepared`) into ``result``
    (the single path's block: the same plan, cells, claims and numbers); ``prepare``: `prepare_sharded`."""
    from cje_engine.result.segments import SegmentsResult

    opts, counts = sp.options, sp.segments
    remap, group_names, info = plan_from_counts(counts.rows, counts.labels, counts.names, opts.segment_min_rows,
                                                opts.segment_min_labels)
    rows = SegmentRows(counts.columns, counts.names, counts.lab_segment)
    block = summarize_segments(sp.prep, rows, plan=(remap[counts.lab_segment], group_names, info),
                               cell_pass=ShardedCellPass(sp, counts, remap, prepare))
    result.model.segments = SegmentsResult.model_validate(block)

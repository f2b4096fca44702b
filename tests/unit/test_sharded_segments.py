"""Segments and the verified claims on the sharded row pass (`cje_engine.pipeline.sharded_segments`).

The segmented result of the sharded path is the single-process one (every number to 1e-12 relative, every claim
and string equal) under 1, 3 and 17 shards, per-prompt terms or the Gram form; the segment cells' bootstrap
replicates are bit-identical in any order of arrival. The segment is a per-row column: here ``band`` differs
between the rows of one prompt. Policies without own labels (``clone``) or with few (``concise``) keep the
single path's verified claims: level claims, assumed levels, labels to verify, baseline comparisons, best policy.
"""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import direct, segments, sharded, sharded_segments
from cje_engine.simulate import simulate

from tests.unit.test_sharded import assert_same_result


@pytest.fixture(scope="module")
def table() -> pa.Table:
    """600 prompts x 5 policies; ``clone`` has no own label, ``concise`` a few; ``band`` is per row (a prompt's
    rows lie in both bands), ``topic`` per prompt with a rare value and missing values."""
    f = simulate(600, seed=4, oracle_fraction=0.2).frame
    pol = f["policy"].to_numpy()
    lab = f["oracle_label"].to_numpy().copy()
    lab[pol == "clone"] = np.nan
    lab[(pol == "concise") & (np.arange(len(f)) % 8 > 0)] = np.nan
    f["oracle_label"] = lab
    f["band"] = np.where(f["response_length"].to_numpy() > np.median(f["response_length"]), "long", "short")
    code = f["prompt_id"].astype("category").cat.codes.to_numpy()
    f["topic"] = np.array(["a", "b", "c", "rare", None], dtype=object)[np.where(code % 50 == 0, 3, code % 3)]
    f.loc[code % 23 == 0, "topic"] = None
    return pa.Table.from_pandas(f, preserve_index=False)


def _single(table: pa.Table, opts: EvaluationOptions, B: int = 0) -> tuple[dict, list]:
    prep = direct.prepare(table, opts)
    chunks = [direct.bootstrap_chunk(prep, 0, B)] if B else []
    return direct.finalize(prep, chunks).to_dict(), chunks


def test_the_segment_spans_the_rows_of_a_prompt(table):
    f = table.select(["prompt_id", "band"]).to_pandas()
    assert (f.groupby("prompt_id")["band"].nunique() > 1).mean() > 0.5


@pytest.mark.parametrize("n_shards,budget", [(1, None), (3, 1000), (17, None)], ids=["1", "3-gram", "17"])
def test_shard_counts_give_the_single_path_segments(table, n_shards, budget):
    opts = EvaluationOptions.of(None, seed=3, inference="analytic", baseline="base", segment_by=("topic", "band"),
                                segment_min_rows=20, segment_min_labels=5)
    single, _ = _single(table, opts)
    seg = single["segments"]
    status = {s["name"]: s["status"] for s in seg["segments"]}
    assert status["rare / long"] == status["(missing) / short"] == "pooled" and status["a / long"] == "shown"
    assert seg["recalibration"]["applied"] is True  # the segment-as-covariate fit on the shards too
    kinds = {c["claim_kind"] for c in seg["cells"]}
    assert {"verified", "assumes_transport"} <= kinds  # clone has no own label
    sp = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts, terms_budget=budget)
    assert sp.segments is not None and sp.segments.names == tuple(s["name"] for s in seg["segments"][:-1])
    assert_same_result(single, sp.finalize([]).to_dict(), influence="gram" if budget else "per_prompt")


def test_segment_replicates_are_bit_identical_in_any_order_of_arrival(table):
    opts = EvaluationOptions.of(None, seed=5, inference="bootstrap", n_bootstrap=60, segment_by=("band",),
                                segment_min_labels=5, segment_recalibrate="never")
    prep = direct.prepare(table, opts)
    chunks = [direct.bootstrap_chunk(prep, 0, 60)]
    single = direct.finalize(prep, chunks).to_dict()
    group, names, _ = segments.plan_segments(prep.design.data.policy, prep.segments.code, prep.design.data.labelled,
                                             len(prep.design.data.policies), prep.segments.names, 50, 5)
    _, cells, _, expected = segments.segment_cells(prep, group, names, False)

    def shuffled(fn, items):
        out = [(i, fn(*item)) for i, item in enumerate(items)]
        random.Random(11).shuffle(out)
        return out

    sp = sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts, mapper=shuffled, terms_budget=1000)
    counts = sp.segments
    remap, names2, _ = sharded_segments.plan_from_counts(counts.rows, counts.labels, counts.names, 50, 5)
    cell_pass = sharded_segments.ShardedCellPass(sp, counts, remap, sharded.prepare_sharded)
    _, cells2, _, got = cell_pass(sp.prep, remap[counts.lab_segment], names2, False)
    assert names2 == names and np.array_equal(cells2, cells)
    assert np.array_equal(got, expected, equal_nan=True)
    assert_same_result(single, sp.finalize(chunks).to_dict(), influence="gram")


def _words(x):
    """``x`` without its floats (the numbers are `assert_same_result`'s, to 1e-12): the claims' words and counts."""
    if isinstance(x, dict):
        return {k: _words(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_words(v) for v in x]
    return "<float>" if isinstance(x, float) else x


def _claims(res: dict) -> dict:
    """The verified claims of a result: per policy and per segment cell, comparisons, ranking, best policy."""
    keys = ("level_claim", "basis_code", "relative_claim", "relative_reason", "assumed", "labels_to_verify",
            "refusal_reasons", "estimate")
    seg = res.get("segments") or {}
    return _words({"policies": {n: {k: p.get(k) for k in keys} for n, p in res["policies"].items()},
            **{k: res.get(k) for k in ("comparisons", "baseline_comparisons", "ranking", "best_policy",
                                       "best_policy_reason", "assumes_transport")},
            "cells": [(c["segment"], c["policy"], c["claim_kind"], c["reason"]) for c in seg.get("cells", [])],
            "segment_comparisons": [(c["segment"], c["policy"], c["claim_kind"], c["significant"])
                                    for c in seg.get("comparisons", [])]})


@pytest.mark.parametrize("n_shards,budget", [(1, 1000), (3, None), (17, 1000)], ids=["1-gram", "3", "17-gram"])
@pytest.mark.parametrize("kw", [dict(baseline="base"),
                                dict(policies=("concise", "unhelpful", "clone"), trust_transport=("clone",),
                                     baseline="unhelpful")], ids=["all", "trusted"])
def test_the_verified_claims_are_the_single_paths(table, n_shards, budget, kw):
    opts = EvaluationOptions.of(None, seed=3, inference="analytic", segment_by=("band",), segment_min_labels=5,
                                segment_min_rows=20, **kw)
    single, _ = _single(table, opts)
    pols = single["policies"]
    assert pols["clone"]["n_labelled"] == 0 and pols["clone"]["labels_to_verify"]["n_labels"] > 0
    if "trust_transport" in kw:
        assert single["best_policy"] == "concise" and pols["clone"]["level_claim"] != "ok"
    else:
        assert single["best_policy"] is None and "clone" in single["best_policy_reason"]
        assert pols["unhelpful"]["level_claim"] == "ok" and pols["clone"]["level_claim"] == "assumes_transport"
    got = sharded.prepare_sharded(sharded.split_by_shard(table, n_shards), opts, terms_budget=budget).finalize([])
    got = got.to_dict()
    assert _claims(got) == _claims(single)
    assert_same_result(single, got, influence="gram" if budget else "per_prompt")


def test_plan_from_counts_is_plan_segments():
    rng = np.random.default_rng(2)
    n, K, S = 3000, 3, 7
    policy, code = rng.integers(0, K, n), rng.choice(S, n, p=[.3, .2, .2, .15, .1, .04, .01])
    labelled = rng.random(n) < 0.1
    names = tuple("abcdefg")
    for min_rows, min_labels in ((50, 20), (10, 0), (400, 5), (2, 400)):
        group, gn, info = segments.plan_segments(policy, code, labelled, K, names, min_rows, min_labels)
        rows = np.bincount(code * K + policy, minlength=S * K).reshape(S, K)
        remap, gn2, info2 = sharded_segments.plan_from_counts(rows, np.bincount(code[labelled], minlength=S), names,
                                                              min_rows, min_labels)
        assert gn2 == gn and info2 == info and np.array_equal(remap[code], group)


def test_a_missing_segment_column_on_a_shard_is_a_clear_input_error(table):
    opts = EvaluationOptions.of(None, inference="analytic", segment_by=("topik",))
    with pytest.raises(CJEInputError, match="segment_by column 'topik' is not a column"):
        sharded.prepare_sharded(sharded.split_by_shard(table, 3), opts)


def test_empty_shards_and_a_nullable_integer_segment_change_nothing():
    """More shards than prompts need (a small window on a large cluster, `row_pass: sharded` forced): empty shards
    are reduced to nothing (they crashed the run's first pass before); a segment column of nullable integers
    reads as on the single path (``(missing)``, ``0``, ...); the evaluated policies are a subset."""
    f = simulate(120, seed=1, oracle_fraction=0.3).frame
    f["band"] = np.where(f["response_length"] > f["response_length"].median(), "long", None)
    f["n"] = (f["response_length"] % 3).astype("Int64")
    f.loc[::7, "n"] = None
    t = pa.Table.from_pandas(f, preserve_index=False)
    opts = EvaluationOptions.of(None, seed=3, inference="bootstrap", n_bootstrap=50, segment_by=("band", "n"),
                                segment_min_labels=3, segment_min_rows=5, policies=("base", "verbose"))
    single, chunks = _single(t, opts, 50)
    assert {"(missing) / (missing)", "long / 0"} <= {s["name"] for s in single["segments"]["segments"]}
    parts = sharded.split_by_shard(t, 60)
    assert sum(p.num_rows == 0 for p in parts) >= 3
    sp = sharded.prepare_sharded(parts, opts)
    got = sp.replicates(0, 50)
    assert np.array_equal(got, chunks[0], equal_nan=True)
    assert_same_result(single, sp.finalize([got]).to_dict())

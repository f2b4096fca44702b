"""The sharded readers' label join (`flows.runtime.label_index`) against `flows.storage.labels.join_labels`.

The index is built once a run and probed by each file's ids; its join must give `join_labels`' table exactly
(rows in order, labels, probabilities, ``label_conflict``, the join counts in the schema metadata) on stores
with versions, conflicts, exact repeats, missing probabilities, NFD ids, inline labels and ids absent on either
side, and on ids whose fingerprints collide (a few to a fingerprint, and past `MAX_SHARED`).
"""
from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.errors import CJEInputError
from flows.pipelines.sharded_pass import FileRows
from flows.runtime import label_index
from flows.runtime.label_index import BUILD_KEYS, LabelIndex, build_label_index
from flows.runtime.sharded_ray import id_fingerprint
from flows.storage.labels import LabelStore, join_counts, join_labels
from flows.storage.objects import Storage


def _labels(ids, values, probs=None) -> pa.Table:
    cols = {"response_id": pa.array(ids, pa.string()), "oracle_label": pa.array(values, pa.float64())}
    if probs is not None:
        cols["label_probability"] = pa.array(probs, pa.float64())
    return pa.table(cols)


def _collide(middle: str) -> str:
    """A 30-byte id whose fingerprint does not depend on ``middle`` (bytes 8-10 are outside the windows read)."""
    return "AAAAAAAA" + middle + "MMMMMMMM" + "qqq" + "ZZZZZZZZ"


def _assert_same_join(logs: pa.Table, store: pa.Table) -> pa.Table:
    want = join_labels(logs, store)
    got = LabelIndex.build(store).join(logs)
    assert got.schema == want.schema and got.schema.metadata == want.schema.metadata
    assert got.equals(want), (got.to_pydict(), want.to_pydict())
    return got


def _store(tmp_path, rng: np.random.Generator, n_ids: int) -> tuple[LabelStore, list[str]]:
    """Three versions: fresh labels, repeats of some (exact, so kept once) and conflicts (flagged), with and
    without probabilities, some ids with an accent (stored in NFC)."""
    ids = [f"r{i}" if i % 7 else f"caf\u00e9-{i}" for i in range(n_ids)]
    ls = LabelStore(Storage.for_uri(str(tmp_path / "labels")))
    first = rng.choice(n_ids, size=n_ids // 2, replace=False)
    prob = np.where(rng.random(first.size) < 0.3, np.nan, rng.uniform(0.1, 1, first.size))
    v1 = pa.table({"response_id": pa.array([ids[i] for i in first], pa.string()),
                   "oracle_label": rng.integers(0, 2, first.size).astype(float),
                   "label_probability": pa.array(prob, from_pandas=True)})  # nulls: no probability
    ls.append(v1, "v1")
    again = first[: first.size // 4]  # the same labels again (kept once) plus conflicting ones
    v2 = v1.take(pa.array(np.arange(again.size)))
    conflicts = _labels([ids[i] for i in first[-20:]], [0.5] * 20, [0.9] * 20)
    ls.append(pa.concat_tables([v2, conflicts]), "v2")
    rest = rng.choice(np.setdiff1d(np.arange(n_ids), first), size=n_ids // 5, replace=False)
    ls.append(_labels([unicodedata.normalize("NFD", ids[i]) for i in rest], rng.uniform(0, 1, rest.size)), "v3")
    return ls, ids


@pytest.mark.parametrize("inline", ["none", "label", "label_and_probability"])
def test_the_index_joins_as_join_labels_does(tmp_path, inline):
    rng = np.random.default_rng(29)
    ls, ids = _store(tmp_path, rng, 600)
    store = ls.read()
    assert store["flagged"].to_numpy().sum() >= 20 and ls.version() == 3
    # logs: most stored ids (some in NFD), ids the store lacks, shuffled
    rows = list(rng.permutation(len(ids))[:500]) + list(range(len(ids), len(ids) + 100))
    log_ids = [(unicodedata.normalize("NFD", ids[i]) if i < len(ids) and i % 3 == 0 else ids[i])
               if i < len(ids) else f"absent-{i}" for i in rows]
    cols = {"response_id": log_ids, "judge_score": rng.random(len(rows))}
    if inline != "none":  # inline labels on a third of the rows: some agree with the store, some differ
        lab = np.where(rng.random(len(rows)) < 0.33, rng.integers(0, 2, len(rows)).astype(float), np.nan)
        cols["oracle_label"] = pa.array(lab, from_pandas=True)
        if inline == "label_and_probability":
            cols["label_probability"] = pa.array(np.where(np.isnan(lab), np.nan, 0.5), from_pandas=True)
    logs = pa.table(cols)
    got = _assert_same_join(logs, store)
    counts = join_counts(got)
    assert counts["n_store_labels"] > 100 and counts["n_conflicting_rows"] > 0
    if inline != "none":
        assert counts["n_inline_labels"] > 0 and counts["n_inline_overridden"] > 0
    _assert_same_join(logs.slice(0, 0), store)  # an empty file
    _assert_same_join(pa.concat_tables([logs.slice(0, 100), logs.slice(100)]), store)  # columns in two chunks
    _assert_same_join(logs, store.slice(0, 0))  # an empty label table
    _assert_same_join(logs, store.drop_columns(["flagged"]))  # a table without `flagged`: conflicts found here
    _assert_same_join(pa.table({"response_id": pa.array([None, "r1"], pa.string()), "x": [1, 2]}), store)


def test_ids_sharing_a_fingerprint_are_told_apart_by_their_strings():
    few = [_collide(f"{i:03d}") for i in range(5)]  # 5 stored ids to one fingerprint
    assert len(set(id_fingerprint(pa.array(few)).tolist())) == 1
    store = _labels(few + ["plain"], [0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [0.2, 0.4, 0.6, 0.8, 1.0, None])
    index = LabelIndex.build(store)
    assert index.fp is not None and index.shared == 5
    logs = pa.table({"response_id": [few[4], _collide("999"), few[0], "plain", few[2], "nope"]})
    got = _assert_same_join(logs, store)
    assert got["oracle_label"].to_pylist() == [0.0, None, 0.0, 1.0, 0.0, None]
    assert got["label_probability"].to_pylist() == [1.0, None, 0.2, 1.0, 0.6, None]
    many = [_collide(f"{i:03d}") for i in range(label_index.MAX_SHARED + 1)]  # past MAX_SHARED: exact hash
    store = _labels(many, np.arange(len(many)) % 2, [1.0] * len(many))
    assert LabelIndex.build(store).fp is None
    _assert_same_join(pa.table({"response_id": many[::-1] + ["x"]}), store)


def test_two_spellings_of_one_stored_id_join_its_first_label():
    """A label table written before ids were normalised (not through `LabelStore.append`): the NFD and NFC
    spellings of one id are two groups; `join_labels` (``index_in``) uses the first, and so does the index."""
    nfc = "caf\u00e9"
    nfd = unicodedata.normalize("NFD", nfc)
    store = _labels([nfd, "b", nfc, "b"], [1.0, 0.0, 0.0, 1.0], [0.5, None, 0.25, None])
    logs = pa.table({"response_id": [nfc, nfd, "b", "c"]})
    got = _assert_same_join(logs, store)
    assert got["oracle_label"].to_pylist() == [1.0, 1.0, 0.0, None]
    assert got["label_conflict"].to_pylist() == [False, False, True, False]


def test_the_join_errors_are_join_labels_errors():
    store = _labels(["a"], [1.0], [1.0])
    for logs, labels in ((pa.table({"x": [1]}), store), (pa.table({"response_id": ["a"]}), store.drop_columns(
            ["label_probability"]))):
        with pytest.raises(CJEInputError) as want:
            join_labels(logs, labels)
        with pytest.raises(CJEInputError) as got:
            LabelIndex.build(labels).join(logs)
        assert (str(got.value), got.value.column) == (str(want.value), want.value.column)


def test_file_rows_join_with_the_index_it_is_handed(tmp_path):
    rng = np.random.default_rng(3)
    ls, ids = _store(tmp_path, rng, 200)
    store = ls.read()
    logs = pa.table({"prompt_id": [f"p{i}" for i in range(150)], "policy": ["a", "b"] * 75,
                     "judge_score": rng.random(150), "response_id": ids[:150]})
    by_arg = FileRows([])(logs, "file-0", LabelIndex.build(store))
    want = join_labels(logs, store)
    assert by_arg[0].equals(want.drop_columns(["label_conflict"]).replace_schema_metadata(by_arg[0].schema.metadata))
    assert {k: by_arg[1][k] for k in join_counts(want)} == join_counts(want)
    assert sum(p["labelled"] for p in by_arg[1]["policies"].values()) == 150 - want["oracle_label"].null_count


def test_the_index_is_built_from_the_store_with_its_lineage_and_its_errors(tmp_path):
    rng = np.random.default_rng(5)
    cfg = {}
    empty, info = build_label_index(str(tmp_path / "nothing"), cfg)
    assert empty is None and {k: v for k, v in info.items() if k not in BUILD_KEYS} == {
        "labels_uri": str(tmp_path / "nothing"), "label_store_version": 0, "n_label_rows": 0, "n_flagged": 0}
    assert set(info) - {"labels_uri", "label_store_version", "n_label_rows", "n_flagged"} == set(BUILD_KEYS)
    ls, ids = _store(tmp_path, rng, 100)
    index, info = build_label_index(str(tmp_path / "labels"), cfg)
    store = ls.read()
    assert (info["label_store_version"], info["n_label_rows"], info["n_flagged"]) == (
        3, store.num_rows, int(store["flagged"].to_numpy().sum()))
    logs = pa.table({"response_id": ids})
    assert index.join(logs).equals(join_labels(logs, store))
    # a damaged object: the store's own error, naming the object, nothing indexed
    obj = ls.history()[1]["object"]
    path = tmp_path / "labels" / obj
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CJEInputError, match="checksum mismatch") as err:
        build_label_index(str(tmp_path / "labels"), cfg)
    assert obj in str(err.value.source)


def test_the_build_retries_a_storage_failure_never_bad_data_and_its_memory_follows_the_committed_rows(
        tmp_path, monkeypatch):
    """The build runs in a Ray task, concurrently with the readers' sampling (no Prefect task around it retries it):
    a storage failure is retried after each of the run's delays, bad data (`CJEInputError`) is raised at once; the
    task's memory request is derived from the store's committed rows, read from its commit records alone."""
    from flows.storage.objects import StorageError

    rng = np.random.default_rng(11)
    ls, _ = _store(tmp_path, rng, 100)
    want_rows = sum(r["rows"] for r in ls.history())
    assert ls.committed_rows() == (3, want_rows)
    assert LabelStore(Storage.for_uri(str(tmp_path / "empty"))).committed_rows() == (0, 0)
    assert label_index.index_task_memory(want_rows) == 64 * 2**20 + label_index.INDEX_BYTES_PER_LABEL * want_rows

    calls = []
    real = LabelStore.current_sorted  # what the build reads the store with (`current` and the sorted fingerprints)

    def flaky(self, uri, **kw):
        calls.append(uri)
        if len(calls) == 1:
            raise StorageError("simulated 503 on the first read", key="labels/_commits/", operation="list")
        return real(self, uri, **kw)

    monkeypatch.setattr(LabelStore, "current_sorted", flaky)
    index, info = build_label_index(str(tmp_path / "labels"), {}, delays=(0.0,))
    assert len(calls) == 2 and index is not None and info["n_label_rows"] == ls.read().num_rows
    calls.clear()
    with pytest.raises(StorageError, match="simulated 503"):  # no delay left: the failure is the build's error
        build_label_index(str(tmp_path / "labels"), {}, delays=())
    assert len(calls) == 1

    def bad(self, uri, **kw):
        calls.append(uri)
        raise CJEInputError("label-store object checksum mismatch (simulated)", source="labels/v000001.parquet")

    calls.clear()
    monkeypatch.setattr(LabelStore, "current_sorted", bad)
    with pytest.raises(CJEInputError, match="checksum mismatch"):
        build_label_index(str(tmp_path / "labels"), {}, delays=(0.0, 0.0, 0.0))
    assert len(calls) == 1  # bad data is never retried


def test_a_damaged_commit_record_fails_the_memory_estimate_naming_it(tmp_path):
    ls, _ = _store(tmp_path, np.random.default_rng(12), 50)
    rec = tmp_path / "labels" / "labels" / "_commits" / "v000002.json"
    if not rec.exists():  # the store's own layout: find the second record
        rec = next(p for p in (tmp_path / "labels").rglob("v000002.json"))
    rec.write_text(rec.read_text()[:-9])
    with pytest.raises(CJEInputError, match="commit record") as err:
        ls.committed_rows()
    assert "v000002.json" in str(err.value.source)


def test_the_bit_set_skips_only_ids_that_are_not_stored():
    """`LabelIndex.lookup` searches only the ids whose fingerprint's top bits are set in the index's bit set: the
    same rows as `pyarrow.compute.index_in` (no stored id is skipped), and the unstored ids that pass are the bit
    set's false positives only."""
    import math

    import pyarrow.compute as pc

    stored = [f"s-{i}" for i in range(10_000)]
    index = LabelIndex.build(_labels(stored, [1.0] * len(stored), [0.5] * len(stored)).append_column(
        "version", pa.array(np.ones(len(stored), dtype=np.int64))))
    assert index.bits is not None and index.bits.size * 64 == label_index.filter_bits(10_000) == 2**18
    probe = pa.chunked_array([pa.array([f"s-{i}" for i in range(0, 20_000, 2)] + [f"u-{i}" for i in range(10_000)])])
    got = index.lookup(probe)
    want = pc.index_in(probe, value_set=index.table.column("response_id"))
    assert got.to_pylist() == want.to_pylist()
    assert sum(v is not None for v in got.to_pylist()) == 5_000
    fp = id_fingerprint(probe)
    passed = index._may_hold(fp)
    assert set(range(5_000)) <= set(passed.tolist())  # every stored id is searched
    # unstored ids passing: Binomial(10,000, p), p = 1 - exp(-10,000 / 2^18) = 0.0374 (fingerprints uniform): mean
    # 374, sd 19; 5 sd above the mean bounds it (a false failure ~3e-7)
    p = 1 - math.exp(-10_000 / 2**18)
    bound = 10_000 * p + 5 * math.sqrt(10_000 * p * (1 - p))
    assert (passed >= 10_000).sum() < bound
    no_bits = LabelIndex(index.table, index.fp, index.shared, rows=index.rows)
    assert no_bits.lookup(probe).to_pylist() == want.to_pylist()

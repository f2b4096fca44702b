"""The evaluate flow on its sharded row pass (`row_pass: sharded`): same numbers, says which path it took.

A real Prefect server and the flow's own local Ray; logs in daily files with every prompt on two days,
half the labels inline and half in the label store (joined on the workers)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine import evaluate as engine_evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate import simulate
from flows.pipelines.sharded_pass import SHARDED_MIN_BYTES, row_pass_for
from flows.storage.labels import LabelStore
from flows.storage.objects import Storage

from tests.unit.test_sharded import assert_same_result

DAYS = ("2026-02-02", "2026-02-03")


def test_row_pass_is_chosen_by_size_or_forced():
    small, big = [{"key": "a", "size": 10}], [{"key": "a", "size": SHARDED_MIN_BYTES}]
    assert row_pass_for("auto", "direct", small)[0] == "single"
    assert row_pass_for("auto", "direct", big)[0] == "sharded"
    path, why = row_pass_for("auto", "logs-only", big)
    assert path == "single" and why.startswith("mode 'logs-only' has no sharded row pass: its estimators need")
    assert row_pass_for("sharded", "direct", small) == ("sharded", "requested (row_pass: sharded)")
    assert row_pass_for("single", "direct", big)[0] == "single"
    with pytest.raises(CJEInputError, match="row_pass: sharded is not available in mode 'hybrid'"):
        row_pass_for("sharded", "hybrid", small)
    # Few bytes, many rows (logs without inline labels compress to ~3 B a row: issue 29's 100M rows are 312 MB,
    # under the bytes' threshold): the footers' rows decide; fewer rows, or none known, leave it to the bytes.
    from flows.pipelines.sharded_pass import SHARDED_MIN_ROWS

    path, why = row_pass_for("auto", "direct", small, rows=SHARDED_MIN_ROWS)
    assert (path, why) == ("sharded", f"{SHARDED_MIN_ROWS:,} rows of logs >= {SHARDED_MIN_ROWS:,} (row_pass: auto)")
    assert row_pass_for("auto", "direct", small, rows=SHARDED_MIN_ROWS - 1)[0] == "single"
    assert row_pass_for("auto", "logs-only", small, rows=SHARDED_MIN_ROWS)[0] == "single"
    assert row_pass_for("single", "direct", small, rows=SHARDED_MIN_ROWS)[0] == "single"


@pytest.mark.parametrize("mode", ["logs-only", "hybrid"])
def test_row_pass_sharded_in_an_offpolicy_mode_exits_2_before_prefect_and_ray(tmp_path, capsys, monkeypatch, mode):
    """The off-policy modes have no sharded row pass (docs/scaling.md): ``row_pass: sharded`` is refused when the
    file is loaded (`cje run` exits 2, Prefect never started) and by the flows' parameter check (no flow run)."""
    import yaml

    from flows.cli import main as cli
    from flows.pipelines.audit import evaluate_and_audit
    from flows.pipelines.evaluate import evaluate

    f = tmp_path / "evaluations.yaml"
    opts = {"targets": ["near"], "logger": "base", "inference": "analytic"}
    f.write_text(yaml.safe_dump({"evaluations": [{"name": "off", "logs_uri": str(tmp_path / "logs"), "mode": mode,
                                                  "options": opts, "row_pass": "sharded"}]}))

    def no_services(*a, **k):
        raise AssertionError("Prefect was started before the inputs were checked")

    monkeypatch.setattr(cli, "_services", no_services)
    assert cli.main(["run", "off", "--config", str(f)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "cje run: error:" in ln]
    assert len(err) == 1 and f"row_pass: sharded is not available in mode {mode!r}" in err[0], err
    params = {"logs_uri": str(tmp_path / "logs"), "window": "2026-02-02", "mode": mode, "options": opts,
              "row_pass": "sharded"}
    for flow in (evaluate, evaluate_and_audit):
        with pytest.raises(CJEInputError, match=f"not available in mode {mode!r}"):
            flow.check_parameters(dict(params))


@pytest.mark.parametrize("terms", ["per_prompt", "gram"])
def test_the_flow_on_the_sharded_path_gives_the_single_process_numbers(prefect_server, tmp_path, monkeypatch, terms):
    """Per-prompt terms where they fit the driver's budget, else (a 1-byte budget here) the Gram form; the Gram
    run is segmented (``segments: [band]``, a per-row column) and has a policy without own labels: its segment
    cells and verified claims are the single path's too."""
    from flows.pipelines.evaluate import evaluate

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    options: dict = {"inference": "analytic", "seed": 1}
    f = simulate(300, seed=5, oracle_fraction=0.1).frame
    if terms == "gram":
        monkeypatch.setenv("CJE_MAX_DRIVER_TERMS_BYTES", "1")
        f.loc[f["policy"] == "clone", ["oracle_label", "label_probability"]] = np.nan
        f["band"] = np.where(f["response_length"] > f["response_length"].median(), "long", "short")
        options.update(segment_by=["band"], segment_min_labels=5, segment_min_rows=20, baseline="base")
    pol = f["policy"].astype("category").cat.codes.to_numpy()
    f["ts"] = pd.Timestamp(DAYS[0], tz="UTC") + pd.to_timedelta(pol % 2, unit="D") + pd.Timedelta(hours=12)
    f = f.iloc[np.argsort(pol % 2, kind="stable")].reset_index(drop=True)  # rows in file (day) order
    labelled = np.flatnonzero(f["oracle_label"].notna().to_numpy())
    logs = f.copy()
    logs.loc[labelled[::2], ["oracle_label", "label_probability"]] = np.nan  # half the labels in the store only
    day = (f["ts"] - f["ts"].min()).dt.days.to_numpy()
    for i, d in enumerate(DAYS):
        (tmp_path / "logs" / f"dt={d}").mkdir(parents=True)
        pq.write_table(pa.Table.from_pandas(logs[day == i], preserve_index=False),
                       tmp_path / "logs" / f"dt={d}" / "part-0.parquet")
    store = f.loc[labelled[::2], ["response_id", "oracle_label", "label_probability"]].reset_index(drop=True)
    LabelStore(Storage.for_uri(str(tmp_path / "labels"))).append(pa.Table.from_pandas(store, preserve_index=False),
                                                                  "oracle")
    out = evaluate(logs_uri=str(tmp_path / "logs"), window=f"{DAYS[0]}..{DAYS[1]}", evaluation="sharded",
                   results_uri=str(tmp_path / "results"), labels_uri=str(tmp_path / "labels"),
                   options=options, row_pass="sharded")
    got = out["result"]
    assert got["inference"]["row_pass"]["path"] == "sharded"
    assert got["data"]["n_labelled"] == labelled.size  # no label dropped
    ref = engine_evaluate(f.drop(columns=["ts"]), **options).to_dict()
    if terms == "gram":
        assert got["segments"]["cells"] and {c["claim_kind"] for c in ref["segments"]["cells"]} >= {"verified",
                                                                                                  "assumes_transport"}
        assert got["policies"]["clone"]["level_claim"] == ref["policies"]["clone"]["level_claim"] != "ok"
    assert_same_result(ref, got, influence=terms)


def test_row_pass_walks_from_yaml_to_the_flow_typed_once(tmp_path):
    """``row_pass:`` of an evaluation is validated when the file is loaded and reaches the flows as it is."""
    import yaml

    from flows.pipelines.audit import evaluate_and_audit
    from flows.runtime.schedules import load_evaluations

    f = tmp_path / "evaluations.yaml"
    entry = {"name": "big", "logs_uri": "logs", "options": {"inference": "analytic"}, "row_pass": "sharded"}
    f.write_text(yaml.safe_dump({"evaluations": [entry]}))
    params = load_evaluations(str(f))["big"].flow_parameters()
    assert params["row_pass"] == "sharded"
    assert evaluate_and_audit.check_parameters(dict(params))["row_pass"] == "sharded"
    f.write_text(yaml.safe_dump({"evaluations": [{**entry, "row_pass": "sideways"}]}))
    with pytest.raises(CJEInputError, match="row_pass"):
        load_evaluations(str(f))


def test_a_log_file_without_a_segment_column_is_refused_by_its_read_task():
    """On the sharded path the segment columns are checked where each file is read (`FileRows`), naming it."""
    from flows.pipelines.sharded_pass import FileRows

    t = pa.Table.from_pandas(simulate(20, seed=1).frame, preserve_index=False)
    with pytest.raises(CJEInputError, match="column 'band'.*column is missing from the logs") as err:
        FileRows([], ["band"])(t, "s3://b/logs/dt=2026-02-02/part-0.parquet")
    assert err.value.source == "s3://b/logs/dt=2026-02-02/part-0.parquet"
    table, info = FileRows([], ["band"])(t.append_column("band", pa.array(["x"] * t.num_rows)), "f")
    assert "band" in table.column_names and info["policies"]


def test_the_shards_are_sized_by_the_rows_in_the_files_footers_not_by_their_bytes(tmp_path):
    """The sharded path sizes its shards by the window's rows (`window_footers`: the Parquet footers). The files'
    bytes misjudge them by the bytes a row, which depends on the columns and on how well they compress: the
    100M-row window of issue 29 (no inline labels, 3.1 B a row) read as 26M rows, 8 shards of 12.5M rows on
    2 CPUs instead of 26 of at most 4M. Here two files whose bytes give a tenth of their rows or less; a file
    whose footer cannot be read falls back to the bytes (the read then reports it)."""
    from flows.pipelines.sharded_pass import PARQUET_BYTES_PER_ROW, window_footers

    files = []
    for i, n in enumerate((40_000, 25_000)):
        key = f"dt={DAYS[i]}/part-0.parquet"
        (tmp_path / key).parent.mkdir(parents=True)
        pq.write_table(pa.table({"prompt_id": pa.array(np.zeros(n, np.int64)), "judge_score": np.full(n, 0.5)}),
                       tmp_path / key)
        files.append({"key": key, "size": (tmp_path / key).stat().st_size})
    by_bytes = sum(f["size"] for f in files) // PARQUET_BYTES_PER_ROW
    assert by_bytes * 10 < 65_000  # constant columns: a few bytes for 65,000 rows
    rows, footers = window_footers(str(tmp_path), None, files)
    assert rows == 65_000 and [f.rows for f in footers] == [40_000, 25_000]
    assert not any(f.bounds_known for f in footers)  # integer prompt ids: their string order is not the footer's
    (tmp_path / "dt=2026-02-04").mkdir()
    (tmp_path / "dt=2026-02-04" / "part-0.parquet").write_bytes(b"not parquet" * 100)
    bad = files + [{"key": "dt=2026-02-04/part-0.parquet", "size": 1100}]
    assert window_footers(str(tmp_path), None, bad) == ((sum(f["size"] for f in files) + 1100) // PARQUET_BYTES_PER_ROW,
                                                       None)


def test_a_swapped_label_object_fails_the_sharded_flow_naming_it(prefect_server, tmp_path, monkeypatch):
    """The sharded path reads and indexes the label store in a Ray task (`flows.runtime.label_index`) while the readers
    sample the files' prompt ids, and every reader waits for the index: a label object swapped for another valid
    label table is still the store's own error, naming the object (exit 2), raised as itself by the flow (not the
    readers' echo of it, a `RayTaskError`), and none of its labels is used (no reader ran: the run fails before any
    file's rows are read and split; nothing published)."""
    import io

    from flows.pipelines.evaluate import evaluate

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    f = simulate(60, seed=3, oracle_fraction=0.2).frame
    f["ts"] = pd.Timestamp(DAYS[0], tz="UTC") + pd.Timedelta(hours=12)  # valid logs: the store's error is the only one
    (tmp_path / "logs" / f"dt={DAYS[0]}").mkdir(parents=True)
    pq.write_table(pa.Table.from_pandas(f.drop(columns=["oracle_label", "label_probability"]), preserve_index=False),
                   tmp_path / "logs" / f"dt={DAYS[0]}" / "part-0.parquet")
    st = Storage.for_uri(str(tmp_path / "labels"))
    store = LabelStore(st)
    lab = f.loc[f["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    store.append(pa.Table.from_pandas(lab.iloc[:5], preserve_index=False), "one")
    store.append(pa.Table.from_pandas(lab.iloc[5:], preserve_index=False), "two")
    obj = store.history()[1]["object"]
    other = pa.table({"response_id": lab["response_id"].iloc[5:].tolist(),
                      "oracle_label": [1.0] * (len(lab) - 5), "label_probability": [None] * (len(lab) - 5)},
                     schema=pa.schema([("response_id", pa.string()), ("oracle_label", pa.float64()),
                                       ("label_probability", pa.float64())]))
    buf = io.BytesIO()
    pq.write_table(other, buf)
    st.write_bytes(obj, buf.getvalue())  # valid Parquet, other labels
    with pytest.raises(CJEInputError, match="label-store object checksum mismatch") as err:
        evaluate(logs_uri=str(tmp_path / "logs"), window=DAYS[0], evaluation="swapped",
                 results_uri=str(tmp_path / "results"), labels_uri=str(tmp_path / "labels"),
                 options={"inference": "analytic", "seed": 1}, row_pass="sharded")
    assert err.value.source == st.url(obj)
    assert type(err.value) is CJEInputError  # the build's own error, not a reader's RayTaskError wrapping it
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("result.json"))


def test_a_window_without_labels_fails_the_sharded_flow_naming_the_column(prefect_server, tmp_path, monkeypatch):
    """An empty label store (no build submitted: `load_label_index` reads its commit records only) and logs without
    inline labels: the sharded pass refuses the window after its readers, naming the label column, nothing
    published."""
    from flows.pipelines.evaluate import evaluate

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    f = simulate(60, seed=4, oracle_fraction=0.2).frame
    f["ts"] = pd.Timestamp(DAYS[0], tz="UTC") + pd.Timedelta(hours=12)
    (tmp_path / "logs" / f"dt={DAYS[0]}").mkdir(parents=True)
    pq.write_table(pa.Table.from_pandas(f.drop(columns=["oracle_label", "label_probability"]), preserve_index=False),
                   tmp_path / "logs" / f"dt={DAYS[0]}" / "part-0.parquet")
    with pytest.raises(CJEInputError, match="no row of the window has an oracle label") as err:
        evaluate(logs_uri=str(tmp_path / "logs"), window=DAYS[0], evaluation="unlabelled",
                 results_uri=str(tmp_path / "results"), labels_uri=str(tmp_path / "labels"),
                 options={"inference": "analytic", "seed": 1}, row_pass="sharded")
    assert err.value.column == "oracle_label"
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("result.json"))

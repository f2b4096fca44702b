"""A ``columns:`` mapping per evaluation in service mode (issue 13).

Logs whose columns are ``id``, ``model``, ``judge``, ``human_rating`` are read through the
evaluation's mapping (the top-level ``columns:`` its default) by `cje run` / `cje serve`, their
pre-flight check and the evaluate flow, with the rename rule of `cje evaluate`
(`cje_engine.data.io.column_renames`). Real local folders, the moto S3 server, a real Prefect
server and Ray cluster; config and pre-flight errors exit 2 before either starts.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate.direct import simulate
from flows.config import load_config
from flows.runtime.schedules import load_evaluations
from flows.storage.labels import LabelStore
from flows.storage.logs import discover_partitions, read_window

cli = importlib.import_module("flows.cli.main")

#: The team's names for the canonical log columns.
MAPPING = {"prompt_id": "id", "policy": "model", "judge_score": "judge", "oracle_label": "human_rating"}
DAYS = ("2025-03-01", "2025-03-02")
WINDOW = f"{DAYS[0]}..{DAYS[1]}"
COLS = ["prompt_id", "policy", "judge_score", "response_id", "oracle_label", "dt"]


def _frame(n_prompts: int = 150, seed: int = 7) -> pd.DataFrame:
    """Simulated canonical logs over the two days of `DAYS`, rows in file (day) order."""
    f = simulate(n_prompts, seed=seed).frame.drop(columns=["label_probability"])
    day = f["prompt_id"].astype("category").cat.codes.to_numpy() % 2
    f["ts"] = pd.Timestamp(DAYS[0], tz="UTC") + pd.to_timedelta(day, unit="D") + pd.Timedelta(hours=12)
    return f.iloc[np.argsort(day, kind="stable")].reset_index(drop=True)


def _write(put, frame: pd.DataFrame, mapping: dict | None, drop: dict | None = None) -> None:
    """One Parquet file per day under ``dt=YYYY-MM-DD/``, columns renamed canonical -> ``mapping``
    (not through `write_logs`, which writes canonical logs only); ``drop``: day -> (renamed) columns left out."""
    for d in DAYS:
        part = frame[frame["ts"].dt.strftime("%Y-%m-%d") == d].rename(columns=mapping or {})
        table = pa.Table.from_pandas(part.drop(columns=list((drop or {}).get(d, ()))), preserve_index=False)
        put(f"dt={d}/part-0.parquet", table)


def _local(root: Path):
    def put(key: str, table: pa.Table) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / key)
    return put


def _s3(st):
    def put(key: str, table: pa.Table) -> None:
        with st.open_output(key) as out:
            pq.write_table(table, out)
    return put


def _config(tmp_path: Path, text: str) -> Path:
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(text)
    return cfg


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _same_numbers(got: dict, ref: dict) -> None:
    assert got["data"]["n_labelled"] == ref["data"]["n_labelled"]
    assert set(got["policies"]) == set(ref["policies"])
    for name, p in ref["policies"].items():
        assert got["policies"][name]["estimate"] == pytest.approx(p["estimate"], abs=1e-12)
        assert got["policies"][name]["ci"] == pytest.approx(p["ci"], abs=1e-12)
        assert got["policies"][name]["level_claim"] == p["level_claim"]


# ------------------------------------------------------------------------------ the config model


TOP = "columns: {prompt_id: id, policy: engine}\n"


def test_top_level_columns_are_the_default_and_an_evaluation_overrides_them_key_by_key(tmp_path):
    cfg = _config(tmp_path, TOP + "evaluations:\n"
                  "  - {name: plain, logs_uri: ./l}\n"
                  "  - {name: own, logs_uri: ./l, columns: {policy: model, judge_score: judge}}\n"
                  "  - {name: dropped, logs_uri: ./l, columns: {policy: null}}\n")
    ev = load_config(cfg).evaluations
    assert ev["plain"].columns == {"prompt_id": "id", "policy": "engine"}
    assert ev["own"].columns == {"prompt_id": "id", "policy": "model", "judge_score": "judge"}
    assert ev["dropped"].columns == {"prompt_id": "id"}
    assert load_evaluations(cfg)["own"].flow_parameters()["columns"] == ev["own"].columns
    assert load_config(_config(tmp_path, "evaluations: [{name: a, logs_uri: ./l}]\n")).evaluations["a"].columns == {}


@pytest.mark.parametrize("text, needles", [
    (TOP + "evaluations:\n  - {name: ev, logs_uri: ./l, columns: {judge_scor: judge}}\n",
     ["evaluations[0] ('ev')", "key columns", "'judge_scor'", "did you mean 'judge_score'?"]),
    (TOP + "evaluations:\n  - {name: ev, logs_uri: ./l, columns: {judge_score: engine}}\n",
     ["evaluations[0] ('ev')", "key columns", "('policy' and 'judge_score')", "'engine'", "top-level columns:"]),
    ("columns: {polcy: model}\nevaluations:\n  - {name: ev, logs_uri: ./l}\n",
     ["top-level key columns", "'polcy'", "did you mean 'policy'?"]),
    ("evaluations:\n  - {name: ev, logs_uri: ./l, columns: [id, model]}\n",
     ["evaluations[0] ('ev')", "key columns", "valid dictionary"]),
    ("evaluations:\n  - {name: ev, logs_uri: ./l, columns: {response_length: n_words}}\n",
     ["evaluations[0] ('ev')", "'response_length'", "not a canonical column"]),
])
def test_bad_mappings_are_config_errors_naming_the_evaluation_and_key(tmp_path, capsys, text, needles):
    cfg = _config(tmp_path, text)
    with pytest.raises(CJEInputError) as exc:
        load_config(cfg)
    for needle in needles:
        assert needle in str(exc.value)
    for command in (["run", "ev"], ["serve"]):  # refused before Prefect or Ray start: exit 2, one line
        code, _, err = _run(capsys, *command, "--config", str(cfg))
        assert code == 2 and "Traceback" not in err
        assert [ln for ln in err.splitlines() if ln.startswith("cje ")] == [
            ln for ln in err.splitlines() if "error:" in ln]
        assert all(n in err for n in needles)


def test_a_covariate_named_in_options_may_be_mapped(tmp_path):
    cfg = _config(tmp_path, "evaluations:\n  - {name: ev, logs_uri: ./l, columns: {response_length: n_words},"
                  " options: {covariates: [response_length]}}\n")
    assert load_config(cfg).evaluations["ev"].columns == {"response_length": "n_words"}


def test_cje_evaluate_shares_the_top_level_default_and_ignores_its_ts_key(tmp_path, capsys, monkeypatch):
    """The top-level mapping of a service config (with ``ts``, a log column the engine does not
    read) is also `cje evaluate`'s default; the result is the canonical frame's."""
    frame = _frame(60)
    frame.rename(columns={**MAPPING, "ts": "time"}).to_csv(tmp_path / "scores.csv", index=False)
    _config(tmp_path, "columns: {prompt_id: id, policy: model, judge_score: judge, oracle_label: human_rating, "
            "ts: time}\nevaluations:\n  - {name: ev, logs_uri: ./logs}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "evaluate", "scores.csv", "--out", "o", "--n-bootstrap", "60", "--json",
                          "--exit-zero")
    assert code == 0, err
    ref = evaluate(frame.drop(columns=["ts"]), n_bootstrap=60, seed=0).to_dict()
    _same_numbers(json.loads(out)["result"], ref)


# ------------------------------------------------------------------------------ reading


def test_mapped_logs_read_as_the_canonical_ones_locally(tmp_path):
    from flows.storage.objects import Storage

    frame = _frame(60)
    _write(_local(tmp_path / "canon"), frame, None)
    _write(_local(tmp_path / "mapped"), frame, MAPPING)
    canon, mapped = Storage.for_uri(str(tmp_path / "canon")), Storage.for_uri(str(tmp_path / "mapped"))
    files = discover_partitions(mapped, *DAYS)
    want = read_window(canon, discover_partitions(canon, *DAYS), columns=COLS, policies=["base", "clone"])
    got = read_window(mapped, files, columns=COLS, policies=["base", "clone"], mapping=MAPPING)
    assert want.num_rows == got.num_rows > 0 and got.equals(want)
    # every column, and a caller's row filter on a renamed column (applied after the rename)
    assert set(read_window(mapped, files, mapping=MAPPING).column_names) >= set(MAPPING)
    flt = read_window(mapped, files, columns=["response_id"], row_filter=pc.field("policy") == "base",
                      mapping=MAPPING, check_unique=False)
    assert sorted(flt["response_id"].to_pylist()) == sorted(frame.loc[frame.policy == "base", "response_id"])
    pushed = read_window(mapped, files, columns=["response_id"], row_filter=lambda field: field("policy") == "base",
                         mapping=MAPPING, check_unique=False)  # built on the files' names: into the scan
    assert pushed.equals(flt)
    # unmapped, the same files are refused with the way out in the message
    with pytest.raises(CJEInputError, match="map it with columns: in evaluations.yaml"):
        read_window(mapped, files, columns=COLS)


def test_mapped_logs_read_as_the_canonical_ones_from_s3(s3_server, bucket, direct_storage):
    frame = _frame(60)
    canon, mapped = direct_storage(f"s3://{bucket}/canon"), direct_storage(f"s3://{bucket}/mapped")
    _write(_s3(canon), frame, None)
    _write(_s3(mapped), frame, MAPPING, drop={DAYS[1]: ["human_rating"]})  # day 2: no inline labels
    want = read_window(canon, discover_partitions(canon, *DAYS), columns=COLS, policies=["verbose"])
    got = read_window(mapped, discover_partitions(mapped, *DAYS), columns=COLS, policies=["verbose"],
                      mapping=MAPPING)
    assert got.column_names == COLS and got.num_rows == want.num_rows > 0
    first = pc.equal(got["dt"], DAYS[0])
    assert got.filter(first).equals(want.filter(first))  # day 1 identical, labels included
    assert got.filter(pc.invert(first))["oracle_label"].null_count == int(pc.sum(pc.invert(first)).as_py())


def test_the_labelling_loop_reads_mapped_logs(tmp_path):
    """Request exports (response texts) and label ingestion (ids to log dates) read the logs
    through the evaluation's mapping too."""
    from flows.label_requests.exports import read_texts
    from flows.pipelines.labels import _scan_logs

    frame = _frame(30)
    frame["response"] = [f"answer {i}" for i in range(len(frame))]
    mapping = {**MAPPING, "response": "answer"}
    _write(_local(tmp_path / "logs"), frame, mapping)
    rows = [{"response_id": r, "dt": d} for r, d in zip(frame["response_id"][:3],
                                                         frame["ts"].dt.strftime("%Y-%m-%d")[:3])]
    texts = read_texts(str(tmp_path / "logs"), None, rows, ("response",), mapping)
    assert texts == {r["response_id"]: {"response": frame.set_index("response_id").at[r["response_id"], "response"]}
                     for r in rows}
    ids = set(frame["response_id"][-4:])
    found = _scan_logs(str(tmp_path / "logs"), None, ids, None, mapping)
    assert {r: v["dt"] for r, v in found.items()} == dict(zip(frame["response_id"][-4:],
                                                              frame["ts"].dt.strftime("%Y-%m-%d")[-4:]))
    with pytest.raises(CJEInputError, match="columns: in evaluations.yaml"):  # unmapped: refused, with the way out
        _scan_logs(str(tmp_path / "logs"), None, ids, None)


def test_label_requests_and_drift_alarms_read_the_linked_evaluations_mapped_logs(tmp_path):
    """The rows a label request samples from (inline labels under ``human_rating`` combined
    with the store's) and the drift monitor's link to its evaluation's mapping."""
    from flows.label_requests.raising import read_evaluated_logs
    from flows.pipelines.drift_config import DriftSettings, load_drift_monitors
    from flows.storage.objects import Storage

    frame = _frame(40)
    labelled = np.flatnonzero(frame["oracle_label"].notna().to_numpy())
    logs = frame.copy()
    logs.loc[labelled[::2], "oracle_label"] = np.nan
    _write(_local(tmp_path / "logs"), logs, MAPPING)
    store = frame.loc[labelled[::2], ["response_id", "oracle_label"]].reset_index(drop=True)
    LabelStore(Storage.for_uri(str(tmp_path / "labels"))).append(pa.Table.from_pandas(store, preserve_index=False),
                                                                 "oracle")
    rows = read_evaluated_logs(str(tmp_path / "logs"), f"{DAYS[0]}_{DAYS[1]}", str(tmp_path / "labels"), None,
                               MAPPING)
    assert rows.num_rows == len(frame) and rows["oracle_label"].null_count == len(frame) - len(labelled)
    got = dict(zip(rows["response_id"].to_pylist(), rows["oracle_label"].to_pylist()))
    assert all(got[r] == pytest.approx(y) for r, y in zip(frame["response_id"][labelled],
                                                           frame["oracle_label"][labelled]))
    cfg = _config(tmp_path, "columns: {prompt_id: id}\nevaluations:\n  - name: ev\n    logs_uri: ./logs\n"
                  "    columns: {policy: model, judge_score: judge, oracle_label: human_rating}\n"
                  "drift_monitors:\n  - {set_name: anchors, anchors_uri: ./a, evaluation: ev}\n")
    settings = load_drift_monitors(cfg)["anchors"].settings_dict()
    assert settings["evaluation_columns"] == MAPPING
    assert DriftSettings(**settings).evaluation_columns == MAPPING


# ------------------------------------------------------------------------------ pre-flight


def test_a_mapped_column_missing_from_one_file_is_one_line_naming_the_file(tmp_path, capsys):
    _write(_local(tmp_path / "logs"), _frame(40), MAPPING, drop={DAYS[1]: ["model"]})
    cfg = _config(tmp_path, f"columns: {{prompt_id: id}}\nevaluations:\n  - name: ev\n    logs_uri: ./logs\n"
                  f"    window: {WINDOW}\n    columns: {{policy: model, judge_score: judge, oracle_label: human_rating}}\n")
    for command in (["run", "ev"], ["serve"]):
        code, out, err = _run(capsys, *command, "--config", str(cfg))
        assert code == 2, err
        errors = [ln for ln in err.splitlines() if "error:" in ln]
        assert len(errors) == 1 and "Traceback" not in err and not out
        assert f"dt={DAYS[1]}/part-0.parquet" in errors[0] and "column 'model'" in errors[0]
        assert "did you mean" in errors[0] or "columns present" in errors[0]


def test_a_mapped_label_column_in_no_file_is_refused(tmp_path, capsys):
    _write(_local(tmp_path / "logs"), _frame(40), MAPPING)
    cfg = _config(tmp_path, f"evaluations:\n  - name: ev\n    logs_uri: ./logs\n    window: {WINDOW}\n"
                  "    columns: {prompt_id: id, policy: model, judge_score: judge, oracle_label: human_ratings}\n")
    code, _, err = _run(capsys, "run", "ev", "--config", str(cfg))
    assert code == 2 and "'human_ratings'" in err and "in none of the 2 log file(s)" in err
    assert "did you mean 'human_rating'?" in err


# ------------------------------------------------------------------------------ cje run


def test_cje_run_on_mapped_logs_gives_the_numbers_of_canonical_logs(tmp_path, prefect_server, ray_cluster,
                                                                    monkeypatch, capsys):
    """Local folders: the same rows as id/model/judge/human_rating (mapped per evaluation, over a
    top-level default it overrides) and with canonical names give the same result."""
    frame = _frame()
    _write(_local(tmp_path / "mapped"), frame, MAPPING)
    _write(_local(tmp_path / "canon"), frame, None)
    common = f"    window: {WINDOW}\n    options: {{n_bootstrap: 60}}\n"
    _config(tmp_path, "columns: {prompt_id: id, policy: engine}\nevaluations:\n"
            "  - name: mapped\n    logs_uri: ./mapped\n" + common
            + "    columns: {policy: model, judge_score: judge, oracle_label: human_rating}\n"
            "  - name: canon\n    logs_uri: ./canon\n" + common + "    columns: {prompt_id: null, policy: null}\n")
    monkeypatch.chdir(tmp_path)
    docs = {}
    for name in ("mapped", "canon"):
        code, out, err = _run(capsys, "run", name, "--json", "--exit-zero")
        assert code == 0, err[-3000:]
        docs[name] = json.loads(out)
        assert docs[name]["published"] and "label_requests_error" not in docs[name]
    _same_numbers(docs["mapped"]["result"], docs["canon"]["result"])
    assert docs["mapped"]["result"]["data"]["n_labelled"] == int(frame["oracle_label"].notna().sum())
    assert docs["mapped"]["run_key"] != docs["canon"]["run_key"]  # the mapping is part of the run's config


def test_cje_run_on_mapped_s3_logs_joins_store_and_inline_labels(prefect_server, ray_cluster, s3_env, bucket,
                                                                 direct_storage, tmp_path, monkeypatch, capsys):
    """S3: half the labels inline under ``human_rating``, half in the label store (keyed by the
    canonical response_id): every label is used, and the numbers are the engine's on the
    canonical rows with all labels."""
    frame = _frame()
    labelled = np.flatnonzero(frame["oracle_label"].notna().to_numpy())
    in_store = labelled[::2]
    logs = frame.copy()
    logs.loc[in_store, "oracle_label"] = np.nan
    _write(_s3(direct_storage(f"s3://{bucket}/logs")), logs, MAPPING)
    store = frame.loc[in_store, ["response_id", "oracle_label"]].reset_index(drop=True)
    LabelStore(direct_storage(f"s3://{bucket}/labels")).append(pa.Table.from_pandas(store, preserve_index=False),
                                                               "oracle")
    _config(tmp_path, f"columns: {{prompt_id: id, policy: model}}\nevaluations:\n  - name: s3ev\n"
            f"    logs_uri: s3://{bucket}/logs\n    labels_uri: s3://{bucket}/labels\n    window: {WINDOW}\n"
            "    options: {n_bootstrap: 60}\n    columns: {judge_score: judge, oracle_label: human_rating}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "run", "s3ev", "--json", "--exit-zero")
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["published"] and "label_requests_error" not in doc
    assert doc["result"]["data"]["n_labelled"] == len(labelled)  # no label dropped
    ref = evaluate(frame.drop(columns=["ts"]), n_bootstrap=60, seed=0).to_dict()
    _same_numbers(doc["result"], ref)

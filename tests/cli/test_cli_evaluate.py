"""`cje evaluate` and `cje plan`: column mapping, config discovery, --out safety, --json, exit codes,
hints in flag form and escaped terminal output."""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import simulate
from flows.cli.common import result_problems, write_atomic
from cje_engine.errors import CJEInputError

from .conftest import run_cje

cli = importlib.import_module("flows.cli.main")
MAP = "prompt_id=id,policy=model,oracle_label=human_rating"
SCALES = ["--score-scale", "1-10", "--label-scale", "1-5"]
FAST = ["--n-bootstrap", "60", "--exit-zero"]


def test_columns_mapping_evaluates_a_team_csv(team_csv, tmp_path, capsys, in_tmp):
    code = cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), "--columns", MAP, *SCALES, *FAST,
                     "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    doc = json.loads(cap.out)  # stdout is exactly one JSON document
    assert doc["cje_json"] == 1 and doc["command"] == "evaluate"
    assert set(doc["result"]["policies"]) == {"base", "clone", "verbose", "concise", "unhelpful"}
    assert doc["result"]["config"]["label_scale"] == [1, 5] and doc["result"]["data"]["n_labelled"] > 0
    assert Path(doc["result_path"]).is_file() and Path(doc["report_path"]).is_file()
    assert json.loads(Path(doc["result_path"]).read_text()) == doc["result"]


def test_mapped_csv_gives_the_numbers_of_canonical_columns(team_csv, tmp_path, capsys, in_tmp):
    canon = pd.read_csv(team_csv, dtype={"id": str}).rename(
        columns={"id": "prompt_id", "model": "policy", "human_rating": "oracle_label"})
    ref = evaluate(canon, score_scale="1-10", label_scale="1-5", n_bootstrap=60, seed=0).to_dict()
    assert cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), "--columns", MAP, *SCALES, *FAST,
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["result"]
    for name, p in ref["policies"].items():  # chunked bootstrap with progress = one engine call
        assert got["policies"][name]["estimate"] == pytest.approx(p["estimate"], abs=1e-12)
        assert got["policies"][name]["ci"] == pytest.approx(p["ci"], abs=1e-12)


def test_unmapped_team_csv_says_which_columns_are_missing(team_csv, tmp_path, capsys, in_tmp):
    assert cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), *SCALES, *FAST]) == 2
    err = capsys.readouterr().err
    assert "prompt_id" in err and "scores.csv" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "result.json").exists()


def test_scale_hint_names_the_flag(team_csv, tmp_path, capsys, in_tmp):
    assert cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), "--columns", MAP,
                     "--label-scale", "1-5", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--score-scale 1-10" in err and "score_scale=" not in err


def test_columns_from_the_config_in_the_current_folder(team_csv, tmp_path, capsys, in_tmp):
    (in_tmp / "evaluations.yaml").write_text(
        "columns: {prompt_id: id, policy: model, oracle_label: human_rating}\n"
        "evaluations:\n  - name: a\n    logs_uri: ./logs\n")
    assert cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), *SCALES, *FAST]) == 0
    err = capsys.readouterr().err
    assert f"config: {in_tmp / 'evaluations.yaml'} (from ./evaluations.yaml)" in err


def test_config_discovery_order(team_csv, tmp_path, capsys, in_tmp, monkeypatch):
    """--config, else $CJE_CONFIG, else ./evaluations.yaml; the path in use is printed."""
    good = "columns: {prompt_id: id, policy: model, oracle_label: human_rating}\n"
    bad = "columns: {prompt_id: nope}\n"
    (in_tmp / "evaluations.yaml").write_text(bad)
    env_cfg, flag_cfg = tmp_path / "env.yaml", tmp_path / "flag.yaml"
    env_cfg.write_text(good)
    flag_cfg.write_text(bad)
    monkeypatch.setenv("CJE_CONFIG", str(env_cfg))
    args = ["evaluate", str(team_csv), *SCALES, *FAST]
    assert cli.main(args + ["--out", str(tmp_path / "o1")]) == 0  # $CJE_CONFIG beats ./evaluations.yaml
    assert f"config: {env_cfg} (from $CJE_CONFIG)" in capsys.readouterr().err
    assert cli.main(args + ["--out", str(tmp_path / "o2"), "--config", str(flag_cfg)]) == 2  # --config beats both
    err = capsys.readouterr().err
    assert f"config: {flag_cfg} (from --config)" in err and "'nope'" in err
    assert cli.main(args + ["--out", str(tmp_path / "o3"), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "evaluations file not found" in capsys.readouterr().err


def test_bad_columns_mapping_in_config_has_a_did_you_mean(team_csv, tmp_path, capsys, in_tmp):
    (in_tmp / "evaluations.yaml").write_text("columns: {promt_id: id}\n")
    assert cli.main(["evaluate", str(team_csv), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "did you mean 'prompt_id'?" in capsys.readouterr().err


def test_out_refuses_an_earlier_result_unless_overwrite(canonical_parquet, tmp_path, capsys, in_tmp):
    out = tmp_path / "o"
    args = ["evaluate", str(canonical_parquet), "--out", str(out), *FAST]
    assert cli.main(args) == 0
    first = (out / "result.json").read_bytes()
    assert cli.main(args + ["--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "earlier result" in err and "--overwrite" in err
    assert (out / "result.json").read_bytes() == first  # nothing overwritten
    assert cli.main(args + ["--seed", "5", "--overwrite"]) == 0
    assert json.loads((out / "result.json").read_text())["config"]["seed"] == 5
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "result.json", "terms.npz"]  # no temp file


def test_out_that_is_a_file_or_unwritable_fails_before_computing(canonical_parquet, tmp_path, monkeypatch, capsys,
                                                                 in_tmp):
    import cje_engine.pipeline.direct as direct

    def no_compute(*a, **k):
        raise AssertionError("computed before checking --out")

    monkeypatch.setattr(direct, "prepare", no_compute)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["evaluate", str(canonical_parquet), "--out", str(afile), *FAST]) == 2
    assert "must be a folder" in capsys.readouterr().err
    assert cli.main(["evaluate", str(canonical_parquet), "--out", str(afile / "sub"), *FAST]) == 2
    assert "not writable" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        assert cli.main(["evaluate", str(canonical_parquet), "--out", str(ro), *FAST]) == 2
        assert "not writable" in capsys.readouterr().err
    assert list(tmp_path.glob("**/.*tmp")) == []


def test_failed_write_leaves_no_temp_file(tmp_path):
    target = tmp_path / "result.json"
    target.mkdir()  # os.replace onto a folder fails
    with pytest.raises(CJEInputError, match="cannot write"):
        write_atomic(target, "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_exit_1_when_an_audit_fails_or_a_level_is_refused(canonical_parquet, tmp_path, capsys, in_tmp):
    out = tmp_path / "o"
    code = cli.main(["evaluate", str(canonical_parquet), "--out", str(out), "--n-bootstrap", "60"])
    cap = capsys.readouterr()
    d = json.loads((out / "result.json").read_text())
    problems = result_problems(d)
    assert problems, "the simulated data must have a failed audit for this test"  # seed 2: several fail
    assert code == 1 and "exit code 1" in cap.err and problems[0] in cap.err
    assert cli.main(["evaluate", str(canonical_parquet), "--out", str(out), "--n-bootstrap", "60", "--overwrite",
                     "--exit-zero"]) == 0


def test_terminal_output_escapes_control_characters_in_policy_names(tmp_path, capsys, in_tmp):
    f = simulate(200, seed=3).frame
    evil = {"clone": "clo\x1b[31mne\u202e", "verbose": "ver\nbose"}
    f["policy"] = f["policy"].replace(evil)
    f["response_id"] = f["policy"].str.len().astype(str) + f["response_id"]
    src = tmp_path / "evil.parquet"
    f.to_parquet(src)
    code = cli.main(["evaluate", str(src), "--out", str(tmp_path / "o"), *FAST])
    cap = capsys.readouterr()
    # Control and format characters in an id are refused (issue 25), and the message shows them escaped.
    assert code == 2, cap.err
    for stream in (cap.out, cap.err):
        assert "\x1b" not in stream and "\u202e" not in stream
    assert "invisible or control character" in cap.err and str(src) in cap.err
    assert "clo\\x1b[31mne\\u202e" in cap.err or "ver\\nbose" in cap.err
    assert not (tmp_path / "o" / "result.json").exists()


def test_plan_defaults_to_an_mde_for_unresolved_pairs_and_parses_targets(tmp_path, capsys, in_tmp):
    data = tmp_path / "pilot.parquet"
    simulate(400, seed=5, label_design="calibration_policy", audit_labels=40).frame.to_parquet(data)
    ev = tmp_path / "ev"
    cli.main(["evaluate", str(data), "--out", str(ev), "--inference", "analytic", "--calibration-policies", "base",
              "--exit-zero"])
    capsys.readouterr()
    assert cli.main(["plan", str(ev / "result.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    d = json.loads((ev / "result.json").read_text())
    unresolved = {f"{c['a']} - {c['b']}" for c in d["comparisons"] if not c["significant"]}
    assert plan["target_mde"] == 0.02 and set(plan["planned_for"]) == (unresolved or set(plan["planned_for"]))
    assert cli.main(["plan", str(ev / "result.json"), "--target", "base-clone", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["planned_for"] == ["base - clone"]
    assert cli.main(["plan", str(ev / "result.json"), "--target", "base-clone,base - verbose", "--budget", "20000"]) == 0
    text = capsys.readouterr().out
    assert "best design for budget 20000" in text and "plan_from" not in text
    assert cli.main(["plan", str(ev / "result.json"), "--target", "base-nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_evaluate_as_a_process_json_and_bad_input(team_csv, tmp_path):
    r = run_cje("evaluate", str(team_csv), "--out", str(tmp_path / "o"), "--columns", MAP, *SCALES, *FAST, "--json",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["command"] == "evaluate"  # stdout: the JSON document only; logs on stderr
    assert "loaded" in r.stderr
    assert "\x1b[" not in r.stderr and "bootstrap" not in r.stderr  # no progress display without a terminal
    r = run_cje("evaluate", str(team_csv), "--out", str(tmp_path / "o2"), "--columns", "prompt_id=ident", *FAST,
                cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "'ident'" in r.stderr
    assert r.stdout == ""


def test_bad_whole_numbers_and_encodings_are_bad_input(canonical_parquet, tmp_path, capsys, in_tmp):
    assert cli.main(["evaluate", str(canonical_parquet), "--out", str(tmp_path / "o"), "--seed", "-1"]) == 2
    assert "--seed must be a whole number >= 0" in capsys.readouterr().err
    assert cli.main(["evaluate", str(canonical_parquet), "--out", str(tmp_path / "o"), "--n-bootstrap", "0"]) == 2
    latin = tmp_path / "latin.csv"
    latin.write_bytes("prompt_id,policy,judge_score,oracle_label\n1,caf\xe9,0.5,0.4\n".encode("latin-1"))
    assert cli.main(["evaluate", str(latin), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "Traceback" not in err

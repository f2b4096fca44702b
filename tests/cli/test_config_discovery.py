"""One rule for the evaluations file in every command: ``--config``, else ``$CJE_CONFIG``, else
``./evaluations.yaml`` of the current folder, never the repository's own file; the file in use is named
on stderr (``config: PATH (from ...)``, silenced by ``-q``), and an unknown name's error names the file
and the closest declared name. `runs`, `diff`, `plan --evaluation` and `deploy` used to read the
repository's file and ignore ``$CJE_CONFIG``."""
from __future__ import annotations

import importlib
import json

import pytest

cli = importlib.import_module("flows.cli.main")

CONFIG = """\
evaluations:
  - name: team-eval
    logs_uri: ./logs
drift_monitors:
  - name: team-mon
    set_name: team-anchors
    anchors_uri: ./anchors
"""

#: Every command that looks a name up in the evaluations file, with an unknown (misspelt) name.
LOOKUPS = {
    "run": ["run", "team-evl"],
    "drift": ["drift", "team-mn"],
    "serve": ["serve", "--only", "team-evl"],
    "deploy": ["deploy", "--only", "team-evl"],
    "runs": ["runs", "team-evl"],
    "diff": ["diff", "team-evl"],
    "plan --evaluation": ["plan", "--evaluation", "team-evl"],
    "labels": ["labels", "{labels}", "--evaluation", "team-evl", "--no-reevaluate"],
    "requests list": ["requests", "list", "--evaluation", "team-evl"],
    "requests status": ["requests", "status", "--evaluation", "team-evl"],
    "requests show": ["requests", "show", "lr-20990101-000000000000", "--evaluation", "team-evl"],
    "requests export": ["requests", "export", "lr-20990101-000000000000", "--evaluation", "team-evl",
                        "--out", "{tmp}/x.csv"],
    "anchors list": ["anchors", "list", "--monitor", "team-mn"],
}


@pytest.fixture
def team_config(tmp_path, monkeypatch):
    """A team's evaluations file named by $CJE_CONFIG; the current folder is another, empty one."""
    cfg = tmp_path / "team" / "evals.yaml"
    cfg.parent.mkdir()
    cfg.write_text(CONFIG)
    (tmp_path / "labels.csv").write_text("response_id,oracle_label\nr1,0.5\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CJE_CONFIG", str(cfg))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return cfg


def _argv(argv: list[str], tmp_path) -> list[str]:
    return [a.format(labels=tmp_path / "labels.csv", tmp=tmp_path) for a in argv]


@pytest.mark.parametrize("command", sorted(LOOKUPS))
def test_every_command_reads_cje_config_and_names_it_in_errors(command, team_config, tmp_path, capsys):
    code = cli.main(_argv(LOOKUPS[command], tmp_path))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"config: {team_config} (from $CJE_CONFIG)" in err
    what, close = ("drift monitor", "team-mon") if "mn" in " ".join(LOOKUPS[command]) else ("evaluation", "team-eval")
    assert f"file {team_config}: no {what} named " in err and f"did you mean {close!r}?" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(LOOKUPS))
def test_no_command_falls_back_to_the_repositorys_file(command, tmp_path, monkeypatch, capsys):
    """No --config, no $CJE_CONFIG, no ./evaluations.yaml: every command says so (it used to deploy or
    list the repository's demo evaluations)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CJE_CONFIG", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    (tmp_path / "labels.csv").write_text("response_id,oracle_label\nr1,0.5\n")
    assert cli.main(_argv(LOOKUPS[command], tmp_path)) == 2
    err = capsys.readouterr().err
    assert "evaluations file not found" in err and "CJE_CONFIG" in err


def test_config_flag_beats_cje_config_and_quiet_silences_the_line(team_config, tmp_path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text(CONFIG.replace("team-eval", "other-eval"))
    assert cli.main(["runs", "team-eval", "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"config: {other} (from --config)" in err and f"file {other}: no evaluation named 'team-eval'" in err
    assert cli.main(["-q", "runs", "team-evl"]) == 2
    err = capsys.readouterr().err
    assert "config:" not in err and f"file {team_config}: no evaluation named" in err


@pytest.mark.parametrize("command", ["evaluate", "plan"])
def test_evaluate_and_plan_take_the_columns_of_cje_config(command, team_config, team_csv, tmp_path, capsys):
    """The top-level ``columns:`` of the file $CJE_CONFIG names maps the team's CSV."""
    team_config.write_text(CONFIG + "columns: {prompt_id: id, policy: model, oracle_label: human_rating}\n")
    argv = [command, str(team_csv), "--label-scale", "1-5", "--score-scale", "1-10", "--json"]
    argv += ["--out", str(tmp_path / "out"), "--n-bootstrap", "50", "--exit-zero"] if command == "evaluate" else []
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert f"config: {team_config} (from $CJE_CONFIG)" in captured.err
    assert json.loads(captured.out)["command"] == command

"""Parser conventions: --version, -v/-q anywhere, usage errors exit 64, hints in flag form,
terminal escaping, progress only on a terminal, docs/cli.md generated from the parser."""
from __future__ import annotations

import argparse
import json
import os
import pty
import subprocess
import sys

import pytest

from cje_engine.errors import CJEInputError
import importlib

from flows.cli import docs
from flows.cli.exits import EXIT_BAD_INPUT, EXIT_USAGE
from flows.cli.hints import cli_hint, message_of
from flows.cli.terminal import escape, escape_lines

from .conftest import REPO, cje_env, run_cje

cli = importlib.import_module("flows.cli.main")  # the module (flows.cli.main is also the entry function)


def test_version_prints_and_exits_0(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cje ") and "engine" in out


@pytest.mark.parametrize("argv", [
    ["-v", "gate", "r.json", "--baseline", "b", "--fail-if", "worse"],
    ["gate", "-v", "r.json", "--baseline", "b", "--fail-if", "worse"],
    ["gate", "r.json", "--baseline", "b", "--fail-if", "worse", "-v"],
])
def test_verbose_in_any_position(argv):
    ns = cli.build_parser().parse_args(argv)
    assert ns.verbose is True and getattr(ns, "quiet", False) is False


def test_quiet_in_any_position_and_defaults():
    p = cli.build_parser()
    assert p.parse_args(["anchors", "list", "--store", ".", "-q"]).quiet is True
    assert p.parse_args(["-q", "plan", "x.json"]).quiet is True
    ns = p.parse_args(["plan", "x.json"])
    assert not getattr(ns, "verbose", False) and not getattr(ns, "quiet", False)


def test_registered_modules_get_the_global_options():
    """A module of COMMAND_MODULES adds its parser with sub.add_parser: -v works after its command too."""
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    extra = sub.add_parser("extra")
    extra.set_defaults(handler=lambda ns: 0)
    assert p.parse_args(["extra", "-v"]).verbose is True


@pytest.mark.parametrize("argv", [
    [], ["evaluate"], ["evaluate", "x.csv"], ["nope"], ["evaluate", "x", "--out", "o", "--bogus"],
    ["evaluate", "x", "--out", "o", "--columns", "prompt_id"], ["gate", "r.json", "--baseline", "b", "--fail-if", "cand <"],
    ["plan", "x", "--budget", "lots"],
])
def test_usage_errors_exit_64(argv, capsys):
    assert cli.main(argv) == EXIT_USAGE
    assert "usage:" in capsys.readouterr().err


def test_usage_error_exit_64_as_a_process():
    r = run_cje("evaluate", "--out")
    assert r.returncode == 64 and "usage:" in r.stderr and "Traceback" not in r.stderr


def test_hints_name_the_flag_not_the_keyword():
    msg = ("file a.csv, column 'judge_score', row 0: value 7 is outside the declared score_scale [0, 1]; "
           "declare it explicitly, e.g. score_scale='1-10' or score_scale='0-10'")
    out = cli_hint(msg, "score_scale")
    assert "--score-scale 1-10 or --score-scale 0-10" in out and "score_scale=" not in out
    assert cli_hint("did you mean columns={'oracle_label': 'human_rating'}?") == \
        "did you mean --columns oracle_label=human_rating?"
    assert cli_hint("label_scale=(1, 5) please") == "--label-scale 1-5 please"
    assert cli_hint("covariates=['response_length']") == "--covariates response_length"
    # the keyword a hint refers to is taken from CJEInputError.option
    exc = CJEInputError("declare level_range='1-5'")
    exc.option = "level_range"
    assert message_of(exc) == "declare --level-range 1-5"
    # service mode: the key of evaluations.yaml
    assert cli_hint("e.g. score_scale='1-10'", context="yaml") == "e.g. options.score_scale: 1-10"
    # words that merely contain a keyword are left alone
    assert cli_hint("my_score_scale='x'") == "my_score_scale='x'"


def test_escape_neutralises_control_and_bidi_characters():
    evil = "a\x1b[31mred\x1b[0m\nline2\r\t\x07\u202egnp.exe\u2066x\x9b"
    e = escape(evil)
    assert all(ord(ch) >= 0x20 and ch not in "\x7f\u202e\u2066\x9b" for ch in e)
    assert e == "a\\x1b[31mred\\x1b[0m\\nline2\\r\\t\\x07\\u202egnp.exe\\u2066x\\x9b"
    assert escape("évaluation café 評価") == "évaluation café 評価"  # printable text is kept
    assert escape_lines("row1 \x1b[2J\nrow2") == "row1 \\x1b[2J\nrow2"


def test_progress_is_drawn_in_a_terminal(canonical_parquet, tmp_path):
    """Under a pseudo-terminal the bar is drawn on stderr (off when not a terminal: the process tests
    of tests/cli/test_cli_evaluate.py find no escape sequence and no "bootstrap" on stderr)."""
    args = [sys.executable, "-m", "flows.cli.main", "evaluate", str(canonical_parquet), "--out",
            str(tmp_path / "a"), "--n-bootstrap", "200", "--exit-zero"]
    # under a pseudo-terminal the bar is drawn on stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(args, env=cje_env(),
                         stdin=slave, stdout=slave, stderr=slave, cwd=tmp_path, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=120) == 0
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "bootstrap" in text and "\x1b[" in text


def test_docs_cli_md_matches_the_parser():
    """docs/cli.md is generated from the parser: regenerate with `python -m flows.cli.docs --write`."""
    committed = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == docs.render(), "docs/cli.md is out of date: run python -m flows.cli.docs --write"
    for command in ("evaluate", "plan", "gate", "run", "anchors create", "anchors add-scores", "anchors list"):
        assert f"## `cje {command}`" in committed
    for code in (0, 1, 2, 64, 69):
        assert f"| {code} |" in committed


def test_bad_input_exit_2_prints_one_line_and_no_traceback(tmp_path, capsys, in_tmp):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    assert cli.main(["gate", str(bad), "--baseline", "b", "--fail-if", "worse"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("cje gate: error: ") and "r.json" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_internal_error_exit_70_traceback_only_with_v(monkeypatch, capsys, in_tmp):
    from flows.cli.commands import gate

    def boom(ns):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(gate, "cmd_gate", boom)
    argv = ["gate", "r.json", "--baseline", "b", "--fail-if", "worse"]
    assert cli.main(argv) == 70
    err = capsys.readouterr().err
    assert "internal error (ZeroDivisionError)" in err and "-v" in err and "Traceback" not in err
    assert cli.main(argv + ["-v"]) == 70
    assert "Traceback" in capsys.readouterr().err


def test_service_unavailable_exit_69(monkeypatch, capsys, in_tmp):
    from flows.cli.commands import gate
    from flows.storage.objects import StorageError

    def down(ns):
        raise StorageError("list s3://bucket/logs failed after 3 attempt(s): connection refused", operation="list")

    monkeypatch.setattr(gate, "cmd_gate", down)
    assert cli.main(["gate", "r.json", "--baseline", "b", "--fail-if", "worse"]) == 69
    assert "service unavailable" in capsys.readouterr().err
    # Ray that cannot start (seen on an overloaded machine) is a service unavailable too
    assert cli.exit_code_of(Exception("The current node timed out during startup. This could happen ...")) == 69
    assert cli.exit_code_of(ConnectionError("refused")) == 69 and cli.exit_code_of(KeyError("x")) == 70


def test_a_remote_call_or_run_past_its_time_limit_exits_69():
    from prefect.flow_engine import FlowRunTimeoutError
    from prefect.task_engine import TaskRunTimeoutError

    from flows.runtime.timeouts import RayTimeoutError

    for exc in (RayTimeoutError("Ray tasks 'cje_read': 2 of 2 did not finish within 2 s (CJE_RAY_GET_TIMEOUT)"),
                TaskRunTimeoutError("Task run exceeded timeout of 3600 second(s)"),
                FlowRunTimeoutError("Flow run exceeded timeout of 14400 second(s)")):
        assert cli.exit_code_of(exc) == 69, exc  # was 70, "internal error"


def test_json_documents_are_ascii(capsys):
    from flows.cli.terminal import out_json

    out_json({"policy": "é\x1b\u202e"})
    text = capsys.readouterr().out
    assert text.isascii() and json.loads(text)["policy"] == "é\x1b\u202e"


def test_cli_logging_survives_prefects_logging_setup(capsys):
    """Prefect replaces root handlers that do not look like the user's; the CLI's must stay."""
    import logging

    import prefect.logging.configuration as prefect_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level, dict(prefect_logging.PROCESS_LOGGING_CONFIG))
    try:
        cli._setup_logging(False, False)
        prefect_logging.setup_logging(incremental=False)
        logging.getLogger("flows.cli.test").info("still here")
        assert "INFO flows.cli.test: still here" in capsys.readouterr().err
    finally:  # leave the session's logging as it was
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        prefect_logging.PROCESS_LOGGING_CONFIG.clear()
        prefect_logging.PROCESS_LOGGING_CONFIG.update(saved[2])

"""Labelling tools as a registry (`flows.integrations.labelling`).

* conformance: every registered tool's export of a raised request, answered as the tool hands it back,
  is read by the label reader and kept whole by the labels flow's validation (label count checked:
  nothing dropped, nothing changed; a half-answered file is counted or refused, never silently short);
* a toy tool registered inside a test becomes a ``--format`` choice (and a toy server tool a ``--to``
  and ``--from`` choice) without editing any other file, and the pull of a server tool is ingested by
  ``cje labels`` through the same validation as a file.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from cje_engine import evaluate
from cje_engine.errors import CJEInputError
from cje_engine.simulate.direct import PolicySpec, simulate
from flows.cli.main import main
from flows.integrations import labelling
from flows.integrations.labelling.base import add_answers, answer_number
from flows.label_requests.raising import raise_requests_for_run
from flows.pipelines.labels import read_label_file, validate_labels
from flows.storage.labels import LabelStore
from flows.storage.logs import write_logs
from flows.storage.objects import Storage

POLICIES = (PolicySpec("base", quality_shift=0.8), PolicySpec("clone", quality_shift=0.8),
            PolicySpec("unhelpful", quality_shift=-1.0, adversarial=True))
NOW = datetime(2025, 3, 5, tzinfo=timezone.utc)
BUILTIN = ("csv", "jsonl", "label-studio", "argilla")


@pytest.fixture(scope="module")
def case():
    """Two days of logs with text (prompts start like a spreadsheet formula), and a result failing an audit."""
    sim = simulate(200, POLICIES, label_design="calibration_policy", oracle_fraction=0.3, audit_labels=5, seed=4)
    frame = sim.frame.copy()
    start = datetime(2025, 3, 1, tzinfo=timezone.utc)
    frame["ts"] = [start + timedelta(days=i % 2, hours=1) for i in range(len(frame))]
    result = evaluate(frame.drop(columns=["ts"]), calibration_policies=["base"], inference="analytic").to_dict()
    frame["prompt"] = "=question " + frame["prompt_id"]
    frame["response"] = "answer of " + frame["response_id"]
    return frame, result, dict(zip(frame["response_id"], sim.oracle_all))


@pytest.fixture
def world(case, tmp_path):
    """The logs, the label store, one pending request (for unhelpful) and an evaluations file naming them."""
    frame, result, oracle = case
    root = str(tmp_path / "data")
    st = Storage.for_uri(root)
    write_logs(st, pa.Table.from_pandas(frame.drop(columns=["oracle_label", "label_probability"]),
                                        preserve_index=False), basename="sim")
    lab = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    LabelStore(st).append(pa.Table.from_pandas(lab.reset_index(drop=True), preserve_index=False), "initial")
    (m,) = raise_requests_for_run(None, root, "ev", "2025-03-01_2025-03-02", result, root,
                                  {"notify": False, "triggers": ["audit_failed"]}, now=NOW)
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(yaml.safe_dump({"evaluations": [{"name": "ev", "logs_uri": root, "window": "2025-03-01..2025-03-02",
                                                     "options": {"calibration_policies": ["base"]}}]}))
    return {"root": root, "st": st, "request": m, "oracle": oracle, "config": str(cfg), "tmp": tmp_path}


def _export(world: dict, name: str, tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    tool = labelling.get(name)
    out = tmp_path / f"export-{name}{tool.suffix}"
    assert main(["requests", "export", world["request"]["request_id"], "--requests-uri", world["root"],
                 "--format", name, "--out", str(out)]) == 0
    return out, {p: p.read_bytes() for p in tool.outputs(out)}


def _round_trip(world: dict, name: str, tmp_path: Path) -> None:
    """Export, answer every item, read back (auto-detected and named), validate: every label kept."""
    tool = labelling.get(name)
    m = world["request"]
    out, files = _export(world, name, tmp_path)
    assert list(files) == tool.outputs(out) and all(p.exists() for p in files)
    ids = [r["response_id"] for r in m["rows"]]
    assert len(ids) >= 5
    answers = {i: float(world["oracle"][i]) for i in ids}
    back = tmp_path / f"answered-{name}{tool.suffix}"
    back.write_bytes(tool.answered(files, answers))
    for fmt in ("auto", tool.answers_format):
        table, source, info = read_label_file(str(back), answers_format=fmt)
        assert info["format"] == tool.answers_format
        got = dict(zip(table.column("response_id").to_pylist(), table.column("oracle_label").to_pylist()))
        assert table.num_rows == len(ids) and got == pytest.approx(answers)  # nothing dropped, nothing changed
    known = {r["response_id"]: {"inclusion_probability": r["inclusion_probability"]} for r in m["rows"]}
    assert validate_labels(table, source, known, m.get("label_scale") or (0.0, 1.0)).num_rows == len(ids)
    # one item left unanswered: counted as such by a tool's own reader; a table refuses the empty cell
    partial = tmp_path / f"partial-{name}{tool.suffix}"
    partial.write_bytes(tool.answered(files, {i: v for i, v in answers.items() if i != ids[0]}))
    table, source, info = read_label_file(str(partial))
    if tool.answers_format == "table":
        with pytest.raises(CJEInputError, match="oracle_label.*is empty"):
            validate_labels(table, source, known, (0.0, 1.0))
    else:
        assert table.num_rows == len(ids) - 1 and info["unanswered"] == 1


def test_the_builtin_tools_are_registered_in_order():
    assert labelling.names()[:4] == BUILTIN
    assert "label-studio" in labelling.server_names()
    assert callable(labelling.get("label-studio", server=True).status)  # push, pull and status on the interface
    assert labelling.answer_formats()[:4] == ("auto", "table", "label-studio", "argilla")


@pytest.mark.parametrize("name", labelling.names())
def test_every_registered_tool_round_trips_its_export_through_the_label_reader(name, world, tmp_path):
    _round_trip(world, name, tmp_path)


# ------------------------------------------------------------------------------ toy tools


class ToyTool:
    """A tool with its own answer format: ``[{"toy_key", "score"}]``."""

    name = "toy"
    title = "Toy"
    help = "a toy tool registered by a test"
    answers_format = "toy"
    suffix = ".json"

    def outputs(self, dest):
        return [Path(dest)]

    def export(self, items, dest, options):
        rows = [{"key": i["item_id"], "text": i.get(options.text_columns[-1])} for i in items]
        return {Path(dest): json.dumps({"toy": rows}).encode()}

    def answered(self, files, answers):
        doc = json.loads(next(iter(files.values())))
        return json.dumps([{"toy_key": r["key"], "score": answers.get(r["key"])} for r in doc["toy"]]).encode()

    def detects(self, first):
        return "toy_key" in first

    def parse(self, doc, source, answer_field="oracle_label", id_field="response_id"):
        out, seen = labelling.Answers(), {}
        for r in doc:
            where = f"toy {r['toy_key']}"
            values = [] if r["score"] is None else [(answer_number(r["score"], where, source), where)]
            add_answers(out, seen, str(r["toy_key"]), values, source)
        return out


class ToyServer(ToyTool):
    """`ToyTool` with an in-memory server: projects of ``{item: score or None}``."""

    name = "toy-server"
    answers_format = "toy-server"
    token_env = "TOY_TOKEN"

    def __init__(self):
        self.projects: dict[str, dict] = {}
        self.extra: list[dict] = []

    def detects(self, first):
        return False  # the toy above claims the format in `auto`

    def push(self, items, manifest, dest, options, storage=None):
        if dest.url.endswith(":9"):
            raise labelling.ToolUnavailable(f"toy server at {dest.url} is not reachable")
        project = self.projects.setdefault(dest.project or dest.new_project, {})
        already = len(project)
        fresh = [i["item_id"] for i in items if i["item_id"] not in project]
        project.update({i: None for i in fresh})
        return labelling.PushResult(project=str(dest.project), imported=len(fresh), already=already,
                                    tasks={k: n for n, k in enumerate(project)})

    def pull(self, dest, storage=None):
        if dest.url.endswith(":9"):
            raise labelling.ToolUnavailable(f"toy server at {dest.url} is not reachable")
        rows = [{"toy_key": k, "score": v} for k, v in self.projects[dest.project].items()] + self.extra
        return labelling.PullResult(document=json.dumps(rows).encode(), n_tasks=len(rows))


@pytest.fixture
def toy():
    tool = labelling.register(ToyTool())
    yield tool
    labelling.unregister(tool.name)


@pytest.fixture
def toy_server():
    tool = labelling.register(ToyServer())
    yield tool
    labelling.unregister(tool.name)


def test_a_tool_registered_in_a_test_is_a_cli_choice_and_round_trips(world, tmp_path, capsys):
    assert "toy" not in labelling.names()
    assert main(["requests", "export", world["request"]["request_id"], "--requests-uri", world["root"],
                 "--format", "toy", "--out", str(tmp_path / "x.json")]) == 64  # not a choice before it is registered
    assert "invalid choice: 'toy'" in capsys.readouterr().err
    labelling.register(ToyTool())
    try:
        assert main(["requests", "export", "--help"]) == 0
        assert "toy: a toy tool registered by a test" in " ".join(capsys.readouterr().out.split())
        assert main(["labels", "--help"]) == 0
        assert "toy}" in capsys.readouterr().out  # a --format of `cje labels`
        _round_trip(world, "toy", tmp_path)
    finally:
        labelling.unregister("toy")
    assert "toy" not in labelling.names()


def test_a_toy_server_tool_is_pushed_to_and_its_pull_ingested_by_cje_labels(prefect_server, toy, toy_server, world,
                                                                            capsys):
    m, n = world["request"], len(world["request"]["rows"])
    push = ["requests", "push", m["request_id"], "--to", "toy-server", "--url", "http://127.0.0.1:8", "--project",
            "p1", "--requests-uri", world["root"]]
    assert main(push) == 0
    said = capsys.readouterr().out
    assert f"{n} task(s) imported into Toy project p1 at http://127.0.0.1:8 (0 there already)" in said
    assert main(push) == 0 and "0 task(s) imported" in capsys.readouterr().out  # idempotent
    assert main([*push[:6], "http://127.0.0.1:9", *push[7:]]) == 69  # the tool's server down: unavailable
    assert "not reachable" in capsys.readouterr().err
    answers = {i: float(world["oracle"][i]) for i in toy_server.projects["p1"]}
    toy_server.projects["p1"].update(answers)
    pull = ["labels", "--from", "toy-server", "--url", "http://127.0.0.1:8", "--project", "p1", "--evaluation", "ev",
            "--config", world["config"], "--no-reevaluate"]
    # a second, disagreeing answer for one item: refused by the same validation as a file, nothing stored
    first = next(iter(answers))
    toy_server.extra = [{"toy_key": first, "score": 1.0 - answers[first]}]
    version = LabelStore(world["st"]).version()
    assert main(pull) == 2
    assert f"item {first!r} appears twice" in capsys.readouterr().err
    assert LabelStore(world["st"]).version() == version
    toy_server.extra = []
    assert main(pull) == 0
    out = capsys.readouterr().out
    assert f"ingested {n} label(s)" in out and "(toy-server" in out
    assert f"request {m['request_id']}: {n}/{n} received (fulfilled)" in out
    store = LabelStore(world["st"]).read()
    got = dict(zip(store.column("response_id").to_pylist(), store.column("oracle_label").to_pylist()))
    assert {i: got[i] for i in answers} == pytest.approx(answers)  # every pulled label stored
    pulled = [i.key for i in world["st"].list("label_requests/_pulled/")]
    assert len(pulled) == 2 and all(k.split("/")[-1].startswith("toy-server-p1-") for k in pulled)  # kept as pulled


def test_registering_checks_the_protocol_and_names(toy):
    with pytest.raises(ValueError, match="already registered"):
        labelling.register(ToyTool())
    with pytest.raises(ValueError, match="lower case"):
        labelling.register(type("Bad", (ToyTool,), {"name": "Bad Name"})())
    with pytest.raises(TypeError, match="lacks"):
        labelling.register(type("NoExport", (), {"name": "no-export", "title": "x", "help": "x",
                                                 "answers_format": "table", "suffix": ".csv"})())
    half = type("Half", (ToyTool,), {"name": "half", "answers_format": "half", "push": lambda self: None})
    with pytest.raises(TypeError, match="push and pull"):
        labelling.register(half())
    with pytest.raises(CJEInputError, match="unknown labelling tool 'label-studoi'.*did you mean 'label-studio'"):
        labelling.get("label-studoi")
    with pytest.raises(CJEInputError, match="unknown labelling tool with a server 'csv'"):
        labelling.get("csv", server=True)


# ------------------------------------------------------------------------------ status


@pytest.mark.parametrize("name", labelling.names())
def test_every_tool_says_what_its_files_hold(name, world, tmp_path, capsys):
    """Issue 30: the interface had export, push and pull but no status. Now every tool says how many items its
    exported or answered file holds, answered and not (a file cannot tell what was deleted in the tool)."""
    tool = labelling.get(name)
    out, files = _export(world, name, tmp_path)
    capsys.readouterr()
    ids = [r["response_id"] for r in world["request"]["rows"]]
    partial = tmp_path / f"partial-{name}{tool.suffix}"
    partial.write_bytes(tool.answered(files, {i: float(world["oracle"][i]) for i in ids[1:]}))
    for path, answered in ((out, 0), (partial, len(ids) - 1)):
        assert main(["requests", "status", "--tool", name, "--file", str(path), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["tool"]
        assert (got["pushed"], got["answered"], got["unanswered"], got["deleted"]) == (
            len(ids), answered, len(ids) - answered, None), got
    assert main(["requests", "status", "--tool", name, "--file", str(partial)]) == 0
    assert (f"{name} {partial}: {len(ids)} pushed, {len(ids) - 1} answered, 1 unanswered, ? deleted"
            in capsys.readouterr().out)


def test_status_of_a_server_tool_asks_its_server(toy, toy_server, world, capsys):
    m = world["request"]
    ids = [r["response_id"] for r in m["rows"]]
    assert main(["requests", "push", m["request_id"], "--to", "toy-server", "--url", "http://127.0.0.1:8",
                 "--project", "p1", "--requests-uri", world["root"]]) == 0
    toy_server.projects["p1"].update({i: 0.5 for i in ids[:3]})
    status = ["requests", "status", "--tool", "toy-server", "--url", "http://127.0.0.1:8", "--project", "p1",
              "--requests-uri", world["root"]]
    capsys.readouterr()
    assert main([*status, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["tool"]["pushed"], doc["tool"]["answered"], doc["tool"]["unanswered"]) == (len(ids), 3, len(ids) - 3)
    assert doc["requests"] == 1  # the requests' own counts are still there
    assert main([*status[:5], "http://127.0.0.1:9", *status[6:]]) == 69
    assert "not reachable" in capsys.readouterr().err
    assert main(["requests", "status", "--tool", "csv", "--url", "http://127.0.0.1:8", "--project", "p1"]) == 2
    assert "unknown labelling tool with a server 'csv'" in capsys.readouterr().err
    assert main(["requests", "status", "--file", "x.csv", "--requests-uri", world["root"]]) == 2
    assert "--file, --url and --project go with --tool" in capsys.readouterr().err

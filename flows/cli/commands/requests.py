"""``cje requests list | show | status | export | push``: label requests as work for people.

Requests live under ``label_requests/`` of the evaluation's results (or ``label_requests.requests_uri``);
``--evaluation NAME`` finds them through the evaluations file, ``--requests-uri`` names them directly.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from cje_engine.errors import CJEInputError

from flows.cli.common import CONFIG_HELP
from flows.cli.exits import EXIT_OK, EXIT_UNAVAILABLE
from flows.cli.terminal import json_doc, out_json
from flows.integrations import labelling
from flows.label_requests import exports
from flows.label_requests.manifests import list_requests, progress, summarize
from flows.storage.objects import Storage, StorageConfig

log = logging.getLogger(__name__)

STATUSES = ("pending", "partly_fulfilled", "fulfilled", "expired")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def config_path(ns: argparse.Namespace) -> str:
    """The evaluations file in use (`flows.cli.common.find_config`: --config, $CJE_CONFIG, ./evaluations.yaml)."""
    from flows.cli.common import find_config

    if getattr(ns, "config_in_use", None) is None:  # found (and named on stderr) once per command
        ns.config_in_use = str(find_config(ns.config))
    return ns.config_in_use


def spec_of(config: str, name: str):
    """The declared evaluation ``name`` of the evaluations file ``config`` (`flows.cli.common.find_evaluation`)."""
    from flows.cli.common import find_evaluation

    return find_evaluation(name, config, quiet=True)[1]


def _where(spec: Any) -> dict[str, Any]:
    req = (spec.label_requests or {}).get("requests_uri") or spec.results_uri or spec.logs_uri
    return {"requests_uri": req, "labels_uri": (spec.label_requests or {}).get("labels_uri") or spec.labels_uri
            or spec.logs_uri, "logs_uri": spec.logs_uri, "columns": dict(spec.columns) or None}


def roots(ns: argparse.Namespace) -> list[dict[str, str]]:
    """Where to look: the named evaluation, every declared one, or ``--requests-uri``."""
    if getattr(ns, "requests_uri", None):
        return [{"requests_uri": ns.requests_uri, "labels_uri": ns.labels_uri or ns.requests_uri,
                 "logs_uri": ns.logs_uri}]
    if ns.evaluation:
        return [_where(spec_of(config_path(ns), ns.evaluation))]
    from flows.runtime.schedules import load_evaluations

    seen: dict[str, dict] = {}
    for spec in load_evaluations(config_path(ns)).values():
        w = _where(spec)
        seen.setdefault(w["requests_uri"], w)
    return list(seen.values())


def _labelled(labels_uri: str, cfg: StorageConfig) -> set[str]:
    from flows.storage.labels import LabelStore

    store = LabelStore(Storage.for_uri(labels_uri, cfg))
    return set(store.read().column("response_id").to_pylist()) if store.version() else set()


def _anchors_done(manifests: list[dict], anchors_uri: str | None, cfg: StorageConfig) -> set | None:
    from flows.storage.anchors import labelled_since

    sets = {(m.get("drift") or {}).get("set_name") for m in manifests if m.get("anchors")}
    if not sets:
        return set()
    if not anchors_uri:
        return None
    st = Storage.for_uri(anchors_uri, cfg)
    first = min(str(m.get("created_at")) for m in manifests if m.get("anchors"))
    return {(s, a) for s in sets if s for a in labelled_since(st, s, first)}


def collect(ns: argparse.Namespace) -> list[tuple[dict, dict, dict]]:
    """(where, manifest, progress) of every request found."""
    cfg = StorageConfig.from_env()
    out = []
    for w in roots(ns):
        manifests = list_requests(Storage.for_uri(w["requests_uri"], cfg))
        if not manifests:
            continue
        labelled = _labelled(w["labels_uri"], cfg)
        done = _anchors_done(manifests, getattr(ns, "anchors_uri", None), cfg)
        out += [(w, m, progress(m, labelled, done)) for m in manifests]
    return out


def find(ns: argparse.Namespace, request_id: str) -> tuple[dict, dict, dict]:
    """The (evaluation, manifest, progress) of ``request_id``; `CJEInputError` when no request has it."""
    for item in collect(ns):
        if item[1]["request_id"] == request_id:
            return item
    raise CJEInputError(f"no label request {request_id!r} (see `cje requests list`)")


# --------------------------------------------------------------------------------------
# handlers


def _line(p: dict) -> str:
    anchors = f" + {p['anchors_received'] if p['anchors_received'] is not None else '?'}/{p['anchors']} anchors" \
        if p["anchors"] else ""
    return (f"{p['request_id']}  {p['status']:<16} {p['evaluation'] or '-'}/{p['scope']:<12} "
            f"{p['rows_received']:>4}/{p['rows']:<4} rows{anchors}  {','.join(p['triggers'])}  "
            f"deadline {str(p['deadline'])[:10]}")


def cmd_list(ns: argparse.Namespace) -> int:
    """``cje requests list``: the requests (optionally of one status); returns the exit code."""
    items = [p for _, _, p in collect(ns) if ns.status is None or p["status"] == ns.status]
    if ns.json:
        out_json(json_doc("requests list", requests=items))
        return EXIT_OK
    if not items:
        sys.stdout.write("no label requests" + (f" with status {ns.status}" if ns.status else "") + "\n")
    for p in items:
        sys.stdout.write(_line(p) + "\n")
    return EXIT_OK


def cmd_show(ns: argparse.Namespace) -> int:
    """``cje requests show``: one request's manifest and progress; returns the exit code."""
    w, m, p = find(ns, ns.request_id)
    if ns.json:
        out_json(json_doc("requests show", **{k: v for k, v in m.items() if k not in ("cje_json", "command")},
                          progress=p))
        return EXIT_OK
    out = [_line(p), f"  requests: {w['requests_uri']}", f"  window {m.get('window')}  design {m.get('design')}",
           f"  budget {m.get('budget', {}).get('period')}: {m.get('n_labels')} label(s)"]
    out += [f"  reason [{r['trigger']}] {r['reason']}" for r in m.get("reasons") or []]
    if m.get("note"):
        out.append(f"  note: {m['note']}")
    if m.get("drift"):
        out.append(f"  drift: monitor {m['drift'].get('monitor')}, anchor set {m['drift'].get('set_name')}, "
                   f"look {m['drift'].get('look')}; traffic: {m['drift'].get('traffic')}")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


def tool_status(ns: argparse.Namespace) -> labelling.ToolStatus | None:
    """What ``--tool`` says about its items: its server's ``--project`` at ``--url``, or the ``--file`` it
    exported or handed back (`flows.integrations.labelling.tool_status`); None without ``--tool``."""
    if not getattr(ns, "tool", None):
        if ns.file or ns.url or ns.project:
            raise CJEInputError("--file, --url and --project go with --tool (e.g. --tool csv --file labelled.csv, "
                                "or --tool label-studio --url URL --project 12)")
        return None
    if ns.url or ns.project:
        if not (ns.url and ns.project):
            raise CJEInputError(f"--tool {ns.tool} with a server needs both --url and --project")
        storage = None
        if getattr(ns, "requests_uri", None) or ns.evaluation:
            storage = Storage.for_uri(roots(ns)[0]["requests_uri"], StorageConfig.from_env())
        dest = labelling.Destination(url=ns.url, project=ns.project, token_env=ns.token_env)
        return labelling.tool_status(ns.tool, dest=dest, storage=storage)
    if not ns.file:
        raise CJEInputError(f"--tool {ns.tool} needs --file FILE (an exported or answered file)"
                            + (" or --url and --project" if ns.tool in labelling.server_names() else ""))
    path = Path(ns.file)
    if not path.is_file():
        raise CJEInputError("not found (the file exported with `cje requests export` or answered)", source=str(path))
    return labelling.tool_status(ns.tool, data=path.read_bytes(), source=str(path))


def cmd_status(ns: argparse.Namespace) -> int:
    """``cje requests status``: counts by status and each request's progress (and, with ``--tool``, what the
    labelling tool holds); returns the exit code (69 when the tool's server does not answer)."""
    try:
        tool = tool_status(ns)
    except labelling.ToolUnavailable as exc:
        sys.stderr.write(f"cje requests status: error: {exc}\n")
        return EXIT_UNAVAILABLE
    items = [p for _, _, p in collect(ns)] if (ns.evaluation or ns.requests_uri or tool is None) else []
    s = summarize(items)
    if ns.json:
        extra = {"tool": tool.to_dict()} if tool is not None else {}
        out_json(json_doc("requests status", **s, items=items, **extra))
        return EXIT_OK
    if tool is not None:
        sys.stdout.write(tool.line() + "\n")
        if not items:
            return EXIT_OK
    lines = [f"{s['requests']} request(s), {s['received']} of {s['requested']} label(s) received"]
    lines += [f"  {st:<16} {s['by_status'].get(st, 0)}" for st in STATUSES]
    lines.append("by reasons (a request merged from several reasons counts once):")
    lines += [f"  {t:<18} {r['requests']} request(s), {r['received']}/{r['requested']} label(s)"
              for t, r in sorted(s["by_reasons"].items())]
    lines += ["", *[_line(p) for p in items]]
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK


def request_items(w: dict, m: dict, ns: argparse.Namespace) -> list[dict]:
    """The request's items with text from the logs (and the anchor set)."""
    cfg = StorageConfig.from_env()
    logs_uri = ns.logs_uri or m.get("logs_uri") or w.get("logs_uri")
    if m.get("rows") and not logs_uri:
        raise CJEInputError(f"request {m['request_id']} does not name its logs; pass --logs-uri")
    mapping = w.get("columns") if logs_uri == w.get("logs_uri") else None  # the evaluation's column names
    if ns.text_columns is None:  # from the logs' own columns (`exports.default_text_columns`)
        ns.text_columns = list(exports.default_text_columns(logs_uri, cfg, m.get("rows") or [], mapping)
                               if m.get("rows") else exports.DEFAULT_TEXT_COLUMNS)
    cols = tuple(ns.text_columns)
    texts = exports.read_texts(logs_uri, cfg, m.get("rows") or [], cols, mapping) if m.get("rows") else {}
    anchor_texts = None
    if m.get("anchors"):
        drift = m.get("drift") or {}
        anchors_uri = ns.anchors_uri or _monitor_anchors_uri(ns, drift.get("set_name"))
        if anchors_uri:
            anchor_texts = exports.read_anchor_texts(anchors_uri, cfg, drift.get("set_name"),
                                                     drift.get("anchors_version"), cols)
    _warn_ids_naming_policies(m)
    return exports.request_items(m, texts, anchor_texts, text_columns=cols, include_judge_score=ns.include_judge_score)


def _blind_description(m: dict) -> str:
    """What labellers read about a request: its id and trigger codes, never the reasons (they name the
    policy) nor the policy."""
    triggers = ", ".join(dict.fromkeys(str(r.get("trigger")) for r in m.get("reasons") or []))
    return f"cje label request {m['request_id']}" + (f" ({triggers})" if triggers else "")


def _warn_ids_naming_policies(m: dict) -> None:
    """Exports hide the policy, but a response id that contains its policy's name (the ids `cje evaluate`
    synthesises, ``policy:prompt_id:k``) shows it to labellers: say so."""
    named = [r for r in m.get("rows") or [] if r.get("policy") and str(r["policy"]) in str(r.get("response_id"))]
    if named:
        log.warning("request %s: %d of %d response id(s) contain their policy's name (e.g. %r); labellers will "
                    "see it in the id column. Give the logs opaque response ids "
                    "(flows.storage.logs.opaque_response_ids, "
                    "docs/logs-layout.md \"Response ids\")",
                    m.get("request_id"), len(named), len(m.get("rows") or []), named[0]["response_id"])


def _monitor_anchors_uri(ns: argparse.Namespace, set_name: str | None) -> str | None:
    try:
        from flows.pipelines.drift_config import load_drift_monitors

        for spec in load_drift_monitors(config_path(ns)).values():
            if spec.set_name == set_name:
                return spec.anchors_uri
    except CJEInputError:
        return None
    return None


def _options(m: dict, ns: argparse.Namespace) -> labelling.ExportOptions:
    """How the request's items are shown (`flows.integrations.labelling.ExportOptions`)."""
    lo, hi = m.get("label_scale") or (0.0, 1.0)
    return labelling.ExportOptions(tuple(ns.text_columns), (float(lo), float(hi)), bool(ns.include_judge_score))


def cmd_export(ns: argparse.Namespace) -> int:
    """``cje requests export``: the request's items as the files of the labelling tool ``--format``
    (every path checked before any work, written create-only)."""
    tool = labelling.get(ns.format)
    out = Path(ns.out)
    paths = tool.outputs(out)
    _check_outputs(paths, ns.force)  # before any work
    w, m, _ = find(ns, ns.request_id)
    items = request_items(w, m, ns)
    files = tool.export(items, out, _options(m, ns))
    if list(files) != paths:
        raise RuntimeError(f"labelling tool {tool.name!r} exported {list(files)}, not the files it declares {paths}")
    _write_exports(files, ns.force)
    extra = f" (also: {', '.join(str(p) for p in paths[1:])})" if len(paths) > 1 else ""
    sys.stdout.write(f"request {m['request_id']}: {len(items)} item(s) as {ns.format} in {out}{extra}; judge scores "
                     f"{'included' if ns.include_judge_score else 'left out'}\n")
    return EXIT_OK


def _check_outputs(paths: list[Path], force: bool) -> None:
    """Refuse an export file that is a symbolic link, or exists without ``--force`` (`CJEInputError`)."""
    for path in paths:
        if path.is_symlink():
            raise CJEInputError("is a symbolic link; refusing to write through it (give a plain file path)",
                                source=str(path))
        if path.exists() and not force:
            raise CJEInputError("exists already; give --force to replace it or choose another file",
                                source=str(path))


def _write_exports(files: dict[Path, bytes], force: bool) -> None:
    """Write each export file create-only (``--force``: replace), never through a symbolic link; every
    file is checked again before the first is written, so a refusal writes nothing."""
    from flows.cli.common import write_new_file

    _check_outputs(list(files), force)
    for path, blob in files.items():
        write_new_file(path, blob, force=force)


def cmd_push(ns: argparse.Namespace) -> int:
    """``cje requests push``: the request's items into a project of the server tool ``--to`` (exit 69 when
    its server does not answer)."""
    tool = labelling.get(ns.to, server=True)
    w, m, _ = find(ns, ns.request_id)
    items = request_items(w, m, ns)
    dest = labelling.Destination(url=ns.url, project=ns.project, new_project=ns.new_project, token_env=ns.token_env,
                                 description=_blind_description(m))
    try:
        out = tool.push(items, m, dest, _options(m, ns),
                        storage=Storage.for_uri(w["requests_uri"], StorageConfig.from_env()))
    except labelling.ToolUnavailable as exc:
        sys.stderr.write(f"cje requests push: error: {exc}\n")
        return EXIT_UNAVAILABLE
    sys.stdout.write(f"request {m['request_id']}: {out.imported} task(s) imported into {tool.title} project "
                     f"{out.project} at {ns.url} ({out.already} there already)\n")
    return EXIT_OK


# --------------------------------------------------------------------------------------
# parser


def token_envs() -> str:
    """``VARIABLE for tool`` of each server tool, for the help texts."""
    return ", ".join(f"{labelling.get(n).token_env} for {n}" for n in labelling.server_names())


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--evaluation", help="a declared evaluation (default: every declared one)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--requests-uri", help="where label_requests/ lives (instead of --evaluation)")
    p.add_argument("--labels-uri", help="the label store (with --requests-uri; default the same root)")
    p.add_argument("--logs-uri", help="logs to join the text from (default: the request's)")
    p.add_argument("--anchors-uri", help="anchor sets of drift requests (default: the declared drift monitor's)")


def _text(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-columns", type=_csv, default=None,
                   help="log columns shown to labellers (default: prompt,response, those of the two the logs have "
                        "after the evaluation's columns: mapping; else the logs' text columns named like question, "
                        "answer, output, text; never ids, the policy or scores)")
    p.add_argument("--include-judge-score", action="store_true",
                   help="show the judge score (default: left out, labellers stay blind to it)")


def register(sub: Any) -> None:
    """Add ``cje requests ...`` to the ``cje`` parser."""
    p = sub.add_parser("requests", help="list, show, export and push oracle label requests")
    rs = p.add_subparsers(dest="requests_command", required=True)
    q = rs.add_parser("list", help="requests with their status and counts")
    _common(q)
    q.add_argument("--status", choices=STATUSES)
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_list)
    q = rs.add_parser("show", help="one request: reasons, budget, progress")
    q.add_argument("request_id")
    _common(q)
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_show)
    q = rs.add_parser("status", help="counts per status and per reason (--tool: what a labelling tool holds)")
    _common(q)
    q.add_argument("--json", action="store_true")
    q.add_argument("--tool", choices=labelling.names(),
                   help="also say what this labelling tool holds: pushed, answered, unanswered, deleted items "
                        "(a server tool asks its server: --url, --project; a file tool reads --file)")
    q.add_argument("--file", help="with --tool: a file exported for it or answered in it")
    q.add_argument("--url", help="with a server --tool: its URL")
    q.add_argument("--project", help="with a server --tool: the project")
    q.add_argument("--token-env", help="environment variable holding the token (default: the tool's, "
                                       + token_envs() + ")")
    q.set_defaults(handler=cmd_status)
    q = rs.add_parser("export", help="a request as files for a labelling tool: "
                                     + ", ".join(labelling.names()))
    q.add_argument("request_id")
    q.add_argument("--format", choices=labelling.names(), default="csv",
                   help="the labelling tool (" + labelling.help_lines() + ")")
    q.add_argument("--out", required=True, help="output file (never replaced unless --force; never a symbolic link)")
    q.add_argument("--force", action="store_true", help="replace an existing --out file")
    _common(q)
    _text(q)
    q.set_defaults(handler=cmd_export)
    q = rs.add_parser("push", help="push a request into a labelling tool with a server")
    q.add_argument("request_id")
    q.add_argument("--to", choices=labelling.server_names(), required=True,
                   help="the tool (" + labelling.help_lines(server=True) + ")")
    q.add_argument("--url", required=True, help="the tool's server URL")
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("--project", help="an existing project id")
    g.add_argument("--new-project", help="create a project with this title (labeling config from the request)")
    q.add_argument("--token-env", help="environment variable holding the token (default: the tool's, "
                                       + token_envs() + ")")
    _common(q)
    _text(q)
    q.set_defaults(handler=cmd_push)

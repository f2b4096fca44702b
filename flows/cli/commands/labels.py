"""``cje labels``: ingest returned oracle labels (a file or a labelling tool's project) and re-evaluate.

A file can be a table (CSV, JSONL, Parquet) or the answers of a registered labelling tool (a Label Studio
JSON export, Argilla records, ...: `flows.integrations.labelling`); with ``--from TOOL --url URL --project P``
(a tool with a server, e.g. ``label-studio``) the project's answers are pulled first and kept, as pulled,
under ``label_requests/_pulled/`` (create-only), then ingested exactly like a file of that tool's format.
"""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from typing import Any

from flows.cli.common import CONFIG_HELP
from flows.cli.exits import EXIT_OK, EXIT_UNAVAILABLE
from flows.cli.commands.requests import config_path, spec_of, token_envs
from flows.integrations import labelling
from flows.label_requests.answers import answer_formats, parse_scale
from flows.storage.objects import Storage, StorageConfig

PULLED = "label_requests/_pulled"


def pull_answers(ns: argparse.Namespace, requests_uri: str) -> tuple[str, list[str]]:
    """Pull a project's answers from the server tool ``ns.source`` into the requests storage, create-only
    (``label_requests/_pulled/<tool>-<project>-<time><suffix>``); returns its URL and the items deleted in
    the tool."""
    tool = labelling.get(ns.source, server=True)
    st = Storage.for_uri(requests_uri, StorageConfig.from_env())
    got = tool.pull(labelling.Destination(url=ns.url, project=ns.project, token_env=ns.token_env), storage=st)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    key = f"{PULLED}/{tool.name}-{_safe(ns.project)}-{stamp}{got.suffix}"
    st.put_if_absent(key, got.document)
    return st.url(key), list(got.deleted)


def _safe(project: str) -> str:
    """A project id as part of an object key (anything but letters, digits, ``-``, ``_`` and ``.`` -> ``_``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(project).strip())


def cmd_labels(ns: argparse.Namespace) -> int:
    """``cje labels``: a label file, or the pull of a server tool (``--from``), through the labels flow."""
    from flows.pipelines.labels import labels
    from flows.runtime.prefect_server import prefect_api

    config = config_path(ns)
    spec = spec_of(config, ns.evaluation)
    requests_uri = (spec.label_requests or {}).get("requests_uri") or spec.results_uri or spec.logs_uri
    deleted: list[str] = []
    path, fmt = ns.file, ns.format
    if ns.source:
        if ns.file or not (ns.url and ns.project is not None):
            sys.stderr.write(f"cje labels: error: --from {ns.source} needs --url and --project (and no file)\n")
            return 64
        try:
            path, deleted = pull_answers(ns, requests_uri)
        except labelling.ToolUnavailable as exc:
            sys.stderr.write(f"cje labels: error: {exc}\n")
            return EXIT_UNAVAILABLE
        fmt = labelling.get(ns.source).answers_format  # the pull is read like a file of the tool's format
    elif not ns.file:
        sys.stderr.write("cje labels: error: give a label file, or --from TOOL --url URL --project P (TOOL: "
                         + ", ".join(labelling.server_names()) + ")\n")
        return 64
    with prefect_api():
        out = labels(path, labels_uri=spec.labels_uri or spec.logs_uri, logs_uri=spec.logs_uri,
                     results_uri=spec.results_uri, requests_uri=requests_uri, evaluations_file=config,
                     reevaluate=not ns.no_reevaluate, label_scale=list(ns.label_scale) if ns.label_scale else None,
                     answers_format=fmt, answer_field=ns.answer_field, id_field=ns.id_field,
                     anchors_uri=ns.anchors_uri, partial_windows=ns.partial_windows)
    _print(out, deleted)
    return EXIT_OK


def _print(out: dict[str, Any], deleted: list[str]) -> None:
    w = sys.stdout.write
    if out["version"] is not None:
        w(f"ingested {out['rows']} label(s) from {out['source']} ({out['format']}, scale "
          f"{out['label_scale'][0]:g}-{out['label_scale'][1]:g}): label-store version {out['version']} "
          f"({'new' if out['new'] else 'already stored'}, {len(out['conflicts'])} conflict(s))\n")
    for a in out.get("anchors") or []:
        w(f"anchor set {a['set_name']}: {a['labels']} label(s) stored as version {a['version']} "
          f"({a['relabelled']} relabelled)\n")
    if out.get("ignored") or out.get("duplicates") or out.get("unanswered"):
        w(f"tool answers: {out.get('duplicates', 0)} duplicate(s) counted once, ignored {out.get('ignored') or {}}, "
          f"{out.get('unanswered', 0)} item(s) not answered yet\n")
    if deleted:
        w(f"warning: {len(deleted)} pushed task(s) are no longer in the labelling tool (deleted there?): "
          f"{', '.join(deleted[:5])}{' ...' if len(deleted) > 5 else ''}; their rows stay pending; push the request "
          "again to recreate them\n")
    for r in out["requests"]:
        w(f"request {r['request_id']}: {r['received']}/{r['requested']} received ({r['status']})\n")
    for ev in out["reevaluations"]:
        w(f"re-evaluated {ev.get('evaluation')} {ev.get('window')}: "
          f"{'published ' + str(ev.get('run_key')) if ev.get('published') else ev.get('reason')}"
          + (f" (days without logs: {', '.join(ev['missing_days'])})" if ev.get("missing_days") else "") + "\n")
    for sk in out.get("skipped_windows") or []:
        w(f"not re-evaluated {sk['evaluation']} {sk['window']}: {sk['reason']}\n")


def register(sub: Any) -> None:
    """Add ``cje labels`` to the ``cje`` parser."""
    p = sub.add_parser("labels", help="ingest returned oracle labels and re-evaluate the windows they touch")
    p.add_argument("file", nargs="?", help="labels: CSV/JSONL/Parquet (response_id, oracle_label[, label_probability]), "
                                           "or a labelling tool's answers (" + ", ".join(answer_formats()[2:]) + ")")
    p.add_argument("--evaluation", required=True, help="the declared evaluation whose label store receives them")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--no-reevaluate", action="store_true", help="only ingest; do not re-run the evaluations")
    p.add_argument("--partial-windows", action="store_true",
                   help="re-evaluate a published window even when some of its days have no logs (default: skip it)")
    p.add_argument("--from", dest="source", choices=labelling.server_names(),
                   help="pull the answers from a labelling tool with a server")
    p.add_argument("--url", help="the tool's server URL (with --from)")
    p.add_argument("--project", help="the tool's project id (with --from)")
    p.add_argument("--token-env", help="environment variable holding the token (with --from; default: the tool's, "
                                       + token_envs() + ")")
    p.add_argument("--format", choices=answer_formats(), default="auto", help="format of the file (default: detect)")
    p.add_argument("--answer-field", default="oracle_label",
                   help="the tool's answer field: column, Label Studio control or Argilla question (default oracle_label)")
    p.add_argument("--id-field", default="response_id", help="id column of a table (default response_id)")
    p.add_argument("--label-scale", type=parse_scale,
                   help="scale of the answers, e.g. 1-5 (mapped onto the evaluation's label scale when it differs)")
    p.add_argument("--anchors-uri", help="anchor-set storage for anchor labels (default: the declared drift monitor's)")
    p.set_defaults(handler=cmd_labels)

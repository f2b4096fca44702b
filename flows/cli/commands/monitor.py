"""`cje runs NAME` (run history) and `cje diff NAME [RUN_A RUN_B]` (what changed between two runs).

Both read only what is published under the evaluation's results location (``results_uri`` of its entry
in the evaluations file, default its ``logs_uri``): committed runs, never partial ones.
"""
from __future__ import annotations

import argparse
import math
import sys
from statistics import NormalDist
from typing import Any, Mapping, Sequence

from cje_engine.errors import CJEInputError

from flows.cli.common import CONFIG_HELP
from flows.cli.exits import EXIT_OK
from flows.cli.terminal import json_doc, out_json
from flows.reports.common import fmt, fmt_ci, safe_str, signed
from flows.reports.history import latest_per_window, previous_run, read_history, what_changed, window_changes_of
from flows.reports.table import text_table
from flows.storage.objects import Storage
from flows.storage.publish import list_runs, read_run

__all__ = ["register", "cmd_runs", "cmd_diff", "published_result"]


def register(sub: Any) -> None:
    """Add ``runs`` and ``diff`` to the `cje` sub-commands."""
    p = sub.add_parser("runs", help="history of a declared evaluation: every published run, per policy value, "
                                    "claim, audit and labels")
    p.add_argument("name", help="evaluation name in the evaluations file")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (shape in docs/cli.md)")
    p.set_defaults(handler=cmd_runs)

    p = sub.add_parser("diff", help="what changed between two published runs (default: the latest and the one "
                                    "before it)")
    p.add_argument("name", help="evaluation name in the evaluations file")
    p.add_argument("runs", nargs="*", metavar="RUN", help="two run keys (or unique prefixes, or window labels)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (shape in docs/cli.md)")
    p.set_defaults(handler=cmd_diff)


def _results_storage(name: str, config: str | None) -> tuple[str, Storage]:
    from flows.cli.common import find_evaluation

    _, spec = find_evaluation(name, config)  # --config, $CJE_CONFIG, ./evaluations.yaml
    uri = spec.results_uri or spec.logs_uri
    return uri, Storage.for_uri(uri)


def _history(ns: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    uri, st = _results_storage(ns.name, ns.config)
    return uri, read_history(st, ns.name)


def published_result(name: str, config: str | None = None, run: str | None = None) -> dict[str, Any]:
    """The parsed result.json of one published run of a declared evaluation.

    Parameters
    ----------
    name : evaluation name in the evaluations file
    config : the evaluations file (default: ``$CJE_CONFIG``, else ``./evaluations.yaml``)
    run : run key, unique prefix or window label (as in `cje diff`); default the newest publication

    Returns
    -------
    dict with ``window``, ``run_key``, ``path`` (the run), ``result`` (the result dict) and ``result_json``
    (where that result.json is). Raises `CJEInputError`
    when the evaluation has no such published run or its result.json is missing.
    """
    uri, st = _results_storage(name, config)
    runs = list_runs(st, name)  # manifests only: the one result.json is read below
    if not runs:
        raise CJEInputError(f"no published runs of {name!r}; `cje run {name}` publishes one", source=uri)
    row = _find(runs, run) if run else runs[-1]  # oldest publication first
    got = read_run(st, name, row["window"], row["run_key"])
    if got is None or not isinstance(got.get("result"), dict):
        raise CJEInputError(f"run {row['run_key']} of {name!r} has no readable result.json", source=row["path"])
    return {**{k: got[k] for k in ("window", "run_key", "path", "result")},
            "result_json": (got.get("artifacts") or {}).get("result.json")}


def _when(ts: Any) -> str:
    return str(ts or "")[:19].replace("T", " ")


def _window(w: Any) -> str:
    a, _, b = str(w).partition("_")
    return a if not b or a == b else f"{a}..{b}"


def cmd_runs(ns: argparse.Namespace) -> int:
    """Print the run history (or ``--json``)."""
    uri, history = _history(ns)
    changes = window_changes_of(history)
    alarms = {(n, w) for n, pc in changes.items() for w in pc.alarms}
    latest = {(r["window"], r["run_key"]) for r in latest_per_window(history)}
    if ns.json:
        out = []
        for r in history:
            row = {k: v for k, v in r.items() if k != "report_key"}
            row["superseded"] = (r["window"], r["run_key"]) not in latest
            row["regression_alarms"] = sorted(n for n in r["policies"] if (n, r["window"]) in alarms
                                              and not row["superseded"])
            out.append(row)
        out_json(json_doc("runs", evaluation=ns.name, results_uri=uri, runs=out))
        return EXIT_OK
    if not history:
        sys.stdout.write(f"No published runs of {safe_str(ns.name)} under {safe_str(uri)}\n")
        return EXIT_OK
    rows = []
    for r in history:
        first = True
        superseded = (r["window"], r["run_key"]) not in latest
        for name, p in r["policies"].items():
            est = "refused" if p["level_claim"] == "refused" else fmt(p["estimate"])
            ci = "" if p["level_claim"] == "refused" else fmt_ci(p["ci"])
            flag = "REGRESSION" if (name, r["window"]) in alarms and not superseded else ""
            rows.append([_window(r["window"]) if first else "", (r["run_key"] + ("*" if superseded else ""))
                         if first else "", _when(r["published_at"]) if first else "", safe_str(name), est, ci,
                         str(p["level_claim"]), str(p["audit"]), str(p.get("n_labelled") or "-"), flag])
            first = False
        rows.append(["", "", "", f"best: {safe_str(r.get('best_policy') or 'none')}", "", "", "", "", "", ""])
    lines = [f"Runs of {safe_str(ns.name)} ({len(history)} published, {len(latest)} window(s); {safe_str(uri)})"]
    lines += text_table(["window", "run", "published (UTC)", "policy", "estimate", "95% CI", "claim", "audit",
                         "labels", "alarm"], rows, right={4, 5, 8})
    if len(latest) < len(history):
        lines.append("* superseded by a later run of the same window (new labels)")
    lines.append("Alarms: a significant drop against the previous window or the baseline, with the false-alarm "
                 "rate held over all windows (docs/monitoring.md)")
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK


def _find(history: Sequence[Mapping[str, Any]], ident: str) -> dict[str, Any]:
    exact = [r for r in history if r["run_key"] == ident]
    if exact:
        return dict(exact[-1])
    by_window = [r for r in history if r["window"] == ident or _window(r["window"]) == ident]
    if by_window:
        return dict(max(by_window, key=lambda r: str(r.get("published_at"))))
    pref = [r for r in history if r["run_key"].startswith(ident)]
    if len(pref) == 1:
        return dict(pref[0])
    what = "matches several runs" if pref else "matches no published run"
    raise CJEInputError(f"run {ident!r} {what}; `cje runs NAME` lists them", column="RUN")


def _pair_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per policy: difference b - a with a fixed-sample 95% interval (independent windows)."""
    out = {}
    z = NormalDist().inv_cdf(0.975)
    for n in b["policies"]:
        pa, pb = a["policies"].get(n), b["policies"][n]
        if pa is None or pa["estimate"] is None or pb["estimate"] is None or pa["se"] is None or pb["se"] is None:
            continue
        d, se = pb["estimate"] - pa["estimate"], math.sqrt(pa["se"] ** 2 + pb["se"] ** 2)
        out[n] = {"diff": d, "se": se, "ci": [d - z * se, d + z * se]}
    return out


def cmd_diff(ns: argparse.Namespace) -> int:
    """Print what changed between two runs (or ``--json``)."""
    uri, history = _history(ns)
    if len(ns.runs) not in (0, 2):
        raise CJEInputError("give two runs (RUN_A RUN_B) or none (the latest and the one before it)", column="RUN")
    if ns.runs:
        a, b = _find(history, ns.runs[0]), _find(history, ns.runs[1])
    else:
        if not history:
            raise CJEInputError(f"no published runs of {ns.name!r}", source=uri)
        b = max(history, key=lambda r: str(r.get("published_at")))
        a = previous_run(history, b["window"], b["run_key"])
        if a is None:
            raise CJEInputError(f"{ns.name!r} has one published run; nothing to compare", source=uri)
    for run in (a, b):  # a run whose result failed verification (checksum mismatch) is never compared
        if run.get("error"):
            raise CJEInputError(f"run {run['run_key']} cannot be compared: {run['error']}", source=run.get("path"))
    changed = what_changed(a, b)
    stats = _pair_diff(a, b)
    if ns.json:
        out_json(json_doc("diff", evaluation=ns.name, a={k: a[k] for k in ("window", "run_key", "published_at")},
                          b={k: b[k] for k in ("window", "run_key", "published_at")}, changes=changed,
                          intervals=stats))
        return EXIT_OK
    rows = []
    for ch in changed:
        if ch.get("policy") is None:
            continue
        n = ch["policy"]
        before = "refused" if ch["claim_before"] == "refused" else fmt(ch["before"])
        after = "refused" if ch["claim_after"] == "refused" else fmt(ch["after"])
        st = stats.get(n)
        rows.append([safe_str(n), before, after, signed(ch["diff"]) if ch["diff"] is not None else "-",
                     fmt_ci(st["ci"]) if st else "", safe_str("; ".join(ch["notes"]))])
    lines = [f"{safe_str(ns.name)}: {_window(a['window'])} run {a['run_key']} -> {_window(b['window'])} run "
             f"{b['run_key']}"]
    lines += text_table(["policy", "before", "after", "change", "95% CI of change", "what moved"], rows,
                        right={1, 2, 3, 4})
    lines += [safe_str(note) for ch in changed if ch.get("policy") is None for note in ch["notes"]]
    lines.append("One comparison at its own 95% level (independent windows); the regression alarms of `cje runs` "
                 "and the trend page hold their error rate over all windows.")
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK

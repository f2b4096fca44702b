"""Prefect artifacts for the evaluate, drift and labels flows: the Prefect UI as the service's console.

Each flow run gets a markdown summary, a table (policies or looks) and links (report, result, trend
page). Artifacts are attached to the current flow run (Prefect's run context); keys are stable per
evaluation or monitor, so the Artifacts page shows the latest and keeps the history of each key.
Creating artifacts never fails a flow: errors are logged and the flow's return value is unchanged.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from flows.reports.common import fmt, fmt_ci
from flows.reports.segments import brief_lines, brief_rows, segment_brief

log = logging.getLogger(__name__)

__all__ = ["artifact_key", "is_web_link", "place_line", "evaluate_artifacts", "drift_artifacts", "labels_artifacts",
           "policy_rows", "evaluate_markdown", "segment_markdown"]


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from name parts."""
    text = "-".join(str(p) for p in parts if p)
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")[:100] or "cje"


def _href(location: str | None) -> str | None:
    """Where a stored object is: an http(s) URL as it is, an object-store URI as it is, a local path made
    absolute (never a ``file://`` URL: the Prefect UI, a web page, cannot open those)."""
    if not location:
        return None
    if "://" in location and not location.startswith("file://"):
        return location
    path = location[len("file://"):] if location.startswith("file://") else location
    return str(Path(path).resolve())


def is_web_link(href: str | None) -> bool:
    """Whether ``href`` opens from the Prefect UI (an http or https URL)."""
    return bool(href) and str(href).startswith(("http://", "https://"))


def place_line(name: str, href: str) -> str:
    """A markdown line for a link: a clickable link for a web URL, else the path or URI as code with what to
    do with it (a file of the machine that ran the flow, or an object to fetch from storage)."""
    if is_web_link(href):
        return f"- [{_md(name)}]({href})"
    where = "in object storage" if "://" in href else "a file on the machine that ran the flow; open it there"
    return f"- {_md(name)}: `{href.replace('`', '')}` ({where})"


def _place_spec(key: str, name: str, href: str, description: str) -> tuple[str, str, Any, str]:
    """An artifact for a link: a link artifact for a web URL, else a markdown artifact with the plain place."""
    if is_web_link(href):
        return ("link", key, href, description)
    return ("markdown", key, f"**{_md(description)}**\n\n{place_line(name, href)}", description)


def _md(text: Any) -> str:
    """Text safe inside a markdown table cell or line (no pipes, no newlines, no markup)."""
    return re.sub(r"[|\\`*_\[\]<>#]", lambda m: "\\" + m.group(0), " ".join(str(text).split()))


def policy_rows(result: Mapping[str, Any], changes: Mapping[str, Any] | None = None,
                window: str | None = None) -> list[dict[str, Any]]:
    """One row per policy: estimate and CI (or "refused"), claim, audit, labels, and the latest changes."""
    rows = []
    for name, p in (result.get("policies") or {}).items():
        refused = p.get("level_claim") == "refused"
        audit = (p.get("audit") or {}).get("verdict") or "not_run"
        row = {"policy": str(name), "estimate": "refused" if refused else fmt(p.get("estimate")),
               "ci": "" if refused else fmt_ci(p.get("ci")), "level_claim": p.get("level_claim"),
               "audit": audit, "labels": p.get("n_labelled")}
        pc = (changes or {}).get(name)
        if pc is not None and window in pc.windows:
            i = pc.windows.index(window)
            c, b = pc.consecutive[i], pc.against_baseline[i]
            row["change_vs_previous"] = c.status if c else ""
            row["change_vs_baseline"] = b.status if b else ""
            row["pooled_alarm"] = any(x.status == "regression" for x in pc.pooled[i])
        rows.append(row)
    return rows


def evaluate_markdown(evaluation: str, window: str, run_key: str, result: Mapping[str, Any],
                      links: Mapping[str, str | None], alarms: Sequence[str] = ()) -> str:
    """The markdown summary of one evaluate run."""
    lines = [f"# CJE evaluation {_md(evaluation)}", "", f"Window **{_md(window)}**, run `{_md(run_key)}`.", ""]
    best = result.get("best_policy")
    lines.append(f"**Best policy:** {_md(best) if best else 'none (no clear winner)'}")
    refused = [n for n, p in (result.get("policies") or {}).items() if p.get("level_claim") == "refused"]
    if refused:
        lines.append(f"**Refused levels:** {', '.join(_md(n) for n in refused)}")
    if alarms:
        lines.append(f"**Regression alarm:** {', '.join(_md(a) for a in alarms)} (a significant drop; the "
                     "false-alarm rate is held over all windows)")
    lines += ["", "| policy | estimate | 95% CI | level | audit | labels |", "|---|---:|---:|---|---|---:|"]
    for r in policy_rows(result):
        lines.append(f"| {_md(r['policy'])} | {r['estimate']} | {r['ci']} | {r['level_claim']} | {r['audit']} | "
                     f"{r['labels'] if r['labels'] is not None else ''} |")
    lines += segment_markdown(result)
    lines.append("")
    for name, href in links.items():
        if href:
            lines.append(place_line(name, href))
    return "\n".join(lines)


def segment_markdown(result: Mapping[str, Any]) -> list[str]:
    """The summary's segment lines (`flows.reports.segments.segment_brief`): claims against the baseline,
    audits failing by segment, the omnibus test; none when the evaluation has no segments."""
    brief = segment_brief(result)
    if brief is None:
        return []
    text = brief_lines(brief)
    return ["", f"## {_md(text['title'])}", "", f"- {_md(text['claims'])}", f"- {_md(text['audits'])}",
            f"- {_md(text['omnibus'])}"]


def evaluate_artifacts(evaluation: str, window: str, run_key: str, result: Mapping[str, Any],
                       outcome: Mapping[str, Any], trend: str | None = None,
                       changes: Mapping[str, Any] | None = None, alarms: Sequence[str] = ()) -> list[str]:
    """Create the artifacts of an evaluate run (summary, policy table, links); returns their ids."""
    arts = outcome.get("artifacts") or {}
    links = {"report": _href(arts.get("report.html")), "result": _href(arts.get("result.json")),
             "trend": _href(trend)}
    base = artifact_key("cje", evaluation)
    return _create([
        ("markdown", f"{base}-summary", evaluate_markdown(evaluation, window, run_key, result, links, alarms),
         f"Summary of {evaluation} {window}"),
        ("table", f"{base}-policies", policy_rows(result, changes, window), f"Policies of {evaluation} {window}"),
        *_segment_specs(base, evaluation, window, result),
        *[_place_spec(f"{base}-{name}", name, href, f"{name} of {evaluation} {window}") for name, href in links.items()
          if href],
    ])


def _segment_specs(base: str, evaluation: str, window: str, result: Mapping[str, Any]) -> list[tuple[str, str, Any, str]]:
    """The segment table artifact (claims, failing audits, omnibus test) of a segmented result; none otherwise."""
    brief = segment_brief(result)
    if brief is None:
        return []
    return [("table", f"{base}-segments", brief_rows(brief), f"Segments of {evaluation} {window}")]


def drift_artifacts(summary: Mapping[str, Any]) -> Mapping[str, Any]:
    """Create the artifacts of a drift run; returns ``summary`` unchanged (for ``return drift_artifacts(...)``)."""
    try:
        mon = str(summary.get("monitor"))
        looks = list(summary.get("new_looks") or [])
        rows = [{"look": lk.get("look"), "day": (lk.get("meta") or {}).get("dt"), "alarm": bool(lk.get("alarm")),
                 "metrics alarming": ", ".join(lk.get("alarms") or []),
                 "judge": (lk.get("meta") or {}).get("judge_id")} for lk in looks]
        status = (f"**Drift alarm** on {', '.join(_md(a) for a in summary.get('alarms') or [])}"
                  if summary.get("alarm") else "No drift alarm in the new looks.")
        md = "\n".join([f"# CJE drift monitor {_md(mon)}", "", f"{len(looks)} new look(s), {summary.get('n_looks')} in "
                        "total.", "", status, "", f"Label requests raised: {len(summary.get('label_requests') or [])}"])
        base = artifact_key("cje-drift", mon)
        specs = [("markdown", f"{base}-summary", md, f"Drift monitor {mon}"),
                 ("table", f"{base}-looks", rows or [{"look": None, "day": None, "alarm": False}],
                  f"New looks of {mon}")]
        if summary.get("report"):
            specs.append(_place_spec(f"{base}-report", "drift report", _href(summary["report"]),
                                     f"Drift report of {mon}"))
        _create(specs)
    except Exception as exc:  # noqa: BLE001 - artifacts never fail a flow
        log.warning("drift artifacts not created: %s", exc)
    return summary


def labels_artifacts(out: Mapping[str, Any]) -> Mapping[str, Any]:
    """Create the artifacts of a labels run; returns ``out`` unchanged."""
    try:
        rows = [{"evaluation": r.get("evaluation"), "window": r.get("window"), "run_key": r.get("run_key"),
                 "published": r.get("published"), "report": r.get("report")} for r in out.get("reevaluations") or []]
        md = "\n".join([f"# CJE labels from {_md(out.get('source'))}", "",
                        f"{out.get('rows')} label(s); label-store version {out.get('version')} "
                        f"({'new' if out.get('new') else 'already stored'}).",
                        f"Requests fulfilled: {len(out.get('requests') or [])}; days touched: "
                        f"{_md(', '.join(out.get('touched_dates') or [])) or 'none'}; re-evaluations: {len(rows)}."])
        specs = [("markdown", "cje-labels-summary", md, "Label ingestion"),
                 ("table", "cje-labels-reevaluations", rows or [{"evaluation": None, "window": None}],
                  "Windows re-evaluated")]
        specs += [_place_spec(artifact_key("cje-labels-report", r["evaluation"] or "", r["window"] or ""), "report",
                              _href(r["report"]), "re-evaluated report") for r in rows if r.get("report")]
        _create(specs)
    except Exception as exc:  # noqa: BLE001 - artifacts never fail a flow
        log.warning("labels artifacts not created: %s", exc)
    return out


def _create(specs: Sequence[tuple[str, str, Any, str]]) -> list[str]:
    """Create artifacts ``(kind, key, content, description)`` in the current run; returns their ids."""
    # imported here: Prefect is heavy and the pure builders above need none of it
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    ids = []
    for kind, key, content, description in specs:
        if kind == "markdown":
            ids.append(create_markdown_artifact(markdown=content, key=key, description=description))
        elif kind == "table":
            ids.append(create_table_artifact(table=content, key=key, description=description))
        else:
            ids.append(create_link_artifact(link=content, link_text=description, key=key, description=description))
    return [str(i) for i in ids]

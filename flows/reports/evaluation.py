"""Self-contained HTML report and terminal summary table for a CJE result.

The input is the plain result dict of ``docs/result-schema.md`` (``EvaluationResult.to_dict()`` or the
``result.json`` written by ``cje evaluate``). Two renderers:

- :func:`render_report` returns one HTML page with inline CSS and inline SVG drawn here (no scripts,
  no fonts, no network), so it can be mailed, archived or opened offline;
- :func:`format_table` returns a fixed-width text table for the terminal.

Both honour the level gate: a policy whose ``level_claim`` is ``"refused"`` is shown as "refused",
never with its (ranking-only) estimate or interval. Every user-supplied string is HTML-escaped.

Run ``python -m flows.reports.evaluation result.json [-o report.html] [--drift drift.json]`` to render a file.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from cje_engine.errors import CJEInputError
from flows.reports.charts import forest_svg, win_svg
from cje_engine.result.model import Calibration, DataSummary, EvaluationModel, Inference
from flows.reports.common import FONT, alpha_of, as_pair, check_drift, conf_label, esc, policy_order, result_model
from flows.reports.sections import (audit_section, calibration_section, changed_section, comparisons_table,
                                    context_meta, drift_section, estimator_table, policy_table, report_footer,
                                    summary_html)
from flows.reports.segments import SEGMENT_CSS, segments_section
from flows.reports.table import format_table

logger = logging.getLogger(__name__)

__all__ = ["render_report", "main"]

CSS = """
:root{--ink:#1f2328;--muted:#59636e;--line:#d8dee4;--bg:#f4f6f8;--card:#fff;--blue:#0072B2;
--green:#009E73;--verm:#D55E00;--amber:#B07800}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.5 FONT;
-webkit-font-smoothing:antialiased}
main{max-width:1180px;margin:0 auto;padding:28px 24px 40px}
header.top{margin-bottom:18px}
header.top h1{font-size:26px;margin:0 0 4px;letter-spacing:-.01em}
header.top .meta{color:var(--muted);font-size:14px}
header.top .meta.partial{color:#9a3d00}
section,footer{background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:20px 24px;margin:0 0 18px}
h2{font-size:18px;margin:0 0 12px;letter-spacing:-.005em}
h3{font-size:15px;margin:20px 0 4px}
p{margin:6px 0}
.lead{color:var(--muted);font-size:14px;max-width:900px}
.summary .item{border-left:4px solid var(--line);padding:6px 12px;margin:8px 0;background:#fafbfc;
border-radius:0 6px 6px 0}
.summary .item ul{margin:4px 0 2px;padding-left:20px}
.summary .ok{border-left-color:var(--green)}
.summary .warn{border-left-color:#E69F00}
.summary .bad{border-left-color:var(--verm)}
.note{color:var(--muted);font-size:13px}
.muted{color:var(--muted)}
.num{font-variant-numeric:tabular-nums}
.figure{overflow-x:auto}
svg.chart{display:block;max-width:100%;height:auto}
table.data{border-collapse:collapse;width:100%;font-size:13px;margin:10px 0}
table.data.compact{width:auto;min-width:420px}
table.data th{text-align:left;font-weight:600;color:var(--muted);border-bottom:2px solid var(--line);
padding:6px 8px;white-space:nowrap}
table.data td{border-bottom:1px solid #eaeef2;padding:6px 8px;vertical-align:top}
table.data tbody tr:hover{background:#f6f8fa}
table.data .r{text-align:right}
table.data .c{text-align:center}
td.name{font-weight:600;overflow-wrap:break-word}
td.num,th{white-space:nowrap}
td.reason{color:var(--muted);min-width:220px}
tr.is-refused td{background:#fafafa}
td.refused-cell{color:var(--muted);font-style:italic;text-align:center}
tr.alarm td{background:#fdf0e8}
.scroll{overflow-x:auto}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
white-space:nowrap;border:1px solid transparent}
.badge.ok{background:#e3f4ee;color:#00664a;border-color:#b5e2d2}
.badge.refused{background:#eceef1;color:#4b5259;border:1px dashed #8d949c}
.v-pass{background:#e3f4ee;color:#00664a}
.v-fail{background:#fbe6da;color:#9a3d00}
.v-inconclusive{background:#fdf3d9;color:#7a5400}
.v-not_run{background:#eceef1;color:#4b5259}
.sig{color:#3f1f80;font-weight:600}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(500px,1fr));gap:14px;margin:12px 0}
figure.panel{margin:0;border:1px solid #eaeef2;border-radius:8px;padding:10px 10px 4px}
figure.panel figcaption{font-size:14px}
figure.panel .cap{display:block;color:var(--muted);font-size:12.5px;margin-top:2px}
.facts{font-size:14px}
ul.bases{font-size:13px;color:var(--muted);margin:6px 0 0;padding-left:20px}
dl.config{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:4px 18px;
margin:0 0 10px;font-size:13px}
dl.config div{display:flex;justify-content:space-between;gap:8px;border-bottom:1px dotted #e1e4e8;
padding:2px 0}
dl.config dt{color:var(--muted)}
dl.config dd{margin:0;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;
font-size:12px;text-align:right;word-break:break-all}
footer p{font-size:13px;color:var(--muted)}
footer .stamp{color:var(--ink)}
a{color:var(--blue)}
@media print{body{background:#fff}section,footer{break-inside:avoid;border-color:#ccc}}
@media (max-width:640px){
main{padding:14px 10px 24px}
section,footer{padding:14px 12px}
header.top h1{font-size:21px}
.figure svg.chart,figure.panel svg.chart{max-width:none}
.panels{grid-template-columns:minmax(0,1fr)}
figure.panel{overflow-x:auto}
table.data th,table.data td{padding:5px 5px}
table.data.compact{min-width:0}
td.reason{min-width:0}
}
""".replace("FONT", FONT) + SEGMENT_CSS


def _meta_items(m: EvaluationModel, order: list[str]) -> list[str]:
    """The facts under the title: policies, rows, prompts, labels, calibration, inference."""
    data = m.data if isinstance(m.data, DataSummary) else None
    cal = m.calibration if isinstance(m.calibration, Calibration) else None
    inference = m.inference if isinstance(m.inference, Inference) else None
    meta = [f"{len(order)} policies"]
    if data is not None and data.n_rows is not None:
        meta.append(f"{data.n_rows} rows")
    if data is not None and data.n_prompts is not None:
        meta.append(f"{data.n_prompts} prompts")
    if data is not None and data.n_labelled is not None:
        meta.append(f"{data.n_labelled} oracle labels"
                    + (f" ({data.n_calibration_labels} calibrate)" if data.n_calibration_labels is not None else ""))
    if cal is not None and cal.mode:
        meta.append(f"{cal.mode} calibration")
    if inference is not None and inference.method:
        nb = inference.n_bootstrap
        meta.append(f"{inference.method} inference"
                    + (f" ({nb} replicates)" if inference.method == "bootstrap" and nb else ""))
    return meta


def _short_day(d: str, first: str) -> str:
    """``2025-03-04`` -> ``03-04`` when the year is that of ``first``."""
    return d[5:] if d[:4] == first[:4] else d


def _days_meta(days: dict | None) -> str:
    """The window's days the run holds (and those without logs), under the title."""
    if not isinstance(days, dict) or not isinstance(days.get("days"), list):
        return ""
    held = [str(d) for d in days["days"]]
    missing = [str(d) for d in days.get("missing_days") or []]
    total = len(held) + len(missing)
    if not held:
        return ""
    first = held[0]
    if not missing:
        text = (f"days: {held[0]} to {held[-1]}, all {total} with logs" if total > 1 else f"day: {held[0]}")
    else:
        text = (f"days: {len(held)} of {total} with logs: {', '.join(_short_day(d, first) for d in held)}"
                f" (no logs: {', '.join(_short_day(d, first) for d in missing)})")
    cls = "meta days partial" if missing else "meta days"
    return (f"<div class='{cls}' data-days='{esc(' '.join(held))}' data-missing-days='{esc(' '.join(missing))}'>"
            f"{esc(text)}</div>")


def render_report(result: Any, *, title: str | None = None, drift: dict | None = None,
                  context: dict | None = None, days: dict | None = None) -> str:
    """Render a result dict as one self-contained HTML page.

    Parameters
    ----------
    result : dict, EvaluationResult or EvaluationModel
        The result dict of ``docs/result-schema.md`` (schema version 1), or the typed result.
    title : str, optional
        Page title; defaults to "CJE evaluation report". Escaped like every user string.
    drift : dict, optional
        Judge-drift timeline from re-scoring an anchor set every period; adds a "Judge drift"
        section and a summary line. Accepted format (lists have one entry per period)::

            {
              "periods": ["2025-01", "2025-02", ...],   # required, labels in time order
              "kendall_tau": [0.97, 0.95, ...],         # required, tau-b reference vs current (null = missing)
              "tau_threshold": 0.8,                     # optional, alarm when tau < this (default 0.8)
              "residual_shift": [0.0, 0.01, ...],       # optional, change in mean residual on labelled anchors
              "residual_shift_ci": [[lo, hi], ...],     # optional, interval per period (null = none)
              "shift_threshold": 0.05,                  # optional, alarm when |shift| > this (default 0.05)
              "alarms": [false, true, ...],             # optional, alarms from an external monitor (e.g. a
                                                        # confidence sequence); overrides the thresholds
              "n_anchors": 200, "method": "..."         # optional, shown in the section text
            }

    context : dict, optional
        The run's place in its evaluation (`flows.reports.history.report_context`, filled in by the
        publisher): ``generated_at``, ``result_href``, ``trend_href``, ``index_href``, ``previous``
        (window, run_key, published_at, href), ``changes`` (`flows.reports.history.what_changed`) and
        ``drift`` (monitor -> drift dict as above, for the monitors linked to the evaluation). Adds the
        generated-at time and links under the title, a "What changed since the previous run" section and
        one judge-drift section per linked monitor.
    days : dict, optional
        The days of the window the run holds: ``{"days": [YYYY-MM-DD, ...], "missing_days": [...]}`` (the
        manifest's ``window_spec``); listed under the title (``data-days`` / ``data-missing-days``).

    Returns
    -------
    str
        The HTML document: inline CSS and SVG only, no scripts, no external resources.

    Raises
    ------
    CJEInputError
        When ``result`` or ``drift`` does not follow the format (the error names the field).
    """
    m = result_model(result)
    if not isinstance(result, dict):  # an EvaluationResult / EvaluationModel: the sections read its JSON form
        result = m.model_dump(mode="json", exclude_unset=True, by_alias=True)
    drift_data = check_drift(drift) if drift is not None else None
    ctx = context if isinstance(context, dict) else {}
    alpha = alpha_of(m)
    order = policy_order(m)
    page_title = title if title is not None else "CJE evaluation report"
    meta = _meta_items(m, order)
    warnings = [str(w) for w in m.warnings or []]
    warn_html = ("<ul>" + "".join(f"<li>{esc(w)}</li>" for w in warnings) + "</ul>"
                 if warnings else "<p class='muted'>No warnings.</p>")
    conf = conf_label(alpha)
    sep = " \u00b7 "
    parts = [
        "<!DOCTYPE html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{esc(page_title)}</title><style>{CSS}</style></head><body><main>",
        f"<header class='top'><h1>{esc(page_title)}</h1>"
        f"<div class='meta'>{esc(sep.join(meta))}</div>{_days_meta(days)}"
        f"{context_meta(ctx) if ctx else ''}</header>",
        summary_html(m, order, alpha, drift_data),
        changed_section(ctx) if ctx else "",
        "<section id='estimates'><h2>Policy estimates</h2>"
        f"<p class='lead'>Calibrated values on the oracle scale with {conf} intervals that include "
        "the calibration's uncertainty. Refused policies are drawn hollow and dashed: their "
        "interval is computed for ranking only and is not a level. Raw judge means (orange) show "
        "how far the uncalibrated judge is off.</p>"
        f"<div class='figure'>{forest_svg(m, order, alpha)}</div>"
        f"{policy_table(m, order, alpha)}"
        "<h3>Plug-in vs augmented</h3>"
        f"{estimator_table(m, order, alpha)}</section>",
        f"<section id='calibration'><h2>Calibration</h2>{calibration_section(m)}</section>",
        f"<section id='audit'><h2>Transport audit</h2>{audit_section(m, order, alpha)}"
        "</section>",
        "<section id='comparisons'><h2>Pairwise comparisons</h2>"
        f"<div class='figure'>{win_svg(m)}</div>{comparisons_table(m, alpha)}"
        "</section>",
    ]
    parts.append(segments_section(m, alpha, as_pair((m.config or {}).get("label_scale") if isinstance(m.config, dict)
                                                    else None)))
    if drift_data is not None:
        parts.append(drift_section(drift_data))
    for monitor, d in sorted((ctx.get("drift") or {}).items()):
        parts.append(drift_section(check_drift(d)).replace("<h2>Judge drift</h2>",
                                                           f"<h2>Judge drift: monitor {esc(monitor)}</h2>", 1)
                     .replace("id='drift'", f"id='drift-{esc(monitor)}'", 1))
    parts.append(f"<section id='warnings'><h2>Warnings</h2>{warn_html}</section>")
    parts.append(report_footer(result))
    parts.append("</main></body></html>")
    logger.debug("rendered report for %d policies", len(order))
    return "\n".join(parts)



def main(argv: Sequence[str] | None = None) -> int:
    """Command line: render ``result.json`` to HTML and print the terminal table."""
    parser = argparse.ArgumentParser(prog="python -m flows.reports.evaluation", description=main.__doc__,
                                     allow_abbrev=False)
    parser.add_argument("result", type=Path, help="result.json written by cje evaluate")
    parser.add_argument("-o", "--output", type=Path, help="HTML file to write")
    parser.add_argument("--title", help="report title")
    parser.add_argument("--drift", type=Path, help="drift JSON (format: see render_report)")
    args = parser.parse_args(argv)

    def load(path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CJEInputError(f"cannot read JSON: {exc}", source=str(path)) from exc

    result = load(args.result)
    drift = load(args.drift) if args.drift else None
    sys.stdout.write(format_table(result) + "\n")
    if args.output:
        args.output.write_text(render_report(result, title=args.title, drift=drift),
                               encoding="utf-8")
        logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())

"""The service index (``results/index.html``) and one trend page per evaluation
(``results/<evaluation>/trend.html``): self-contained HTML (inline CSS and SVG, no scripts, no network).

Trend page: each policy's value and interval over windows (refused windows drawn as such), regression
alarms, audit verdicts and label counts over windows, drift alarms of linked monitors on the same time
axis, the changes of the latest window and the open label requests. Markers carry ``data-*`` attributes
(``data-policy``, ``data-window``) so that tests and tools can read them.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from cje_engine.inference.changes import PolicyChanges

from flows.storage.objects import Storage
from flows.storage.publish import RESULTS

from flows.reports.common import (BLUE, GREEN, GREY, INK, MUTED, SKY, VERDICT_STYLE, VERMILLION, _esc, _fmt,
                                  _fmt_ci, _signed)
from flows.reports.evaluation import CSS
from flows.reports.history import (evaluations, latest_per_window, linked_drift, open_label_requests,
                                   read_history, window_changes_of)
from flows.reports.svg import _diamond, _el, _legend, _line, _Lin, _polylines, _r, _svg, _text, _ticks, _y_axis

__all__ = ["render_index", "render_trend", "write_pages", "INDEX", "TREND"]

INDEX = "index.html"
TREND = "trend.html"

WIDTH, LEFT, RIGHT = 1040, 190, 24
DASH, DOT = "\u2013", " \u00b7 "
OK_BADGE = "<span class='badge ok'>ok</span>"
EXTRA_CSS = """
.chip{display:inline-block;margin:1px 6px 1px 0;padding:1px 8px;border-radius:10px;background:#eef3f8;
font-size:12.5px;white-space:nowrap}
.chip.refused{background:#eceef1;color:#4b5259;border:1px dashed #8d949c}
.chip.alarm{background:#fbe6da;color:#9a3d00;font-weight:600}
.kpis{display:flex;flex-wrap:wrap;gap:12px;margin:6px 0 2px}
.kpi{flex:1 1 180px;border:1px solid #eaeef2;border-radius:8px;padding:10px 14px;background:#fafbfc}
.kpi b{display:block;font-size:22px;letter-spacing:-.01em}
.kpi span{color:var(--muted);font-size:13px}
.kpi.bad{border-color:#f0c3a8;background:#fdf3ed}
td.cell{text-align:center;white-space:nowrap}
nav.crumbs{font-size:14px;margin-bottom:6px}
td.links{white-space:nowrap}
"""


def _page(title: str, subtitle: str, body: Sequence[str], crumbs: str = "") -> str:
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_esc(title)}</title><style>{CSS}{EXTRA_CSS}</style></head><body><main>",
        crumbs,
        f"<header class='top'><h1>{_esc(title)}</h1><div class='meta'>{_esc(subtitle)}</div></header>",
        *body,
        "<footer><p class='stamp'>Self-contained page (no scripts, no external resources), rebuilt on every "
        f"publish \u00b7 generated {_esc(_now())}</p></footer>",
        "</main></body></html>"])


def _dash(v: Any) -> Any:
    return DASH if v is None else v


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _window_label(w: str) -> str:
    """``2025-01-01_2025-01-01`` -> ``2025-01-01``; ``a_b`` -> ``a..b``."""
    a, _, b = str(w).partition("_")
    return a if not b or a == b else f"{a}..{b}"


def _chip(name: str, row: Mapping[str, Any], alarm: bool) -> str:
    p = row["policies"][name]
    if p.get("level_claim") == "refused":
        return f"<span class='chip refused' title='level refused'>{_esc(name)}: refused</span>"
    cls = "chip alarm" if alarm else "chip"
    return f"<span class='{cls}'>{_esc(name)} <b>{_esc(_fmt(p.get('estimate')))}</b></span>"


# --------------------------------------------------------------------------------------------- index
def render_index(entries: Sequence[Mapping[str, Any]]) -> str:
    """The service index: every evaluation, its latest run and its open alarms.

    Parameters
    ----------
    entries : list of dict
        Per evaluation: ``evaluation``, ``latest`` (a `flows.reports.history.run_summary` row), ``n_runs``,
        ``n_windows``, ``alarms`` (policy -> list of windows with a regression alarm), ``drift_alarms`` (count),
        ``open_requests`` (count).
    """
    rows = []
    for e in entries:
        latest = e["latest"]
        name = str(e["evaluation"])
        alarmed = {p for p, ws in (e.get("alarms") or {}).items() if latest["window"] in ws}
        chips = "".join(_chip(n, latest, n in alarmed) for n in latest["policies"])
        status = []
        if alarmed:
            status.append(f"<span class='badge v-fail'>regression: {_esc(', '.join(sorted(alarmed)))}</span>")
        if e.get("drift_alarms"):
            status.append(f"<span class='badge v-fail'>drift alarm \u00d7{_esc(e['drift_alarms'])}</span>")
        if e.get("open_requests"):
            status.append(f"<span class='badge v-inconclusive'>{_esc(e['open_requests'])} label request(s)</span>")
        links = [f"<a href='{_esc(name)}/trend.html'>trend</a>"]
        if latest.get("report_key"):
            links.append(f"<a href='{_esc(latest['report_key'])}'>latest report</a>")
        rk = latest.get("report_key")
        if rk:
            links.append(f"<a href='{_esc(rk.rsplit('/', 1)[0])}/result.json'>result.json</a>")
        rows.append(
            f"<tr data-evaluation='{_esc(name)}' data-open-requests='{_esc(e.get('open_requests', 0))}' "
            f"data-drift-alarms='{_esc(e.get('drift_alarms', 0))}' data-runs='{_esc(e.get('n_runs', 0))}' "
            f"data-windows='{_esc(e.get('n_windows', 0))}'><td class='name'><a href='{_esc(name)}/trend.html'>{_esc(name)}</a>"
            f"</td><td class='num'>{_esc(_window_label(latest['window']))}</td>"
            f"<td class='num'>{_esc(str(latest.get('published_at') or '')[:19].replace('T', ' '))}</td>"
            f"<td>{_esc(latest.get('best_policy') or 'none')}</td><td>{chips}</td>"
            f"<td>{''.join(status) or OK_BADGE}</td>"
            f"<td class='r num'>{_esc(e.get('n_windows', 0))} / {_esc(e.get('n_runs', 0))}</td>"
            f"<td class='links'>{DOT.join(links)}</td></tr>")
    table = ("<section><h2>Evaluations</h2><div class='scroll'><table class='data'><thead><tr>"
             "<th>evaluation</th><th>latest window</th><th>published (UTC)</th><th>best policy</th>"
             "<th>policy values (oracle scale)</th><th>status</th><th class='r'>windows / runs</th><th></th>"
             f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div></section>") if rows else \
        "<section><p class='muted'>Nothing published yet.</p></section>"
    return _page("CJE results", f"{len(entries)} evaluation(s)", [table])


# --------------------------------------------------------------------------------------------- trend
def _x_scale(n: int) -> _Lin:
    return _Lin(-0.5, n - 0.5, LEFT, WIDTH - RIGHT)


def _x_labels(sx: _Lin, windows: Sequence[str], y: float) -> list[str]:
    out = []
    rotate = len(windows) > 8
    for i, w in enumerate(windows):
        lab = _window_label(w)
        if rotate:
            out.append(_el("text", _esc(lab), x=sx(i), y=float(y), text_anchor="end", fill=MUTED,
                           font_size="10.5", transform=f"rotate(-35 {_r(sx(i))} {_r(y)})"))
        else:
            out.append(_text(sx(i), y, lab, text_anchor="middle", fill=MUTED, font_size="11"))
    return out


def _policy_panel(name: str, rows: Sequence[Mapping[str, Any]], ch: PolicyChanges | None) -> str:
    windows = [r["window"] for r in rows]
    sx = _x_scale(len(windows))
    T, H = 30, 150
    vals = []
    for r in rows:
        p = r["policies"].get(name) or {}
        if p.get("ci"):
            vals += list(p["ci"])
        elif p.get("estimate") is not None:
            vals.append(p["estimate"])
    lo, hi, ticks, dec = _ticks(min(vals, default=0.0), max(vals, default=1.0), 5)
    sy = _Lin(lo, hi, T + H, T)
    alarms = set(ch.alarms) if ch else set()
    body = [_text(LEFT, 18, name, fill=INK, font_size="14", font_weight="600"),
            _text(WIDTH - RIGHT, 18, f"baseline {_window_label(ch.baseline) if ch and ch.baseline else 'none'}",
                  text_anchor="end", fill=MUTED, font_size="11.5")]
    body += _y_axis(sy, ticks, dec, LEFT - 10, WIDTH - RIGHT, "value")
    pts = []
    for i, r in enumerate(rows):
        p = r["policies"].get(name)
        x = sx(i)
        if p is None:
            body.append(_text(x, T + H / 2, "not evaluated", text_anchor="middle", fill=GREY, font_size="10"))
            continue
        if p.get("level_claim") == "refused":
            body.append(_el("g", _el("title", _esc(f"{_window_label(r['window'])}: refused - "
                                                   + "; ".join(p.get("refusal_reasons") or [])))
                            + _el("rect", x=x - 14, y=float(T), width="28", height=float(H), fill="#eceef1",
                                  stroke="#8d949c", stroke_dasharray="3 3")
                            + _text(x, T + H / 2, "refused", text_anchor="middle", fill=MUTED, font_size="10",
                                    font_style="italic"),
                            class_="refused-marker", data_policy=name, data_window=r["window"]))
            pts.append(None)
            continue
        est, ci = p.get("estimate"), p.get("ci")
        if ci:
            body.append(_line(x, sy(ci[0]), x, sy(ci[1]), stroke=SKY, stroke_width="3", stroke_linecap="round"))
        if est is not None:
            pts.append((x, sy(est)))
            alarm = r["window"] in alarms
            tip = f"{_window_label(r['window'])}: {_fmt(est)} {_fmt_ci(ci)}"
            if alarm:
                body.append(_el("g", _el("title", _esc(tip + " - regression alarm"))
                                + _diamond(x, sy(est), 8, fill=VERMILLION, stroke="#fff", stroke_width="1.5"),
                                class_="alarm-marker", data_policy=name, data_window=r["window"]))
            else:
                body.append(_el("circle", _el("title", _esc(tip)), cx=x, cy=sy(est), r="5", fill=BLUE,
                                stroke="#fff", stroke_width="1.5", class_="value-marker", data_policy=name,
                                data_window=r["window"]))
        else:
            pts.append(None)
    lines = _polylines(pts, stroke=BLUE, stroke_width="1.6", stroke_opacity="0.6")
    body = body[:2] + lines + body[2:]
    body += _x_labels(sx, windows, T + H + 18)
    return _svg(WIDTH, T + H + (48 if len(windows) > 8 else 30), body, f"Value of {name} over windows")


def _drift_strip(windows: Sequence[str], drift: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    sx = _x_scale(len(windows))
    rows_h = 30
    H = rows_h * max(len(drift), 1) + 34
    body = [_text(LEFT - 10, 16, "drift monitor", text_anchor="end", fill=MUTED, font_size="11", font_weight="600")]
    for k, (mon, looks) in enumerate(sorted(drift.items())):
        y = 34 + k * rows_h
        body.append(_text(LEFT - 10, y + 4, mon, text_anchor="end", fill=INK, font_size="12"))
        body.append(_line(LEFT, y, WIDTH - RIGHT, y, stroke="#eaeef2", stroke_width="8", stroke_linecap="round"))
        for lk in looks:
            i = _window_index(windows, lk.get("dt"))
            if i is None:
                continue
            tip = f"look {lk.get('look')} ({lk.get('dt')}): " + (
                "alarm on " + ", ".join(lk.get("alarms") or []) if lk.get("alarm") else "no alarm")
            if lk.get("alarm"):
                body.append(_el("g", _el("title", _esc(tip)) + _diamond(sx(i), y, 8, fill=VERMILLION, stroke="#fff"),
                                class_="drift-alarm", data_monitor=mon, data_window=windows[i]))
            else:
                body.append(_el("circle", _el("title", _esc(tip)), cx=sx(i), cy=float(y), r="5", fill=GREEN,
                                stroke="#fff", class_="drift-look", data_monitor=mon, data_window=windows[i]))
    return _svg(WIDTH, H, body, "Drift looks of linked monitors on the windows' time axis")


def _window_index(windows: Sequence[str], dt: Any) -> int | None:
    if not dt:
        return None
    hit = None
    for i, w in enumerate(windows):
        a, _, b = str(w).partition("_")
        if a <= str(dt) <= (b or a):
            hit = i
    return hit


def _grid(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    head = "".join(f"<th class='c'>{_esc(_window_label(r['window']))}</th>" for r in rows)
    out = []
    for n in names:
        cells = []
        for r in rows:
            p = r["policies"].get(n)
            if p is None:
                cells.append("<td class='cell muted'>\u2013</td>")
                continue
            v = p.get("audit") if p.get("audit") in VERDICT_STYLE else "not_run"
            sym, label, _ = VERDICT_STYLE[v]
            cells.append(f"<td class='cell' data-policy='{_esc(n)}' data-window='{_esc(r['window'])}'>"
                         f"<span class='badge v-{_esc(v)}' title='{_esc(label)}'>{_esc(sym)}</span> "
                         f"<span class='num'>{_esc(_dash(p.get('n_labelled')))}</span></td>")
        out.append(f"<tr><td class='name'>{_esc(n)}</td>{''.join(cells)}</tr>")
    total = "".join(f"<td class='cell num'>{_esc(_dash(r.get('n_labels')))}</td>" for r in rows)
    out.append(f"<tr><td class='muted'>all labels</td>{total}</tr>")
    return (f"<div class='scroll'><table class='data'><thead><tr><th>policy</th>{head}</tr></thead>"
            f"<tbody>{''.join(out)}</tbody></table></div>")


def _changes_table(changes: Mapping[str, PolicyChanges], window: str) -> str:
    rows = []
    for n, pc in changes.items():
        if window not in pc.windows:
            continue
        i = pc.windows.index(window)
        for c in pc.tests_at(i):
            if c.status == "not_estimable":
                num = f"<td class='muted' colspan='2'>not estimable: {_esc(c.reason)}</td>"
            else:
                num = (f"<td class='r num'>{_esc(_signed(c.diff))}</td>"
                       f"<td class='r num'>{_esc(_fmt_ci(c.ci_anytime))}</td>")
            cls = {"regression": "v-fail", "improvement": "v-pass", "undecided": "v-inconclusive"}.get(c.status,
                                                                                                    "v-not_run")
            extra = f" ({c.labels_needed} more labels would decide)" if c.labels_needed else ""
            what = f"mean of last {c.n_windows} windows" if c.kind == "pooled" else c.kind
            rows.append(f"<tr><td class='name'>{_esc(n)}</td><td>{_esc(what)} vs "
                        f"{_esc(_window_label(c.ref))}</td>{num}<td><span class='badge {cls}'>{_esc(c.status)}"
                        f"</span>{_esc(extra)}</td><td class='r num'>{_esc(f'{c.alpha_spent:.1e}')}</td></tr>")
    if not rows:
        return "<p class='muted'>No change can be computed yet (one window, or no estimable value).</p>"
    return ("<div class='scroll'><table class='data'><thead><tr><th>policy</th><th>change</th>"
            "<th class='r'>diff</th><th class='r'>anytime CI</th><th>status</th><th class='r'>\u03b1 spent</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _runs_table(history: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for r in reversed(history):
        link = f"<a href='../{_esc(r['report_key'])}'>report</a>" if r.get("report_key") else ""
        rows.append(f"<tr data-window='{_esc(r['window'])}' data-run-key='{_esc(r['run_key'])}'>"
                    f"<td class='num'>{_esc(_window_label(r['window']))}</td><td class='num'>"
                    f"{_esc(r['run_key'])}</td><td class='num'>{_esc(str(r.get('published_at'))[:19])}</td>"
                    f"<td>{_esc(r.get('best_policy') or 'none')}</td><td>{link}</td></tr>")
    return ("<div class='scroll'><table class='data compact'><thead><tr><th>window</th><th>run</th>"
            "<th>published</th><th>best policy</th><th></th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _requests_table(requests: Sequence[Mapping[str, Any]]) -> str:
    if not requests:
        return "<p class='muted'>No open label requests.</p>"
    rows = "".join(f"<tr data-request-id='{_esc(r.get('request_id'))}' data-status='{_esc(r.get('status'))}'>"
                   f"<td class='num'>{_esc(r.get('request_id'))}</td><td>{_esc(r.get('scope'))}</td>"
                   f"<td class='r num'>{_esc(r.get('n_labels'))}</td><td class='num'>{_esc(r.get('deadline'))}</td>"
                   f"<td class='reason'>{_esc('; '.join(str(x) for x in r.get('reasons') or []))}</td></tr>"
                   for r in requests)
    return ("<div class='scroll'><table class='data'><thead><tr><th>request</th><th>scope</th><th class='r'>labels"
            f"</th><th>deadline</th><th>why</th></tr></thead><tbody>{rows}</tbody></table></div>")


def render_trend(evaluation: str, windows: Sequence[Mapping[str, Any]], history: Sequence[Mapping[str, Any]],
                 changes: Mapping[str, PolicyChanges], drift: Mapping[str, Sequence[Mapping[str, Any]]],
                 requests: Sequence[Mapping[str, Any]]) -> str:
    """The trend page of one evaluation.

    Parameters
    ----------
    evaluation : str
    windows : list of dict
        The latest run of each window, in time order (`flows.reports.history.latest_per_window`).
    history : list of dict
        Every published run (`flows.reports.history.read_history`).
    changes : dict of str -> PolicyChanges
    drift : dict of monitor -> looks (`flows.reports.history.linked_drift`)
    requests : list of dict (`flows.reports.history.open_label_requests`)
    """
    names: list[str] = []
    for r in windows:
        names += [n for n in r["policies"] if n not in names]
    latest = windows[-1]
    alarm_now = sorted(n for n, pc in changes.items() if latest["window"] in pc.alarms)
    drift_alarms = sum(1 for looks in drift.values() for lk in looks if lk.get("alarm"))
    kpis = [("latest window", _window_label(latest["window"]), False),
            ("best policy", latest.get("best_policy") or "none", False),
            ("regression alarms now", ", ".join(alarm_now) or "none", bool(alarm_now)),
            ("drift alarms (all looks)", str(drift_alarms), bool(drift_alarms)),
            ("open label requests", str(len(requests)), bool(requests))]
    kpi_html = "".join(f"<div class='kpi{' bad' if bad else ''}' data-kpi='{_esc(k)}'><span>{_esc(k)}</span>"
                       f"<b>{_esc(v)}</b></div>" for k, v, bad in kpis)
    legend = _svg(WIDTH, 26, _legend([
        (_el("circle", cx=0.0, cy=0.0, r="5", fill=BLUE), "estimate"),
        (_line(0, -7, 0, 7, stroke=SKY, stroke_width="3"), "95% CI"),
        (_diamond(0, 0, 7, fill=VERMILLION), "regression alarm"),
        (_el("rect", x=-8.0, y=-7.0, width="16", height="14", fill="#eceef1", stroke="#8d949c",
             stroke_dasharray="3 3"), "level refused (no value)"),
    ], LEFT, 14, gap=26), "Legend")
    panels = "".join(f"<div class='figure'>{_policy_panel(n, windows, changes.get(n))}</div>" for n in names)
    drift_html = (f"<div class='figure'>{_drift_strip([r['window'] for r in windows], drift)}</div>" if drift else
                  "<p class='muted'>No drift monitor is linked to this evaluation (a monitor is linked when its "
                  "calibration comes from this evaluation's results).</p>")
    body = [
        f"<section id='status' class='summary'><h2>Status</h2><div class='kpis'>{kpi_html}</div></section>",
        "<section id='values'><h2>Policy values over windows</h2><p class='lead'>Calibrated values on the oracle "
        "scale with their intervals, one panel per policy on one time axis. A refused window has no value (its "
        "number is a ranking-only figure and is never drawn). Diamonds: regression alarms (a significant drop "
        "against the previous window or the baseline, with the false-alarm rate held over all windows by alpha "
        f"spending; see docs/monitoring.md).</p>{legend}{panels}</section>",
        f"<section id='drift'><h2>Judge drift of linked monitors</h2>{drift_html}</section>",
        "<section id='changes'><h2>Changes in the latest window</h2>"
        f"{_changes_table(changes, latest['window'])}</section>",
        "<section id='audits'><h2>Audit verdicts and own labels over windows</h2>"
        f"{_grid(windows, names)}</section>",
        f"<section id='requests'><h2>Open label requests</h2>{_requests_table(requests)}</section>",
        f"<section id='runs'><h2>Runs</h2>{_runs_table(history)}</section>",
    ]
    crumbs = "<nav class='crumbs'><a href='../index.html'>\u2190 all evaluations</a></nav>"
    return _page(f"Trend: {evaluation}", f"{len(windows)} window(s), {len(history)} run(s)", body, crumbs)


# --------------------------------------------------------------------------------------------- writing
def evaluation_pages(st: Storage, evaluation: str, *, requests_st: Storage | None = None,
                     labels_st: Storage | None = None,
                     drift_st: Storage | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """The trend page of ``evaluation`` and its index entry, from what is published (None if nothing is).

    Label requests are read from ``requests_st`` (their status with the label store ``labels_st``, as
    ``cje requests status``) and drift looks from ``drift_st``; each defaults to ``st``.
    """
    history = read_history(st, evaluation)
    if not history:
        return None, None
    windows = latest_per_window(history)
    changes = window_changes_of(history)
    drift = linked_drift(drift_st or st, evaluation)
    requests = open_label_requests(requests_st or st, evaluation, labels_st or _label_store_at(st))
    page = render_trend(evaluation, windows, history, changes, drift, requests)
    entry = {"evaluation": evaluation, "latest": windows[-1] if windows else history[-1], "n_runs": len(history),
             "n_windows": len(windows), "alarms": {n: pc.alarms for n, pc in changes.items()},
             "drift_alarms": sum(1 for looks in drift.values() for lk in looks if lk.get("alarm")),
             "open_requests": len(requests)}
    return page, entry


def _label_store_at(st: Storage) -> Storage | None:
    """``st`` when it holds a label store (``labels/``), else None."""
    return st if st.list("labels/") else None


def write_pages(st: Storage, evaluation: str | None = None, *, requests_st: Storage | None = None,
                labels_st: Storage | None = None, drift_st: Storage | None = None) -> dict[str, str]:
    """Rebuild ``results/<evaluation>/trend.html`` (one evaluation, or all) and ``results/index.html``.

    Each page is one atomic object write (readers see the old or the new page). Returns page -> location.
    ``requests_st``, ``labels_st``, ``drift_st``: where ``evaluation``'s label requests, label store and
    drift looks live when not under ``st`` (`evaluation_pages`); the other evaluations read ``st``.
    """
    written = {}
    entries = []
    for name in evaluations(st):
        sources = (dict(requests_st=requests_st, labels_st=labels_st, drift_st=drift_st) if name == evaluation
                   else {})
        page, entry = evaluation_pages(st, name, **sources)
        if page is None:
            continue
        if evaluation is None or name == evaluation:
            key = f"{RESULTS}/{name}/{TREND}"
            st.write_bytes(key, page.encode("utf-8"))
            written[key] = st.url(key)
        entries.append(entry)
    key = f"{RESULTS}/{INDEX}"
    st.write_bytes(key, render_index(entries).encode("utf-8"))
    written[key] = st.url(key)
    return written

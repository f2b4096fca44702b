"""Issue 28, the report's and the trend page's segment surfaces: a segment x policy heatmap of differences with
the baseline (verified cells marked, assumes-transport cells visibly different, too-few cells blank with the
reason), a drill-down table, the omnibus test and a reliability diagram per policy; a trend per segment over
windows. Rendered from a real segmented result of the engine (`cje_engine.evaluate(..., segment_by=...)`)."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.segments import SegmentSpec, simulate_segments
from flows.reports.common import fmt, fmt_ci, signed
from flows.reports.evaluation import render_report
from flows.reports.history import segments_summary
from flows.reports.trend import render_trend, segments_trend_section

SEGMENTS = ("code", "legal", "math", "chat", "german", "tiny")


def segmented_frame(seed: int = 1, n_prompts: int = 1500, shift: float = 0.0):
    """Three policies over six segments: ``new`` loses in legal; ``cand`` has no own labels in german (its level
    there assumes transport); ``tiny`` is too small and is pooled into ``other`` (itself too small)."""
    spec = SegmentSpec(n_prompts=n_prompts, segments=SEGMENTS, policies=("base", "new", "cand"),
                       mu=((0,) * 6, (0.2 + shift, -0.6, 0.2, 0.1, 0.15, 0.0), (0.05, 0.0, -0.1, 0.0, 0.4, 0.0)),
                       bias=(0.0,) * 6, oracle_fraction=0.15, seed=seed)
    d = simulate_segments(spec).frame
    rng = np.random.default_rng(seed)
    d = d[(d["segment"] != "tiny") | (rng.random(len(d)) < 0.03)].copy()
    m = (d["policy"] == "cand") & (d["segment"] == "german")
    d.loc[m, ["oracle_label", "label_probability"]] = np.nan
    return d


@pytest.fixture(scope="module")
def seg_result() -> dict:
    res = evaluate(segmented_frame(), segment_by=["segment"], baseline="base", n_bootstrap=200, seed=0,
                   segment_pooling="eb")
    return res.to_dict()


class _Cells(HTMLParser):
    """Every element with a data-segment attribute: (tag, attrs)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-segment" in a:
            self.found.append((tag, a))


def _cells(doc: str) -> list[tuple[str, dict]]:
    p = _Cells()
    p.feed(doc)
    return p.found


def _section(doc: str, sec_id: str) -> str:
    m = re.search(rf"<section id=['\"]{sec_id}['\"][^>]*>(.*?)</section>", doc, re.S)
    assert m, f"section {sec_id} missing"
    return m.group(1)


def test_the_report_has_the_segment_sections_with_the_right_marking(seg_result):
    seg = seg_result["segments"]
    kinds = {c["claim_kind"] for c in seg["comparisons"]}
    assert {"verified", "assumes_transport", "too_few"} <= kinds  # the fixture holds every kind of cell
    doc = render_report(seg_result)
    body = _section(doc, "segments")
    for h in ("Difference with the baseline, segment x policy", "Drill-down", "Calibration by segment",
              "Reliability by policy"):
        assert h in body
    heat = re.search(r"<table class='heat'.*?</table>", body, re.S).group(0)
    tds = {(a["data-segment"], a["data-policy"]): a for tag, a in _cells(heat) if tag == "td"}
    for c in seg["comparisons"]:
        td = tds[(c["segment"], c["policy"])]
        assert td["data-claim"] == c["claim_kind"]
        if c["claim_kind"] == "too_few":  # blank: no number, the reason
            assert td["class"] == "too_few" and "data-diff" not in td and td["data-reason"]
            assert "style" not in td  # no colour either
        else:
            assert td["class"].split()[0] == c["claim_kind"] and td["data-diff"] == signed(c["diff"])
            assert td["data-significant"] == str(bool(c["significant"])).lower()
            assert ("sig" in td["class"].split()) == bool(c["significant"])
    # verified and assumed cells look different: a solid frame and a check mark against a dashed, hatched cell
    css = doc[doc.index("<style>"):doc.index("</style>")]
    assert "td.verified{border:2px solid" in css and "td.assumes_transport{border:2px dashed" in css
    assert "repeating-linear-gradient" in css.split("td.assumes_transport{", 1)[1].split("}", 1)[0]
    german = re.search(r"<td class='assumes_transport[^>]*data-segment='german'[^>]*>(.*?)</td>", heat, re.S)
    assert german and "assumes transport" in german.group(1) and "\u2713" not in german.group(1)
    # a significant loss is named in the section's summary
    worse = [c for c in seg["comparisons"] if c["worse"]]
    assert worse and all(f"{c['policy']} in {c['segment']}" in body for c in worse)
    # the drill-down: one row per segment x policy cell with level, interval, labels / rows, audit, adjusted p
    rows = {(a["data-segment"], a["data-policy"]): a for tag, a in _cells(body) if tag == "tr"}
    shown = {c["segment"] for c in seg["cells"]}
    assert {(c["segment"], c["policy"]) for c in seg["cells"] if c["segment"] in shown} == set(rows)
    for c in seg["cells"]:
        r = rows[(c["segment"], c["policy"])]
        assert r["data-claim"] == c["claim_kind"] and r["data-audit"] == c["audit"]["verdict"]
        row = re.search(rf"<tr[^>]*data-segment='{c['segment']}' data-policy='{c['policy']}'.*?</tr>", body, re.S).group(0)
        assert f"{c['n_labels']} / {c['n_rows']}" in row
        if c["claim_kind"] == "too_few":
            assert fmt_ci(c["ci"]) not in row or c["ci"] is None
        else:
            assert fmt_ci(c["ci"]) in row
    # the omnibus tests and one reliability diagram per policy, well-formed SVG
    assert body.count("data-reject=") == len(seg["omnibus"])
    rel = re.findall(r"<svg\b.*?</svg>", body.split("Reliability by policy", 1)[1], re.S)
    assert len(rel) == len(seg["reliability"]) == 3
    for svg in rel:
        ET.fromstring(svg)
    # partial pooling (segment_pooling="eb"): the pooled level and its interval beside the cell's own
    pooled = [c for c in seg["cells"] if c.get("pooled")]
    assert pooled and "EB " in body
    for c in pooled:
        row = re.search(rf"<tr[^>]*data-segment='{c['segment']}' data-policy='{c['policy']}'.*?</tr>", body, re.S).group(0)
        assert f"EB {fmt(c['pooled']['estimate'])}" in row and fmt_ci(c["pooled"]["ci"]) in row
    # an unsegmented result has no segment section
    plain = {k: v for k, v in seg_result.items() if k != "segments"}
    assert "id='segments'" not in render_report(plain)


def _row(window: str, result: dict) -> dict:
    return {"window": window, "run_key": window, "published_at": window, "policies": {}, "best_policy": None,
            "segments": segments_summary(result)}


def test_the_trend_page_draws_a_trend_per_segment_over_windows(seg_result):
    later = evaluate(segmented_frame(seed=2, shift=-0.6), segment_by=["segment"], baseline="base", n_bootstrap=200,
                     seed=0).to_dict()
    rows = [_row("2025-06-01_2025-06-01", seg_result), {**_row("2025-06-02_2025-06-02", {}), "segments": None},
            _row("2025-06-03_2025-06-03", later)]
    html = segments_trend_section(rows)
    segs = [s["name"] for s in later["segments"]["segments"] if s["status"] != "pooled"]
    for s in segs:  # one panel (wide and narrow) per segment
        assert html.count(f"aria-label=\"Segment {s}: difference with base over windows\"") == 2
    markers = [a for tag, a in _cells(html) if "segment-marker" in a.get("class", "").split()
               and "m" not in a["class"].split()]
    by = {(a["data-segment"], a["data-policy"], a["data-window"]): a for a in markers}
    for w, res in (("2025-06-01_2025-06-01", seg_result), ("2025-06-03_2025-06-03", later)):
        for c in res["segments"]["comparisons"]:
            key = (c["segment"], c["policy"], w)
            if c["claim_kind"] == "too_few":
                assert key not in by
            else:
                assert by[key]["data-claim"] == c["claim_kind"] and by[key]["data-worse"] == str(bool(c["worse"])).lower()
    gaps = [a for tag, a in _cells(html) if "segment-gap" in a.get("class", "")]
    assert any(a["data-window"] == "2025-06-02_2025-06-02" for a in gaps)  # the unsegmented window: a gap
    assert any(a["data-segment"] == "other" for a in gaps)  # too few: a gap, never a value
    # the section is on the trend page, and absent when no window was segmented
    page = render_trend("ev", [{**r, "policies": {}} for r in rows], rows, {}, {}, [])
    assert "<section id='segments'>" in page and "Segments over windows" in page
    assert segments_trend_section([{**r, "segments": None} for r in rows]) == ""


def test_segment_sections_read_at_1280_and_420_px(seg_result, tmp_path):
    """Laid out in headless Chromium (network dead) at a laptop and a phone width: nothing wider than the viewport
    outside a scroll box, every chart label >= 10 CSS px, the drill-down and its too-few cells readable."""
    import os

    from tests.flows.test_monitoring import _chromium, _measure

    if _chromium() is None:
        if os.environ.get("CJE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not installed but CJE_REQUIRE_CHROMIUM=1 (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium); the static checks passed")
    doc = render_report(seg_result)
    head = doc[:doc.index("<main>") + 6]
    section = re.search(r"<section id='segments'>.*?</section>", doc, re.S).group(0)
    page = tmp_path / "segments.html"
    page.write_text(head + section + "</main></body></html>", encoding="utf-8")
    rows = [_row("2025-06-01_2025-06-01", seg_result), _row("2025-06-02_2025-06-02", seg_result)]
    trend = tmp_path / "trend.html"
    trend.write_text(render_trend("ev", [{**r, "policies": {}} for r in rows], rows, {}, {}, []), encoding="utf-8")
    for p in (page, trend):
        for width in (1280, 420):
            m = _measure(p, tmp_path, width)
            assert m["scrollWidth"] <= width and m["wide"] == [], (p.name, width, m["wide"][:5])
            small = [f for f in m["fonts"] if f[0] < 10]
            assert m["fonts"] and not small, (p.name, width, small[:5])
            if p == page:
                assert "Drill-down" in m["text"] and "too few" in m["text"]


def test_published_segmented_runs_keep_their_segments_and_the_trend_page_reads_them(seg_result, tmp_path):
    """Published through the storage layer (no Prefect): the result keeps its segments, the history rows carry
    them, and the rebuilt trend page has the per-segment panels of every window."""
    import json

    from flows.pipelines.pages import rebuild_pages
    from flows.reports.history import read_history
    from flows.storage.objects import Storage
    from flows.storage.publish import publish_run, read_latest

    st = Storage.for_uri(tmp_path)
    windows = ["2025-06-01_2025-06-01", "2025-06-02_2025-06-02"]
    for i, w in enumerate(windows):
        publish_run(st, "ev", w, f"k{i}", {"result.json": json.dumps(seg_result).encode()}, {})
    rebuild_pages(str(tmp_path), None, "ev")
    assert read_latest(st, "ev")["result"]["segments"] == seg_result["segments"]
    hist = read_history(st, "ev")
    assert all(r["segments"] and r["segments"]["baseline"] == "base" for r in hist)
    trend = (tmp_path / "results" / "ev" / "trend.html").read_text()
    section = trend.split("<section id='segments'>", 1)[1].split("</section>", 1)[0]
    shown = [c for c in seg_result["segments"]["comparisons"] if c["claim_kind"] != "too_few"]
    for w in windows:
        marks = [a for tag, a in _cells(section) if a.get("data-window") == w and a.get("class") == "segment-marker"]
        assert {(a["data-segment"], a["data-policy"]) for a in marks} == {(c["segment"], c["policy"]) for c in shown}

"""Issue 28, segments where people look first: the evaluate flow's Prefect artifacts (summary markdown and a
segment table) and the index card and trend page of the results pages carry a short segment summary (claims
against the baseline after the family's adjustment, audits failing by segment, the omnibus test) when the
evaluation has segments, and nothing when it has none. Before, only the report and the trend panels showed
segments: the artifacts and the index were silent about a policy losing in a segment."""
from __future__ import annotations

import os
from html.parser import HTMLParser

import pytest

from cje_engine import evaluate
from cje_engine.simulate.segments import SegmentSpec, simulate_segments
from flows.reports import artifacts
from flows.reports.common import fmt_ci, signed
from flows.reports.history import run_summary
from flows.reports.trend import render_index, render_trend


@pytest.fixture(scope="module")
def results():
    """``new`` better in a, b, c and worse in d; the judge over-rates a and under-rates b (audits fail there,
    the omnibus test fails); and the same data unsegmented."""
    spec = SegmentSpec(n_prompts=1200, mu=((0, 0, 0, 0), (0.3, 0.3, 0.3, -0.8)), bias=(0.8, -0.8, 0, 0),
                       oracle_fraction=0.2, seed=3)
    frame = simulate_segments(spec).frame
    seg = evaluate(frame, segment_by=["segment"], inference="analytic", seed=0, segment_recalibrate="never").to_dict()
    plain = evaluate(frame, inference="analytic", seed=0).to_dict()
    return seg, plain


def _expected(seg: dict) -> tuple[list[dict], list[dict]]:
    claims = [c for c in seg["segments"]["comparisons"] if c["better"] or c["worse"]]
    failing = [c for c in seg["segments"]["cells"] if c["audit"]["verdict"] == "fail"]
    # the fixture makes every part of the summary non-empty
    assert any(c["worse"] for c in claims) and any(c["better"] for c in claims) and failing
    assert next(t for t in seg["segments"]["omnibus"] if t["policy"] == "*")["reject"] is True
    return claims, failing


def _artifacts(result: dict, monkeypatch) -> dict:
    made = []
    monkeypatch.setattr(artifacts, "_create", lambda specs: made.extend(specs) or [])
    artifacts.evaluate_artifacts("ev", "w", "run", result, {"artifacts": {}})
    return {key: (kind, content) for kind, key, content, _ in made}


def test_artifacts_of_a_segmented_run_summarise_claims_failing_audits_and_the_omnibus_test(results, monkeypatch):
    seg, plain = results
    claims, failing = _expected(seg)
    by_key = _artifacts(seg, monkeypatch)
    summary = by_key["cje-ev-summary"][1]
    assert "## Segments by segment (against base)" in summary
    part = summary.split("## Segments", 1)[1]
    for c in claims:
        word = "WORSE" if c["worse"] else "BETTER"
        assert f"{c['policy']} {word} in {c['segment']} ({signed(c['diff'])}" in part
    assert f"Benjamini-Hochberg over {seg['segments']['error_control']['n_comparisons']} comparisons" in part
    for c in failing:
        assert f"{c['policy']} in {c['segment']}" in part.split("audits failing by segment:", 1)[1].split("\n")[0]
    assert "calibration by segment and score decile: FAILS" in part
    kind, rows = by_key["cje-ev-segments"]
    assert kind == "table"
    got = {(r["segment"], r["policy"], r["finding"]) for r in rows}
    want = {(c["segment"], c["policy"], f"{'worse' if c['worse'] else 'better'} than base") for c in claims}
    want |= {(c["segment"], c["policy"], "audit fails") for c in failing}
    want.add(("all segments", "all labels", "omnibus calibration test fails"))
    assert got == want
    ci = {(r["segment"], r["policy"]): r["interval"] for r in rows if r["finding"].endswith("than base")}
    for c in claims:  # the interval shown is the claim's false-coverage-rate interval
        assert ci[(c["segment"], c["policy"])] == fmt_ci(c["ci_fcr"])
    # without segments: no segment lines, no segment table
    by_key = _artifacts(plain, monkeypatch)
    assert "Segments" not in by_key["cje-ev-summary"][1] and "cje-ev-segments" not in by_key


class _Brief(HTMLParser):
    """The segment summaries of a page: their data attributes and list items."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.divs: list[dict] = []
        self.items: dict[str, str] = {}
        self._li: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div" and a.get("class") == "segbrief":
            self.divs.append(a)
        if tag == "li" and "data-brief" in a:
            self._li = a["data-brief"]
            self.items[self._li] = ""

    def handle_data(self, data):
        if self._li:
            self.items[self._li] += data

    def handle_endtag(self, tag):
        if tag == "li":
            self._li = None


def _brief(page: str) -> _Brief:
    p = _Brief()
    p.feed(page)
    return p


def _pages(result: dict) -> tuple[str, str]:
    row = run_summary({"evaluation": "ev", "window": "2025-06-01_2025-06-01", "run_key": "k",
                       "published_at": "2025-06-02T00:00:00", "result": result})
    index = render_index([{"evaluation": "ev", "latest": row, "n_runs": 1, "n_windows": 1}])
    trend = render_trend("ev", [row], [row], {}, {}, [])
    return index, trend


def test_index_card_and_trend_status_carry_the_segment_summary_only_when_segmented(results):
    seg, plain = results
    claims, failing = _expected(seg)
    for page in _pages(seg):
        b = _brief(page)
        assert len(b.divs) == 1, page
        d = b.divs[0]
        assert int(d["data-segment-claims"]) == len(claims)
        assert int(d["data-segment-worse"]) == sum(bool(c["worse"]) for c in claims)
        assert int(d["data-segment-audits-failing"]) == len(failing)
        assert d["data-omnibus"] == "fail"
        worst = next(c for c in claims if c["worse"])
        assert f"{worst['policy']} WORSE in {worst['segment']}" in b.items["claims"]
        assert all(f"{c['policy']} in {c['segment']}" in b.items["audits"] for c in failing)
        assert "FAILS" in b.items["omnibus"]
    for page in _pages(plain):
        assert _brief(page).divs == [] and "Segments by" not in page


def test_segment_summary_pages_read_at_1280_and_420_px(results, tmp_path):
    """Laid out in headless Chromium (network dead): the index card and the trend page with the summary are no
    wider than a phone's viewport, no link is clipped, and the summary's words are on the page."""
    from tests.flows.test_monitoring import _chromium, _measure

    if _chromium() is None:
        if os.environ.get("CJE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not installed but CJE_REQUIRE_CHROMIUM=1 (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium); the static checks passed")
    seg, _ = results
    worst = next(c for c in seg["segments"]["comparisons"] if c["worse"])
    index, trend = _pages(seg)
    paths = []
    for name, page in (("index.html", index), ("trend.html", trend)):
        (tmp_path / name).write_text(page, encoding="utf-8")
        paths.append(tmp_path / name)
    for p in paths:
        for width in (1280, 420):
            m = _measure(p, tmp_path, width)
            assert m["scrollWidth"] <= width and m["wide"] == [], (p.name, width, m["wide"][:5])
            assert m["clipped"] == [], (p.name, width, m["clipped"][:5])
            assert f"{worst['policy']} WORSE in {worst['segment']}" in m["text"]
            assert "audits failing by segment" in m["text"]

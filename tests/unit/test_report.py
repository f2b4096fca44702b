"""Tests for flows.reports.evaluation: the self-contained HTML report and the terminal table."""
from __future__ import annotations

import copy
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cje_engine.errors import CJEInputError
from flows.reports import evaluation as report
from flows.reports.common import BLUE, GREEN, GREY, VERMILLION
from flows.reports.evaluation import render_report
from flows.reports.svg import _tick_label, nice_ticks
from flows.reports.table import format_table

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "result_example.json"
SVG_NS = "{http://www.w3.org/2000/svg}"
EVIL = "<script>alert(1)</script>"
AMP = 'a&b"c'

DRIFT = {
    "periods": ["2025-01", "2025-02", "2025-03", "2025-04"],
    "kendall_tau": [1.0, 0.93, None, 0.71],
    "tau_threshold": 0.8,
    "residual_shift": [0.0, 0.01, 0.02, 0.08],
    "residual_shift_ci": [None, [-0.02, 0.04], [-0.01, 0.05], [0.05, 0.11]],
    "shift_threshold": 0.05,
    "n_anchors": 200,
}


@pytest.fixture()
def result() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------- helpers
class _Text(HTMLParser):
    """Visible text of an HTML fragment (tags dropped, entities decoded)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("style", "title"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("style", "title") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def visible_text(fragment: str) -> str:
    parser = _Text()
    parser.feed(fragment)
    return " ".join("".join(parser.parts).split())


def section(doc: str, sec_id: str) -> str:
    m = re.search(rf"<section id=['\"]{sec_id}['\"][^>]*>(.*?)</section>", doc, re.S)
    assert m, f"section {sec_id} missing"
    return m.group(1)


def svgs(doc: str) -> list[ET.Element]:
    blocks = re.findall(r"<svg\b.*?</svg>", doc, re.S)
    return [ET.fromstring(b) for b in blocks]


def svg_by_label(doc: str, prefix: str) -> list[ET.Element]:
    return [s for s in svgs(doc) if s.get("aria-label", "").startswith(prefix)]


def rename(result: dict, old: str, new: str) -> dict:
    """Rename a policy everywhere in the result dict."""
    res = copy.deepcopy(result)
    res["policies"] = {(new if k == old else k): v for k, v in res["policies"].items()}
    sub = lambda x: new if x == old else x  # noqa: E731
    res["data"]["policies"] = [sub(x) for x in res["data"]["policies"]]
    for c in res["comparisons"]:
        c["a"], c["b"] = sub(c["a"]), sub(c["b"])
    for r in res["ranking"]:
        r["policy"] = sub(r["policy"])
    res["win_matrix"]["policies"] = [sub(x) for x in res["win_matrix"]["policies"]]
    ra = res["rank_agreement"]
    ra["raw_order"] = [sub(x) for x in ra["raw_order"]]
    ra["calibrated_order"] = [sub(x) for x in ra["calibrated_order"]]
    res["best_policy"] = sub(res["best_policy"])
    return res


# ---------------------------------------------------------------------------- structure
def test_every_section_present_and_drift_only_when_given(result):
    doc = render_report(result)
    assert doc.startswith("<!DOCTYPE html>")
    for sec_id in ("summary", "estimates", "calibration", "audit", "comparisons", "warnings"):
        assert section(doc, sec_id)
    assert "<footer id='footer'>" in doc
    assert "id='drift'" not in doc
    labels = [s.get("aria-label") for s in svgs(doc)]
    assert "Forest plot of policy estimates with confidence intervals" in labels
    assert "Calibration curve and reliability diagram" in labels
    assert "Pairwise win matrix with adjusted significance" in labels
    with_drift = render_report(result, drift=DRIFT)
    assert section(with_drift, "drift")
    assert "Judge drift timeline" in [s.get("aria-label") for s in svgs(with_drift)]


def test_all_svg_is_well_formed_xml(result):
    doc = render_report(rename(result, "unhelpful", EVIL), title=AMP, drift=DRIFT)
    blocks = re.findall(r"<svg\b.*?</svg>", doc, re.S)
    # forest + calibration + 3 audit panels (clone is not audited) + win matrix + drift
    assert len(blocks) == 7
    for block in blocks:
        root = ET.fromstring(block)  # raises on malformed XML
        assert root.tag == SVG_NS + "svg"
        assert root.get("viewBox")


def test_self_contained_no_network_resources(result):
    doc = render_report(result, drift=DRIFT)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", doc, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//", doc, re.I)
    for banned in ("@import", "<link", "<script", "<iframe", "<img", "@font-face"):
        assert banned not in doc.lower()
    assert "<style>" in doc  # CSS is inline


def test_render_is_deterministic(result):
    assert render_report(result, drift=DRIFT) == render_report(result, drift=DRIFT)


# ---------------------------------------------------------------------------- escaping
def test_user_strings_are_escaped(result):
    res = rename(rename(result, "unhelpful", EVIL), "base", AMP)
    res["policies"][EVIL]["refusal_reasons"].append("<img src=x onerror=alert(2)>")
    res["warnings"].append("</section><script>alert(3)</script>")
    res["best_policy"] = AMP
    res["best_policy_reason"] = "<b>bold</b> & done"
    drift = dict(DRIFT, periods=["<i>p1</i>", "p2", "p3", "p&4"], method="<u>m</u>")
    doc = render_report(res, title="<h1>x</h1> & 'y'", drift=drift)
    for raw in (EVIL, AMP, "<img src=x", "<script>alert(3)", "<b>bold</b>", "<i>p1</i>",
                "<u>m</u>", "<h1>x</h1>", "p&4"):
        assert raw not in doc, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in doc
    assert "a&amp;b&quot;c" in doc
    assert "&lt;h1&gt;x&lt;/h1&gt; &amp; &#x27;y&#x27;" in doc
    assert "&lt;img src=x onerror=alert(2)&gt;" in doc
    assert "p&amp;4" in doc
    # the names survive as text, both in the HTML and inside the SVG
    text = visible_text(doc)
    assert EVIL in text and AMP in text
    forest = svg_by_label(doc, "Forest plot")[0]
    names = {"".join(t.itertext()) for t in forest.iter(SVG_NS + "text")}
    assert any(EVIL in n for n in names) and any(AMP in n for n in names)


def test_escaped_names_in_terminal_table_stay_plain(result):
    table = format_table(rename(result, "base", AMP))
    assert AMP in table and "&amp;" not in table


# ---------------------------------------------------------------------------- level gate
def _refused_numbers(pol: dict) -> list[str]:
    est, (lo, hi) = pol["estimate"], pol["ci"]
    nums = [f"{est:.3f}", f"{lo:.3f}", f"{hi:.3f}"]
    for key in ("plug_in", "augmented"):
        if pol.get(key):
            nums += [f"{pol[key]['estimate']:.3f}", f"{pol[key]['ci'][0]:.3f}",
                     f"{pol[key]['ci'][1]:.3f}"]
    return nums


def test_refused_policy_never_shown_with_a_quotable_number(result):
    pol = result["policies"]["unhelpful"]
    assert pol["level_claim"] == "refused"
    doc = render_report(result)
    summary = visible_text(section(doc, "summary"))
    assert "unhelpful" in summary and "refused" in summary
    assert "transport audit failed" in summary  # the engine's reason is shown
    forbidden = _refused_numbers(pol) + [f"{pol['estimate']:.2f}"]
    for num in forbidden:
        assert num not in summary, num
    # nowhere in the visible page (tables, charts) either
    whole = visible_text(doc)
    for num in _refused_numbers(pol):
        assert num not in whole, num
    # the forest plot says "refused" for it and draws it hollow (one hollow marker)
    forest = svg_by_label(doc, "Forest plot")[0]
    texts = ["".join(t.itertext()) for t in forest.iter(SVG_NS + "text")]
    assert "refused" in texts
    circles = list(forest.iter(SVG_NS + "circle"))
    hollow = [c for c in circles if c.get("fill") == "#fff" and c.get("stroke") == GREY]
    filled = [c for c in circles if c.get("fill") == BLUE]
    # legend has one of each; rows have 1 refused and 3 quotable policies
    assert len(hollow) == 1 + 1
    assert len(filled) == 1 + 3


def test_refused_number_hidden_even_when_distinctive(result):
    res = copy.deepcopy(result)
    res["policies"]["clone"].update(level_claim="refused", estimate=0.6543, ci=[0.6012, 0.7071],
                                    refusal_reasons=["calibration support limited"])
    res["policies"]["clone"]["plug_in"] = {"estimate": 0.6543, "se": 0.01, "ci": [0.6012, 0.7071]}
    doc = render_report(res)
    whole = visible_text(doc)
    for num in ("0.654", "0.601", "0.707"):
        assert num not in whole
    summary = visible_text(section(doc, "summary"))
    assert "0.65" not in summary and "0.60" not in summary and "0.71" not in summary
    assert "calibration support limited" in summary
    assert "clone" in summary


def test_best_policy_must_not_be_refused(result):
    res = copy.deepcopy(result)
    res["best_policy"] = "unhelpful"
    with pytest.raises(CJEInputError) as err:
        render_report(res)
    assert err.value.column == "best_policy"
    with pytest.raises(CJEInputError):
        format_table(res)


# ---------------------------------------------------------------------------- summary
def test_summary_content(result):
    summary = visible_text(section(render_report(result), "summary"))
    # quotable levels with their numbers
    assert "base: 0.754 (95% CI 0.732–0.776)" in summary
    assert "parallel_universe_prompt: 0.780" in summary
    assert "unaudited" in summary  # clone has no own labels
    assert "No clear winner" in summary
    assert "no clear winner: no clear winner" not in summary.lower()
    assert "Transport audit failed for unhelpful" in summary
    assert "about 95 more labels needed" in summary
    assert "disagrees" in summary and "τ-b = 0.67" in summary
    assert "Raw judge order: clone > parallel_universe_prompt > base > unhelpful" in summary


def test_summary_best_policy_and_agreement(result):
    res = copy.deepcopy(result)
    res["best_policy"] = "parallel_universe_prompt"
    res["best_policy_reason"] = "significantly better than every other policy"
    order = ["parallel_universe_prompt", "clone", "base", "unhelpful"]
    res["rank_agreement"] = {"kendall_tau_b_raw_vs_calibrated": 1.0, "raw_order": order,
                             "calibrated_order": order}
    summary = visible_text(section(render_report(res), "summary"))
    assert "Best policy: parallel_universe_prompt — significantly better" in summary
    assert "No clear winner" not in summary
    assert "the same way" in summary and "disagrees" not in summary


def test_summary_when_nothing_is_quotable(result):
    res = copy.deepcopy(result)
    for pol in res["policies"].values():
        pol["level_claim"] = "refused"
    summary = visible_text(section(render_report(res), "summary"))
    assert "No policy has a verified level" in summary
    assert "Levels that can be quoted" not in summary


# ---------------------------------------------------------------------------- figures
def test_audit_panels_only_for_audited_policies(result):
    doc = render_report(result)
    panels = svg_by_label(doc, "Audit residuals by score bin for ")
    names = sorted(p.get("aria-label").rsplit(" for ", 1)[1] for p in panels)
    assert names == ["base", "parallel_universe_prompt", "unhelpful"]
    for panel in panels:
        name = panel.get("aria-label").rsplit(" for ", 1)[1]
        deciles = result["policies"][name]["audit"]["deciles"]
        # one point per bin + one diamond for the overall mean
        assert len(list(panel.iter(SVG_NS + "circle"))) == len(deciles)
        assert len(list(panel.iter(SVG_NS + "polygon"))) == 1
        band = [r for r in panel.iter(SVG_NS + "rect") if r.get("fill") == GREEN]
        assert len(band) == 1 and float(band[0].get("height")) > 0
    assert "Not audited (no own labels): clone" in visible_text(section(doc, "audit"))


def test_win_matrix_symbols_follow_direction(result):
    win = svg_by_label(render_report(result), "Pairwise win matrix")[0]
    titles = ["".join(t.itertext()) for t in win.iter(SVG_NS + "title")]
    assert "unhelpful vs base: P(row better) = 0.00; significantly worse" in titles
    assert "base vs unhelpful: P(row better) = 1.00; significantly better" in titles
    assert "base vs clone: P(row better) = 0.18; not significant" in titles
    texts = ["".join(t.itertext()) for t in win.iter(SVG_NS + "text")]
    assert texts.count("▲") == 3 and texts.count("▼") == 3
    assert any("BH-adjusted" in t for t in texts)  # legend names the adjustment


def test_win_matrix_falls_back_to_comparisons(result):
    res = copy.deepcopy(result)
    del res["win_matrix"]
    win = svg_by_label(render_report(res), "Pairwise win matrix")[0]
    titles = ["".join(t.itertext()) for t in win.iter(SVG_NS + "title")]
    assert "unhelpful vs clone: P(row better) = 0.00; significantly worse" in titles
    assert "parallel_universe_prompt vs base: P(row better) = 0.88; not significant" in titles


def _win_titles(res: dict) -> list[str]:
    win = svg_by_label(render_report(res), "Pairwise win matrix")[0]
    return ["".join(t.itertext()) for t in win.iter(SVG_NS + "title")]


def test_win_matrix_directional_and_signed_marks(result):
    res = copy.deepcopy(result)
    res["comparisons"] = []
    # directional: only the winner's row is marked; direction comes from P(row better)
    res["win_matrix"]["significant"] = [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    titles = _win_titles(res)
    assert "unhelpful vs clone: P(row better) = 0.00; significantly worse" in titles
    assert "clone vs unhelpful: P(row better) = 1.00; significantly better" in titles
    # signed, without probabilities: direction comes from the sign
    res["win_matrix"]["significant"] = [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 1],
                                        [-1, -1, -1, 0]]
    res["win_matrix"]["prob_row_better"] = [[None] * 4 for _ in range(4)]
    titles = _win_titles(res)
    assert "unhelpful vs base: P(row better) = n/a; significantly worse" in titles
    assert "base vs unhelpful: P(row better) = n/a; significantly better" in titles
    assert "base vs clone: P(row better) = n/a; not significant" in titles


def test_calibration_figure_draws_points_curve_and_bins(result):
    cal = svg_by_label(render_report(result), "Calibration curve")[0]
    circles = list(cal.iter(SVG_NS + "circle"))
    n_points = len(result["calibration"]["points"]["score"])
    n_bins = len(result["calibration"]["reliability"])
    # + 2 legend markers (labelled point, bin)
    assert len(circles) == n_points + n_bins + 2
    curve = [p for p in cal.iter(SVG_NS + "polyline")]
    assert len(curve) == 1
    assert len(curve[0].get("points").split()) == len(result["calibration"]["curve"]["score"])


def test_ticks_cover_range_with_round_steps():
    lo, hi, ticks, dec = nice_ticks(0.093, 0.871)
    assert lo <= 0.093 and hi >= 0.871
    steps = {round(b - a, 10) for a, b in zip(ticks, ticks[1:])}
    assert steps == {0.2} and dec == 1
    assert [_tick_label(t, dec) for t in ticks] == ["0.0", "0.2", "0.4", "0.6", "0.8",
                                                           "1.0"]
    lo, hi, ticks, dec = nice_ticks(-0.33, 0.06, 5)
    assert ticks[0] <= -0.33 and ticks[-1] >= 0.06 and _tick_label(0.0, dec) == "0.0"


def test_minimal_result_renders(result):
    minimal = {"policies": {
        "x": {"estimate": 0.5, "ci": [0.4, 0.6], "level_claim": "ok"},
        "y": {"estimate": None, "ci": None, "level_claim": "refused"},
    }}
    doc = render_report(minimal)
    for sec_id in ("summary", "estimates", "calibration", "audit", "comparisons"):
        assert section(doc, sec_id)
    assert "No calibration information" in doc
    assert "No pairwise comparisons" in doc
    for block in re.findall(r"<svg\b.*?</svg>", doc, re.S):
        ET.fromstring(block)
    table = format_table(minimal)
    assert "Pairwise comparisons: none" in table


# ---------------------------------------------------------------------------- drift
def test_drift_alarms_from_thresholds(result):
    doc = render_report(result, drift=DRIFT)
    summary = visible_text(section(doc, "summary"))
    # period 4: tau 0.71 < 0.8 and shift 0.08 > 0.05; period 3 has tau missing and shift 0.02
    assert "Judge drift alarm in period(s) 2025-04." in summary
    drift_svg = svg_by_label(doc, "Judge drift timeline")[0]
    alarm_markers = [p for p in drift_svg.iter(SVG_NS + "polygon")
                     if p.get("fill") == VERMILLION]
    assert len(alarm_markers) == 2 + 1  # tau and shift panels at period 4, plus legend
    text = visible_text(section(doc, "drift"))
    assert "200 anchor pairs" in text


def test_drift_explicit_alarms_override_thresholds(result):
    drift = dict(DRIFT, alarms=[False, True, False, False])
    summary = visible_text(section(render_report(result, drift=drift), "summary"))
    assert "alarm in period(s) 2025-02." in summary
    quiet = dict(DRIFT, kendall_tau=[1.0, 0.95, 0.94, 0.93], residual_shift=None,
                 residual_shift_ci=None)
    summary = visible_text(section(render_report(result, drift=quiet), "summary"))
    assert "No judge drift alarm over 4 period(s)" in summary


@pytest.mark.parametrize("bad, column, row", [
    ({"periods": []}, "periods", None),
    ({"periods": ["a", "b"], "kendall_tau": [1.0]}, "kendall_tau", None),
    ({"periods": ["a", "b"], "kendall_tau": [1.0, "x"]}, "kendall_tau", 1),
    ({"periods": ["a"], "kendall_tau": [1.0], "residual_shift": [float("nan")]},
     "residual_shift", 0),
    ({"periods": ["a"], "kendall_tau": [1.0], "tau_threshold": "high"}, "tau_threshold", None),
    ({"periods": ["a"], "kendall_tau": [1.0], "alarms": ["yes"]}, "alarms", None),
    ({"periods": ["a"], "kendall_tau": [1.0], "residual_shift_ci": [[0.1]]},
     "residual_shift_ci", 0),
])
def test_bad_drift_is_rejected_with_location(result, bad, column, row):
    with pytest.raises(CJEInputError) as err:
        render_report(result, drift=bad)
    assert err.value.source == "drift"
    assert err.value.column == column
    assert err.value.row == row


def test_drift_must_be_a_dict(result):
    with pytest.raises(CJEInputError, match="expected a dict"):
        render_report(result, drift=[1, 2])


# ---------------------------------------------------------------------------- bad results
@pytest.mark.parametrize("mutate, column", [
    (lambda r: r.update(schema_version=2), "schema_version"),
    (lambda r: r.update(policies={}), "policies"),
    (lambda r: r.pop("policies"), "policies"),
    (lambda r: r["policies"]["base"].update(level_claim="maybe"), "policies.base.level_claim"),
    (lambda r: r["policies"]["base"].update(estimate="high"), "policies.base.estimate"),
    (lambda r: r["policies"]["base"].update(ci=[0.1]), "policies.base.ci"),
    (lambda r: r["policies"].update(base=[1, 2]), "policies.base"),
    (lambda r: r.update(best_policy="nobody"), "best_policy"),
])
def test_bad_result_is_rejected_with_location(result, mutate, column):
    mutate(result)
    with pytest.raises(CJEInputError) as err:
        render_report(result)
    assert err.value.column == column
    assert err.value.source == "result"
    with pytest.raises(CJEInputError):
        format_table(result)


def test_non_dict_result_is_rejected():
    with pytest.raises(CJEInputError, match="expected the result dict"):
        render_report([1, 2, 3])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- footer
def test_footer_has_config_seed_and_version(result):
    doc = render_report(result)
    footer = visible_text(doc.split("<footer id='footer'>", 1)[1])
    assert "seed 0" in footer and "engine version 0.1.0" in footer
    for key in result["config"]:
        assert key in footer
    assert '"response_length"' in footer


def test_title_default_and_custom(result):
    assert "<title>CJE evaluation report</title>" in render_report(result)
    assert "<title>Weekly eval</title>" in render_report(result, title="Weekly eval")


# ---------------------------------------------------------------------------- terminal table
def test_format_table_rows_and_alignment(result):
    table = format_table(result)
    lines = table.splitlines()
    header = lines[1]
    for col in ("policy", "estimate", "95% CI", "claim", "basis", "audit", "assumes transport", "raw judge",
                "oracle mean"):
        assert col in header
    rows = {ln.split()[1]: ln for ln in lines[3:7]}
    assert set(rows) == set(result["policies"])
    assert rows["base"].split() == ["1-3", "base", "0.754", "[0.732,", "0.776]", "ok", "augmented",
                                    "pass", "0.841", "0.754"]
    assert rows["clone"].split()[-3:] == ["run", "0.849", "n/a"]
    assert rows["unhelpful"].split()[:5] == ["4", "unhelpful", "refused", "refused", "refused"]
    assert "0.140" not in table and "0.096" not in table
    # right-aligned numeric columns end at the same character position on every row
    est_end = header.index("estimate") + len("estimate")
    for ln in lines[3:7]:
        cell = ln[:est_end].rstrip()
        assert cell.endswith(("0.754", "0.763", "0.780", "refused"))
        assert len(cell) == est_end
    # highest estimate first
    assert [ln.split()[1] for ln in lines[3:7]] == ["parallel_universe_prompt", "clone", "base", "unhelpful"]


def test_format_table_orders_by_estimate_and_shows_the_rank_the_comparisons_support(result):
    """An imprecise low estimate that nothing beats significantly has rank 1 in the engine's ranking
    (1 + policies significantly better): the table used to print it second, as "rank 1". It is listed
    last (by estimate) with the ranks the comparisons leave open, 1-4."""
    res = copy.deepcopy(result)
    names = ["a", "b", "c", "d"]
    est = {"a": 0.80, "b": 0.70, "c": 0.60, "d": 0.30}
    res["policies"] = {n: dict(copy.deepcopy(result["policies"]["base"]), estimate=est[n]) for n in names}
    # a > b > c significantly; d (few labels, wide interval) is not significantly different from any
    res["win_matrix"] = {"policies": names, "significant": [[0, 1, 1, 0], [-1, 0, 1, 0], [-1, -1, 0, 0], [0, 0, 0, 0]],
                         "prob_row_better": [[None] * 4 for _ in names]}
    res["ranking"] = [{"policy": n, "rank": r, "estimate": est[n], "level_claim": "ok", "tied_with": []}
                      for n, r in (("a", 1), ("d", 1), ("b", 2), ("c", 3))]
    res["comparisons"] = []
    lines = format_table(res).splitlines()
    rows = [ln.split()[:3] for ln in lines[3:7]]
    # d could rank anywhere; a, b, c are ordered among themselves, but each could swap places with d
    assert rows == [["1-2", "a", "0.800"], ["2-3", "b", "0.700"], ["3-4", "c", "0.600"], ["1-4", "d", "0.300"]]
    assert "a range (1-3) when the comparisons leave it open" in lines[7]
    # the report's policy table agrees with the terminal: same order (a, b, c, d), same ranks
    doc = render_report(res)
    assert re.findall(r"class='r num rank'>([^<]*)</td>", doc) == ["1-2", "2-3", "3-4", "1-4"]


def test_format_table_comparisons_and_best(result):
    table = format_table(result)
    assert "p adjusted by BH" in table
    comp = [ln for ln in table.splitlines() if ln.startswith("base ") and "unhelpful" in ln][0]
    assert comp.split() == ["base", "unhelpful", "+0.614", "[0.565,", "0.663]", "<0.001",
                            "<0.001", "yes", "1.00", "*"]
    assert "* involves a refused policy" in table
    assert table.splitlines()[-1].startswith("Best policy: none, no clear winner (parallel")
    res = copy.deepcopy(result)
    res["best_policy"], res["best_policy_reason"] = "base", "because"
    assert format_table(res).splitlines()[-1] == "Best policy: base (because)"


def test_format_table_uses_alpha(result):
    res = copy.deepcopy(result)
    res["inference"]["alpha"] = 0.1
    res["config"]["alpha"] = 0.1
    assert "90% CI" in format_table(res) and "95% CI" not in format_table(res)
    assert "90% CI" in render_report(res)


# ---------------------------------------------------------------------------- command line
def test_cli_writes_report_and_prints_table(tmp_path, capsys):
    out = tmp_path / "report.html"
    drift = tmp_path / "drift.json"
    drift.write_text(json.dumps(DRIFT))
    assert report.main([str(FIXTURE), "-o", str(out), "--drift", str(drift),
                        "--title", "T"]) == 0
    printed = capsys.readouterr().out
    assert "Policy estimates (oracle scale)" in printed
    doc = out.read_text(encoding="utf-8")
    assert "<title>T</title>" in doc and "id='drift'" in doc


def test_cli_bad_json_names_the_file(tmp_path):
    bad = tmp_path / "result.json"
    bad.write_text("{not json")
    with pytest.raises(CJEInputError) as err:
        report.main([str(bad)])
    assert err.value.source == str(bad)


# ---------------------------------------------------------------------------- issue 16: non-estimable comparisons
def _not_estimable(result: dict, legacy_numbers: bool) -> dict:
    """base - unhelpful made non-estimable in the engine's contract (reported false, numbers null); with
    ``legacy_numbers`` the numbers are left in place, which must not matter."""
    res = copy.deepcopy(result)
    c = next(c for c in res["comparisons"] if (c["a"], c["b"]) == ("base", "unhelpful"))
    c.update(reported=False, not_estimable="overlap refused: TTC 0.34 < 0.70")
    if not legacy_numbers:
        c.update(diff=None, ci=None, p_value=None, p_adjusted=None, significant=None, prob_a_better=None)
    else:
        c.update(diff=0.6351, ci=[0.5791, 0.7013])
    for other in res["comparisons"]:
        other.setdefault("reported", True)
        other.setdefault("not_estimable", None)
    return res


@pytest.mark.parametrize("legacy", [False, True])
def test_non_estimable_comparison_is_never_a_number(result, legacy):
    res = _not_estimable(result, legacy)
    doc = render_report(res)
    comp = section(doc, "comparisons")
    row = re.search(r"<tr class='is-refused not-estimable'>(.*?)</tr>", comp, re.S).group(1)
    assert "not estimable: overlap refused: TTC 0.34 &lt; 0.70" in row
    assert not re.search(r"\d\.\d{3}", row), row  # no diff, CI or p in the row
    assert "0.635" not in comp and "0.579" not in comp
    assert "5 comparisons reported, 1 not estimable" in visible_text(comp)
    # the win matrix leaves that cell without a number or a significance mark
    win = svg_by_label(doc, "Pairwise win matrix")[0]
    titles = [t.text for t in win.iter(SVG_NS + "title") if t.text and t.text.startswith("base vs unhelpful")]
    assert titles and all("n/a" in t and "not significant" in t for t in titles)
    table = format_table(res)
    line = next(ln for ln in table.splitlines() if ln.startswith("base") and "unhelpful" in ln)
    assert "not estimable: overlap refused: TTC 0.34 < 0.70" in line
    assert "0.635" not in table and "+0.6" not in line


def test_comparisons_without_the_new_keys_render_as_before(result):
    assert "not estimable" not in render_report(result) and "not estimable" not in format_table(result)


# ---------------------------------------------------------------------------- issue 13: scales
def _two_scales(result: dict) -> dict:
    """Judge scores on 1-10, labels on 1-5: every label-scale number mapped by y = 1 + 4 v, raw judge means by
    s = 1 + 9 v, so the judge reads 1 + 4 (s - 1) / 9 on the label scale."""
    res = copy.deepcopy(result)
    res["config"]["score_scale"], res["config"]["label_scale"] = [1, 10], [1, 5]
    for p in res["policies"].values():
        for k in ("estimate", "oracle_mean"):
            if p.get(k) is not None:
                p[k] = 1 + 4 * p[k]
        if p.get("ci"):
            p["ci"] = [1 + 4 * v for v in p["ci"]]
        p["raw_judge_mean"] = 1 + 9 * p["raw_judge_mean"]
    cal = res["calibration"]
    cal["curve"]["score"] = [1 + 9 * v for v in cal["curve"]["score"]]
    cal["curve"]["fitted"] = [1 + 4 * v for v in cal["curve"]["fitted"]]
    cal["points"]["score"] = [1 + 9 * v for v in cal["points"]["score"]]
    cal["points"]["label"] = [1 + 4 * v for v in cal["points"]["label"]]
    cal["label_range"] = [1 + 9 * v for v in cal["label_range"]]
    return res


def test_raw_judge_means_are_read_on_the_label_scale_and_no_identity_across_scales(result):
    res = _two_scales(result)
    doc = render_report(res)
    forest = svg_by_label(doc, "Forest plot")[0]
    # the forest's x axis is the label scale: every tick is within [1, 5] (raw means 8.6 on 1-10 would push it out)
    ticks = [float(t.text) for t in forest.iter(SVG_NS + "text") if t.text and re.fullmatch(r"-?\d+(\.\d+)?", t.text)]
    assert ticks and max(ticks) <= 5.0 and min(ticks) >= 1.0
    assert "raw judge mean, 1\u201310 read on 1\u20135" in visible_text(doc)
    cal = svg_by_label(doc, "Calibration curve")[0]
    legend = [t.text for t in cal.iter(SVG_NS + "text")]
    assert "identity" not in legend and "judge score (1\u201310)" in legend and "oracle label (1\u20135)" in legend
    assert "raw judge (1\u201310)" in visible_text(section(doc, "estimates"))
    assert "raw judge (1\u201310)" in format_table(res)
    # on one scale the identity line stays, and the raw judge column keeps its plain header
    same = visible_text(render_report(result))
    assert "identity" in same and "raw judge mean" in same and "read on" not in same


# ---------------------------------------------------------------------------- issue 11: terminal escapes
@pytest.mark.parametrize("name", ["two\nlines", "red\x1b[31mALERT\x1b[0m", "abc\u202edcba", "bell\x07", "c1\x9bx"])
def test_terminal_table_escapes_control_characters(result, name):
    res = rename(result, "clone", name)
    res["best_policy_reason"] = f"{name} is not better"
    out = format_table(res)
    assert not any(ord(c) < 0x20 and c != "\n" or 0x7f <= ord(c) < 0xa0 or c in "\u202e\u2066" for c in out)
    n_lines = len(format_table(result).splitlines())
    assert len(out.splitlines()) == n_lines  # a newline in a name never splits a row
    shown = {"two\nlines": "two\\x0alines", "red\x1b[31mALERT\x1b[0m": "red\\x1b[31mALERT\\x1b[0m",
             "abc\u202edcba": "abc\\u202edcba", "bell\x07": "bell\\x07", "c1\x9bx": "c1\\x9bx"}[name]
    assert shown in out and f"{shown} is not better" in out


# ---------------------------------------------------------------------------- issue 12: run context
def test_report_context_links_and_what_changed(result):
    prev = {"window": "2025-03-01_2025-03-07", "run_key": "abc123", "published_at": "2025-03-08T06:00:00+00:00",
            "href": "../../../2025-03-01_2025-03-07/abc123/20250308T060000Z-00000000/report.html"}
    ctx = {"generated_at": "2025-03-15 06:00:01 UTC", "result_href": "result.json", "trend_href": "../../../trend.html",
           "index_href": "../../../../index.html", "previous": prev,
           "changes": [{"policy": "base", "before": 0.741, "after": 0.756, "diff": 0.015, "notes": [],
                        "claim_before": "ok", "claim_after": "ok"},
                       {"policy": "unhelpful", "before": None, "after": None, "diff": None,
                        "notes": ["level ok \u2192 refused"], "claim_before": "ok", "claim_after": "refused"},
                       {"policy": None, "notes": ["best policy base \u2192 none"]}],
           "drift": {"judge-mon": dict(DRIFT, alarms=[False, False, False, True])}}
    doc = render_report(result, context=ctx)
    head = doc[doc.index("<header"):doc.index("</header>")]
    assert "generated 2025-03-15 06:00:01 UTC" in head and "href='result.json'" in head
    assert f"href='{prev['href']}' rel='prev'" in head and "previous run (2025-03-01..2025-03-07)" in head
    changed = " ".join(re.sub(r"<[^>]+>", " ", section(doc, "changed")).split())
    assert "base 0.741 0.756 +0.015" in changed and "unhelpful n/a refused n/a" in changed
    assert "level ok \u2192 refused" in changed and "best policy base \u2192 none" in changed
    drift = section(doc, "drift-judge-mon")
    assert "Judge drift: monitor judge-mon" in drift and "<b>alarm</b>" in drift
    # without context: no such block (cje evaluate writes a report outside any service)
    plain = render_report(result)
    assert "id='changed'" not in plain and "generated " not in plain

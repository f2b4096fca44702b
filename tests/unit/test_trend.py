"""Trend page, results index and run history (pure parts; storage end to end in tests/flows/test_monitoring.py)."""
from __future__ import annotations

import hashlib
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from flows.reports.history import (drift_for_report, latest_per_window, linked_drift, previous_run, read_history,
                                   what_changed, window_changes_of)
from flows.reports.trend import ENTRY, ENTRY_VERSION, kept_entry, render_index, render_trend, write_pages
from flows.storage.objects import Storage
from flows.pipelines.pages import contextual_report, rebuild_pages
from flows.storage.publish import publish_run

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "result_example.json"


def _row(window: str, key: str, published: str, values: dict, refused=(), best=None) -> dict:
    pols = {}
    for n, v in values.items():
        r = n in refused
        pols[n] = {"estimate": None if r else v, "se": None if r else 0.01, "ci": None if r else [v - 0.02, v + 0.02],
                   "level_claim": "refused" if r else "ok", "refusal_reasons": ["overlap: TTC 0.3"] if r else [],
                   "audit": "fail" if r else "pass", "n_labelled": 50}
    return {"evaluation": "ev", "window": window, "run_key": key, "published_at": published, "policies": pols,
            "best_policy": best, "n_labels": 100, "report_key": f"ev/{window}/{key}/a/report.html"}


def _history() -> list[dict]:
    days = [f"2025-01-0{d}_2025-01-0{d}" for d in range(1, 6)]
    hist = [_row(days[0], "k1", "2025-01-02T06", {"a": 0.70, "b": 0.50}),
            _row(days[1], "k2", "2025-01-03T06", {"a": 0.70, "b": 0.50}, refused={"b"}),
            _row(days[2], "k3", "2025-01-04T06", {"a": 0.70, "b": 0.50}),
            _row(days[3], "k4", "2025-01-05T06", {"a": 0.60, "b": 0.50}, best="b"),
            _row(days[4], "k5", "2025-01-06T06", {"a": 0.60, "b": 0.50}, best="b"),
            _row(days[2], "k3b", "2025-01-07T06", {"a": 0.71, "b": 0.50})]  # new labels for day 3
    return hist


def test_latest_per_window_and_previous_run():
    hist = _history()
    latest = latest_per_window(hist)
    assert [r["run_key"] for r in latest] == ["k1", "k2", "k3b", "k4", "k5"]
    assert previous_run(hist, "2025-01-05_2025-01-05", "k5")["run_key"] == "k4"
    assert previous_run(hist, "2025-01-03_2025-01-03", "k3b")["run_key"] == "k3"  # same window, superseded
    assert previous_run(hist, "2025-01-01_2025-01-01", "k1") is None


def test_what_changed_lists_values_claims_and_best_policy():
    hist = _history()
    ch = what_changed(hist[0], hist[1])
    b = next(c for c in ch if c["policy"] == "b")
    assert b["after"] is None and "level ok \u2192 refused" in b["notes"] and "audit pass \u2192 fail" in b["notes"]
    ch = what_changed(hist[2], hist[3])
    a = next(c for c in ch if c["policy"] == "a")
    assert a["diff"] == pytest.approx(-0.10)
    assert {"policy": None, "notes": ["best policy none \u2192 b"]} in ch


def test_trend_page_draws_values_refusals_alarms_and_drift_on_one_axis():
    hist = _history()
    windows = latest_per_window(hist)
    changes = window_changes_of(hist)
    assert changes["a"].alarms == ["2025-01-04_2025-01-04", "2025-01-05_2025-01-05"]  # a drop of 0.1 = 7 SEs
    drift = {"mon": [{"look": 1, "dt": "2025-01-02", "alarm": False, "alarms": []},
                     {"look": 2, "dt": "2025-01-04", "alarm": True, "alarms": ["residual_mean"]}]}
    reqs = [{"request_id": "r1", "scope": "a", "n_labels": 40, "deadline": "2025-01-10", "reasons": ["audit fail"]}]
    page = render_trend("ev", windows, hist, changes, drift, reqs)
    svgs = [ET.fromstring(b) for b in re.findall(r"<svg\b.*?</svg>", page, re.S)]  # well-formed
    assert len(svgs) == 8  # legend, a, b, drift strip: each drawn wide and narrow (phones; CSS shows one)
    assert page.count("class='figure chartw'") == page.count("class='figure chartn'") == 4
    marks = re.findall(r'<g class="alarm-marker" data-policy="(\w+)" data-window="([\d_-]+)"', page)
    assert marks == [("a", "2025-01-04_2025-01-04"), ("a", "2025-01-05_2025-01-05")]
    refused = re.findall(r'class="refused-marker" data-policy="(\w+)" data-window="([\d_-]+)"', page)
    assert refused == [("b", "2025-01-02_2025-01-02")]
    # a refused window has no value marker (its number is never drawn)
    assert 'class="value-marker" data-policy="b" data-window="2025-01-02_2025-01-02"' not in page
    # drift marks sit on the x position of their window in the policy panels (same time axis)
    x_of = {w: float(x) for x, w in re.findall(r'<circle[^>]*cx="([\d.]+)"[^>]*class="value-marker" data-policy="a" '
                                                r'data-window="([\d_-]+)"', page)}
    drift_alarm = re.search(r'<g class="drift-alarm" data-monitor="mon" data-window="([\d_-]+)"><title>[^<]*</title>'
                            r'<polygon points="([\d.]+),', page)
    assert drift_alarm.group(1) == "2025-01-04_2025-01-04"
    look = re.search(r'<circle[^>]*cx="([\d.]+)"[^>]*class="drift-look" data-monitor="mon" data-window="([\d_-]+)"',
                     page)
    assert float(look.group(1)) == pytest.approx(x_of["2025-01-02_2025-01-02"], abs=0.1)
    assert "r1" in page and "audit fail" in page and "Changes in the latest window" in page
    assert not re.search(r"(src|href)=['\"](https?:)?//", page)  # self-contained


def test_index_lists_evaluations_with_latest_run_and_alarms():
    hist = _history()
    changes = window_changes_of(hist)
    entry = {"evaluation": "ev", "latest": latest_per_window(hist)[-1], "n_runs": 6, "n_windows": 5,
             "alarms": {n: pc.alarms for n, pc in changes.items()}, "drift_alarms": 1, "open_requests": 2}
    page = render_index([entry])
    assert "data-evaluation='ev'" in page and "regression: a" in page and "drift alarm \u00d71" in page
    assert "2 label request(s)" in page and "href='ev/trend.html'" in page and "5 window(s) / 6 run(s)" in page
    # the latest values with their intervals and claims
    assert "data-policy='a' data-claim='ok' data-value='0.600' data-ci='[0.580, 0.620]'" in page
    assert "Nothing published yet" in render_index([])


def test_pages_written_on_publish_and_read_back(tmp_path):
    st = Storage.for_uri(tmp_path)
    result = json.loads(FIXTURE.read_text())
    for d in (1, 2):
        publish_run(st, "ev", f"2025-01-0{d}_2025-01-0{d}", f"k{d}", {"result.json": json.dumps(result).encode()}, {})
    assert not (tmp_path / "results" / "index.html").exists()  # storage renders nothing: the flow's pages step does
    assert rebuild_pages(str(tmp_path), None, "ev") == write_pages(st, "ev")
    hist = read_history(st, "ev")
    assert [r["run_key"] for r in hist] == ["k1", "k2"] and hist[0]["policies"]["unhelpful"]["estimate"] is None
    index, trend = (tmp_path / "results" / "index.html").read_text(), (tmp_path / "results/ev/trend.html").read_text()
    assert "data-evaluation='ev'" in index and "2025-01-02" in index
    assert trend.count('class="value-marker" data-policy="base"') == 2
    assert write_pages(st)["results/index.html"].endswith("index.html")


class _CountedReads:
    """A storage's ``read_bytes`` counted per evaluation folder (the index's kept entries apart)."""

    def __init__(self, st, monkeypatch):
        self.reads: dict[str, int] = {}
        real = st.read_bytes

        def read_bytes(key):
            parts = key.split("/")
            if len(parts) > 2 and parts[-1] != ENTRY:
                self.reads[parts[1]] = self.reads.get(parts[1], 0) + 1
            return real(key)

        monkeypatch.setattr(st, "read_bytes", read_bytes)


def _undated(page: str) -> str:
    return re.sub(r"generated [0-9: -]+UTC", "generated -", page)


def _publish(st, evaluation, day, key, result):
    publish_run(st, evaluation, f"2025-01-0{day}_2025-01-0{day}", key, {"result.json": json.dumps(result).encode()}, {})


def test_a_publish_reads_its_own_history_and_the_others_kept_entries(tmp_path, monkeypatch):
    """The index after one evaluation's publish takes every other evaluation's kept entry (no read of their runs) and
    is the index a rebuild of every evaluation gives; an evaluation whose runs changed since its entry was kept (a
    run published without its pages rebuilt) is computed again."""
    st = Storage.for_uri(tmp_path)
    result = json.loads(FIXTURE.read_text())
    for ev in ("a", "b", "c"):
        _publish(st, ev, 1, "k1", result)
        write_pages(st, ev)
    counted = _CountedReads(st, monkeypatch)
    _publish(st, "a", 2, "k2", result)
    counted.reads.clear()
    write_pages(st, "a")
    assert set(counted.reads) == {"a"}  # b's and c's runs not read: their kept entries
    index = _undated((tmp_path / "results" / "index.html").read_text())
    write_pages(st)  # every evaluation computed again
    assert index == _undated((tmp_path / "results" / "index.html").read_text())
    assert "data-evaluation='b'" in index and "data-evaluation='c'" in index and "1 window(s) / 1 run(s)" in index
    # b's run published without its pages (a flow whose pages step failed): its listing changed, its entry computed
    _publish(st, "b", 3, "k3", result)
    counted.reads.clear()
    write_pages(st, "a")
    assert set(counted.reads) == {"a", "b"}
    assert "2 window(s) / 2 run(s)" in (tmp_path / "results" / "index.html").read_text().split("data-evaluation='b'")[1]
    kept = json.loads((tmp_path / "results" / "b" / ENTRY).read_text())
    assert json.loads(kept["body"])["entry"]["n_runs"] == 2


@pytest.mark.parametrize("damage", ["altered", "not json", "other version"])
def test_a_kept_entry_is_used_only_with_its_checksum_and_version(tmp_path, monkeypatch, caplog, damage):
    """A kept entry whose body does not match its SHA-256, that is not JSON or of another format is not used: the
    evaluation is computed again (a warning names the object where it is damaged) and its entry kept again."""
    st = Storage.for_uri(tmp_path)
    result = json.loads(FIXTURE.read_text())
    for ev in ("a", "b"):
        _publish(st, ev, 1, "k1", result)
        write_pages(st, ev)
    path = tmp_path / "results" / "b" / ENTRY
    kept = json.loads(path.read_text())
    if damage == "altered":  # a value changed, the checksum left as it was
        path.write_text(json.dumps({**kept, "body": kept["body"].replace('"n_runs":1', '"n_runs":7')}))
    elif damage == "not json":
        path.write_text("{not json")
    else:  # a body of another format, with its own correct checksum
        body = json.loads(kept["body"])
        text = json.dumps({**body, "version": 0}, sort_keys=True, separators=(",", ":"))
        path.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": text}))
    assert kept_entry(st, "b", [(f"results/b/2025-01-01_2025-01-01/k1/manifest.json",
                                 (tmp_path / "results/b/2025-01-01_2025-01-01/k1/manifest.json").stat().st_size)]) is None
    counted = _CountedReads(st, monkeypatch)
    with caplog.at_level("WARNING"):
        write_pages(st, "a")
    assert "b" in counted.reads  # computed again
    assert "7 run(s)" not in (tmp_path / "results" / "index.html").read_text()
    if damage != "other version":
        assert any(str(path.name) in r.getMessage() and "computed again" in r.getMessage() for r in caplog.records)
    assert json.loads(json.loads(path.read_text())["body"])["version"] == ENTRY_VERSION  # kept again


def test_linked_drift_reads_looks_of_monitors_calibrated_by_the_evaluation(tmp_path):
    st = Storage.for_uri(tmp_path)
    look = {"look": 1, "alarm": True, "alarms": ["tau_b"], "meta": {"dt": "2025-01-02", "calibration": {"evaluation": "ev"}},
            "metrics": {"tau_b": {"estimate": -0.2, "detail": {"tau": 0.71}},
                        "residual_mean": {"estimate": 0.06, "ci": [0.02, 0.1]}}}
    st.write_bytes("drift/mon/looks/000001.json", json.dumps(look).encode())
    other = dict(look, meta={"dt": "2025-01-02", "calibration": {"evaluation": "other"}})
    st.write_bytes("drift/mon2/looks/000001.json", json.dumps(other).encode())
    got = linked_drift(st, "ev")
    assert list(got) == ["mon"] and got["mon"][0]["tau"] == 0.71 and got["mon"][0]["alarm"]
    d = drift_for_report("mon", got["mon"])
    assert d["periods"] == ["#1 2025-01-02"] and d["alarms"] == [True] and d["residual_shift_ci"] == [[0.02, 0.1]]


#: Template code that reached a page: a Python expression of an f-string that lost its ``f`` prefix.
TEMPLATE_LEFTOVER = re.compile(r"\{_?esc\(|\{_[a-z]|\{[a-z_]+\(|\{[a-z_]+\[|\{[a-z_]+\.[a-z_]+")


def test_rendered_pages_hold_no_template_code(tmp_path):
    """Every report showed "p-values adjusted by {_esc(method.upper() or 'n/a')}" (a missing f-prefix):
    the report, trend and index pages as published, and the drift page, hold no template leftover."""
    from flows.reports.evaluation import render_report

    result = json.loads(FIXTURE.read_text())
    report = render_report(result, drift={"periods": ["2025-01", "2025-02"], "kendall_tau": [1.0, 0.9]})
    assert "p-values adjusted by BH at" in report
    st = Storage.for_uri(tmp_path)
    for d in (1, 2):
        publish_run(st, "ev", f"2025-01-0{d}_2025-01-0{d}", f"k{d}", {"result.json": json.dumps(result).encode(),
                                                                       "report.html": report.encode()}, {},
                    render_report=contextual_report)
    rebuild_pages(str(tmp_path), None, "ev")
    hist = _history()
    trend = render_trend("ev", latest_per_window(hist), hist, window_changes_of(hist),
                         {"mon": [{"look": 1, "dt": "2025-01-02", "alarm": True, "alarms": ["residual_mean"]}]},
                         [{"request_id": "r1", "scope": "a", "n_labels": 4, "deadline": "2025-01-10", "reasons": ["x"]}])
    pages = {"report.html": report, "trend.html (rendered)": trend,
             **{str(p.relative_to(tmp_path)): p.read_text() for p in (tmp_path / "results").rglob("*.html")}}
    assert {"results/index.html", "results/ev/trend.html"} <= set(pages)
    for name, page in pages.items():
        text = re.sub(r"<style.*?</style>|<script.*?</script>", "", page, flags=re.S)  # CSS braces are not template
        found = TEMPLATE_LEFTOVER.findall(text)
        assert not found, f"{name} shows template code: {found[:3]}"


def test_trend_page_names_a_window_without_a_verified_level():
    """A window whose policy only assumes transport (no verified level: estimate null) and whose history row
    carries no assumed value is drawn as "unverified", never as a value."""
    hist = _history()
    p = hist[3]["policies"]["a"]
    p.update(estimate=None, se=None, ci=None, level_claim="assumes_transport")
    windows = latest_per_window(hist)
    page = render_trend("ev", windows, hist, window_changes_of(hist), {}, [])
    marks = re.findall(r'class="unverified-marker" data-policy="(\w+)" data-window="([\d_-]+)"', page)
    assert marks == [("a", "2025-01-04_2025-01-04")]
    assert 'class="value-marker" data-policy="a" data-window="2025-01-04_2025-01-04"' not in page
    assert "no verified level" in page


def test_index_shows_the_assumed_value_of_an_assumes_transport_policy_and_nothing_for_a_refused_one():
    hist = _history()
    latest = dict(latest_per_window(hist)[-1])
    latest["policies"] = dict(latest["policies"])
    latest["policies"]["c"] = {"estimate": None, "se": None, "ci": None, "level_claim": "assumes_transport",
                               "refusal_reasons": [], "audit": "not_run", "n_labelled": 3,
                               "assumed": {"estimate": 0.655, "ci": [0.61, 0.70]}}
    latest["policies"]["d"] = {"estimate": None, "se": None, "ci": None, "level_claim": "refused",
                               "refusal_reasons": ["x"], "audit": "fail", "n_labelled": 3, "assumed": None}
    page = render_index([{"evaluation": "ev", "latest": latest, "n_runs": 1, "n_windows": 1}])
    assert ("data-policy='c' data-claim='assumes_transport' data-value='0.655' data-ci='[0.610, 0.700]' "
            "data-value-kind='assumed'") in page and ">assumes transport</span>" in page
    assert "data-policy='d' data-claim='refused' data-value='' data-ci='' data-value-kind='none'" in page
    assert ">verified</span>" in page
    trend = render_trend("ev", [latest], [latest], {}, {}, [])
    assert 'class="assumed-marker" data-policy="c"' in trend

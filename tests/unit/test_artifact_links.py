"""Prefect artifacts name where the report, result and trend page are in a form the Prefect UI can use."""
from __future__ import annotations

from flows.reports import artifacts


def test_artifacts_give_web_links_or_plain_paths_never_file_urls(tmp_path, monkeypatch):
    """Issue 26: the artifacts' links were ``file://`` URLs, dead from the Prefect UI (a web page cannot open
    them). Now a local report is named by its absolute path as plain text (with where it is), an http(s) URL
    stays a link, and an object-store URI is shown as what it is."""
    made = []
    monkeypatch.setattr(artifacts, "_create", lambda specs: made.extend(specs) or [])
    report = tmp_path / "results" / "daily" / "w" / "run" / "report.html"
    result = {"policies": {"base": {"estimate": 0.5, "ci": [0.4, 0.6], "level_claim": "ok"}}, "best_policy": None}
    outcome = {"artifacts": {"report.html": str(report), "result.json": "s3://bucket/results/daily/result.json"}}
    artifacts.evaluate_artifacts("daily", "w", "run", result, outcome, trend="https://pages.example/daily/trend.html")
    by_key = {key: (kind, content) for kind, key, content, _ in made}
    text = "\n".join(str(c) for _, c in by_key.values())
    assert "file://" not in text
    kind, content = by_key["cje-daily-report"]
    assert kind == "markdown" and f"`{report}`" in content and "on the machine that ran the flow" in content
    assert by_key["cje-daily-result"][0] == "markdown" and "`s3://bucket/results/daily/result.json`" in text
    assert by_key["cje-daily-trend"] == ("link", "https://pages.example/daily/trend.html")
    summary = by_key["cje-daily-summary"][1]
    assert f"- report: `{report}`" in summary and "- [trend](https://pages.example/daily/trend.html)" in summary
    made.clear()
    artifacts.drift_artifacts({"monitor": "m", "new_looks": [], "n_looks": 0, "report": "drift/m/report.html"})
    (kind, _, content, _), = [s for s in made if s[1].endswith("-report")]
    assert kind == "markdown" and "file://" not in content and str((tmp_path / "x").anchor) in content

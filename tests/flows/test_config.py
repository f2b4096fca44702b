"""Fast checks of the configuration (`flows.config`): windows, chunking, evaluations.yaml, and that
every bad setting is refused at load, with a one-line message naming the file, entry and key."""
from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest
import yaml

from cje_engine.errors import CJEInputError
from flows.config import DEFAULT_FILE, MAX_WINDOW_DAYS, Window, load_config, parse_window
from flows.pipelines.evaluate import _group_files
from flows.runtime.ray_fanout import chunk_ranges
from flows.pipelines.deployments import evaluation_deployments
from flows.runtime.schedules import load_evaluations


def test_parse_window_forms():
    ref = "2025-03-10"
    assert parse_window("last 7 days", ref) == Window(date(2025, 3, 3), date(2025, 3, 9))
    assert parse_window("last_1_day", ref) == Window(date(2025, 3, 9), date(2025, 3, 9))
    assert parse_window("3d", ref) == Window(date(2025, 3, 7), date(2025, 3, 9))
    assert parse_window("2025-01-01..2025-01-31").days == 31
    assert parse_window("2025-01-05").label == "2025-01-05_2025-01-05"
    assert parse_window({"start": "2025-01-01", "end": "2025-01-02"}).days == 2
    assert parse_window({"last_days": 2}, ref).start == date(2025, 3, 8)


@pytest.mark.parametrize("bad, needle", [
    ("last 0 days", "at least one day"),
    ("2025-02-01..2025-01-01", "ends before it starts"),
    ("yesterday-ish", "not a date"),
    ({"from": "2025-01-01"}, "'start' and 'end'"),
    ("last -3 days", "at least one day"),       # was read as 3 days
    ("-3d", "at least one day"),
    ("last 999999 days", f"longer than {MAX_WINDOW_DAYS} days"),  # was an OverflowError
    ("0001-01-01..9999-12-31", f"longer than {MAX_WINDOW_DAYS} days"),
])
def test_parse_window_rejects_bad_specs_clearly(bad, needle):
    with pytest.raises(CJEInputError, match=needle):
        parse_window(bad, "2025-03-10")


@pytest.mark.parametrize("n, k", [(10, 3), (2000, 8), (5, 9), (1, 1), (1601, 4)])
def test_chunk_ranges_cover_every_replicate_once_in_order(n, k):
    ranges = chunk_ranges(n, k)
    assert [b for lo, hi in ranges for b in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in ranges]
    assert len(ranges) == min(n, k) and max(sizes) - min(sizes) <= 1


def test_group_files_keeps_order_and_balances_sizes():
    files = [{"key": f"dt=2025-01-0{i}/p.parquet", "size": s} for i, s in enumerate([5, 5, 5, 5, 20, 1], 1)]
    groups = _group_files(files, 3)
    assert [f for g in groups for f in g] == files and len(groups) <= 3 and all(groups)
    assert _group_files(files, 100) == [[f] for f in files]


def test_repository_evaluations_file_deploys_with_its_cron():
    specs = load_evaluations(DEFAULT_FILE)
    assert specs, "evaluations.yaml declares no evaluation"
    for spec in specs.values():
        dep = evaluation_deployments([spec])[0]
        assert dep.name == spec.name and dep.entrypoint == "flows.pipelines.audit.evaluate_and_audit"
        assert dep.parameters["evaluation"] == spec.name and dep.parameters["logs_uri"] == spec.logs_uri
        if spec.cron:
            assert dep.schedules[0].schedule.cron == spec.cron


@pytest.mark.parametrize("text, needle", [
    ("evaluations: []", "at least one entry"),
    ("evaluations:\n  - logs_uri: x\n", "needs name"),
    ("evaluations:\n  - name: a\n", "needs logs_uri"),
    ("evaluations:\n  - {name: a, logs_uri: x, cron: '61 * * * *'}\n", "cron '61 \\* \\* \\* \\*'"),
    ("evaluations:\n  - {name: a, logs_uri: x, cron: '0 * * * *', interval: 600}\n", "either cron or interval"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {n_bootstrapp: 5}}\n", "unknown option"),
    ("evaluations:\n  - {name: a, logs_uri: x, window: 'last week'}\n", "not a date"),
    ("evaluations:\n  - {name: a, logs_uri: x}\n  - {name: a, logs_uri: y}\n", "declared twice"),
    ("evaluations:\n  - {name: a, logs_uri: x, colour: red}\n", "unknown key"),
    ("evaluations:\n  - {name: a, logs_uri: x, intervall: 60}\n", "unknown key 'intervall' \\(did you mean 'interval'\\?\\)"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {n_bootstrapp: 5}}\n", "did you mean 'n_bootstrap'"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {estimator: auto}}\n", "renamed level_estimator"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {level_estimator: audit}}\n", "did you mean 'audited'"),
    ("evaluationz: []\n", "did you mean 'evaluations'"),
    # types: refused, not coerced
    ("evaluations:\n  - {name: a, logs_uri: x, interval: true}\n", "key interval: must be a number of seconds"),
    ("evaluations:\n  - {name: a, logs_uri: x, interval: 0.001}\n", "key interval: must be from 60 s"),
    ("evaluations:\n  - {name: a, logs_uri: x, interval: 59}\n", "key interval: must be from 60 s"),
    ("evaluations:\n  - {name: a, logs_uri: x, interval: '3600'}\n", "key interval: must be a number"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {n_bootstrap: abc}}\n", "option n_bootstrap must be an integer"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {alpha: '0.05'}}\n", "option alpha must be a finite number"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {seed: -1}}\n", "seed must be an integer from 0"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {n_bootstrap: 1000000000}}\n", "n_bootstrap must be at most"),
    ("evaluations:\n  - {name: a, logs_uri: x, options: {covariates: 7}}\n", "option covariates must be a list"),
    ("evaluations:\n  - {name: 5, logs_uri: x}\n", "key name: Input should be a valid string"),
    ("evaluations:\n  - {name: a, logs_uri: x, policies: base}\n", "key policies: must be a list"),
    ("evaluations:\n  - {name: a, logs_uri: x, mode: offline}\n", "key mode: Input should be 'direct'"),
    ("evaluations:\n  - {name: a, logs_uri: x, window: last -3 days}\n", "at least one day"),
    ("evaluations:\n  - {name: a, logs_uri: x, window: last 999999 days}\n", "longer than"),
    # names the publisher would refuse after the computation
    ("evaluations:\n  - {name: '..', logs_uri: x}\n", "name '..' must be"),
    ("evaluations:\n  - {name: 'évaluation', logs_uri: x}\n", "name 'évaluation' must be"),
    ("evaluations:\n  - {name: ' y ', logs_uri: x}\n", "name ' y ' must be"),
    ("evaluations:\n  - {name: 'a/b', logs_uri: x}\n", "name 'a/b' must be"),
    ("evaluations: [unclosed\n", "not valid YAML"),
])
def test_evaluations_file_errors_name_file_and_entry(tmp_path, text, needle):
    f = tmp_path / "ev.yaml"
    f.write_text(text)
    with pytest.raises(CJEInputError, match=needle) as err:
        load_evaluations(f)
    assert str(f) in str(err.value) and "\n" not in str(err.value)


def test_relative_paths_resolve_against_the_file(tmp_path):
    f = tmp_path / "sub" / "ev.yaml"
    f.parent.mkdir()
    f.write_text("evaluations:\n  - {name: a, logs_uri: ./logs, results_uri: s3://b/r, interval: 60}\n")
    spec = load_evaluations(f)["a"]
    assert spec.logs_uri == str(tmp_path / "sub" / "logs") and spec.results_uri == "s3://b/r"
    assert spec.interval == 60.0 and spec.results_uri.startswith("s3://")


@pytest.mark.parametrize("uri", ["s3://AKIAXKEY:wJalrSecret42@bucket/logs", "s3://AKIAXKEY@bucket/logs",
                                 "https://AKIAXKEY:wJalrSecret42@host/x", "s3://bucket/logs?X-Amz-Signature=wJalrSecret42"])
@pytest.mark.parametrize("key", ["logs_uri", "results_uri", "labels_uri"])
def test_credentials_in_a_uri_are_refused_without_repeating_them(tmp_path, uri, key):
    f = tmp_path / "ev.yaml"
    entry = {"name": "a", "logs_uri": "logs", key: uri}
    f.write_text(yaml.safe_dump({"evaluations": [entry]}))
    with pytest.raises(CJEInputError, match="AWS_ACCESS_KEY_ID") as err:
        load_evaluations(f)
    msg = str(err.value)
    assert "wJalrSecret42" not in msg and "AKIAXKEY" not in msg and key in msg and str(f) in msg


def test_drift_monitor_entries_are_checked_by_the_same_model(tmp_path):
    base = {"set_name": "anchors", "anchors_uri": "."}
    cases = [({**base, "interval": True}, "key interval"),
             ({**base, "anchors_uri": "s3://K:wJalrSecret42@b/x"}, "credentials"),
             ({**base, "monitr": {}}, "did you mean 'monitor'"),
             ({**base, "name": ".."}, "monitor name"),
             ({**base, "scorer": {"base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key": "wJalrSecret42"},
               "judge_id": "j"}, "api_key_env"),
             ({**base, "anchors_version": 0}, "anchors_version"),
             ({**base, "notify_on": "sometimes"}, "notify_on")]
    for entry, needle in cases:
        f = tmp_path / "ev.yaml"
        f.write_text(yaml.safe_dump({"drift_monitors": [entry]}))
        with pytest.raises(CJEInputError, match=needle) as err:
            load_config(f, require_evaluations=False)
        assert "wJalrSecret42" not in str(err.value) and str(f) in str(err.value)
    f.write_text(yaml.safe_dump({"drift_monitors": [{**base, "cron": "30 6 * * *", "monitor": {"alpha": 0.05}}]}))
    mon = load_config(f, require_evaluations=False).drift_monitors["anchors"]
    assert mon.anchors_uri == str(tmp_path) and mon.cron == "30 6 * * *"


def test_the_repository_file_loads_with_its_monitors():
    cfg = load_config(DEFAULT_FILE)
    assert cfg.evaluations and set(cfg.drift_monitors) == {"demo-anchors"}


def test_interval_schedule_has_its_anchor(tmp_path):
    f = tmp_path / "ev.yaml"
    f.write_text("evaluations:\n  - {name: a, logs_uri: x, interval: 120, anchor: '2025-01-01T00:00:10Z'}\n")
    (dep,) = evaluation_deployments([load_evaluations(f)["a"]])
    sched = dep.schedules[0].schedule
    assert sched.interval.total_seconds() == 120 and sched.anchor_date.isoformat().startswith("2025-01-01T00:00:10")


def test_bad_settings_exit_2_before_prefect_or_ray_start(tmp_path):
    """`cje run` on a bad file: exit 2, one line on stderr naming file/entry/key, and no Prefect server
    or Ray was started."""
    import subprocess
    import sys

    from .conftest import REPO

    f = tmp_path / "ev.yaml"
    f.write_text("evaluations:\n  - {name: a, logs_uri: 's3://AKIAXKEY:wJalrSecret42@bucket/logs', interval: 3600}\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PREFECT_API_URL")}
    r = subprocess.run([str(Path(sys.executable).with_name("cje")), "run", "a", "--config", str(f)], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    # the CLI names the config file in use on its own line (`config: PATH (from --config)`), then the error
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("config: ")]
    assert len(lines) == 1 and str(f) in lines[0] and "logs_uri" in lines[0], r.stderr
    assert "wJalrSecret42" not in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert "starting a local" not in r.stderr  # neither a Prefect server nor Ray was started


def test_engine_options_are_typed_and_bounded_before_any_allocation():
    from cje_engine.options import MAX_N_BOOTSTRAP, EvaluationOptions

    for kw, needle in [({"seed": -1}, "seed must be"), ({"seed": True}, "must be an integer"),
                       ({"n_bootstrap": 10**9}, f"at most {MAX_N_BOOTSTRAP}"), ({"n_bootstrap": 2.5}, "integer"),
                       ({"alpha": float("nan")}, "finite number"), ({"n_folds": 10**6}, "n_folds"),
                       ({"support_bandwidth": 0}, "support_bandwidth"), ({"n_bootstrapp": 1}, "did you mean")]:
        with pytest.raises(CJEInputError, match=needle):
            EvaluationOptions.build(**kw)
    opts = EvaluationOptions.build(n_bootstrap=MAX_N_BOOTSTRAP)
    # 3 copies x 8 bytes x 100,000 replicates x n_stats: 24 MB for 10 statistics, 24 GB for 10,000
    assert opts.bootstrap_bytes(10) == 3 * 8 * MAX_N_BOOTSTRAP * 10
    opts.check_bootstrap_memory(10)
    with pytest.raises(CJEInputError, match="GiB for the replicates"):
        opts.check_bootstrap_memory(10_000)
    with pytest.raises(CJEInputError, match="lower n_bootstrap"):
        opts.check_bootstrap_memory(10, budget=1024)
    assert EvaluationOptions.build(inference="analytic", n_bootstrap=50).bootstrap_bytes(10**6) == 0


@pytest.mark.parametrize("flags, needle", [(["--seed", "-1"], "seed must be"),
                                           (["--n-bootstrap", "1000000000"], "n_bootstrap must be at most")])
def test_cje_evaluate_out_of_range_options_exit_2_without_a_traceback(tmp_path, flags, needle):
    import subprocess
    import sys

    data = tmp_path / "d.csv"
    data.write_text("prompt_id,policy,judge_score,oracle_label\n" + "".join(
        f"p{i},{pol},0.5,{'' if i % 2 else (0.25 if i % 4 else 0.75)}\n" for i in range(40) for pol in ("a", "b")))
    r = subprocess.run([str(Path(sys.executable).with_name("cje")), "evaluate", str(data), "--out",
                        str(tmp_path / "out"), *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was computed or written


# ------------------------------------------------------------------------------ hostile YAML

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
evaluations: *i
"""


def test_a_billion_laughs_file_is_a_quick_clear_error(tmp_path):
    """Issue 25: an alias bomb ended in MemoryError and the message rendered the expanded value.  Now: exit 2
    in well under a second, a one-line message naming the file, no value of the document in it."""
    import subprocess
    import sys
    import time

    from .conftest import REPO

    f = tmp_path / "ev.yaml"
    f.write_text(BILLION_LAUGHS)
    t0 = time.perf_counter()
    with pytest.raises(CJEInputError, match="aliases expand to more than 100000 values") as err:
        load_config(f)
    assert time.perf_counter() - t0 < 1.0
    msg = str(err.value)
    assert str(f) in msg and "lol" not in msg and len(msg) < 300
    f2 = tmp_path / "loop.yaml"
    f2.write_text("evaluations: &x [*x]\n")
    with pytest.raises(CJEInputError, match="recursive alias"):
        load_config(f2)
    f3 = tmp_path / "many.yaml"
    f3.write_text("x: &x 1\nevaluations: [" + ", ".join(["*x"] * 1001) + "]\n")
    with pytest.raises(CJEInputError, match="more than 1000 aliases"):
        load_config(f3)
    r = subprocess.run([str(Path(sys.executable).with_name("cje")), "run", "a", "--config", str(f)], cwd=str(REPO),
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("config: ")]
    assert r.returncode == 2 and len(lines) == 1 and "alias bomb" in lines[0] and "lol" not in r.stderr, r.stderr


@pytest.mark.parametrize("text, key, lines", [
    ("evaluations:\n  - {name: a, logs_uri: x}\ncolumns: {}\nevaluations:\n  - {name: b, logs_uri: y}\n",
     "evaluations", (1, 4)),
    ("evaluations:\n  - name: a\n    logs_uri: x\n    options:\n      seed: 1\n      n_bootstrap: 10\n      seed: 2\n",
     "seed", (5, 7)),
    ("evaluations:\n  - {name: a, logs_uri: x, name: b}\n", "name", (2, 2)),
])
def test_duplicate_yaml_keys_are_errors_naming_file_key_and_both_lines(tmp_path, text, key, lines):
    """Issue 25: a second `evaluations:` silently dropped the first list (the last value won)."""
    f = tmp_path / "ev.yaml"
    f.write_text(text)
    with pytest.raises(CJEInputError) as err:
        load_config(f)
    msg = str(err.value)
    assert str(f) in msg and f"duplicate key {key!r} at lines {lines[0]} and {lines[1]}" in msg and "\n" not in msg


def test_yaml_anchors_and_merge_keys_still_work(tmp_path):
    """Aliases within the limits and merge keys (``<<``, which may be overridden) load as before."""
    f = tmp_path / "ev.yaml"
    f.write_text("evaluations:\n  - &base {name: a, logs_uri: x, window: last 7 days, options: &o {seed: 3}}\n"
                 "  - <<: *base\n    name: b\n    window: last 3 days\n    options: *o\n")
    cfg = load_config(f)
    assert cfg.evaluations["b"].window == "last 3 days" and cfg.evaluations["b"].options.declared == {"seed": 3}
    assert cfg.evaluations["a"].window == "last 7 days"

"""Issue 28, the evaluations file's ``segments:`` block: strict, parsed once into the evaluation's ONE typed
`EvaluationOptions` (``segment_by`` and the other segment options), passed by the flow as every other option;
a segment column the logs lack is one line naming the evaluations file, the evaluation, the column and the
closest log column, with exit 2, before Prefect or Ray start."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
import yaml

from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.simulate.segments import SegmentSpec, simulate_segments
from flows.cli import main as cli
from flows.config import engine_options, load_config
from flows.pipelines.evaluate import plan_run
from flows.pipelines.preflight import check_evaluation
from flows.runtime.schedules import load_evaluations
from flows.storage.logs import write_logs
from flows.storage.objects import Storage


def _file(tmp_path, **entry) -> str:
    f = tmp_path / "evaluations.yaml"
    f.write_text(yaml.safe_dump({"evaluations": [{"name": "ev", "logs_uri": str(tmp_path / "logs"), **entry}]}))
    return str(f)


def write_segment_logs(root, days: int = 1, n_prompts: int = 300, column: str = "category", seed: int = 0,
                       first=None) -> list[str]:
    """Simulated logs with a segment column (`cje_engine.simulate.segments`), one partition a day."""
    first = first or (datetime.now(timezone.utc).date() - timedelta(days=days))
    st = Storage.for_uri(str(root))
    for d in range(days):
        f = simulate_segments(SegmentSpec(n_prompts=n_prompts, seed=seed + d, oracle_fraction=0.3)).frame
        day = first + timedelta(days=d)
        f["prompt_id"] = f"{day}-" + f["prompt_id"]
        f["response_id"] = f["prompt_id"] + "-" + f["policy"]
        f["ts"] = datetime(day.year, day.month, day.day, 12, tzinfo=timezone.utc)
        f = f.rename(columns={"segment": column}).drop(columns=["label_probability"])
        write_logs(st, pa.Table.from_pandas(f, preserve_index=False), basename=f"seg{d}")
    return [str(first + timedelta(days=d)) for d in range(days)]


def test_segments_walk_from_yaml_to_the_engine_as_the_one_typed_options(tmp_path):
    f = _file(tmp_path, segments={"by": ["category"], "min_rows": 40, "min_labels": 12, "error_control": "holm",
                                  "recalibrate": "never", "pooling": "eb"},
              options={"n_bootstrap": 100, "baseline": "base"})
    spec = load_evaluations(f)["ev"]
    opts = spec.options
    assert isinstance(opts, EvaluationOptions)
    assert (opts.segment_by, opts.segment_min_rows, opts.segment_min_labels, opts.segment_claims) == \
        (("category",), 40, 12, "holm")
    assert (opts.segment_recalibrate, opts.segment_pooling) == ("never", "eb")
    assert spec.flow_parameters()["options"] is opts  # passed on as it is
    declared = spec.deployment_parameters()["options"]  # a deployment stores the options as declared
    assert declared["segment_by"] == ["category"] and engine_options(declared).segment_by == ("category",)
    plan = plan_run(str(tmp_path / "logs"), "2025-01-01", "ev", None, None, None, opts, None, None, "direct")
    assert plan.opts is opts and "category" in plan.needed_columns  # the flow reads the segment column
    # the short form: a list of columns
    short = load_evaluations(_file(tmp_path, segments=["category", "language"]))["ev"].options
    assert short.segment_by == ("category", "language") and short.segment_min_rows == EvaluationOptions().segment_min_rows
    # without segments: nothing changes (no segment option declared, so the run key is as before)
    plain = load_evaluations(_file(tmp_path, options={"n_bootstrap": 100}))["ev"].options
    assert plain.segment_by == () and "segment_by" not in plain.declared


@pytest.mark.parametrize("entry, needle", [
    ({"segments": {"by": ["category"], "min_rowz": 3}}, "key segments: unknown key 'min_rowz' (did you mean 'min_rows'?)"),
    ({"segments": {"by": []}}, "key segments.by: must be a column name or a non-empty list"),
    ({"segments": {"by": ["a", "a"]}}, "key segments.by: names a column twice"),
    ({"segments": {"min_rows": 10}}, "key segments: needs by"),
    ({"segments": {"by": "a", "min_rows": 1}}, "key segments.min_rows: Input should be greater than or equal to 2"),
    ({"segments": {"by": "a", "min_rows": "50"}}, "key segments.min_rows: Input should be a valid integer"),
    ({"segments": {"by": "a", "error_control": "bonferroni"}}, "key segments.error_control: Input should be 'bh' or"),
    ({"segments": 7}, "key segments: expected a list of columns or a mapping"),
    ({"segments": {"by": ["a"], "pooling": "eb"}, "mode": "logs-only", "options": {"logger": "base"}},
     "segment_pooling='eb' is not supported in mode 'logs-only'"),
    ({"segments": ["a"], "options": {"segment_by": ["b"]}}, "option segment_by is given in options: too"),
    ({"segments": ["a"], "options": {"covariates": ["a"]}}, "segment_by column 'a' is also a covariate"),
])
def test_bad_segments_are_one_line_naming_file_evaluation_and_key(tmp_path, entry, needle):
    f = _file(tmp_path, **entry)
    with pytest.raises(CJEInputError) as err:
        load_config(f)
    msg = str(err.value)
    assert needle in msg and f in msg and "evaluations[0] ('ev')" in msg and "\n" not in msg, msg


def test_preflight_names_a_segment_column_the_logs_lack_with_did_you_mean(tmp_path):
    write_segment_logs(tmp_path / "logs")
    f = _file(tmp_path, segments=["categroy"], options={"n_bootstrap": 100})
    spec = load_evaluations(f)["ev"]
    with pytest.raises(CJEInputError) as err:
        check_evaluation(spec.flow_parameters(), f)
    msg = str(err.value)
    assert msg.startswith(f"file {f}, column 'categroy': evaluation 'ev': segments.by names column 'categroy'")
    assert "(did you mean 'category'?)" in msg and "dt=" in msg and "\n" not in msg
    ok = load_evaluations(_file(tmp_path, segments=["category"]))["ev"]
    assert check_evaluation(ok.flow_parameters())["n_files"] == 1


def test_cje_run_with_a_bad_segment_column_exits_2_before_prefect_and_ray(tmp_path, capsys, monkeypatch):
    write_segment_logs(tmp_path / "logs")
    f = _file(tmp_path, window="last 7 days", segments={"by": ["categroy"]})

    def no_services(*a, **k):
        raise AssertionError("Prefect was started before the inputs were checked")

    monkeypatch.setattr(cli, "_services", no_services)
    assert cli.main(["run", "ev", "--config", f]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "cje run: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f in lines[0] and "evaluation 'ev'" in lines[0] and "'categroy'" in lines[0] and \
        "did you mean 'category'" in lines[0]

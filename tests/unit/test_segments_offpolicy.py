"""Issue 28, segments in the off-policy modes: logs-only and hybrid take no segments (docs/segments.md,
"Off-policy modes"), and say so at every door before any data is read and before Prefect or Ray start:
the engine (`evaluate_offpolicy`, `OffPolicyOptions`), `cje evaluate --mode ... --segment-by`, and an
evaluation whose ``options:`` carry ``segment_by`` in `cje run`. Before, the engine read the data and failed
with "segment_by needs the rows' columns ... not an EvalData", and `cje run` accepted the evaluation and
started Prefect."""
from __future__ import annotations

import pytest
import yaml

from cje_engine.errors import CJEInputError
from cje_engine.pipeline.offpolicy import evaluate_offpolicy
from cje_engine.pipeline.offpolicy_options import OffPolicyOptions
from cje_engine.simulate.logs import simulate_logs
from flows.cli import main as cli


@pytest.fixture(scope="module")
def frames():
    sim = simulate_logs(n_prompts=120, length=4, targets={"t": 0.2}, seed=5, label_fraction=0.5)
    logged, fresh = sim.to_frames("base")
    logged["category"] = ["a", "b"] * (len(logged) // 2) + ["a"] * (len(logged) % 2)
    return logged, fresh


@pytest.mark.parametrize("mode", ["logs-only", "hybrid"])
def test_offpolicy_modes_refuse_segment_by_before_reading_the_data(frames, mode, monkeypatch):
    from cje_engine.pipeline import offpolicy

    def no_read(*a, **k):
        raise AssertionError("the data were read before the options were checked")

    monkeypatch.setattr(offpolicy, "load_offpolicy", no_read)
    logged, fresh = frames
    with pytest.raises(CJEInputError) as exc:
        evaluate_offpolicy(logged, fresh, mode=mode, segment_by=["category"], inference="analytic")
    msg = str(exc.value)
    assert exc.value.option == "segment_by"
    assert f"mode '{mode}'" in msg and "segment_by" in msg and "category" in msg and "\n" not in msg
    with pytest.raises(CJEInputError, match="not supported in mode"):
        OffPolicyOptions.build(mode=mode, segment_by=["category"])
    assert OffPolicyOptions.build(mode=mode).engine.segment_by == ()  # without segments: as before


@pytest.mark.parametrize("mode", ["logs-only", "hybrid"])
def test_cli_evaluate_offpolicy_with_segment_by_exits_2_and_writes_nothing(frames, mode, tmp_path, capsys):
    logged, _ = frames
    src = tmp_path / "logged.parquet"
    logged.to_parquet(src, index=False)
    out = tmp_path / "out"
    code = cli.main(["evaluate", str(src), "--mode", mode, "--segment-by", "category", "--out", str(out),
                     "--inference", "analytic"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"mode '{mode}'" in lines[0] and "--segment-by" in lines[0]
    assert not out.exists()


def test_cje_run_offpolicy_evaluation_with_segment_by_options_exits_2_before_prefect(tmp_path, capsys, monkeypatch):
    f = tmp_path / "evaluations.yaml"
    f.write_text(yaml.safe_dump({"evaluations": [{
        "name": "ev", "logs_uri": str(tmp_path / "logs"), "mode": "hybrid", "policies": ["base", "t"],
        "options": {"logger": "base", "segment_by": ["category"]}}]}))

    def no_services(*a, **k):
        raise AssertionError("Prefect was started before the options were checked")

    monkeypatch.setattr(cli, "_services", no_services)
    assert cli.main(["run", "ev", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "cje run: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(f) in lines[0] and "('ev')" in lines[0] and "mode 'hybrid'" in lines[0] \
        and "segment_by" in lines[0]

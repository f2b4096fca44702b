"""Issue 28, segments in the off-policy modes (docs/segments.md, "Off-policy modes"): ``segment_by`` in logs-only
and hybrid evaluates every segment by the mode's own estimator on the segment's rows (its calibration, weights,
gates, stack and refusals), with the family controlled as Direct's segments are (BH or Holm over the comparisons,
Benjamini-Yekutieli intervals, Holm over the audits). A segment column that varies within a prompt cannot
segment a candidate's unseen responses: exit 2 naming the prompt. Before, the engine read the data and failed
with "segment_by needs the rows' columns ... not an EvalData", and the evaluations file refused ``segments:``
in these modes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from cje_engine.errors import CJEInputError
from cje_engine.inference.multiplicity import adjust, holm
from cje_engine.inference.segments import by_interval_level, normal_interval
from cje_engine.pipeline.offpolicy import evaluate_offpolicy, flow_columns
from cje_engine.pipeline.offpolicy_options import OffPolicyOptions
from cje_engine.simulate.logs import simulate_logs
from flows.cli import main as cli

SEGS = ("a", "b", "c")


@pytest.fixture(scope="module")
def frames():
    """Logs of 900 prompts, a prompt-level ``category`` (a, b: 400 prompts each, c: 100 with too few labels)."""
    sim = simulate_logs(n_prompts=900, length=4, targets={"t": 0.3}, seed=5, label_fraction=0.5)
    logged, fresh = sim.to_frames("base")
    prompts = logged["prompt_id"].unique()
    cat = {p: ("c" if i >= 800 else "ab"[i % 2]) for i, p in enumerate(prompts)}
    logged["category"] = logged["prompt_id"].map(cat)
    c_rows = logged["category"] == "c"
    logged.loc[c_rows & (np.arange(len(logged)) % 10 != 0), "oracle_label"] = np.nan  # c: ~5 labels
    return logged, fresh, cat


def _alone(frames, segment, mode, **kw) -> dict:
    logged, fresh, cat = frames
    return evaluate_offpolicy(logged[logged["category"] == segment], fresh[fresh["prompt_id"].map(cat) == segment],
                              mode=mode, **kw).to_dict()


@pytest.mark.parametrize("mode,kw", [("logs-only", {"inference": "analytic"}), ("hybrid", {"inference": "analytic"}),
                                     pytest.param("hybrid", {"n_bootstrap": 50, "seed": 3}, marks=pytest.mark.slow)])
def test_offpolicy_segment_cells_are_the_modes_evaluation_of_each_segment_alone(frames, mode, kw):
    logged, fresh, _ = frames
    res = evaluate_offpolicy(logged, fresh, mode=mode, segment_by=["category"], **kw).to_dict()
    seg = res["segments"]
    status = {s["name"]: s["status"] for s in seg["segments"]}
    assert status == {"a": "shown", "b": "shown", "c": "pooled", "other": "too_few"}
    cells = {(c["segment"], c["policy"]): c for c in seg["cells"]}
    for s in ("a", "b"):
        alone = _alone(frames, s, mode, **kw)
        for p, q in alone["policies"].items():
            c = cells[(s, p)]
            # the run's claim rule, cell by cell: an importance-weighted level assumes transport (in `assumed`)
            level = q if q["estimate"] is not None else q["assumed"]
            assert c["claim_kind"] == ("verified" if q["estimate"] is not None else "assumes_transport")
            assert c["estimate"] == level["estimate"] and c["se"] == level["se"] and c["ci_marginal"] == level["ci"]
            assert c["audit"]["verdict"] == q["audit"]["verdict"] and c["n_labels"] == q["n_labelled"]
        (cmp,) = [c for c in seg["comparisons"] if c["segment"] == s]
        kind = cmp["claim_kind"]
        (ref,) = alone["comparisons"] if kind == "verified" else alone["assumes_transport"]["comparisons"]
        levels = {p: (q if kind == "verified" else q["assumed"])["estimate"] for p, q in alone["policies"].items()}
        assert cmp["policy"] == "t" and cmp["baseline"] == "base"
        assert cmp["diff"] == pytest.approx(levels["t"] - levels["base"])
        assert cmp["p_value"] == ref["p_value"]
    # other (c, pooled) has too few labels: no level, no comparison, not in the family
    assert all(cells[("other", p)]["estimate"] is None for p in ("base", "t"))
    assert [c["claim_kind"] for c in seg["comparisons"] if c["segment"] == "other"] == ["too_few"]
    # the family's error control, as Direct's: BH over the live comparisons, BY levels for claims and shown cells
    live = [c for c in seg["comparisons"] if c["p_value"] is not None]
    np.testing.assert_allclose([c["p_adjusted"] for c in live], adjust(np.array([c["p_value"] for c in live]), "bh"))
    err = seg["error_control"]
    R = sum(c["significant"] for c in live)
    assert err["n_comparisons"] == len(live) == 2 and err["n_selected"] == R
    assert err["comparison_interval_level"] == by_interval_level(R, 2, 0.05)
    assert err["n_cells"] == 6 and err["n_shown"] == 4
    assert err["level_interval_level"] == pytest.approx(1 - 4 * 0.05 / 6)
    for c in seg["cells"]:
        if c["estimate"] is not None:  # the shown interval: estimate +- z se at the BY level (as Direct's)
            np.testing.assert_allclose(c["ci"], normal_interval(c["estimate"], c["se"], err["level_interval_level"]))
    audited = [c for c in seg["cells"] if c["audit"]["p_value"] is not None]
    np.testing.assert_allclose([c["audit"]["p_adjusted"] for c in audited],
                               holm(np.array([c["audit"]["p_value"] for c in audited])))
    assert {t["policy"] for t in seg["omnibus"]} >= {"*", "base"}
    json.dumps(res, allow_nan=False)


def test_a_segment_column_that_varies_within_a_prompt_is_refused(frames):
    logged, fresh, _ = frames
    bad = logged.copy()
    bad["category"] = np.where(np.arange(len(bad)) % 2 == 0, "x", "y")  # hybrid: one logged row a prompt...
    both = bad.iloc[:2].copy()
    both["prompt_id"] = bad["prompt_id"].iloc[0]  # ...so make one prompt have two logged rows of both values
    both["response_id"] = ["dup-0", "dup-1"]
    bad = bad.iloc[2:]
    bad = type(bad)(list(both.to_dict("records")) + list(bad.to_dict("records")))
    with pytest.raises(CJEInputError) as exc:
        evaluate_offpolicy(bad, mode="logs-only", segment_by=["category"], inference="analytic")
    assert "varies within prompt" in str(exc.value) and exc.value.column == "category"
    with pytest.raises(CJEInputError, match="segment_by names 'categroy'.*did you mean 'category'"):
        evaluate_offpolicy(logged, mode="logs-only", segment_by=["categroy"], inference="analytic")
    with pytest.raises(CJEInputError, match="segment_pooling"):
        OffPolicyOptions.build(mode="hybrid", segment_by=["category"], segment_pooling="eb")


def test_cli_evaluate_logs_only_with_segment_by_prints_the_segment_table(frames, tmp_path, capsys):
    logged, fresh, _ = frames
    src = tmp_path / "logged.parquet"
    logged.to_parquet(src, index=False)
    code = cli.main(["evaluate", str(src), "--mode", "logs-only", "--segment-by", "category", "--out",
                     str(tmp_path / "out"), "--inference", "analytic", "--exit-zero"])
    text = capsys.readouterr().out
    assert code == 0
    assert "segments by category (baseline base" in text
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["segments"]["columns"] == ["category"] and saved["mode"] == "logs-only"


def test_evaluations_file_takes_segments_in_offpolicy_modes_and_the_flow_reads_the_column(tmp_path):
    from flows.runtime.schedules import load_evaluations

    f = tmp_path / "evaluations.yaml"
    f.write_text(yaml.safe_dump({"evaluations": [{
        "name": "ev", "logs_uri": str(tmp_path / "logs"), "mode": "hybrid", "policies": ["base", "t"],
        "segments": ["category"], "options": {"logger": "base"}}]}))
    ev = load_evaluations(str(f))["ev"]
    opts = ev.options
    assert opts.engine.segment_by == ("category",)
    assert "category" in flow_columns(opts)  # the read's projection keeps the segment column


def test_a_candidate_equal_to_the_logger_makes_no_claim_from_rounding():
    """Logs-only with a candidate whose log-probabilities are the logger's (weights exactly 1): its level is computed
    from the logger's numbers, so the difference is ~1e-16 with an SE of 0. Before, that gave p = 0 and a claim
    ("worse") in every segment and in the run's own comparisons; now the difference is 0 and p 1."""
    from cje_engine.inference.comparisons import PolicyColumns, compare_pairs

    sim = simulate_logs(n_prompts=2000, length=4, targets={"t": 0.0}, seed=3, label_fraction=0.25)
    logged, fresh = sim.to_frames("base")
    logged["category"] = np.where(np.arange(len(logged)) % 2 == 0, "a", "b")
    res = evaluate_offpolicy(logged, fresh, mode="logs-only", segment_by=["category"], inference="analytic",
                             baseline="base", seed=0).to_dict()
    comps = res["segments"]["comparisons"]
    assert len(comps) == 2 and all(c["p_value"] == 1.0 and not c["significant"] for c in comps)
    pairs = [c for c in res["assumes_transport"]["comparisons"] if c.get("reported")]
    assert pairs and all(c["p_value"] == 1.0 and not c["significant"] for c in pairs)
    # the bootstrap route's paired replicates: rounding-level differences of one sign are not a difference
    cols = PolicyColumns(names=["x", "y"], estimate=np.array([0.5 + 2e-16, 0.5]),
                         replicates=np.column_stack([np.full(50, 0.4 + 1e-16), np.full(50, 0.4)]),
                         influence=np.zeros((10, 2)), dfs=np.array([9.0, 9.0]), refused=np.zeros(2, bool),
                         claims=["ok", "ok"], raw=np.zeros(2), relative=["ok", "ok"], relative_reason=[None, None],
                         kinds=["verified", "verified"], bias_bound=np.zeros(2), labels=np.full(2, 10.0),
                         calibration_labels=10.0)
    (c,) = compare_pairs(cols, alpha=0.05, method="holm", span=1.0, warnings=[])
    assert c["diff"] == 0.0 and c["p_value"] == 1.0 and not c["significant"]

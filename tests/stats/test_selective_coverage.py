"""Coverage of levels reported after a false audit failure, before and after the selective interval (issue 9,
cause 1), on the simulator's audited protocol (labels on base plus 50-label audit slices, length covariate)."""
from __future__ import annotations

import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import PROTOCOL_TRANSPORTED, protocol_policies, simulate


@pytest.mark.slow
def test_levels_after_false_fails_cover_with_the_selective_interval():
    """400 datasets at n = 1000, 25% of base labelled, analytic route (~17 s CPU; bootstrap figures in
    benchmarks/RESULTS.md, "Issue 9: selective intervals after a failed audit").

    Measured with these seeds: 33 transported intervals after a false fail; the unconditional interval covers 13,
    the selective one 31. Tolerances: if the selective interval covers at 0.95 conditionally, N ~ 33 events give
    a binomial SD of sqrt(33 * 0.95 * 0.05) = 1.25 intervals, so >= 0.8 N is ~4 SD of slack; the unconditional
    ones cover ~0.4 (RESULTS.md: 55-90% miss), so "after - before >= 0.3" holds unless the fix does nothing.
    The six policies' other intervals are untouched, so all covered counts can only move with these events, and
    the adversary's interval (|z| 5-30) barely moves: its coverage may not drop by more than one dataset.
    """
    events = before = after = 0
    total_before = total_after = adv_before = adv_after = 0
    for rep in range(400):
        sim = simulate(1000, protocol_policies(), oracle_fraction=0.25, label_design="calibration_policy",
                       calibration_policy="base", audit_labels=50, seed=1000 + rep)
        d = evaluate(sim.frame, covariates=["response_length"], calibration_policies=["base"],
                     inference="analytic", seed=rep).to_dict()
        for p in (*PROTOCOL_TRANSPORTED, "unhelpful"):
            e = d["policies"][p]
            t = sim.true_values[p]
            unc = e["selective"]["ci_unconditional"] if e["selective"] else e["ci"]
            c0, c1 = unc[0] <= t <= unc[1], e["ci"][0] <= t <= e["ci"][1]
            if p == "unhelpful":
                adv_before += c0
                adv_after += c1
                continue
            total_before += c0
            total_after += c1
            if e["ci_method"] == "selective":
                events += 1
                before += c0
                after += c1
    assert events >= 15
    assert after >= 0.8 * events
    assert after - before >= 0.3 * events
    assert total_after >= total_before
    assert adv_after >= adv_before - 1

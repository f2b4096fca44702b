"""The loop that verifies (issue 24): a policy without labels assumes transport; the result says how many own
labels would verify it; those labels are answered by the simulator's oracle; the re-evaluation reaches the
verified decision.

Design: base and clone identical (true value 0.704), ``newcomer`` truly worse (quality 0.45: true value 0.633,
0.07 below) with a length bias the base calibration only partly sees; the newcomer starts with no labels.
Round r draws ``labels_to_verify.n_labels`` of its rows completely at random (inclusion probability n/N written
on the rows, as a labelling tool's sample would be) and reveals their oracle labels.

Tolerances: ``labels_to_verify`` sizes the closest comparison for 80% power at the assumed difference, so one
round decides with probability about 0.8 (less where the assumed difference over-states the true one) and two
rounds with about 1 - 0.2^2 = 0.96. Over 12 datasets, requiring at least 9 decided within two rounds fails with
probability P(Bin(12, 0.9) < 9) = 0.026 at a conservative 0.9. A decision of the wrong sign needs a 2-SE error in
the direction away from a 0.07 true difference: expected 12 x 0.025 = 0.3 at most, so none is allowed
(P(>= 1) <= 0.26 would be too loose to fail on; we require 0 and note the pinned seeds give 0).
"""
from __future__ import annotations

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.simulate.direct import PolicySpec, simulate

POLICIES = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("newcomer", 0.45, verbosity=1.5))


def _round(frame, oracle_all, rng, n_new: int):
    rows = np.flatnonzero((frame["policy"] == "newcomer").to_numpy() & frame["oracle_label"].isna().to_numpy())
    pick = rng.choice(rows, size=min(n_new, rows.size), replace=False)
    frame = frame.copy()
    frame.loc[frame.index[pick], "oracle_label"] = oracle_all[pick]
    n_lab = int(frame.loc[frame["policy"] == "newcomer", "oracle_label"].notna().sum())
    n_all = int((frame["policy"] == "newcomer").sum())
    mask = (frame["policy"] == "newcomer").to_numpy() & frame["oracle_label"].notna().to_numpy()
    frame.loc[mask, "label_probability"] = n_lab / n_all
    return frame


def test_labels_to_verify_reach_the_verified_decision_in_one_or_two_rounds():
    decided, wrong, rounds_used = 0, 0, []
    for seed in range(12):
        sim = simulate(800, POLICIES, oracle_fraction=0.3, label_design="calibration_policy", audit_labels=0,
                       seed=500 + seed)
        frame = sim.frame.copy()
        truth = sim.true_values
        rng = np.random.default_rng(seed)
        d = evaluate(frame, covariates=["response_length"], n_bootstrap=200, seed=seed).to_dict()
        p = d["policies"]["newcomer"]
        assert p["level_claim"] == "assumes_transport" and p["estimate"] is None
        n_next = int(p["labels_to_verify"]["n_labels"])
        assert n_next >= 10
        for r in (1, 2):
            frame = _round(frame, sim.oracle_all, rng, n_next)
            d = evaluate(frame, covariates=["response_length"], n_bootstrap=200, seed=seed).to_dict()
            p = d["policies"]["newcomer"]
            assert p["level_claim"] == "ok" and p["basis_code"] == "power_tuned" and p["labels_to_verify"] is None
            c = next(c for c in d["comparisons"] if {c["a"], c["b"]} == {"newcomer", "base"})
            if c["significant"]:
                sign = np.sign(c["diff"]) * (1 if c["a"] == "newcomer" else -1)
                decided += 1
                wrong += int(sign != np.sign(truth["newcomer"] - truth["base"]))
                rounds_used.append(r)
                break
            n_next = int(p["n_labelled"])  # not decided yet: double the newcomer's labels
    assert decided >= 9, (decided, rounds_used)
    assert wrong == 0

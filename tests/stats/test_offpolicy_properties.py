"""Seeded statistical properties of the off-policy estimators, diagnostics and gates.

Every tolerance is derived in a comment from the number of replications; nothing was tuned.
The length sweep reproduces the paper's finding (TTC collapse with response length); its slow
version produced the table in docs/offpolicy.md.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from cje_engine.offpolicy.bootstrap import bootstrap_target
from cje_engine.offpolicy.inputs import Rewards
from cje_engine.offpolicy.target import evaluate_target
from cje_engine.simulate.logs import oracle_curve, population_value, simulate_logs
from cje_engine.offpolicy.weights import SIMCal, isotonic_fit, isotonic_predict, solve_simplex_qp

log = logging.getLogger(__name__)

ESTIMATORS = ("ips", "snips", "calibrated_ips", "dr", "direct", "stacked")


def _binomial_band(p: float, reps: int, z: float) -> tuple[float, float]:
    se = math.sqrt(p * (1 - p) / reps)
    return p - z * se, p + z * se


def test_near_clone_if_intervals_cover():
    """Near-clone target (high overlap): IPS, SNIPS, calibrated IPS, DR, Direct and the stack cover ~95%.

    Rewards use the true calibration h(S) so the IF SE is the whole uncertainty (the
    calibration-aware bootstrap is tested below). DR gets a deliberately wrong outcome model
    q = 0.8 h + 0.05, so its weighted correction has to do real work. Each replicate draws new
    prompts, so the estimand is the population value. With 300 replicates the coverage of a
    95% interval has binomial SE sqrt(.95 * .05 / 300) = 0.0126; we allow 3.5 SE (family-wise
    false-failure rate over 6 estimators <= 6 * 4.7e-4 ~ 0.3%).
    """
    reps, n, T, eta = 300, 500, 4, 0.1
    truth = population_value(eta, length=T)
    hits = {k: 0 for k in ESTIMATORS}
    for r in range(reps):
        sim = simulate_logs(n_prompts=n, length=T, targets={"t": eta}, seed=10_000 + r)
        ld, fd = sim.logged_data("t"), sim.fresh_data("t")
        R, Rf = oracle_curve(sim.scores), oracle_curve(fd.scores)
        rep = evaluate_target(ld, Rewards(R, Rf, 0.8 * R + 0.05, 0.8 * Rf + 0.05), fd)
        for k in ESTIMATORS:
            lo, hi = rep.estimates[k].ci(0.95)
            hits[k] += lo <= truth <= hi
        assert rep.logs_only_verdict.claim == "level"
    lo, hi = _binomial_band(0.95, reps, 3.5)
    cover = {k: v / reps for k, v in hits.items()}
    log.info("near-clone coverage %s", cover)
    for k, c in cover.items():
        assert lo <= c <= min(hi, 1.0), (k, cover)


def test_far_target_gates_fire():
    """Far target (eta = 1, T = 64): TTC ~ 0.01 in expectation (see docs), so with 500 logged rows
    a TTC >= 0.70 would need ~350 rows where ~5 are expected: the gate must refuse in every replicate."""
    for r in range(15):
        sim = simulate_logs(n_prompts=500, length=64, targets={"far": 1.0}, seed=20_000 + r)
        ld, fd = sim.logged_data("far"), sim.fresh_data("far")
        rep = evaluate_target(ld, Rewards(oracle_curve(sim.scores), oracle_curve(fd.scores)), fd, target="far")
        d = rep.diagnostics
        assert d.ttc < 0.7 and d.ess_raw < 0.3
        for k in ("ips", "snips", "calibrated_ips"):
            assert rep.verdicts[k].claim == "refused"
        assert rep.verdicts["dr"].claim == "downgraded"
        assert rep.verdicts["direct"].claim == "level"


def test_simcal_cap_and_stacking_properties_over_random_inputs():
    """Deterministic guarantees checked on 40 random heavy-tailed inputs: mean one, Var <= rho,
    ESS not lowered, and the simplex QP never worse than its best vertex."""
    rng = np.random.default_rng(0)
    for i in range(40):
        n = int(rng.integers(60, 400))
        s = np.round(rng.uniform(0, 1, n), int(rng.integers(1, 3)))
        log_w = rng.normal(0, rng.uniform(0.2, 4), n) + rng.uniform(-3, 3) * s
        rho = float(rng.uniform(0.1, 3))
        cal = SIMCal(rho=rho).fit(log_w, s, np.array([f"p{j % (n // 2)}" for j in range(n)]))
        assert cal.weights_.mean() == pytest.approx(1.0, abs=1e-10)
        assert np.var(cal.weights_) <= rho * (1 + 1e-9)
        A = rng.normal(size=(50, 4)) * rng.uniform(0.1, 3, 4)
        sig = A.T @ A
        b = solve_simplex_qp(sig)
        assert b @ sig @ b <= np.min(np.diag(sig)) * (1 + 1e-12)


def _sweep(lengths, eta, reps, n=1000, seed0=0):
    """Per length: mean TTC, share of logs-only refusals, RMSE of each estimator vs the exact truth.

    Rewards come from an isotonic calibration fitted on the logged labelled rows (25%)."""
    out = {}
    for T in lengths:
        err = {k: [] for k in ESTIMATORS}
        ttc, refused, ess, ess_stab = [], [], [], []
        for r in range(reps):
            sim = simulate_logs(n_prompts=n, length=T, targets={"t": eta}, seed=seed0 + 1000 * T + r)
            lab = sim.labelled
            knots, vals = isotonic_fit(sim.scores[lab], sim.oracle[lab])
            ld, fd = sim.logged_data("t"), sim.fresh_data("t")
            rw = Rewards(isotonic_predict(knots, vals, sim.scores), isotonic_predict(knots, vals, fd.scores))
            rep = evaluate_target(ld, rw, fd, target="t")
            for k in ESTIMATORS:
                err[k].append(rep.estimates[k].value - sim.truth["t"])
            ttc.append(rep.diagnostics.ttc)
            ess.append(rep.diagnostics.ess_raw)
            ess_stab.append(rep.diagnostics.ess_stabilised)
            refused.append(rep.logs_only_verdict.claim == "refused")
        out[T] = {"ttc": float(np.mean(ttc)), "ess": float(np.mean(ess)), "ess_stab": float(np.mean(ess_stab)),
                  "refused": float(np.mean(refused)),
                  **{k: float(np.sqrt(np.mean(np.square(v)))) for k, v in err.items()}}
    return out


def test_length_sweep_fast():
    """Short version of the paper's TTC-collapse experiment (eta = 0.6, T = 1 vs 256, 12 reps).

    Margins: the relative SE of an RMSE over R = 12 replicates is ~1/sqrt(2R) = 0.20, so a ratio
    of two RMSEs has log-SE ~0.29. The slow run (docs/offpolicy.md) gives calibrated-IPS/Direct
    ~3.5x, SNIPS/Direct ~4.6x and IPS growth ~100x at T = 256. The bounds 2x, 2x and 10x sit
    1.9, 2.9 and > 5 log-SEs below those values (the run is seeded; this says how much
    room a code change has before the check trips).
    Direct's RMSE (~0.012-0.017 in the slow run) must stay within the same factor of its T = 1 value.
    """
    res = _sweep((1, 256), 0.6, reps=12)
    short, long_ = res[1], res[256]
    log.info("fast sweep %s", res)
    assert short["ttc"] >= 0.7 and long_["ttc"] < 0.1          # coverage collapses
    assert short["refused"] == 0.0 and long_["refused"] == 1.0  # and the gate follows it
    assert long_["ips"] >= 10 * short["ips"]                    # raw IPS error grows many-fold
    assert long_["calibrated_ips"] >= 2 * long_["direct"]       # stabilisation does not rescue it
    assert long_["snips"] >= 2 * long_["direct"]
    assert long_["direct"] <= 2.2 * short["direct"]              # Direct stays accurate (e^{2.4*.29} ~ 2)


@pytest.mark.slow
def test_length_sweep_reproduces_paper_finding():
    """The full sweep recorded in docs/offpolicy.md (100 replicates per cell).

    With R = 100 the relative SE of an RMSE is ~0.07 (log-SE of a ratio ~0.1), so the factor
    bounds below sit > 5 log-SEs inside the measured values.
    """
    lengths = (1, 4, 16, 64, 256, 400)
    for eta in (0.3, 0.6):
        res = _sweep(lengths, eta, reps=100, seed0=int(eta * 1e6))
        for T in lengths:
            r = res[T]
            log.warning("| %.1f | %d | %.3f | %.3f | %.3f | %.2f | %s |", eta, T, r["ttc"], r["ess"], r["ess_stab"],
                        r["refused"], " | ".join(f"{r[k]:.4f}" for k in ESTIMATORS))
        ttcs = [res[T]["ttc"] for T in lengths]
        assert all(a >= b - 0.02 for a, b in zip(ttcs, ttcs[1:]))  # TTC falls with length
        assert max(res[T]["direct"] for T in lengths) <= 0.025      # Direct stays accurate
        assert res[400]["ips"] >= 5 * res[1]["ips"]
        for T in lengths:
            # the gate refuses before the error grows: wherever a logs-only estimator is more than
            # 2x worse than Direct, the refusal rate is already >= 90%
            worst = max(res[T][k] for k in ("snips", "calibrated_ips"))
            if worst > 2 * res[T]["direct"]:
                assert res[T]["refused"] >= 0.9, (eta, T, res[T])


class _Refit:
    def __init__(self, sim):
        self.sim = sim

    def __call__(self, li, fi):
        lab = self.sim.labelled[li]
        k, v = isotonic_fit(self.sim.scores[li][lab], self.sim.oracle[li][lab])
        R = isotonic_predict(k, v, self.sim.scores[li])
        return Rewards(R, isotonic_predict(k, v, self.sim.fresh["t"].scores[fi]))


@pytest.mark.slow
def test_calibration_aware_bootstrap_covers():
    """Near clone with the calibrator refitted per replicate: percentile intervals of Direct, DR and
    calibrated IPS cover the population value ~95%. 100 replicates: binomial SE 0.022, 3 SE band."""
    reps, n, T, eta = 100, 400, 4, 0.1
    truth = population_value(eta, length=T)
    hits = {k: 0 for k in ("calibrated_ips", "dr", "direct")}
    for r in range(reps):
        sim = simulate_logs(n_prompts=n, length=T, targets={"t": eta}, seed=30_000 + r, label_fraction=0.25)
        res = bootstrap_target(sim.logged_data("t"), _Refit(sim), sim.fresh_data("t"), n_boot=200, seed=r)
        for k in hits:
            lo, hi = res.ci(k)
            hits[k] += lo <= truth <= hi
    lo, hi = _binomial_band(0.95, reps, 3.0)
    cover = {k: v / reps for k, v in hits.items()}
    log.warning("bootstrap coverage %s", cover)
    for k, c in cover.items():
        assert lo <= c <= 1.0, (k, cover)


# ------------------------------------------------------------------------------------------
# through the engine's entry point (cje_engine.pipeline.offpolicy.evaluate_offpolicy)
# ------------------------------------------------------------------------------------------


def _entry_point_coverage(reps: int, n: int, n_boot: int, seed0: int) -> dict[str, float]:
    """Share of replicates whose reported interval covers the population value, for the hybrid
    headline (IF stack) and the logs-only headline (calibrated IPS; identical numbers in both modes,
    see tests/unit/test_offpolicy_pipeline.py), plus the share of level claims."""
    from cje_engine.pipeline.offpolicy import evaluate_offpolicy

    T, eta = 4, 0.05
    truth = population_value(eta, length=T)
    hits = {"hybrid/stacked": 0, "logs-only/calibrated_ips": 0}
    level = 0
    for r in range(reps):
        sim = simulate_logs(n_prompts=n, length=T, targets={"t": eta}, seed=40_000 + seed0 + r, label_fraction=0.25)
        logged, fresh = sim.to_frames()
        # the protocol's reported levels (level_estimator="audited"; by default they are kept in ``assumed``)
        res = evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=n_boot, seed=r,
                                 level_estimator="audited").to_dict()
        p = res["policies"]["t"]
        lo, hi = p["ci"]
        hits["hybrid/stacked"] += lo <= truth <= hi
        lo, hi = p["offpolicy"]["estimates"]["calibrated_ips"]["ci"]
        hits["logs-only/calibrated_ips"] += lo <= truth <= hi
        verdicts = p["offpolicy"]["verdicts"]
        level += verdicts["calibrated_ips"]["claim"] == "level" and verdicts["stacked"]["claim"] == "level"
    out = {k: v / reps for k, v in hits.items()}
    out["level"] = level / reps
    return out


def test_entry_point_near_clone_intervals_cover():
    """Near clone (eta = 0.05, T = 4, 300 prompts, 25% labelled): the calibration-aware bootstrap
    intervals the mode reports cover the population value ~95%, and the gates let them through.

    80 replicates: the coverage of a 95% interval has binomial SE sqrt(.95 * .05 / 80) = 0.024; the
    band is 0.95 +/- 3 SE = [0.877, 1] (two estimators: family-wise false-failure rate <= 0.3%).
    B = 100 percentile intervals lose ~1 point of coverage to Monte Carlo noise in their endpoints,
    well inside the band. The overlap gates must pass in every replicate: the near clone's TTC is
    ~0.9 and its raw ESS ~0.99 (docs/offpolicy.md), far from the 0.70 and 0.30 thresholds. (The
    reported level claim may still be refused by Direct's calibration-support rule: 75 labels on
    continuous scores leave ~20% of them thinly supported; that rule is tested with Direct.)
    """
    cover = _entry_point_coverage(reps=80, n=300, n_boot=100, seed0=0)
    log.warning("entry-point coverage (fast) %s", cover)
    lo, _ = _binomial_band(0.95, 80, 3.0)
    assert cover["level"] == 1.0
    for k in ("hybrid/stacked", "logs-only/calibrated_ips"):
        assert lo <= cover[k] <= 1.0, cover


@pytest.mark.slow
def test_entry_point_near_clone_intervals_cover_slow():
    """As above with 300 replicates and B = 200 (binomial SE 0.0126; band 0.95 +/- 3.5 SE)."""
    cover = _entry_point_coverage(reps=300, n=400, n_boot=200, seed0=1000)
    log.warning("entry-point coverage (slow) %s", cover)
    lo, hi = _binomial_band(0.95, 300, 3.5)
    for k in ("hybrid/stacked", "logs-only/calibrated_ips"):
        assert lo <= cover[k] <= min(hi, 1.0), cover


def test_entry_point_far_target_refused():
    """Far target (eta = 1, T = 64) through the entry point in both modes: logs-only is refused on
    TTC in every replicate (expected TTC ~0.01, see test_far_target_gates_fire), the refusal says to
    collect fresh draws, and such a target is never crowned best policy. In hybrid mode the headline
    leaves the refused logs-only estimators out of the stack."""
    from cje_engine.pipeline.offpolicy import evaluate_offpolicy

    for r in range(4):
        sim = simulate_logs(n_prompts=200, length=64, targets={"far": 1.0}, seed=50_000 + r)
        logged, fresh = sim.to_frames()
        lo_res = evaluate_offpolicy(logged, mode="logs-only", n_bootstrap=50, seed=r).to_dict()
        far = lo_res["policies"]["far"]
        assert far["level_claim"] == "refused" and lo_res["best_policy"] != "far"
        assert any("TTC" in x for x in far["refusal_reasons"])
        assert "collect fresh draws" in far["refusal_reasons"][-1]
        hy = evaluate_offpolicy(logged, fresh, mode="hybrid", n_bootstrap=50, seed=r).to_dict()
        coef = hy["policies"]["far"]["offpolicy"]["estimates"]["stacked"]["coef"]
        assert set(coef) <= {"dr", "direct"}


# ------------------------------------------------------------------ refused means refused (issue 16)


def _refusal_study(n_datasets: int) -> dict:
    """benchmarks/bench_offpolicy.py: logs-only (analytic route) beside Direct on the fresh draws."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_offpolicy.py"
    spec = importlib.util.spec_from_file_location("bench_offpolicy", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules.setdefault("bench_offpolicy", mod)  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod.run(n_datasets, n_prompts=400, inference="analytic", n_boot=0)


def _check_refusal_study(r: dict, acc_slack: float, cov_band: tuple[float, float]) -> None:
    # an overlap-refused target is never ranked (exact), and the far target is refused at all
    assert r["refused_target_ranked"] == 0
    assert r["overlap_refusals"].get("far", 0) >= 0.9 * r["n_datasets"]
    d = r["discordant_pairs"]
    diff = (d["offpolicy_only"] - d["direct_only"]) / r["reported_pairs"]
    assert diff >= -acc_slack, (r["ranking_accuracy_offpolicy"], r["ranking_accuracy_direct_same_pairs"])
    lo, hi = cov_band
    assert lo <= r["coverage_reported_intervals"] <= hi, r["coverage_by_target"]


def test_refusal_study_small():
    # 25 data sets. Accuracy: the paired difference (McNemar) has SE sqrt(b + c) / P over P reported
    # pairs with b + c discordant ones; slack = the claim's 0.02 plus 3 SE with b + c <= 15 of ~75
    # pairs (at most ~20% discordant at this size): 0.02 + 3 * sqrt(15) / 75 = 0.175. Coverage: two
    # reported targets per data set share the data, so count the data sets (25) as the independent
    # units: 0.95 +/- (0.02 + 3 * sqrt(0.95 * 0.05 / 25)) = [0.80, 1.0].
    r = _refusal_study(25)
    _check_refusal_study(r, 0.175, (0.80, 1.0))


@pytest.fixture(scope="module")
def study_2000():
    return _refusal_study(2000)


@pytest.mark.slow
def test_refusal_study_2000(study_2000):
    # The claims of issue 16 (benchmarks/RESULTS.md has the figures), on 2000 data sets (the
    # issue asks for 200; more only tightens the estimates; ~150 s CPU): never ranked, accuracy >=
    # Direct - 0.02. Coverage here only against a gross failure: 0.95 - 4 Monte Carlo SEs of a
    # 2000-data-set coverage (0.006, measured by resampling data sets; the next test derives it).
    _check_refusal_study(study_2000, 0.02, (0.95 - 4 * 0.006, 1.0))


@pytest.mark.slow
def test_refusal_study_coverage_in_band(study_2000):
    # The band of issue 16, [0.93, 0.97], for the reported off-policy levels. The independent unit
    # is the data set, not the interval: the two reported targets of a data set share its 100
    # labels, and the calibration noise is ~83% of each interval's variance. The coverage's Monte
    # Carlo SD over 200 data sets is 0.019-0.024 (resampling data sets; blocks of 200 consecutive
    # seeds range 0.878-0.987 with the old intervals, 0.900-0.991 with the new), so 200 cannot pin
    # a band of +/- 0.02; over 2000 it is 0.006, so a method with true coverage 0.95 lands in the
    # band with probability > 0.999, and one at 0.92 or 0.98 (the old 200-data-set reading) lands
    # outside it with probability ~0.95. The run's own Monte Carlo SE is checked to be that small,
    # so the band is not met by a lucky draw of a noisy study.
    r = study_2000
    assert r["coverage_mc_se"] < 0.008, r["coverage_mc_se"]
    assert 0.93 <= r["coverage_reported_intervals"] <= 0.97, (r["coverage_reported_intervals"],
                                                             r["coverage_by_200_block"])
    # The width is right on average, not only the coverage: mean reported SE over the RMSE of the
    # reported estimates, 1 for an honest SE. The RMSE of ~2200 estimates that share labels in
    # pairs (~1100 independent units) has relative Monte Carlo SD 1/sqrt(2 * 1100) = 0.021: 1 +/- 3 SD.
    assert 0.936 <= r["se_over_rmse"] <= 1.064, r["se_over_rmse"]

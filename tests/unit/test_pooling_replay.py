"""Robust pooling rerun in every bootstrap replicate (`cje_engine.pipeline.pooling_replay`), against slow,
obvious reference computations (issue 9, the pooled design's coverage)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from cje_engine import bootstrap_chunk, prepare
from cje_engine.direct.estimators import (bootstrap_view, bootstrap_weights, cross_fit, make_design, own_label_means,
                                          policy_stats, replicate)
from cje_engine.pipeline.calibration import failing_source, fit_mode, source_audits
from cje_engine.pipeline.pooling_replay import DECISIVE_Z_MARGIN, decisive
from cje_engine.simulate.direct import default_policies, simulate

POLICIES = default_policies()


def _holm_reference(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, written out."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adj, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adj[i] = running
    return adj


def _failing_reference(delta, se, is_source, alpha):
    cand = [k for k in range(len(delta)) if is_source[k] and np.isfinite(se[k]) and se[k] > 0]
    if len(cand) < 2:
        return None
    z = [abs(delta[k] / se[k]) for k in cand]
    adj = _holm_reference([2 * norm.sf(x) for x in z])
    failing = [(z[i], cand[i]) for i in range(len(cand)) if adj[i] <= alpha]
    return max(failing)[1] if failing else None


def test_failing_source_matches_a_written_out_holm_rule():
    rng = np.random.default_rng(4)
    for _ in range(300):
        K = int(rng.integers(2, 8))
        delta = rng.normal(0, 1, K) * rng.choice([0.5, 3.0], K)
        se = rng.uniform(0.2, 1.0, K)
        is_source = rng.random(K) < 0.8
        got = failing_source(delta, se, is_source, 0.05)
        assert (None if got is None else got[0]) == _failing_reference(delta, se, is_source, 0.05)


def test_decisive_means_the_holm_critical_value_plus_the_margin():
    crit = norm.isf(0.05 / (2 * 6))
    rec = {"residual_mean": -(crit + DECISIVE_Z_MARGIN + 0.01) * 0.02, "se": 0.02, "family_size": 6}
    assert decisive(rec, 0.05)
    rec["residual_mean"] = (crit + DECISIVE_Z_MARGIN - 0.01) * 0.02
    assert not decisive(rec, 0.05)


def _pooled(seed: int, n: int = 300, frac: float = 0.1):
    return simulate(n, POLICIES, oracle_fraction=frac, seed=seed, length_bias=0.0, judge_noise_sd=0.0)


def _replicate_reference(prep, w: np.ndarray) -> np.ndarray:
    """The pooling loop on one resample, the slow way: row-weighted cross-fit and policy_stats per source set,
    the sources' residual means from those statistics, full-data SEs of each set, the written-out Holm rule."""
    d, mode, K = prep.design.data, prep.design.mode, len(prep.design.data.policies)
    gone = {e["policy"] for e in prep.excluded if decisive(e, prep.options.alpha)}
    names = [p for p in d.policies if p not in gone and (d.labelled & (d.policy == d.policies.index(p))).any()]
    row_w = w[d.prompt]
    while True:
        design = make_design(d, mode, tuple(names))
        f, _ = cross_fit(design, row_w)
        stats = policy_stats(design, f, row_w)
        se = source_audits(fit_mode(d, mode, tuple(names)))[1]
        is_source = np.isin(np.arange(K), [d.policies.index(p) for p in names])
        bad = _failing_reference(stats[K:] - stats[:K], se, is_source, prep.options.alpha)
        if bad is None:
            return stats
        names = [p for p in names if p != d.policies[bad]]


def test_replicates_rerun_the_pooling_like_the_slow_loop():
    sim = _pooled(11)
    prep = prepare(sim.frame, n_bootstrap=50, seed=5, pooling_bootstrap="rerun")
    assert [e["policy"] for e in prep.excluded][:1] == ["unhelpful"] and prep.replay is not None
    assert "unhelpful" not in [prep.design.data.policies[k] for k in prep.replay.start]  # decisive: never back
    reps = bootstrap_chunk(prep, 0, 40)
    n_p = prep.design.data.n_prompts
    K = len(prep.design.data.policies)
    view = bootstrap_view(prep.design, 5)
    for b in range(40):  # the third block: own-label means, which need no calibrator
        np.testing.assert_array_equal(reps[b, 2 * K:], own_label_means(view, bootstrap_weights(5, b, n_p)))
    reps = reps[:, :2 * K]
    differ = 0
    for b in range(40):
        w = bootstrap_weights(5, b, n_p)
        ref = _replicate_reference(prep, w)
        np.testing.assert_allclose(reps[b], ref, rtol=1e-9, atol=1e-12)
        differ += not np.allclose(reps[b], replicate(prep.design, w), rtol=1e-12, atol=0)
    assert differ > 0  # some replicates of this dataset exclude another source, so the rerun is exercised


def test_replicates_that_keep_the_sources_are_the_fixed_replicates_bit_for_bit():
    sim = _pooled(11)
    prep = prepare(sim.frame, n_bootstrap=50, seed=5, pooling_bootstrap="rerun")
    n_p = prep.design.data.n_prompts
    same = 0
    for b in range(40):
        w = bootstrap_weights(5, b, n_p)
        stats = prep.replay.replicate(w)
        K = len(prep.design.data.policies)
        if failing_source(stats[K:] - stats[:K], prep.replay.source_se(prep.replay.final),
                          np.isin(np.arange(K), prep.replay.final), prep.options.alpha) is None:
            fixed = replicate(prep.design, w)
            if np.array_equal(stats, fixed):
                same += 1
    assert same > 0


def test_one_calibration_source_has_nothing_to_rerun():
    sim = simulate(300, POLICIES, oracle_fraction=0.25, label_design="calibration_policy", audit_labels=40, seed=2)
    prep = prepare(sim.frame, calibration_policies=["base"], n_bootstrap=50, seed=1, pooling_bootstrap="rerun")
    assert prep.replay is None
    n_p = prep.design.data.n_prompts
    K = len(prep.design.data.policies)
    np.testing.assert_array_equal(bootstrap_chunk(prep, 0, 5)[:, :2 * K],
                                  np.array([replicate(prep.design, bootstrap_weights(1, b, n_p)) for b in range(5)]))


def test_analytic_inference_has_no_replay():
    prep = prepare(_pooled(3).frame, inference="analytic", pooling_bootstrap="rerun")
    assert prep.replay is None


def test_replay_pickles_without_its_caches_and_gives_the_same_replicates():
    import pickle

    prep = prepare(_pooled(11).frame, n_bootstrap=50, seed=5, pooling_bootstrap="rerun")
    first = bootstrap_chunk(prep, 0, 10)
    clone = pickle.loads(pickle.dumps(prep))
    assert clone.replay._designs == {} and clone.replay._se == {}
    np.testing.assert_array_equal(bootstrap_chunk(clone, 0, 10), first)


def test_the_default_keeps_the_sources_fixed_and_a_bad_value_is_refused():
    from cje_engine.errors import CJEInputError

    prep = prepare(_pooled(11).frame, n_bootstrap=50, seed=5)
    assert prep.replay is None
    with pytest.raises(CJEInputError, match="pooling_bootstrap must be fixed or rerun"):
        prepare(_pooled(11).frame, n_bootstrap=50, pooling_bootstrap="always")


def test_ray_ships_the_prepared_state_when_replicates_rerun_the_pooling():
    from cje_engine.direct.estimators import BootstrapView
    from flows.runtime.ray_fanout import bootstrap_state, remote_bootstrap

    frame = _pooled(11).frame
    fixed = prepare(frame, n_bootstrap=50, seed=5)
    rerun = prepare(frame, n_bootstrap=50, seed=5, pooling_bootstrap="rerun")
    assert isinstance(bootstrap_state(fixed), BootstrapView)
    assert bootstrap_state(rerun) is rerun
    # what a worker computes from the shipped state is the driver's chunk
    np.testing.assert_array_equal(remote_bootstrap(bootstrap_state(rerun), 0, 8), bootstrap_chunk(rerun, 0, 8))
    np.testing.assert_array_equal(remote_bootstrap(bootstrap_state(fixed), 0, 8), bootstrap_chunk(fixed, 0, 8))

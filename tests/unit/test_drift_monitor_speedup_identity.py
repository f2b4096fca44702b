"""Pins every number `DriftMonitor.update` produces to golden values of the code before its speed-up.

The fixture ``tests/fixtures/drift_monitor_golden.json`` was written by the monitor as it was
before the hot paths were optimised (cached pair counts, numpy windows, windowed lattice
convolution). Every look's full ``to_dict()`` (p-values, estimates, intervals, alarms, details)
and the monitor's final state must match it: exactly for text, integers and booleans, to a
relative 1e-12 for floats. Regenerate (only when a number is MEANT to change) with
``PYTHONPATH=. python tests/unit/test_drift_monitor_speedup_identity.py write``.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cje_engine.drift import signflip
from cje_engine.drift.monitor import METRICS, DriftMonitor
from cje_engine.simulate.drift import simulate_monitor
from tests.stats.drift_judge_data import PanelWorld

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "drift_monitor_golden.json"
REL = 1e-12

#: (name, PanelWorld kwargs, monitor kwargs, looks)
PANEL_CASES: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    ("shared_clusters", {"seed": 11, "scenario": "none", "shared": 0.3}, {}, 7),
    ("length_clusters", {"seed": 12, "scenario": "length", "change_at": 3, "shared": 0.3}, {}, 6),
    ("shift_no_clusters", {"seed": 13, "scenario": "shift", "change_at": 4, "pass_clusters": False},
     {"rank_window": 4}, 6),
    ("few_clusters_permutation", {"seed": 14, "scenario": "compress", "n_prompts": 8, "shared": 0.2},
     {"min_anchors": 10}, 4),
    ("no_labels_influence", {"seed": 15, "scenario": "slow", "with_labels": False},
     {"se_method": "influence", "rank_window": 2, "horizon": 10}, 5),
]

#: (name, simulate_monitor kwargs)
SIM_CASES: list[tuple[str, dict[str, Any]]] = [
    ("sim_none", {"scenario": "none", "n_looks": 6, "seed": 21}),
    ("sim_length_clusters", {"scenario": "length", "n_looks": 6, "seed": 22, "anchors_per_prompt": 4,
                             "shared_noise": 0.3, "change_at": 3}),
    ("sim_shift_floor", {"scenario": "shift", "n_looks": 5, "seed": 23, "with_replicate": False,
                         "monitor_kwargs": {"rank_window": 1, "tau_floor": 0.3}}),
]


def _panel_run(world_kwargs: dict[str, Any], monitor_kwargs: dict[str, Any], looks: int) -> dict[str, Any]:
    kw = dict(world_kwargs)
    seed = kw.pop("seed")
    world = PanelWorld(np.random.SeedSequence(seed), **kw)
    mon = DriftMonitor(**monitor_kwargs)
    out = []
    for t in range(1, looks + 1):
        look = mon.update(world.reference, world.look(t), world.labels, world.calibrate,
                          reference_replicate=world.replicate, clusters=world.clusters, meta={"t": t})
        out.append(look.to_dict())
    return {"looks": out, "state": mon.to_dict()}


def _sim_run(kwargs: dict[str, Any]) -> dict[str, Any]:
    run = simulate_monitor(**kwargs)
    nan_free = lambda a: [[None if math.isnan(v) else float(v) for v in row] for row in a]  # noqa: E731
    return {"first_alarm": run.first_alarm, "p_values": nan_free(run.p_values),
            "alpha_spent": nan_free(run.alpha_spent), "metrics": list(METRICS)}


def run_cases() -> dict[str, Any]:
    """Every case's outputs as plain JSON data."""
    out = {name: _panel_run(w, m, n) for name, w, m, n in PANEL_CASES}
    out.update({name: _sim_run(kw) for name, kw in SIM_CASES})
    return json.loads(json.dumps(out))


def _diff(got: Any, want: Any, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}"]
        return [d for k in want for d in _diff(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r} != {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diff(g, w, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        ok = got == want or abs(got - want) <= REL * max(abs(got), abs(want))
        return [] if ok else [f"{path}: {got!r} != {want!r}"]
    return [] if (got == want and type(got) is type(want)) else [f"{path}: {got!r} != {want!r}"]


def test_monitor_outputs_equal_the_golden_values() -> None:
    """Every look and the final state of each seeded monitor equal the pre-optimisation values."""
    want = json.loads(FIXTURE.read_text())
    got = run_cases()
    assert set(got) == set(want)
    diffs = _diff(got, want, "$")
    assert not diffs, f"{len(diffs)} differences, first: {diffs[:5]}"


def test_the_comparison_sees_a_change() -> None:
    """The comparison is not vacuous: a p-value moved by 1e-9 relative is reported."""
    want = json.loads(FIXTURE.read_text())
    case = want["shared_clusters"]["looks"][0]["metrics"]["mean_shift"]
    moved = dict(case, p_value=case["p_value"] * (1 + 1e-9))
    assert _diff(moved, case, "$") == ["$.p_value: %r != %r" % (moved["p_value"], case["p_value"])]


def _old_exact_lattice(k: np.ndarray, observed_steps: int) -> float:
    """The convolution over the full lattice as it was before the speed-up (the reference)."""
    total = int(k.sum())
    dist = np.zeros(2 * total + 1)
    dist[total] = 1.0
    for v in k:
        v = int(v)
        new = np.zeros_like(dist)
        new[v:] += 0.5 * dist[: dist.shape[0] - v]
        new[: dist.shape[0] - v] += 0.5 * dist[v:]
        dist = new
    values = np.abs(np.arange(-total, total + 1))
    return float(min(1.0, dist[values >= observed_steps].sum()))


def _old_lattice_step(a: np.ndarray) -> float | None:
    """Euclid in floating point, as before the whole-number shortcut (the reference)."""
    scale = float(a.max())
    tol = signflip._REL_TOL * scale
    h = float(a[0])
    for v in a[1:]:
        x, y = max(h, float(v)), min(h, float(v))
        while y > tol:
            x, y = y, math.fmod(x, y)
        h = x
        if h <= tol or scale / h > signflip.LATTICE_MAX_STEPS:
            return None
    return h


def test_exact_lattice_equals_the_full_convolution_bit_for_bit() -> None:
    """Integer counts (<= 52 clusters) and the support-only convolution (more) give the old floats."""
    rng = np.random.default_rng(5)
    for G, top in [(1, 3), (5, 4), (20, 4), (50, 4), (52, 30), (53, 3), (70, 6), (30, 3000)]:
        k = rng.integers(1, top + 1, G).astype(float)
        for observed in {0, 1, int(k.sum()) // 3, int(k.sum()) // 2, int(k.sum())}:
            assert signflip._exact_lattice(k, observed) == _old_exact_lattice(k, observed), (G, top, observed)


def test_lattice_step_equals_euclid() -> None:
    """The whole-number gcd shortcut returns Euclid's step (or None) on integer and other weights."""
    rng = np.random.default_rng(6)
    cases = [rng.integers(1, 40, 30).astype(float) * h for h in (1, 2, 5)]
    cases += [np.array([7.0]), np.array([3.0, 200_001.0]), rng.random(10), np.array([0.5, 1.5, 2.5])]
    for a in cases:
        assert signflip._lattice_step(a) == _old_lattice_step(a), a


if __name__ == "__main__" and sys.argv[1:] == ["write"]:
    FIXTURE.write_text(json.dumps(run_cases(), indent=1, sort_keys=True) + "\n")

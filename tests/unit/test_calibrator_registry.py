"""Conformance of every registered calibration mode, and what registering one changes.

Every entry of `cje_engine.calibration.registry` runs through the protocol the pipeline calls: fit on
simulated data (rows and per-cell sums give the same model), predictions inside the label range,
non-decreasing in the judge score where it claims so, a batched fit equal to the one-at-a-time fit,
finite cross-fit residual and influence terms, the same numbers twice under a seed, and `evaluate`
end to end with ``calibration_mode=<name>``. A toy mode registered inside a test becomes a valid
option value, a CLI choice and a valid result's mode without any other file changing.
"""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from cje_engine import evaluate
from cje_engine.calibration import registry
from cje_engine.calibration.calibrators import IsotonicCalibrator, make_cells, pool_rows
from cje_engine.data.frame import EvalData
from cje_engine.errors import CJEInputError
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline.calibration import choose_mode, fit_mode
from cje_engine.simulate import simulate

NAMES = registry.names()


def _rows(seed: int = 0, n: int = 400) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Judge scores on 21 levels, a heavy-tailed covariate, labels in [0, 1] biased by the covariate."""
    rng = np.random.default_rng(seed)
    s = np.round(rng.uniform(0, 1, n) * 20) / 20
    length = rng.lognormal(4, 0.8, n)
    p = 1 / (1 + np.exp(-(4 * (s - 0.5) - 0.4 * (np.log(length) - 4))))
    y = (rng.uniform(size=n) < p).astype(float) * 0.5 + 0.5 * p
    w = rng.uniform(0.5, 2.0, n)
    return s, y, length[:, None], w


@pytest.fixture(scope="module")
def frame():
    """Direct data with a covariate (response_length) and 30% labels."""
    return simulate(n_prompts=300, oracle_fraction=0.3, seed=7).frame


def test_the_builtin_modes_are_registered_and_named_once():
    assert NAMES[:2] == ("monotone", "two_stage")
    assert registry.option_values() == ("auto", *NAMES)
    for name in NAMES:
        entry = registry.get(name)
        assert isinstance(entry, registry.CalibrationMode) and entry.name == name and entry.label
    with pytest.raises(CJEInputError, match="calibration_mode must be one of auto, monotone, two_stage"):
        registry.get("spline")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.MonotoneMode())
    with pytest.raises(ValueError, match="identifier other than 'auto'"):
        registry.register(type("Auto", (registry.MonotoneMode,), {"name": "auto"})())


@pytest.mark.parametrize("name", NAMES)
def test_fit_predicts_inside_the_label_range_and_is_monotone_where_claimed(name):
    entry = registry.get(name)
    s, y, X, w = _rows()
    model = entry.make((0.0, 1.0), entry.n_knots(s.size, X.shape[1])).fit(s, y, X, w)
    assert isinstance(model, registry.Calibrator)
    grid = np.linspace(-0.2, 1.2, 141)  # beyond the fitted scores too: flat there
    for x in np.quantile(X[:, 0], [0.05, 0.5, 0.95]):
        pred = model.predict(grid, np.full((grid.size, 1), x))
        assert np.all(np.isfinite(pred))
        assert pred.min() >= y.min() - 1e-12 and pred.max() <= y.max() + 1e-12  # inside the labels' range
        if entry.monotone:
            assert np.all(np.diff(pred) >= -1e-12), (name, x)
    # rows and per-cell sums give the same model
    cells, row_cell = make_cells(s, X if entry.uses_covariates else None)
    by_cells = entry.make((0.0, 1.0), entry.n_knots(s.size, X.shape[1])).fit_cells(
        cells, *pool_rows(row_cell, cells.size, y, w))
    np.testing.assert_allclose(by_cells.predict_cells(cells), model.predict_cells(cells), atol=1e-10)
    np.testing.assert_allclose(model.predict(s, X), model.predict_cells(cells)[row_cell], atol=1e-12)


@pytest.mark.parametrize("name", [n for n in NAMES if registry.get(n).batched])
def test_a_batched_fit_equals_the_fits_one_at_a_time(name):
    entry = registry.get(name)
    s, y, X, _ = _rows(seed=3)
    cells, row_cell = make_cells(s, X if entry.uses_covariates else None)
    rng = np.random.default_rng(1)
    sums = [pool_rows(row_cell, cells.size, y, rng.poisson(1.0, s.size).astype(float)) for _ in range(4)]
    W, WY, C = (np.stack([t[i] for t in sums]) for i in range(3))
    k = entry.n_knots(s.size, X.shape[1])
    fits = entry.fit_many(cells, W, WY, C, clip=(0.0, 1.0), n_knots=k)
    for j in range(4):
        one = entry.make((0.0, 1.0), k).fit_cells(cells, W[j], WY[j], C[j])
        np.testing.assert_allclose(fits.predict_cells(j, cells), one.predict_cells(cells), atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_cross_fit_residual_and_influence_terms_are_finite(name, frame):
    data = EvalData.from_frame(frame.copy(), covariates=("response_length",), label_scale=(0.0, 1.0))
    fit = fit_mode(data, name, None)
    assert fit.design.mode == name and fit.design.entry is registry.get(name)
    prompt, w, r = fit.residual_terms
    assert r.size == data.labelled.sum() and np.all(np.isfinite(r)) and np.all(np.isfinite(w))
    np.testing.assert_allclose(np.bincount(data.policy[fit.design.lab_rows], weights=w), 1.0)  # each policy 1
    assert np.all((fit.f >= 0) & (fit.f <= 1))
    K = fit.design.n_policies
    assert np.all(np.isfinite(fit.infl["total"])) and np.all(np.isfinite(fit.infl["calibration"][:, :K]))
    # requested explicitly: chosen as requested, with the mode's own selection keys
    selection, fits = choose_mode(data, EvaluationOptions.build(calibration_mode=name,
                                                                covariates=("response_length",)), None)
    assert selection["chosen"] == name and list(fits) == [name]
    assert set(registry.get(name).selection_record(fit.design.n_knots)) <= set(selection)


@pytest.mark.parametrize("name", NAMES)
def test_evaluate_end_to_end_with_each_mode_is_deterministic(name, frame):
    kw = dict(covariates=["response_length"], calibration_mode=name, n_bootstrap=60, seed=3)
    a, b = evaluate(frame, **kw).to_dict(), evaluate(frame, **kw).to_dict()
    assert a["calibration"]["mode"] == name and a["calibration"]["selection"]["requested"] == name
    for p, pol in a["policies"].items():
        assert 0.0 <= pol["estimate"] <= 1.0, (name, p)
        assert pol["estimate"] == b["policies"][p]["estimate"] and pol["ci"] == b["policies"][p]["ci"]


def test_auto_picks_among_the_eligible_registered_modes(frame):
    """Without covariates only monotone is eligible (the covariate modes say why); with them both are
    fitted and the pairwise test decides, recorded as before."""
    plain = evaluate(frame, inference="analytic").to_dict()["calibration"]["selection"]
    assert plain["chosen"] == "monotone" and list(plain["oof_rmse"]) == ["monotone"]
    assert plain["reason"] == "no covariates given, so the two-stage index has nothing to add"
    cov = evaluate(frame, covariates=["response_length"], inference="analytic").to_dict()["calibration"]["selection"]
    assert list(cov["oof_rmse"]) == ["monotone", "two_stage"]
    assert {"paired_difference", "paired_se", "two_stage_knots"} <= set(cov)
    assert cov["chosen"] == ("monotone" if cov["paired_difference"] < -2 * cov["paired_se"] else "two_stage")


class _ToyMode(registry.ModeEntry):
    """Isotonic on the score, never picked by ``auto``: a stand-in for a new calibrator."""

    name = "toy_isotonic"
    label = "toy"
    in_auto = False

    def make(self, clip=None, n_knots=6):
        return IsotonicCalibrator(clip=clip)


@pytest.fixture
def toy():
    entry = registry.register(_ToyMode())
    try:
        yield entry
    finally:
        registry.unregister(entry.name)


def _choices(parser: argparse.ArgumentParser, flag: str) -> list:
    """The choices of ``flag`` in ``parser`` or any of its subcommands."""
    for action in parser._actions:
        if flag in action.option_strings:
            return list(action.choices)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found = _choices(sub, flag)
                if found:
                    return found
    return []


def test_a_registered_toy_mode_is_an_option_a_cli_choice_and_a_result_mode(toy, frame):
    from flows.cli.main import build_parser

    with pytest.raises(CJEInputError, match="calibration_mode must be"):
        EvaluationOptions.build(calibration_mode="toy_isotonc")  # a typo is still refused
    assert EvaluationOptions.build(calibration_mode="toy_isotonic").calibration_mode == "toy_isotonic"
    assert "toy_isotonic" in _choices(build_parser(), "--calibration-mode")
    data = EvalData.from_frame(frame.copy(), covariates=("response_length",), label_scale=(0.0, 1.0))
    opts = EvaluationOptions.build(covariates=("response_length",))
    auto, _ = choose_mode(data, opts, None)
    assert "toy_isotonic" not in auto["oof_rmse"]  # in_auto=False: auto leaves it out
    picked, fits = choose_mode(data, EvaluationOptions.build(calibration_mode="toy_isotonic"), None)
    assert picked["chosen"] == "toy_isotonic"
    # the toy is isotonic on the score: the same numbers as monotone, and a result that validates
    np.testing.assert_array_equal(fits["toy_isotonic"].f, fit_mode(data, "monotone", None).f)
    toy_res = evaluate(frame, calibration_mode="toy_isotonic", inference="analytic").to_dict()
    mono_res = evaluate(frame, calibration_mode="monotone", inference="analytic").to_dict()
    assert toy_res["calibration"]["mode"] == "toy_isotonic"
    assert {p: v["estimate"] for p, v in toy_res["policies"].items()} == {
        p: v["estimate"] for p, v in mono_res["policies"].items()}


def test_after_unregistering_the_toy_is_refused_again():
    from pydantic import ValidationError

    from cje_engine.result.model import Calibration

    assert "toy_isotonic" not in registry.names()
    with pytest.raises(CJEInputError, match="calibration_mode must be auto, monotone or two_stage"):
        EvaluationOptions.build(calibration_mode="toy_isotonic")
    with pytest.raises(ValidationError, match="calibration mode must be a registered one"):
        Calibration(mode="toy_isotonic", n_train=10)


def test_the_registry_is_light_to_import():
    """Options and the CLI read the registry: it must not load the calibrators (scipy.optimize and
    scipy.linalg, ~1.5 s of a CLI start) until a mode is fitted."""
    import subprocess
    import sys

    from cje_engine.calibration.calibrators import TWO_STAGE_MAX_KNOTS

    assert registry.DEFAULT_KNOTS == TWO_STAGE_MAX_KNOTS
    code = ("import sys, cje_engine.options, cje_engine.calibration.registry as r; r.option_values(); "
            "print(sorted(m for m in ('scipy.optimize', 'scipy.linalg', 'cje_engine.calibration.calibrators') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""The calibration modes: a registry of entries behind one protocol.

A *calibration mode* is what ``calibration_mode=`` names: a judge-to-oracle calibrator (scikit-learn
style, `Calibrator`) plus what the pipeline asks of it (`CalibrationMode`): whether it reads the
covariates, how many index segments its design gets for a number of labels, whether ``auto`` may
pick it, and optionally a batched fit of many rows of per-cell sums (the cross-fit's K + 1 fits and
the bootstrap's refits in one call). Everything that lists the modes reads this registry: the
options' validation (`cje_engine.options`), the CLI's ``--calibration-mode`` choices, the result's
allowed ``calibration.mode`` values, and ``auto``'s candidates (`cje_engine.pipeline.calibration`).

Adding a calibrator (e.g. a spline index): its module with the calibrator class, one `register`
call at the bottom of this file (an entry: a subclass of `ModeEntry`), and the conformance test
(tests/unit/test_calibrator_registry.py) runs it like every other entry. Register at import time, in a
module every process imports (this one for the built-in modes): Ray workers import the registry afresh,
so a mode registered only in the driver at run time is unknown to them.

Contract of a calibrator. It ends with an isotonic stage on a one-dimensional index: ``index(score,
X)`` and the fitted, non-decreasing curve ``x_``, ``y_`` (interpolated, flat outside). The cross-fit
residual terms of the influence function (`cje_engine.direct.estimators.calibration_term`) are
computed on the level sets of that stage, so an entry that keeps the contract gets its analytic
standard errors without further code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Protocol, runtime_checkable

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.registry import Registry

if TYPE_CHECKING:  # the calibrators import scipy: loaded when a mode is fitted, not when options are checked
    from cje_engine.calibration.calibrators import Cells

#: `cje_engine.calibration.calibrators.TWO_STAGE_MAX_KNOTS` (a test pins them equal): the index size a
#: design gets when its mode has no index.
DEFAULT_KNOTS = 6

__all__ = ["AUTO", "MODES", "Calibrator", "CalibrationMode", "ModeEntry", "MonotoneMode", "TwoStageMode",
           "entries", "get", "names", "option_values", "register", "result_mode_type", "unregister"]

#: The option value that lets the pipeline choose among the eligible registered modes.
AUTO = "auto"


@runtime_checkable
class Calibrator(Protocol):
    """A judge-to-oracle calibrator (scikit-learn estimator API, fitted state in ``*_`` attributes).

    ``fit`` and ``fit_cells`` return ``self``; predictions are clipped to ``clip`` (the label
    scale). ``x_``/``y_`` are the final isotonic stage on ``index`` (module docstring).
    """

    x_: np.ndarray
    y_: np.ndarray

    def fit(self, score: np.ndarray, y: np.ndarray, X: np.ndarray | None = None,
            sample_weight: np.ndarray | None = None) -> "Calibrator":
        """Fit on rows (``X``: covariates, ignored by a mode that does not use them)."""

    def fit_cells(self, cells: Cells, w: np.ndarray, wy: np.ndarray, count: np.ndarray | None = None,
                  warm: Any = None) -> "Calibrator":
        """Fit from per-cell sums (weight, weighted label sum, rows with positive weight)."""

    def index(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """The one-dimensional index the final isotonic stage works on."""

    def predict(self, score: np.ndarray, X: np.ndarray | None = None) -> np.ndarray:
        """Calibrated values of rows."""

    def predict_cells(self, cells: Cells) -> np.ndarray:
        """Calibrated values at every cell."""


@runtime_checkable
class CalibrationMode(Protocol):
    """What the pipeline asks of a calibration mode (a registry entry).

    Attributes
    ----------
    name : str
        The ``calibration_mode`` value (and the result's ``calibration.mode``).
    label : str
        Its name in sentences (the ``auto`` selection's reason).
    uses_covariates : bool
        The calibrator reads the covariates (cells are (score, covariates); the support check looks
        for covariates outside the calibration labels' range; the option needs covariates).
    monotone : bool
        Non-decreasing in the judge score for fixed covariates (the conformance test checks it).
    preference : int
        ``auto`` keeps the eligible mode of highest preference unless another fits the labelled rows
        significantly better (`cje_engine.pipeline.calibration.choose_mode`).
    in_auto : bool
        ``auto`` considers this mode at all.
    batched : bool
        The entry fits many rows of per-cell sums at once (`fit_many`, `warm_start`).
    """

    name: str
    label: str
    uses_covariates: bool
    monotone: bool
    preference: int
    in_auto: bool
    batched: bool

    def n_knots(self, n_labels: int, n_covariates: int) -> int:
        """Index segments of the design for ``n_labels`` calibration labels (0: too few to fit)."""

    def shortfall(self, n_labels: int, n_covariates: int) -> str | None:
        """Why an explicit request cannot be fitted on these labels (None: it can)."""

    def auto_exclusion(self, n_labels: int, n_covariates: int) -> str | None:
        """Why ``auto`` leaves this mode out on these data (None: it is a candidate)."""

    def make(self, clip: tuple[float, float] | None = None, n_knots: int = DEFAULT_KNOTS) -> Calibrator:
        """A fresh, unfitted calibrator."""

    def selection_record(self, n_knots: int) -> dict:
        """Keys this mode adds to the result's ``calibration.selection`` when it was fitted."""

    def fit_many(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                 clip: tuple[float, float] | None, n_knots: int, warm: dict | None = None) -> Any:
        """Batched fits of the rows of per-cell sums (only when ``batched``)."""

    def warm_start(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                   clip: tuple[float, float] | None, n_knots: int) -> dict | None:
        """Where the batched solver of every refit starts (only when ``batched``)."""


class ModeEntry:
    """Defaults of a registry entry: no covariates, monotone, always eligible, fitted one at a time.

    Subclass it, set ``name``, ``label`` and `make`, override what differs, and `register` an instance.
    """

    name: str = ""
    label: str = ""
    uses_covariates: bool = False
    monotone: bool = True
    preference: int = 0
    in_auto: bool = True
    batched: bool = False

    def n_knots(self, n_labels: int, n_covariates: int) -> int:
        """Index segments of the design (no index: the two-stage default, unused)."""
        return DEFAULT_KNOTS

    def shortfall(self, n_labels: int, n_covariates: int) -> str | None:
        """None: the cross-fit's own checks (two distinct labels and scores per fold) suffice."""
        return None

    def auto_exclusion(self, n_labels: int, n_covariates: int) -> str | None:
        """None, or why a mode that needs covariates has nothing to add without them."""
        if self.uses_covariates and n_covariates == 0:
            return f"no covariates given, so the {self.label} index has nothing to add"
        return None

    def make(self, clip: tuple[float, float] | None = None, n_knots: int = DEFAULT_KNOTS) -> Calibrator:
        """A fresh, unfitted calibrator (subclasses define it)."""
        raise NotImplementedError

    def selection_record(self, n_knots: int) -> dict:
        """Nothing beyond the common selection keys."""
        return {}

    def fit_many(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                 clip: tuple[float, float] | None, n_knots: int, warm: dict | None = None) -> Any:
        """Not batched: the pipeline fits one calibrator per row of sums."""
        raise NotImplementedError(f"calibration mode {self.name!r} has no batched fit")

    def warm_start(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                   clip: tuple[float, float] | None, n_knots: int) -> dict | None:
        """No warm start."""
        return None

    def __repr__(self) -> str:
        return f"<calibration mode {self.name!r}>"


class MonotoneMode(ModeEntry):
    """``monotone``: isotonic regression of the label on the judge score (`IsotonicCalibrator`)."""

    name = "monotone"
    label = "monotone"

    def make(self, clip: tuple[float, float] | None = None, n_knots: int = DEFAULT_KNOTS) -> Calibrator:
        """An unfitted `IsotonicCalibrator` (``n_knots`` unused)."""
        from cje_engine.calibration.calibrators import IsotonicCalibrator

        return IsotonicCalibrator(clip=clip)


class TwoStageMode(ModeEntry):
    """``two_stage``: a monotone index of score and covariates, then isotonic (`TwoStageCalibrator`).

    Preferred by ``auto`` when covariates are declared and enough labels identify its index; its
    fits are batched (`cje_engine.calibration.two_stage_batch.fit_two_stage_many`).
    """

    name = "two_stage"
    label = "two-stage"
    uses_covariates = True
    preference = 1
    batched = True

    def n_knots(self, n_labels: int, n_covariates: int) -> int:
        """`two_stage_knots`: as many ramp segments as keep two labels per stage-1 parameter, at most six."""
        from cje_engine.calibration.calibrators import two_stage_knots

        return two_stage_knots(n_labels, n_covariates)

    def shortfall(self, n_labels: int, n_covariates: int) -> str | None:
        """The fewest labels of a one-segment index with these covariates, when fewer are given."""
        from cje_engine.calibration.calibrators import TWO_STAGE_LABELS_PER_PARAMETER

        if self.n_knots(n_labels, n_covariates) >= 1:
            return None
        return (f"calibration_mode='two_stage' needs at least "
                f"{TWO_STAGE_LABELS_PER_PARAMETER * (n_covariates + 2)} calibration labels with "
                f"{n_covariates} covariate(s) ({n_labels} given); use calibration_mode='monotone'")

    def auto_exclusion(self, n_labels: int, n_covariates: int) -> str | None:
        """No covariates, or too few labels for a one-segment index."""
        from cje_engine.calibration.calibrators import TWO_STAGE_LABELS_PER_PARAMETER

        reason = super().auto_exclusion(n_labels, n_covariates)
        if reason is None and self.n_knots(n_labels, n_covariates) < 1:
            reason = (f"only {n_labels} calibration labels: too few for a two-stage index with one score segment "
                      f"and {n_covariates} covariate(s) (at least {TWO_STAGE_LABELS_PER_PARAMETER} labels per "
                      "parameter needed), so the covariates are not used")
        return reason

    def make(self, clip: tuple[float, float] | None = None, n_knots: int = DEFAULT_KNOTS) -> Calibrator:
        """An unfitted `TwoStageCalibrator` with ``n_knots`` ramp segments."""
        from cje_engine.calibration.calibrators import TwoStageCalibrator

        return TwoStageCalibrator(n_knots=n_knots, clip=clip)

    def selection_record(self, n_knots: int) -> dict:
        """``two_stage_knots``: the ramp segments its index got."""
        return {"two_stage_knots": n_knots}

    def fit_many(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                 clip: tuple[float, float] | None, n_knots: int, warm: dict | None = None) -> Any:
        """`fit_two_stage_many` (a `TwoStageFits`: ``ok``, ``Z``, ``x``, ``y``, ``predict_cells``, ``model``)."""
        from cje_engine.calibration.two_stage_batch import fit_two_stage_many

        return fit_two_stage_many(cells, W, WY, C, clip=clip, warm=warm, n_knots=n_knots)

    def warm_start(self, cells: Cells, W: np.ndarray, WY: np.ndarray, C: np.ndarray, *,
                   clip: tuple[float, float] | None, n_knots: int) -> dict | None:
        """The active ramps of the first fit (number of ramps -> mask): the solver's start in every refit."""
        fits = self.fit_many(cells, W, WY, C, clip=clip, n_knots=n_knots)
        return {} if fits.ramp[0] is None else {fits.ramp[0].size: fits.ramp[0] > 0}


def _check_mode(entry: Any) -> None:
    name = getattr(entry, "name", "")
    if not isinstance(name, str) or not name.isidentifier() or name == AUTO:
        raise ValueError(f"a calibration mode needs a name that is an identifier other than {AUTO!r}; got {name!r}")
    missing = [a for a in ("label", "uses_covariates", "monotone", "preference", "in_auto", "batched", "n_knots",
                           "shortfall", "auto_exclusion", "make", "selection_record") if not hasattr(entry, a)]
    if missing:
        raise TypeError(f"calibration mode {name!r} lacks {', '.join(missing)} (see CalibrationMode)")


#: The family (`cje_engine.registry.Registry`); the functions below are its public face.
MODES: Registry[CalibrationMode] = Registry("calibration mode", check=_check_mode, option="calibration_mode")


def register(entry: CalibrationMode, *, replace: bool = False) -> CalibrationMode:
    """Add a calibration mode to the registry (returns it, so it can decorate an instance).

    Parameters
    ----------
    entry : CalibrationMode
        The entry; its ``name`` becomes a ``calibration_mode`` value.
    replace : bool
        Allow replacing an entry of the same name (default: a second registration is an error).
    """
    return MODES.register(entry, replace=replace)


def unregister(name: str) -> None:
    """Remove a calibration mode (tests that register a toy one clean up with it)."""
    MODES.unregister(name)


def names() -> tuple[str, ...]:
    """The registered calibration modes, in registration order."""
    return MODES.names()


def option_values() -> tuple[str, ...]:
    """Every accepted ``calibration_mode`` value: ``auto`` then the registered modes."""
    return (AUTO, *MODES.names())


def entries() -> tuple[CalibrationMode, ...]:
    """The registered entries, in registration order."""
    return MODES.entries()


def get(name: str) -> CalibrationMode:
    """The entry of ``name``; a `CJEInputError` naming the accepted values otherwise."""
    if isinstance(name, str) and name in MODES:
        return MODES.get(name)
    raise CJEInputError(f"calibration_mode must be one of {', '.join(option_values())}; got {name!r}",
                        option="calibration_mode")


def _registered(name: str) -> str:
    if name not in MODES:
        raise ValueError(f"calibration mode must be a registered one ({', '.join(MODES)}); got {name!r}")
    return name


def result_mode_type() -> Any:
    """The type of the result's ``calibration.mode`` (`cje_engine.result.model.Calibration`).

    A string checked against the registry when a result is validated (so a mode registered after
    the result model was imported validates too); its JSON Schema is the enum of the modes
    registered when the model is built (the built-in ones: the committed result.schema.json).
    """
    from pydantic import AfterValidator, WithJsonSchema  # only the result model needs pydantic

    return Annotated[str, AfterValidator(_registered), WithJsonSchema({"enum": list(names()), "type": "string"})]


# The built-in modes. A new calibrator adds one line here.
register(MonotoneMode())
register(TwoStageMode())

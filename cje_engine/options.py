"""Evaluation options: every knob that shapes the numbers, validated in one place."""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cje_engine.calibration import registry as calibration_modes
from cje_engine.data.frame import Scale, parse_scale
from cje_engine.errors import CJEInputError, did_you_mean

#: Most bootstrap replicates (percentile intervals are stable to ~0.1% of their width
#: long before this; more only costs time and memory).
MAX_N_BOOTSTRAP = 100_000
#: Largest seed (NumPy seeds are unsigned; 2**63 - 1 keeps it a JSON-safe signed integer too).
MAX_SEED = 2**63 - 1
#: Most cross-fitting folds.
MAX_FOLDS = 100
#: Default memory budget of the bootstrap replicate matrix (bytes); ``CJE_MAX_BOOTSTRAP_BYTES``
#: overrides it.
DEFAULT_BOOTSTRAP_BYTES = 2 * 1024**3

_INT_FIELDS = ("n_bootstrap", "seed", "n_folds", "min_labels", "support_min_labels", "min_prompts", "segment_min_rows",
               "segment_min_labels")
_FLOAT_FIELDS = ("alpha", "audit_margin", "support_bandwidth", "support_material_share", "noninferiority_margin")
_STR_FIELDS = ("calibration_mode", "level_estimator", "inference", "multiplicity", "pooling_bootstrap", "baseline",
               "segment_claims", "segment_recalibrate", "segment_pooling")
#: The level estimators (docs/statistics.md, "Levels").
LEVEL_ESTIMATORS = ("verified", "audited", "robust", "augmented", "plug_in")
_NAMES_FIELDS = ("covariates", "calibration_policies", "policies", "trust_transport", "segment_by")
#: The segment options (docs/segments.md): left out of ``to_dict`` (the result's ``config``) when
#: ``segment_by`` is empty, so an unsegmented evaluation's result is as before.
SEGMENT_FIELDS = ("segment_by", "segment_min_rows", "segment_min_labels", "segment_claims", "segment_recalibrate",
                  "segment_pooling")


def _type_errors(kw: dict) -> None:
    """Raise on an option of the wrong type (before any range check or allocation)."""
    for key in _INT_FIELDS:
        v = kw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise CJEInputError(f"option {key} must be an integer, got {v!r}")
    for key in _FLOAT_FIELDS:
        v = kw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                              or not math.isfinite(float(v))):
            raise CJEInputError(f"option {key} must be a finite number, got {v!r}")
    for key in _STR_FIELDS:
        v = kw.get(key)
        if v is not None and not isinstance(v, str):
            raise CJEInputError(f"option {key} must be a string, got {v!r}")
    for key in _NAMES_FIELDS:
        v = kw.get(key)
        if v is None or isinstance(v, str):
            continue
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise CJEInputError(f"option {key} must be a list of names, got {v!r}")


def options_of(cls: type, options: Any, kwargs: Mapping[str, Any]) -> Any:
    """``options`` itself when it is already a ``cls`` (never rebuilt; no keywords besides), else
    ``cls.build`` of the mapping and/or keywords (the ``of`` of every options class)."""
    if isinstance(options, cls):
        if kwargs:
            raise CJEInputError(f"give the options as an {cls.__name__} or as keywords, not both "
                                f"(got {', '.join(sorted(kwargs))} besides)")
        return options
    if options is not None and not isinstance(options, Mapping):
        raise CJEInputError(f"options must be a mapping of option -> value, got {type(options).__name__}")
    return cls.build(**{**dict(options or {}), **kwargs})


@dataclass(frozen=True)
class EvaluationOptions:
    """Options of `cje_engine.evaluate` (see the README for their meaning).

    Parameters
    ----------
    covariates : tuple of str
        Covariate columns for two-stage calibration (e.g. ``("response_length",)``).
    calibration_mode : {"auto", "monotone", "two_stage"} or another registered mode
        ``auto`` picks by out-of-fold error among the modes the data allows; the accepted values are
        ``auto`` and the names in `cje_engine.calibration.registry`.
    calibration_policies : tuple of str or None
        ``None``: every labelled row trains the calibrator (cross-fitted). Otherwise only
        these policies' labels train it and other policies' labels are their audit slices.
    level_estimator : {"verified", "audited", "robust", "augmented", "plug_in"}
        ``verified`` (the default): a policy's level is verified by its own labels (at least
        ``min_labels`` labelled prompts): the power-tuned residual correction (PPI++), valid whether
        or not the calibration transports; a policy without enough own labels has no verified level
        (``level_claim = "assumes_transport"``: its plug-in is kept in ``assumed``) unless it is in
        ``trust_transport``. ``audited`` (the paper's protocol): the calibrated plug-in wherever the transport audit
        did not fail (pass, inconclusive, or no own labels: unaudited); the own-label level
        (recalibrated) where it failed and the policy has at least ``min_labels`` own labels;
        refused otherwise. ``robust``: the own-label (augmented) level whenever the policy has
        at least ``min_labels`` labels of its own, else the plug-in (unbiased without
        transport, at the variance of its own labels). ``augmented``/``plug_in`` force one.
    inference : {"bootstrap", "analytic"}
        The route for standard errors and intervals (both are always computed; this picks
        the one reported).
    n_bootstrap, seed, alpha, audit_margin, n_folds
        Bootstrap replicates, RNG seed, 1 - confidence level, practical transport margin
        (as a fraction of the label scale's width: 0.05 on a 0-100 scale is 5 points),
        cross-fitting folds.
    multiplicity : {"bh", "holm"}
        Adjustment of pairwise comparison p-values.
    pooling_bootstrap : {"fixed", "rerun"}
        With two or more calibration sources, whether each bootstrap replicate keeps the full
        data's robust-pooling exclusions (``"fixed"``, the default) or reruns robust pooling on
        its resample (``"rerun"``: intervals that carry the selection; 1.3-2.1x the replicate
        cost in pooled designs, docs/statistics.md, "Coverage at 25% labels and in pooled designs").
    trust_transport : tuple of str or None
        Policies whose assumes-transport level (the paper's protocol: calibrated plug-in where the
        audit does not fail) a team decides to trust: it becomes their reported level and enters the
        comparisons, the ranking and the best policy, named ``assumes_transport``. ``("*",)``: every
        policy. ``None`` (default): none.
    baseline : str or None
        A policy to compare every other one with (many-to-one, simultaneous intervals,
        ``baseline_comparisons`` in the result; the question of ``cje gate``).
    noninferiority_margin : float
        Non-inferiority margin against the baseline, as a fraction of the label scale's width
        (a policy is non-inferior when its simultaneous lower bound exceeds minus the margin).
    min_prompts : int
        Fewest distinct prompts a policy needs for any level or comparison (below it its variance
        cannot be estimated: refused, not estimable even relatively).
    min_labels : int
        Fewest own labels for an own-label (augmented or recalibrated) level, and fewest
        calibration labels overall.
    support_min_labels, support_bandwidth, support_material_share
        A score is thinly supported when fewer than ``support_min_labels`` calibration
        labels lie within ``support_bandwidth`` x (score range) of it; a plug-in level
        is refused when more than ``support_material_share`` of the policy's rows are
        thinly supported or outside the labelled range.
    segment_by : tuple of str
        Columns that cut the rows into segments (e.g. ``("category",)``; several: their combinations).
        Empty (the default): no segments. Otherwise the result's ``segments`` block (docs/segments.md).
    segment_min_rows, segment_min_labels
        A segment is shown on its own when every policy has at least ``segment_min_rows`` rows in it and
        it holds at least ``segment_min_labels`` labels; smaller ones are pooled into ``other`` (itself
        reported as too few, without a level, when it is still below the minimums).
    segment_claims : {"bh", "holm"}
        Error control of the segment x policy comparison claims: Benjamini-Hochberg (false discovery
        rate, the default) or Holm (family-wise).
    segment_recalibrate : {"auto", "never"}
        ``auto``: when the omnibus calibration test over all labels fails, the segment levels use a
        calibration with the segment as a covariate (one-hot, two-stage); ``never``: the pooled one.
    segment_pooling : {"none", "eb"}
        ``eb``: each verified segment level also gets an empirical-Bayes partially pooled level across the
        policy's segments with a robust EBCI (``pooled``; coverage measured in docs/segments.md).
    """

    covariates: tuple[str, ...] = ()
    calibration_mode: str = "auto"
    calibration_policies: tuple[str, ...] | None = None
    level_estimator: str = "verified"
    inference: str = "bootstrap"
    n_bootstrap: int = 2000
    seed: int = 0
    alpha: float = 0.05
    audit_margin: float = 0.05
    n_folds: int = 5
    multiplicity: str = "bh"
    pooling_bootstrap: str = "fixed"
    label_scale: Scale = (0.0, 1.0)
    score_scale: Scale | None = (0.0, 1.0)
    min_labels: int = 10
    support_min_labels: int = 10
    support_bandwidth: float = 0.05
    support_material_share: float = 0.10
    policies: tuple[str, ...] | None = field(default=None)
    trust_transport: tuple[str, ...] | None = None
    baseline: str | None = None
    noninferiority_margin: float = 0.02
    min_prompts: int = 10
    segment_by: tuple[str, ...] = ()
    segment_min_rows: int = 50
    segment_min_labels: int = 20
    segment_claims: str = "bh"
    segment_recalibrate: str = "auto"
    segment_pooling: str = "none"

    @classmethod
    def build(cls, **kwargs) -> "EvaluationOptions":
        """Validate and normalise keyword options (lists become tuples, scales are parsed)."""
        if "estimator" in kwargs:
            raise CJEInputError("option estimator was renamed level_estimator (audited, robust, augmented or "
                                "plug_in; the former 'auto' is 'robust')", option="level_estimator")
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            raise CJEInputError(f"unknown option(s): {', '.join(unknown)}"
                                + did_you_mean(unknown[0], cls.__dataclass_fields__))
        kw = dict(kwargs)
        _type_errors(kw)
        for key in ("covariates", "calibration_policies", "policies", "trust_transport", "segment_by"):
            if kw.get(key) is not None:
                v = kw[key]
                kw[key] = (v,) if isinstance(v, str) else tuple(v)
        for key in ("covariates", "segment_by"):
            if key in kw and kw[key] is None:
                kw[key] = ()
        if "label_scale" in kw:
            kw["label_scale"] = parse_scale(kw["label_scale"], "label")
            if kw["label_scale"] is None:
                raise CJEInputError("label_scale must be bounded, e.g. '0-1' or '1-10'")
        if "score_scale" in kw:
            kw["score_scale"] = parse_scale(kw["score_scale"], "judge score")
        opts = cls(**kw)
        opts._check()
        object.__setattr__(opts, "_declared", dict(kwargs))  # the options as given (not a field)
        return opts

    @classmethod
    def of(cls, options: "EvaluationOptions | Mapping[str, Any] | None" = None, **kwargs: Any) -> "EvaluationOptions":
        """The typed options: ``options`` itself when it is already an `EvaluationOptions` (never rebuilt),
        else `build` of the mapping and/or keywords.

        Parameters
        ----------
        options : EvaluationOptions or mapping, optional
            Options parsed once at the edge (the evaluations file, the command line), or keywords.
        **kwargs
            Keyword options (not with an `EvaluationOptions`).

        Returns
        -------
        EvaluationOptions
        """
        return options_of(cls, options, kwargs)

    @property
    def declared(self) -> dict:
        """The options as they were given to `build` (a copy; what names a service run), or every field
        when the object was made otherwise."""
        given = self.__dict__.get("_declared")
        return dict(given) if given is not None else self.to_dict()

    def audit_margin_in(self, label_scale: Scale | None = None) -> float:
        """The transport audit's practical margin in label units: ``audit_margin`` x the width of
        ``label_scale`` (default: the options' own). The one place it is computed; the result's
        ``audit.margin`` of every policy holds it, and label requests read it there.

        Parameters
        ----------
        label_scale : (lo, hi), optional
            The data's label scale (default ``self.label_scale``).

        Returns
        -------
        float
        """
        lo, hi = label_scale if label_scale is not None else self.label_scale
        return self.audit_margin * (hi - lo)

    def _check(self) -> None:
        def bad(msg: str) -> None:
            raise CJEInputError(msg)

        modes = calibration_modes.option_values()
        if self.calibration_mode not in modes:
            bad(f"calibration_mode must be {', '.join(modes[:-1])} or {modes[-1]}; got {self.calibration_mode!r}"
                + did_you_mean(str(self.calibration_mode), modes))
        if (self.calibration_mode != calibration_modes.AUTO and not self.covariates
                and calibration_modes.get(self.calibration_mode).uses_covariates):
            bad(f"calibration_mode={self.calibration_mode!r} needs at least one covariate "
                "(e.g. covariates=['response_length'])")
        if self.level_estimator not in LEVEL_ESTIMATORS:
            bad(f"level_estimator must be one of {', '.join(LEVEL_ESTIMATORS)}; got {self.level_estimator!r}"
                + did_you_mean(self.level_estimator, LEVEL_ESTIMATORS))
        if self.inference not in ("bootstrap", "analytic"):
            bad(f"inference must be bootstrap or analytic; got {self.inference!r}")
        if self.multiplicity not in ("bh", "holm"):
            bad(f"multiplicity must be bh or holm; got {self.multiplicity!r}")
        if self.pooling_bootstrap not in ("fixed", "rerun"):
            bad(f"pooling_bootstrap must be fixed or rerun; got {self.pooling_bootstrap!r}")
        if not (0 < self.alpha < 0.5):
            bad(f"alpha must be in (0, 0.5); got {self.alpha}")
        if self.inference == "bootstrap" and self.n_bootstrap < 50:
            bad(f"n_bootstrap must be at least 50 for percentile intervals; got {self.n_bootstrap}")
        if self.n_bootstrap > MAX_N_BOOTSTRAP:
            bad(f"n_bootstrap must be at most {MAX_N_BOOTSTRAP}; got {self.n_bootstrap}")
        if not (0 <= self.seed <= MAX_SEED):
            bad(f"seed must be an integer from 0 to 2**63-1; got {self.seed}")
        if self.n_folds > MAX_FOLDS:
            bad(f"n_folds must be at most {MAX_FOLDS}; got {self.n_folds}")
        if self.support_min_labels < 1:
            bad(f"support_min_labels must be at least 1; got {self.support_min_labels}")
        if not (0 < self.support_bandwidth < 1):
            bad(f"support_bandwidth must be in (0, 1); got {self.support_bandwidth}")
        if not (0 <= self.support_material_share <= 1):
            bad(f"support_material_share must be in [0, 1]; got {self.support_material_share}")
        if not (0 < self.audit_margin < 1):
            bad(f"audit_margin must be in (0, 1) (a fraction of the label scale); got {self.audit_margin}")
        if self.n_folds < 2:
            bad(f"n_folds must be at least 2; got {self.n_folds}")
        if self.min_labels < 2:
            bad(f"min_labels must be at least 2; got {self.min_labels}")
        if self.min_prompts < 2:
            bad(f"min_prompts must be at least 2; got {self.min_prompts}")
        if self.segment_claims not in ("bh", "holm"):
            bad(f"segment_claims must be bh or holm; got {self.segment_claims!r}")
        if self.segment_recalibrate not in ("auto", "never"):
            bad(f"segment_recalibrate must be auto or never; got {self.segment_recalibrate!r}")
        if self.segment_pooling not in ("none", "eb"):
            bad(f"segment_pooling must be none or eb; got {self.segment_pooling!r}")
        if self.segment_min_rows < 2:
            bad(f"segment_min_rows must be at least 2; got {self.segment_min_rows}")
        if self.segment_min_labels < 0:
            bad(f"segment_min_labels must be at least 0; got {self.segment_min_labels}")
        clash = [c for c in self.segment_by if c in self.covariates]
        if clash:
            bad(f"segment_by column {clash[0]!r} is also a covariate; bucket it into a column of its own")
        if not (0 <= self.noninferiority_margin < 1):
            bad(f"noninferiority_margin must be in [0, 1) (a fraction of the label scale); got "
                f"{self.noninferiority_margin}")

    def trusts(self, policy: str) -> bool:
        """Has the team declared that it trusts the calibration's transport to ``policy``?"""
        t = self.trust_transport or ()
        return "*" in t or policy in t

    def bootstrap_bytes(self, n_stats: int) -> int:
        """Estimated bytes of the replicate matrix (``n_bootstrap x n_stats`` float64), counted
        three times: the chunks, their concatenation and one working copy in ``finalize``."""
        if self.inference != "bootstrap":
            return 0
        return 3 * 8 * int(self.n_bootstrap) * max(1, int(n_stats))

    def check_bootstrap_memory(self, n_stats: int, budget: int | None = None) -> None:
        """Raise `CJEInputError` before allocating when the replicates would not fit the budget.

        ``budget`` defaults to ``CJE_MAX_BOOTSTRAP_BYTES`` or 2 GiB.
        """
        if budget is None:
            raw = os.environ.get("CJE_MAX_BOOTSTRAP_BYTES", "")
            budget = int(raw) if raw.strip().isdigit() else DEFAULT_BOOTSTRAP_BYTES
        need = self.bootstrap_bytes(n_stats)
        if need > budget:
            raise CJEInputError(
                f"n_bootstrap={self.n_bootstrap} with {n_stats} statistics needs about {need / 1024**3:.1f} GiB "
                f"for the replicates, over the budget of {budget / 1024**3:.1f} GiB; lower n_bootstrap "
                "(or raise CJE_MAX_BOOTSTRAP_BYTES)")

    def to_dict(self) -> dict:
        """Every option, JSON-ready (tuples as lists): the result's ``config``."""
        d = asdict(self)
        if not self.segment_by:
            for k in SEGMENT_FIELDS:
                d.pop(k)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

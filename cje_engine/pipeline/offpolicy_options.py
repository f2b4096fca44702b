"""Options of a logs-only or hybrid evaluation (`evaluate_offpolicy`), validated in one place."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.offpolicy.estimators import ALL_ESTIMATORS, DEFAULT_STACK
from cje_engine.offpolicy.gates import OffPolicyGates
from cje_engine.offpolicy.target import OffPolicyConfig
from cje_engine.options import EvaluationOptions, options_of

MODES = ("logs-only", "hybrid")
ESTIMATOR_CHOICES = ("auto",) + ALL_ESTIMATORS + ("stacked",)


@dataclass(frozen=True)
class OffPolicyOptions:
    """Options of an off-policy evaluation (the engine's shared options live in ``engine``).

    Parameters
    ----------
    mode : {"logs-only", "hybrid"}
    targets : candidates (default: every ``logprob__<policy>`` column)
    logger : name of the logging policy (see `cje_engine.data.offpolicy.load_offpolicy`)
    logger_column, length_column : columns of the logger log-probabilities and token counts
    estimator : headline estimator, "auto" or one of ``ips, snips, calibrated_ips, dr, direct,
        stacked`` (falls back to calibrated IPS for a candidate without fresh draws)
    gates : `OffPolicyGates` thresholds (a dict is accepted: min_ttc, min_ess_fraction,
        min_tail_index)
    rho, projection, simcal_stack_by, ttc_mass, stack : see `OffPolicyConfig`
    downgraded : "ok" (a downgraded verdict keeps its level, with a warning) or "refused"
    engine : `EvaluationOptions` (covariates, calibration_mode, calibration_policies, inference
        ("bootstrap", the default, or "analytic": influence functions with the first-order calibration
        term, no replicates), n_bootstrap, seed, alpha, audit_margin, n_folds, multiplicity, label_scale, score_scale, min_labels,
        support_*, trust_transport; ``direct_estimator`` maps to its ``level_estimator``: ``verified``, the
        default, applies Direct's verified-claim rule to every entry, the candidates' off-policy levels then
        kept in ``assumed``; ``audited`` reports the paper's protocol levels)
    """

    mode: str = "logs-only"
    targets: tuple[str, ...] | None = None
    logger: str | None = None
    logger_column: str | None = None
    length_column: str | None = None
    estimator: str = "auto"
    gates: OffPolicyGates = field(default_factory=OffPolicyGates)
    rho: float = 1.0
    projection: str = "exact"
    simcal_stack_by: str = "mse"
    ttc_mass: float = 0.9
    stack: tuple[str, ...] = DEFAULT_STACK
    downgraded: str = "ok"
    engine: EvaluationOptions = field(default_factory=EvaluationOptions)

    @classmethod
    def build(cls, **kwargs: Any) -> "OffPolicyOptions":
        """Validate keyword options; unknown keys go to `EvaluationOptions` (which rejects them)."""
        own = {f.name for f in fields(cls)} - {"engine"}
        mine = {k: v for k, v in kwargs.items() if k in own}
        rest = {k: v for k, v in kwargs.items() if k not in own}
        if "direct_estimator" in rest:
            rest["level_estimator"] = rest.pop("direct_estimator")
        # every entry follows Direct's verified-claim rule (docs/statistics.md, "Off-policy modes"): no default here
        engine = EvaluationOptions.build(**rest)
        if mine.get("mode", "logs-only") not in MODES:
            raise CJEInputError(f"mode must be one of direct, logs-only, hybrid; got {mine.get('mode')!r} "
                                "(this entry point handles logs-only and hybrid)")
        for key in ("targets", "stack"):
            v = mine.get(key)
            if v is not None:
                mine[key] = (v,) if isinstance(v, str) else tuple(str(x) for x in v)
        g = mine.get("gates")
        if g is None:
            mine.pop("gates", None)
        elif isinstance(g, dict):
            unknown = set(g) - {f.name for f in fields(OffPolicyGates)}
            if unknown:
                raise CJEInputError(f"unknown gate(s) {', '.join(sorted(unknown))}; expected min_ttc, "
                                    "min_ess_fraction, min_tail_index")
            mine["gates"] = OffPolicyGates(**{k: float(v) for k, v in g.items()})
        elif not isinstance(g, OffPolicyGates):
            raise CJEInputError(f"gates must be a dict or OffPolicyGates, got {type(g).__name__}")
        opts = cls(engine=engine, **mine)
        opts._check()
        object.__setattr__(opts, "_declared", dict(kwargs))  # the options as given (not a field)
        return opts

    @classmethod
    def of(cls, options: "OffPolicyOptions | Mapping[str, Any] | None" = None, **kwargs: Any) -> "OffPolicyOptions":
        """``options`` itself when it is already an `OffPolicyOptions` (never rebuilt), else `build` of the
        mapping and/or keywords (as `EvaluationOptions.of`)."""
        return options_of(cls, options, kwargs)

    @property
    def declared(self) -> dict:
        """The options as they were given to `build` (a copy; what names a service run), or every
        option when the object was made otherwise."""
        given = self.__dict__.get("_declared")
        return dict(given) if given is not None else self.to_dict()

    def _check(self) -> None:
        if self.engine.segment_by and self.engine.segment_pooling != "none":
            raise CJEInputError(f"segment_pooling={self.engine.segment_pooling!r} is not supported in mode "
                                f"{self.mode!r} (no segment level of an off-policy mode is verified, and partial "
                                "pooling pools verified levels; docs/segments.md, \"Off-policy modes\")",
                                option="segment_pooling")
        if self.estimator not in ESTIMATOR_CHOICES:
            raise CJEInputError(f"estimator must be one of {', '.join(ESTIMATOR_CHOICES)}; got {self.estimator!r}")
        if self.downgraded not in ("ok", "refused"):
            raise CJEInputError(f"downgraded must be 'ok' or 'refused'; got {self.downgraded!r}")
        if not (np.isfinite(self.rho) and self.rho > 0):
            raise CJEInputError(f"rho must be a positive number; got {self.rho!r}")
        if not 0 < self.ttc_mass < 1:
            raise CJEInputError(f"ttc_mass must lie in (0, 1); got {self.ttc_mass!r}")
        if self.projection not in ("exact", "rescale"):
            raise CJEInputError(f"projection must be 'exact' or 'rescale'; got {self.projection!r}")
        if self.simcal_stack_by not in ("mse", "if_variance"):
            raise CJEInputError(f"simcal_stack_by must be 'mse' or 'if_variance'; got {self.simcal_stack_by!r}")
        unknown = [k for k in self.stack if k not in ALL_ESTIMATORS]
        if unknown:
            raise CJEInputError(f"unknown stacking candidate {unknown[0]!r}; expected some of {', '.join(ALL_ESTIMATORS)}")
        g = self.gates
        if not (0 <= g.min_ttc <= 1 and 0 <= g.min_ess_fraction <= 1 and g.min_tail_index >= 0):
            raise CJEInputError(f"gate thresholds out of range: {g}")

    # the attributes the evaluate flow's bootstrap task reads
    @property
    def inference(self) -> str:
        """Inference route of the engine options."""
        return self.engine.inference

    @property
    def n_bootstrap(self) -> int:
        """Bootstrap replicates of the engine options."""
        return self.engine.n_bootstrap

    @property
    def seed(self) -> int:
        """Seed of the engine options."""
        return self.engine.seed

    @property
    def covariates(self) -> tuple[str, ...]:
        """The engine's covariates (columns the flow reads)."""
        return self.engine.covariates

    def config(self) -> OffPolicyConfig:
        """The `OffPolicyConfig` of the off-policy estimators (folds and level from the engine options)."""
        return OffPolicyConfig(rho=self.rho, n_folds=self.engine.n_folds, projection=self.projection,
                               simcal_stack_by=self.simcal_stack_by, ttc_mass=self.ttc_mass, stack=self.stack,
                               level=1 - self.engine.alpha, gates=self.gates)

    def offpolicy_dict(self) -> dict:
        """The off-policy options alone as a plain dict (gates as a dict, sequences as lists)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        d["gates"] = asdict(self.gates)
        for k in ("targets", "stack"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    def to_dict(self) -> dict:
        """Engine and off-policy options in one plain dict."""
        return {**self.engine.to_dict(), **self.offpolicy_dict()}

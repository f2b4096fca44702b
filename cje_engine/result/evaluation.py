"""`EvaluationResult`: the typed result plus the replicates and influence terms behind it."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from cje_engine.result.jsonable import jsonable
from cje_engine.result.model import EvaluationModel
from cje_engine.result.validate import validate_result


class EvaluationResult:
    """Result of `cje_engine.evaluate` and `evaluate_offpolicy` (every mode, one schema).

    Attributes
    ----------
    model : EvaluationModel
        The validated, typed result (``to_dict()`` is its JSON form).
    replicates : ndarray, shape (B, S)
        Bootstrap replicates of the statistics (empty for the analytic route): differences,
        joint intervals and p-value adjustments follow.
    influence : ndarray, shape (n_prompts, S)
        Per-prompt influence contributions of the same statistics.
    columns : ndarray, shape (K,)
        Which statistic is each policy's reported estimate (in ``policies`` order).
    """

    def __init__(self, data: dict | EvaluationModel, replicates: np.ndarray | None = None,
                 influence: np.ndarray | None = None, columns: np.ndarray | None = None) -> None:
        self.model = data if isinstance(data, EvaluationModel) else validate_result(jsonable(data))
        self.replicates = np.empty((0, 0)) if replicates is None else replicates
        self.influence = np.empty((0, 0)) if influence is None else influence
        self.columns = np.arange(len(self.model.policies)) if columns is None else columns

    @classmethod
    def from_dict(cls, d: dict) -> "EvaluationResult":
        """The result of a ``to_dict()`` (or a stored result.json); no replicates or influence terms."""
        return cls(d)

    def to_dict(self) -> dict:
        """The result as plain JSON data (schema: cje_engine/result/result.schema.json)."""
        return self.model.model_dump(mode="json", exclude_unset=True, by_alias=True)

    def to_json(self, **kwargs: Any) -> str:
        """The result as JSON text (NaN refused); ``kwargs`` go to `json.dumps`."""
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    @property
    def policies(self) -> dict:
        """The ``policies`` block of `to_dict`: one entry per policy."""
        return self.to_dict()["policies"]

    def to_policy_table(self) -> pa.Table:
        """One row per policy with the headline numbers (refused levels keep their flag)."""
        rows = []
        for name, p in self.model.policies.items():
            rows.append({
                "policy": name, "estimate": p.estimate, "se": p.se,
                "ci_lo": p.ci[0] if p.ci else None, "ci_hi": p.ci[1] if p.ci else None,
                "level_claim": p.level_claim, "basis": p.basis_code,
                "audit_verdict": p.audit.verdict, "raw_judge_mean": p.raw_judge_mean,
                "oracle_mean": p.oracle_mean, "n_rows": p.n_rows, "n_labelled": p.n_labelled,
                "refusal_reasons": "; ".join(p.refusal_reasons),
            })
        return pa.Table.from_pylist(rows)

    def __repr__(self) -> str:
        def fmt(x: float | None) -> str:
            return "nan" if x is None else f"{x:.3f}"

        parts = [f"{n}: {fmt(p.estimate)} [{fmt(p.ci[0] if p.ci else None)}, {fmt(p.ci[1] if p.ci else None)}] "
                 f"{p.level_claim}" for n, p in self.model.policies.items()]
        return "EvaluationResult(" + "; ".join(parts) + ")"

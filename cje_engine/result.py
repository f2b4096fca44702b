"""The evaluation result: a JSON-ready dict plus the replicates and influence terms behind it."""
from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa


def _clean(x: Any) -> Any:
    """Plain JSON data: numpy scalars to Python, NaN/inf to None, tuples to lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_clean(v) for v in x.tolist()]
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    return x


class EvaluationResult:
    """Result of `cje_engine.evaluate`.

    Attributes
    ----------
    replicates : ndarray, shape (B, 2K)
        Bootstrap replicates of ``[plug_in..., augmented...]`` per policy (empty for the
        analytic route): differences, joint intervals and p-value adjustments follow.
    influence : ndarray, shape (n_prompts, 2K)
        Per-prompt influence contributions of the same statistics.
    columns : ndarray, shape (K,)
        Which column is each policy's reported estimate.
    """

    def __init__(self, data: dict, replicates: np.ndarray, influence: np.ndarray, columns: np.ndarray) -> None:
        self._data = _clean(data)
        self.replicates = replicates
        self.influence = influence
        self.columns = columns

    def to_dict(self) -> dict:
        """The result as plain JSON data (schema: docs/result-schema.md)."""
        return copy.deepcopy(self._data)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self._data, allow_nan=False, **kwargs)

    @property
    def policies(self) -> dict:
        return self._data["policies"]

    def to_policy_table(self) -> pa.Table:
        """One row per policy with the headline numbers (refused levels keep their flag)."""
        rows = []
        for name, p in self._data["policies"].items():
            rows.append({
                "policy": name, "estimate": p["estimate"], "se": p["se"],
                "ci_lo": p["ci"][0] if p["ci"] else None, "ci_hi": p["ci"][1] if p["ci"] else None,
                "level_claim": p["level_claim"], "basis": p["basis_code"],
                "audit_verdict": p["audit"]["verdict"], "raw_judge_mean": p["raw_judge_mean"],
                "oracle_mean": p["oracle_mean"], "n_rows": p["n_rows"], "n_labelled": p["n_labelled"],
                "refusal_reasons": "; ".join(p["refusal_reasons"]),
            })
        return pa.Table.from_pylist(rows)

    def __repr__(self) -> str:
        parts = [f"{n}: {p['estimate']:.3f} [{p['ci'][0]:.3f}, {p['ci'][1]:.3f}] {p['level_claim']}"
                 for n, p in self._data["policies"].items()]
        return "EvaluationResult(" + "; ".join(parts) + ")"

"""`EvaluationResult`: the typed result plus the replicates and influence terms behind it."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from cje_engine.errors import CJEInputError
from cje_engine.inference.gram import NOT_KEPT, GramTerms, TermsNotKept
from cje_engine.result import accessors
from cje_engine.result.jsonable import jsonable
from cje_engine.result.model import Comparison, EvaluationModel
from cje_engine.result.validate import validate_result

#: The terms file `EvaluationResult.save_terms` writes beside result.json (`cje evaluate --out`).
TERMS_FILE = "terms.npz"


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
    dfs : ndarray, shape (S,)
        Degrees of freedom of each statistic (inf: normal reference).

    The accessors `confint`, `compare`, `p_adjust` and `summary` read the typed model and the
    reported levels' replicates and influence terms (`terms`); `save_terms` / `load` keep those
    beside a result.json.
    """

    def __init__(self, data: dict | EvaluationModel, replicates: np.ndarray | None = None,
                 influence: np.ndarray | None = None, columns: np.ndarray | None = None,
                 dfs: np.ndarray | None = None) -> None:
        self.model = data if isinstance(data, EvaluationModel) else validate_result(jsonable(data))
        self.replicates = np.empty((0, 0)) if replicates is None else replicates
        self.influence = np.empty((0, 0)) if influence is None else influence
        self.columns = np.arange(len(self.model.policies)) if columns is None else columns
        self.dfs = dfs

    @classmethod
    def from_dict(cls, d: dict) -> "EvaluationResult":
        """The result of a ``to_dict()`` (or a stored result.json); no replicates or influence terms."""
        return cls(d)

    def to_dict(self) -> dict:
        """The result as plain JSON data (schema: cje_engine/result/result.schema.json)."""
        return self.model.model_dump(mode="json", exclude_unset=True, by_alias=True)

    def to_json(self, **kwargs: Any) -> str:
        """The result as a JSON string (`to_dict`; NaN refused)."""
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    @property
    def segments(self) -> Any:
        """The typed segments block (`cje_engine.result.segments.SegmentsResult`), or None without ``segment_by``."""
        return self.model.segments

    @property
    def policies(self) -> dict:
        """The policies block as plain JSON data (``to_dict()["policies"]``)."""
        return self.to_dict()["policies"]

    # ------------------------------------------------------------------ terms and accessors

    @property
    def terms(self) -> accessors.Terms:
        """The reported levels' replicates (None: analytic route) and influence terms (None: not kept), one
        column per policy, and their degrees of freedom."""
        cols = np.asarray(self.columns, dtype=int)
        reps = self.replicates if self.replicates.size and self.model.inference.method == "bootstrap" else None
        infl = self.influence if self.influence.size else None
        dfs = np.full(cols.size, np.inf) if self.dfs is None else np.asarray(self.dfs, float)[cols]
        return accessors.Terms(None if reps is None else reps[:, cols], None if infl is None else infl[:, cols], dfs)

    def confint(self, policies: Sequence[str] | str | None = None, level: float = 0.95,
                joint: bool = False) -> Any:
        """Confidence intervals of the policies' levels, from the replicates / influence terms.

        Parameters
        ----------
        policies : str or list of str, optional
            Policies to include (default: all, in result order).
        level : float
            Coverage, e.g. 0.95.
        joint : bool
            Simultaneous intervals over the chosen policies (single-step max-T: the ``level`` quantile of
            ``max_k |theta*_k - theta_k| / se_k`` over the bootstrap replicates, or of ``max_k |Z_k|`` under
            the influence terms' correlation on the analytic route).

        Returns
        -------
        pandas.DataFrame
            Indexed by policy: ``estimate``, ``ci_low``, ``ci_high``, ``level``, ``level_claim``,
            ``verified`` and ``method``. Marginal intervals use the reported level's method (percentile or
            normal for plug-in levels, the own-label method such as bca_expanded or skew_t otherwise; a
            selective interval exists only at the result's own level), so at that level they equal the
            result's ``ci``. Claims are respected: a refused level, or an assumes-transport level without an
            estimate, has no interval (NaN, ``method`` "none: no quotable level") and is left out of the
            joint family; an assumes-transport level the team trusts (``trust_transport``) gets an interval
            but ``verified`` False. Intervals are clipped to the label scale.
        """
        return accessors.confint(self.model, self.terms, policies, level, joint)

    def compare(self, a: str, b: str, level: float = 0.95) -> Comparison:
        """The difference ``a - b`` with its interval and p-value, from the paired replicates / influence terms.

        Computed by the result's own comparison step (`cje_engine.inference.comparisons.compare_pairs`): at the
        result's level, ``diff``, ``se``, ``ci`` and ``p_value`` equal those of the result's comparison of the
        pair. ``p_adjusted`` is that of a family of one (= ``p_value``); see `p_adjust` for the family. A pair
        with a policy that is not estimable even relatively (e.g. an unverified level) comes back with
        ``reported`` False and the reason, and no numbers.
        """
        return accessors.compare(self.model, self.terms, a, b, level)

    def p_adjust(self, method: str = "holm", level: float | None = None) -> Any:
        """The reported comparisons' p-values adjusted over their family.

        Parameters
        ----------
        method : {"holm", "bonferroni", "max-t"}
            ``max-t``: single-step max-T over the pairwise differences (bootstrap replicates, or normal draws
            with the influence terms' correlation), never below the pair's own p-value.
        level : float, optional
            ``significant`` is ``p_adjusted <= 1 - level`` (default: the result's own level).

        Returns
        -------
        pandas.DataFrame
            One row per reported comparison: ``a``, ``b``, ``diff``, ``se``, ``p_value``, ``p_adjusted``,
            ``significant``.
        """
        return accessors.p_adjust(self.model, self.terms, method, level)

    def summary(self) -> Any:
        """One row per policy with its reported figures (a pandas DataFrame indexed by policy).

        Columns: ``estimate``, ``se``, ``ci_low``, ``ci_high``, ``level``, ``level_claim``, ``verified``,
        ``basis_code``, ``ci_method``, ``audit``, ``relative_claim``, ``n_rows``, ``n_labelled``. A policy
        without a quotable level (refused, or assumes transport) has no interval; a refused level keeps its
        ranking-only estimate, flagged by ``level_claim``.
        """
        return accessors.summary(self.model)

    def _digest(self) -> str:
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    def save_terms(self, path: str | os.PathLike) -> Path:
        """Write the reported levels' replicates and influence terms to ``path`` (``.npz``, atomically).

        The file records the policies and the sha256 of the result's JSON, so `load` refuses terms of
        another result.
        """
        if isinstance(self.influence, GramTerms):
            raise TermsNotKept(NOT_KEPT + ": save_terms writes per-prompt terms")
        t = self.terms
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, replicates=np.empty((0, 0)) if t.replicates is None else t.replicates,
                     influence=np.empty((0, 0)) if t.influence is None else t.influence, dfs=t.dfs,
                     policies=np.array(list(self.model.policies), dtype=str), result_sha256=np.array(self._digest()))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, terms: str | os.PathLike | None = None) -> "EvaluationResult":
        """A result.json with its terms (``terms``, default: the `TERMS_FILE` beside it when present).

        Raises
        ------
        CJEInputError
            The result is not valid, or the terms file is unreadable or belongs to another result (policies
            or sha256 of the result differ).
        """
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CJEInputError(f"cannot read the result: {exc}", source=str(path)) from None
        res = cls(d)
        tpath = Path(terms) if terms is not None else path.with_name(TERMS_FILE)
        if terms is None and not tpath.exists():
            return res
        try:
            with np.load(tpath, allow_pickle=False) as z:
                arrays = {k: z[k] for k in ("replicates", "influence", "dfs", "policies", "result_sha256")}
        except (OSError, ValueError, KeyError) as exc:
            raise CJEInputError(f"not a terms file of EvaluationResult.save_terms: {exc}", source=str(tpath)) from None
        if list(arrays["policies"]) != list(res.model.policies) or str(arrays["result_sha256"]) != res._digest():
            raise CJEInputError(f"the terms belong to another result (policies or sha256 differ from {path.name})",
                                source=str(tpath))
        res.replicates, res.influence = arrays["replicates"], arrays["influence"]
        res.columns, res.dfs = np.arange(len(res.model.policies)), arrays["dfs"]
        return res

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

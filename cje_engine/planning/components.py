"""Variance components of a pilot result: per policy and per paired difference (docs/planner.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.planning.model import VarianceComponents, check_positive

_AUGMENTED = ("augmented", "recalibrated")


@dataclass
class Pilot:
    """A pilot result with the covariances the planner reads from it."""
    result: dict
    cov_total: np.ndarray | None = None
    cov_cal: np.ndarray | None = None
    cov_eval: np.ndarray | None = None
    columns: np.ndarray | None = None

    @property
    def names(self) -> list[str]:
        """The pilot's policies."""
        return list(self.result["policies"])


def pilot_of(source: Any) -> Pilot:
    """A `Pilot` from a result (object, dict or JSON path) or a pilot itself."""
    if isinstance(source, Pilot):
        return source
    from cje_engine.result import EvaluationResult

    if isinstance(source, EvaluationResult):
        from cje_engine.inference.variance import cluster_cov

        cov = cluster_cov(np.asarray(source.influence, dtype=float)) if source.influence is not None else None
        return Pilot(source.to_dict(), cov_total=cov, columns=np.asarray(source.columns))
    if not isinstance(source, Mapping):
        raise CJEInputError(f"expected an evaluation result (dict from evaluate(...).to_dict() or the "
                            f"EvaluationResult), got {type(source).__name__}")
    if not isinstance(source.get("policies"), Mapping) or not source["policies"]:
        raise CJEInputError("the result has no 'policies' section: expected the dict of evaluate(...).to_dict()",
                            column="policies")
    return Pilot(dict(source))


def _entry(pilot: Pilot, name: str) -> dict:
    pols = pilot.result["policies"]
    if name not in pols:
        raise CJEInputError(f"unknown policy {name!r}; the result has: {', '.join(map(repr, pols))}",
                            column="policy")
    return pols[name]


def _raw(pilot: Pilot, name: str) -> tuple[float, float, float, float, bool]:
    """(sigma2_eval, sigma2_cal, n_prompts, m_labels, augmented) of one policy."""
    e = _entry(pilot, name)
    vc = e.get("variance_components")
    if not isinstance(vc, Mapping):
        raise CJEInputError(f"policy {name!r} has no variance_components (results written before the planner "
                            f"existed lack them): re-run evaluate on the pilot data", column="variance_components")
    for key in ("sigma2_eval", "sigma2_cal", "n_prompts", "m_labels"):
        if vc.get(key) is None:
            raise CJEInputError(f"policy {name!r}: variance_components lack {key!r}", column="variance_components")
    A = check_positive(vc["sigma2_eval"], f"policy {name!r} sigma2_eval", allow_zero=True)
    B = check_positive(vc["sigma2_cal"], f"policy {name!r} sigma2_cal", allow_zero=True)
    n = check_positive(vc["n_prompts"], f"policy {name!r} n_prompts")
    m = float(vc["m_labels"]) if isinstance(vc["m_labels"], (int, float)) else float("nan")
    if not (m >= 1 and math.isfinite(m)):
        raise CJEInputError(f"policy {name!r}: the estimate rests on {vc['m_labels']!r} labels, so its calibration "
                            f"variance cannot be estimated (at least 1 label needed)", column="variance_components")
    return A, B, n, m, e.get("basis_code") in _AUGMENTED


def _scope_multipliers(pilot: Pilot) -> tuple[int, int]:
    """Cost multipliers when the whole pilot design (every policy) is scaled together."""
    n_aug = sum(1 for p in pilot.names if _entry(pilot, p).get("basis_code") in _AUGMENTED)
    return len(pilot.names), max(1, n_aug)


def policy_components(result: Any, policy: str, *, scope: str = "target") -> VarianceComponents:
    """Variance components of one policy's reported estimate (its ``variance_components``).

    ``scope="target"``: costs count this policy only; ``"all"``: every policy of the pilot is
    run on the n prompts (K responses per prompt) with a label set per augmented policy.
    """
    pilot = pilot_of(result)
    A, B, n, m, aug = _raw(pilot, policy)
    r, l = _multipliers(pilot, scope, (1, 1))
    return VarianceComponents(A, B, target=policy, n_pilot=n, m_pilot=m, responses_per_prompt=r, labels_per_unit=l,
                              method=("own-label residual variance (augmented estimate)" if aug else
                                      "calibration influence variance (plug-in estimate)") + " from the pilot result")


def _multipliers(pilot: Pilot, scope: str, own: tuple[int, int]) -> tuple[int, int]:
    if scope == "target":
        return own
    if scope == "all":
        return _scope_multipliers(pilot)
    raise CJEInputError(f"scope must be 'target' or 'all', got {scope!r}")


def _pair_total_variance(pilot: Pilot, a: str, b: str) -> float | None:
    names = pilot.names
    if pilot.cov_total is not None and pilot.columns is not None:
        ca, cb = (int(pilot.columns[names.index(x)]) for x in (a, b))
        c = pilot.cov_total
        return float(max(c[ca, ca] + c[cb, cb] - 2 * c[ca, cb], 0.0))
    for comp in pilot.result.get("comparisons") or []:
        if {comp.get("a"), comp.get("b")} == {a, b}:
            se = comp.get("se_analytic")
            if se is None and (pilot.result.get("inference") or {}).get("method") == "analytic":
                se = comp.get("se")
            if isinstance(se, (int, float)) and math.isfinite(se) and se >= 0:
                return float(se) ** 2
    return None


def difference_components(result: Any, a: str, b: str, *, scope: str = "target") -> VarianceComponents:
    """Variance components of the paired difference ``a - b`` (n prompts shared by both policies).

    Calibration part, in per-label units:

    * at least one augmented estimate: the label-residual terms of the two policies sit on
      different rows, so ``sigma2_cal = B_a + B_b`` with m labels per policy;
      ``m_pilot = (B_a + B_b) / (B_a/m_a + B_b/m_b)`` is the per-policy label count that
      reproduces the pilot's calibration variance;
    * both plug-in on one shared calibrator: ``sigma2_cal = m Var_cal(a - b)`` with the exact
      calibration covariance when available (`plan_from_data`), else ``Var_cal(a - b)`` is
      approximated by the mean of the two calibration shares times the paired variance.

    Evaluation part, ``sigma2_eval = n Var_eval(a - b)`` (paired, so shared-prompt effects cancel):

    * exact from the per-prompt evaluation influence terms (`plan_from_data`);
    * otherwise ``n (V_diff - Var_cal)``, floored at 0, with ``V_diff`` the pilot's paired
      variance from the influence terms (EvaluationResult) or the comparison's analytic SE (dict):
      the covariance between the two calibration terms (labels on the same prompts) lands here;
    * no paired information at all: the policies are treated as independent.
    """
    pilot = pilot_of(result)
    if a == b:
        raise CJEInputError(f"a difference needs two different policies, got {a!r} twice", column="policy")
    Aa, Ba, n_a, m_a, aug_a = _raw(pilot, a)
    Ab, Bb, n_b, m_b, aug_b = _raw(pilot, b)
    n = min(n_a, n_b)
    va_cal, vb_cal = Ba / m_a, Bb / m_b
    names = pilot.names
    cols = None if pilot.columns is None else [int(pilot.columns[names.index(x)]) for x in (a, b)]

    def diff_var(cov: np.ndarray) -> float:
        ca, cb = cols
        return float(max(cov[ca, ca] + cov[cb, cb] - 2 * cov[ca, cb], 0.0))

    if aug_a or aug_b:
        B = Ba + Bb
        v_cal = va_cal + vb_cal
        m = B / v_cal if v_cal > 0 else (m_a + m_b) / 2
        own = (2, 2 if (aug_a and aug_b) else 1)
        cal_how = "calibration part = the two policies' label-residual terms (m labels each)"
    else:
        m = m_a
        own = (2, 1)
        if pilot.cov_cal is not None and cols is not None:
            v_cal = diff_var(pilot.cov_cal)
            cal_how = "exact calibration covariance of the shared calibrator"
        else:
            v_tot = _pair_total_variance(pilot, a, b)
            v_tot = v_tot if v_tot is not None else Aa / n_a + va_cal + Ab / n_b + vb_cal
            sa = va_cal / (Aa / n_a + va_cal) if (Aa / n_a + va_cal) > 0 else 0.0
            sb = vb_cal / (Ab / n_b + vb_cal) if (Ab / n_b + vb_cal) > 0 else 0.0
            v_cal = 0.5 * (sa + sb) * v_tot
            cal_how = "calibration part approximated by the mean calibration share (shared calibrator)"
        B = v_cal * m
    if pilot.cov_eval is not None and cols is not None:
        A = diff_var(pilot.cov_eval) * n
        eval_how = "exact paired evaluation variance"
    else:
        v_tot = _pair_total_variance(pilot, a, b)
        if v_tot is None:
            A = Aa * n / n_a + Ab * n / n_b
            eval_how = "no paired variance in the result: policies treated as independent"
        else:
            A = max(v_tot - v_cal, 0.0) * n
            eval_how = "paired evaluation variance = paired total minus calibration part"
            if v_tot <= v_cal:
                eval_how += (" (not identifiable here: the calibration terms exceed the paired total, so it is "
                             "taken as 0; planning from the pilot data instead of its result gives it exactly)")
    r, l = _multipliers(pilot, scope, own)
    return VarianceComponents(A, B, target=f"{a} - {b}", n_pilot=n, m_pilot=m, responses_per_prompt=r,
                              labels_per_unit=l, method=f"{eval_how}; {cal_how}")


def _split_difference(text: str, names: list[str]) -> tuple[str, str] | None:
    """``"a - b"``, ``"a-b"`` or ``"a -b"`` -> (a, b) when exactly one split at a ``-`` gives two
    known names (names may contain ``-`` themselves); None when no split does."""
    found = set()
    for i, ch in enumerate(text):
        if ch == "-":
            a, b = text[:i].strip(), text[i + 1:].strip()
            if a in names and b in names:
                found.add((a, b))
    if len(found) > 1:
        raise CJEInputError(f"target {text!r} is ambiguous: it reads as "
                            f"{' or '.join(repr(f'{a} - {b}') for a, b in sorted(found))}", column="policy")
    return found.pop() if found else None


def parse_target(result: Any, target: Any) -> tuple[str, ...]:
    """``"base"`` -> ("base",); ``"a - b"`` (spaces optional) or ``("a", "b")`` -> ("a", "b"); names are checked."""
    pilot = pilot_of(result)
    names = pilot.names
    if isinstance(target, str):
        text = target.strip()
        if text in names:
            return (text,)
        pair = _split_difference(text, names)
        if pair is not None:
            return pair
        if "-" in text:
            parts = tuple(p.strip() for p in text.split("-", 1))
            unknown = [p for p in parts if p not in names]
            raise CJEInputError(f"target {text!r}: unknown policy {unknown[0]!r} (the result has: "
                                f"{', '.join(map(repr, names))})", column="policy")
        parts = (text,)
    elif isinstance(target, (list, tuple)) and len(target) in (1, 2) and all(isinstance(t, str) for t in target):
        parts = tuple(target)
    else:
        raise CJEInputError(f"target must be a policy name, 'a - b' or a pair of names, got {target!r}")
    for p in parts:
        _entry(pilot, p)
    return parts


def components_from_result(result: Any, target: Any = None, *, scope: str = "target") -> VarianceComponents:
    """Components for a policy (``"base"``) or a paired difference (``"a - b"``, ``("a", "b")``);
    ``target=None`` only for a one-policy result."""
    pilot = pilot_of(result)
    if target is None:
        if len(pilot.names) > 1:
            raise CJEInputError(f"the result has {len(pilot.names)} policies: name a target policy or 'a - b'",
                                column="policy")
        target = pilot.names[0]
    parts = parse_target(pilot, target)
    if len(parts) == 1:
        return policy_components(pilot, parts[0], scope=scope)
    return difference_components(pilot, parts[0], parts[1], scope=scope)

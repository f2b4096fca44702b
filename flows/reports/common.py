"""Shared pieces of the report renderers: palette, number formatting, result accessors, validation.

Pure functions over the result dict of ``docs/result-schema.md``; no I/O.
"""
from __future__ import annotations

import html
import math
from statistics import NormalDist
from typing import Any

from cje_engine.errors import CJEInputError
from cje_engine.result import validate_result
from cje_engine.result.model import Comparison, EvaluationModel, PolicyResult, RankEntry, WinMatrix
from cje_engine.result.validate import typed_view

# Okabe-Ito palette (colour-blind safe) plus neutral greys.
BLUE = "#0072B2"
SKY = "#56B4E9"
ORANGE = "#E69F00"
GREEN = "#009E73"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"
INK = "#1f2328"
MUTED = "#59636e"
GREY = "#9aa1a9"
GRID = "#e4e7eb"
FONT = ('system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", "Noto Sans", '
        '"Liberation Sans", "DejaVu Sans", Arial, sans-serif')

VERDICT_STYLE = {  # verdict -> (symbol, label, colour)
    "pass": ("\u2713", "pass", GREEN),
    "fail": ("\u2717", "fail", VERMILLION),
    "inconclusive": ("?", "inconclusive", "#B07800"),
    "not_run": ("\u2013", "not run", "#6b7280"),
}
LEVEL_CLAIMS = ("ok", "assumes_transport", "refused")
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def esc(value: Any) -> str:
    """HTML/XML-escape any value (quotes included)."""
    return html.escape(str(value), quote=True)


def as_number(value: Any) -> float | None:
    """A finite float, or None for null, NaN, infinities, booleans and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def fmt(value: Any, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals (``n/a`` when not a finite number)."""
    v = as_number(value)
    if v is None:
        return "n/a"
    text = f"{v:.{digits}f}"
    return "0." + "0" * digits if text == "-0." + "0" * digits else text


def signed(value: Any, digits: int = 3) -> str:
    """``value`` with an explicit sign (``n/a`` when not a finite number)."""
    v = as_number(value)
    if v is None:
        return "n/a"
    text = fmt(v, digits)
    return text if text.startswith("-") or text == fmt(0.0, digits) else "+" + text


def as_pair(ci: Any) -> tuple[float, float] | None:
    """``(lo, hi)`` of an interval given as a two-element list, else None."""
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        return None
    lo, hi = as_number(ci[0]), as_number(ci[1])
    return None if lo is None or hi is None else (lo, hi)


def fmt_ci(ci: Any, digits: int = 3) -> str:
    """An interval as ``[lo, hi]`` (``n/a`` when it is not one)."""
    pair = as_pair(ci)
    return "n/a" if pair is None else f"[{fmt(pair[0], digits)}, {fmt(pair[1], digits)}]"


def fmt_p(p: Any) -> str:
    """A p-value for people (``<0.001`` below it, ``n/a`` when missing)."""
    v = as_number(p)
    if v is None:
        return "n/a"
    if v < 0.001:
        return "<0.001"
    return f"{v:.3f}"


def pct(value: Any) -> str:
    """A share as a whole percentage (``n/a`` when missing)."""
    v = as_number(value)
    return "n/a" if v is None else f"{100 * v:.0f}%"


def name_cell(name: Any) -> str:
    """Escaped name with line-break opportunities after underscores (for table cells)."""
    return esc(name).replace("_", "_<wbr>")


def short_label(name: str, limit: int = 28) -> str:
    """Shorten a long label for a chart (the full name goes into a tooltip)."""
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


def result_model(result: Any) -> EvaluationModel:
    """The typed result the renderers read: a result dict (hand-made partial ones too: missing fields None,
    `cje_engine.result.validate.typed_view`), an `EvaluationResult` or an `EvaluationModel`.

    Raises
    ------
    CJEInputError
        When the result cannot be rendered honestly (the engine's rules).
    """
    return typed_view(result, partial=True)


def alpha_of(result: Any) -> float:
    """The result's alpha (inference, else config; 0.05 when neither holds a valid one); ``result`` is a
    typed model or anything `typed_view` reads."""
    m = result if isinstance(result, EvaluationModel) else loose_model(result)
    for a in (getattr(m.inference, "alpha", None), (m.config or {}).get("alpha") if isinstance(m.config, dict) else None):
        a = as_number(a)
        if a is not None and 0 < a < 1:
            return a
    return 0.05


def loose_model(result: Any) -> EvaluationModel:
    """A result typed as far as it goes, without the rendering checks (for helpers that read a field or two)."""
    return typed_view(result, partial=True, rules=False)


def conf_label(alpha: float) -> str:
    """The confidence level of ``alpha`` as text, e.g. ``95%``."""
    return f"{100 * (1 - alpha):g}%"


def z_of(alpha: float) -> float:
    """The two-sided normal quantile of ``alpha``."""
    return NormalDist().inv_cdf(1 - alpha / 2)


def is_refused(pol: dict | PolicyResult) -> bool:
    """Is the policy's level refused (typed entry or dict)?"""
    if isinstance(pol, PolicyResult):
        return pol.level_claim == "refused"
    return pol.get("level_claim") == "refused"


def audit_of(pol: dict) -> dict:
    """The policy dict's audit block (empty when missing)."""
    audit = pol.get("audit")
    return audit if isinstance(audit, dict) else {}


def verdict_of(pol: dict | PolicyResult) -> str:
    """The policy's audit verdict (``not_run`` when missing or unknown)."""
    verdict = getattr(pol.audit, "verdict", None) if isinstance(pol, PolicyResult) else audit_of(pol).get("verdict")
    return verdict if verdict in VERDICT_STYLE else "not_run"


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def check_result(result: Any) -> None:
    """Raise CJEInputError when the result dict cannot be rendered honestly (the engine's rules,
    `cje_engine.result.validate_result`; partial hand-made results render too)."""
    validate_result(result, partial=True)


def policy_order(result: Any) -> list[str]:
    """Policies by estimate, highest first (policies without a finite estimate last, in the order of
    the ranking, then of the dict). Never by rank group: rank = 1 + the number of policies
    significantly better, so an imprecise low estimate can hold rank 1 (see `rank_text`)."""
    m = result if isinstance(result, EvaluationModel) else loose_model(result)
    policies = m.policies if isinstance(m.policies, dict) else {}
    order: list[str] = []
    for entry in m.ranking or []:
        name = entry.policy if isinstance(entry, RankEntry) else None
        if name in policies and name not in order:
            order.append(name)
    order.extend(name for name in policies if name not in order)

    def key(name: str) -> float:
        p = policies[name]
        est = as_number(p.estimate) if isinstance(p, PolicyResult) else None
        return -est if est is not None else math.inf

    return sorted(order, key=key)  # stable: ties keep the ranking's order


def rank_text(result: Any, name: str) -> str:
    """The rank of ``name`` as the comparisons support it: ``"1"`` when fixed, ``"1-3"`` when the
    policies it is not significantly different from leave it anywhere from 1 to 3 (best possible rank =
    1 + policies significantly better, worst = K - policies significantly worse, `win_matrix`);
    ``"-"`` for a policy left out of the ranking (not estimable)."""
    m = result if isinstance(result, EvaluationModel) else loose_model(result)
    wm = m.win_matrix if isinstance(m.win_matrix, WinMatrix) else None
    names, sig = list((wm.policies if wm else None) or []), (wm.significant if wm else None) or []
    if name not in names or len(sig) != len(names):
        entry = next((e for e in m.ranking or [] if isinstance(e, RankEntry) and e.policy == name), None)
        return str(entry.rank) if entry and entry.rank is not None else "-"
    i, k = names.index(name), len(names)
    better = sum(1 for j in range(k) if j != i and (sig[j][i] == 1 or sig[i][j] == -1))
    worse = sum(1 for j in range(k) if j != i and (sig[i][j] == 1 or sig[j][i] == -1))
    best, worst = 1 + better, k - worse
    return str(best) if best == worst else f"{best}-{worst}"


def check_drift(drift: Any) -> dict:
    """Validate the drift dict (see :func:`render_report`) and fill in defaults."""
    if not isinstance(drift, dict):
        raise CJEInputError(f"expected a dict, got {type(drift).__name__}", source="drift")
    periods = drift.get("periods")
    if not isinstance(periods, list) or not periods:
        raise CJEInputError("expected a non-empty list of period labels", source="drift",
                            column="periods")
    n = len(periods)

    def series(key: str, required: bool) -> list[float | None] | None:
        values = drift.get(key)
        if values is None and not required:
            return None
        if not isinstance(values, list) or len(values) != n:
            raise CJEInputError(f"expected a list of {n} numbers (one per period) or nulls",
                                source="drift", column=key)
        for i, v in enumerate(values):
            if v is not None and as_number(v) is None:
                raise CJEInputError(f"expected a finite number or null, got {v!r}",
                                    source="drift", column=key, row=i)
        return [as_number(v) for v in values]

    out = {
        "periods": [str(p) for p in periods],
        "kendall_tau": series("kendall_tau", True),
        "residual_shift": series("residual_shift", False),
        "residual_shift_ci": None,
        "alarms": None,
        "n_anchors": drift.get("n_anchors"),
        "method": drift.get("method"),
    }
    for key, default in (("tau_threshold", 0.8), ("shift_threshold", 0.05)):
        value = drift.get(key, default)
        if as_number(value) is None:
            raise CJEInputError(f"expected a finite number, got {value!r}", source="drift",
                                column=key)
        out[key] = float(value)
    cis = drift.get("residual_shift_ci")
    if cis is not None:
        if not isinstance(cis, list) or len(cis) != n:
            raise CJEInputError(f"expected a list of {n} [low, high] pairs or nulls",
                                source="drift", column="residual_shift_ci")
        for i, ci in enumerate(cis):
            if ci is not None and as_pair(ci) is None:
                raise CJEInputError(f"expected [low, high] or null, got {ci!r}", source="drift",
                                    column="residual_shift_ci", row=i)
        out["residual_shift_ci"] = [as_pair(ci) for ci in cis]
    alarms = drift.get("alarms")
    if alarms is not None:
        if not isinstance(alarms, list) or len(alarms) != n or \
                not all(isinstance(a, bool) for a in alarms):
            raise CJEInputError(f"expected a list of {n} booleans", source="drift", column="alarms")
        out["alarms"] = list(alarms)
    else:
        tau, shift, thr_t, thr_s = (out["kendall_tau"], out["residual_shift"],
                                    out["tau_threshold"], out["shift_threshold"])
        out["alarms"] = [
            (tau[i] is not None and tau[i] < thr_t)
            or (shift is not None and shift[i] is not None and abs(shift[i]) > thr_s)
            for i in range(n)]
    return out




# --------------------------------------------------------------------------------------------
# scales and non-estimable comparisons
# --------------------------------------------------------------------------------------------
def scales_of(result: Any) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """(score scale, label scale) as declared in the result's config (None when not declared)."""
    config = loose_model(result).config
    config = config if isinstance(config, dict) else {}
    return as_pair(config.get("score_scale")), as_pair(config.get("label_scale"))


def same_scale(result: Any) -> bool:
    """True when judge scores and oracle labels share one scale (undeclared scales default to 0-1)."""
    score, label = scales_of(result)
    return (score or (0.0, 1.0)) == (label or (0.0, 1.0))


def raw_on_label_scale(result: dict, raw: Any) -> float | None:
    """A raw judge mean mapped linearly from the declared score scale onto the declared label scale.

    This is the naive reading of the judge (its score taken at face value on the label scale), the
    comparator the calibration corrects; None when either scale is unknown or degenerate.
    """
    v = as_number(raw)
    score, label = scales_of(result)
    if v is None:
        return None
    if same_scale(result):
        return v
    if score is None or label is None or score[1] == score[0]:
        return None
    return label[0] + (v - score[0]) / (score[1] - score[0]) * (label[1] - label[0])


def scale_text(pair: tuple[float, float] | None) -> str:
    """A scale as ``lo-hi`` (``n/a`` when unknown)."""
    return "n/a" if pair is None else f"{pair[0]:g}\u2013{pair[1]:g}"


def not_estimable_reason(comparison: dict | Comparison) -> str | None:
    """The reason a comparison carries no number (``reported`` false or ``not_estimable`` set), else None.

    Results before issue 16 (no such fields) render as before.
    """
    if isinstance(comparison, Comparison):
        reason, reported = comparison.not_estimable, comparison.reported
    else:
        reason, reported = comparison.get("not_estimable"), comparison.get("reported", True)
    if reported is False or reason:
        return str(reason or "not reported by the engine")
    return None


_UNSAFE = {0x7F, *range(0x00, 0x20), *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
           *range(0x2066, 0x206A)}


def safe_str(value: Any) -> str:
    """A user string made safe for a terminal: control characters, ANSI escapes and bidirectional
    overrides (e.g. U+202E) are shown as escapes (``\\x1b``, ``\\u202e``), never sent raw."""
    text = str(value)
    if not any(ord(c) in _UNSAFE for c in text):
        return text
    return "".join((f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") if ord(c) in _UNSAFE else c
                   for c in text)

"""Fixed-width terminal tables for a CJE result."""
from __future__ import annotations

from typing import Sequence

from flows.reports.common import (VERDICT_STYLE, _alpha, _check_result, _conf_label, _fmt, _fmt_ci, _fmt_p,
                                  _is_refused, _policy_order, _signed, _verdict)
from flows.reports.sections import _strip_winner_prefix

__all__ = ["format_table"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(result: dict) -> str:
    """Fixed-width text summary of a result dict for the terminal.

    One row per policy (estimate, CI, level claim, basis, audit verdict, raw judge mean, oracle
    mean; refused levels read "refused"), then the pairwise comparisons with adjusted p-values and
    the best-policy line.

    Raises
    ------
    CJEInputError
        When ``result`` does not follow ``docs/result-schema.md``.
    """
    _check_result(result)
    alpha = _alpha(result)
    conf = _conf_label(alpha)
    pols = result["policies"]
    order = _policy_order(result)
    rows = []
    for n in order:
        p = pols[n]
        refused = _is_refused(p)
        rows.append([
            n,
            "refused" if refused else _fmt(p.get("estimate")),
            "refused" if refused else _fmt_ci(p.get("ci")),
            str(p.get("level_claim")),
            str(p.get("basis_code") or "n/a"),
            VERDICT_STYLE[_verdict(p)][1],
            _fmt(p.get("raw_judge_mean")),
            _fmt(p.get("oracle_mean")),
        ])
    lines = ["Policy estimates (oracle scale)"]
    lines += _table(["policy", "estimate", f"{conf} CI", "level", "basis", "audit", "raw judge",
                     "oracle mean"], rows, right={1, 2, 6, 7})
    comps = [c for c in result.get("comparisons") or [] if isinstance(c, dict)]
    mult = result.get("multiplicity") or {}
    method = str(mult.get("method") or (result.get("config") or {}).get("multiplicity") or "n/a")
    lines.append("")
    if comps:
        lines.append(f"Pairwise comparisons (a - b; p adjusted by {method.upper()}, "
                     f"alpha {_fmt(mult.get('alpha', alpha), 2)})")
        crow = []
        any_refused = False
        for c in comps:
            a, b = str(c.get("a")), str(c.get("b"))
            involves = bool(c.get("involves_refused")) or any(
                _is_refused(pols[x]) for x in (a, b) if x in pols)
            any_refused |= involves
            crow.append([a, b, _signed(c.get("diff")), _fmt_ci(c.get("ci")),
                         _fmt_p(c.get("p_value")), _fmt_p(c.get("p_adjusted")),
                         "yes" if c.get("significant") else "no",
                         _fmt(c.get("prob_a_better"), 2), "*" if involves else ""])
        lines += _table(["a", "b", "diff", f"{conf} CI", "p", "p adj", "sig", "P(a better)", ""],
                        crow, right={2, 3, 4, 5, 7})
        if any_refused:
            lines.append("* involves a refused policy: relative comparison only, no level implied")
    else:
        lines.append("Pairwise comparisons: none")
    lines.append("")
    best = result.get("best_policy")
    if best is not None:
        reason = str(result.get("best_policy_reason") or "")
        lines.append(f"Best policy: {best}" + (f" ({reason})" if reason else ""))
    else:
        reason = _strip_winner_prefix(result.get("best_policy_reason"))
        lines.append("Best policy: none, no clear winner" + (f" ({reason})" if reason else ""))
    return "\n".join(lines)


"""Fixed-width terminal tables for a CJE result."""
from __future__ import annotations

from typing import Sequence

from flows.reports.common import (VERDICT_STYLE, alpha_of, check_result, conf_label, fmt, fmt_ci, fmt_p, is_refused,
                                  not_estimable_reason, policy_order, rank_text, safe_str, same_scale, scale_text,
                                  scales_of, signed, verdict_of)
from flows.reports.sections import strip_winner_prefix

__all__ = ["format_table"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Lines of a plain-text table: a header, a rule and the rows, columns padded to their widest cell.

    Parameters
    ----------
    headers : sequence of str
    rows : sequence of sequences of str
    right : set of int
        Indices of the right-aligned (numeric) columns.
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_table(result: dict) -> str:
    """Fixed-width text summary of a result dict for the terminal.

    One row per policy, highest estimate first (rank as the comparisons support it, `rank_text`;
    estimate, CI, level claim, basis, audit verdict, raw judge mean on the judge's
    own scale, oracle mean; refused levels read "refused"), then the pairwise comparisons with adjusted
    p-values ("not estimable: <reason>" where the engine reported none) and the best-policy line. User
    strings are escaped for the terminal (control characters, ANSI escapes, bidirectional overrides).

    Raises
    ------
    CJEInputError
        When ``result`` does not follow ``docs/result-schema.md``.
    """
    check_result(result)
    alpha = alpha_of(result)
    conf = conf_label(alpha)
    pols = result["policies"]
    order = policy_order(result)
    rows = []
    for n in order:
        p = pols[n]
        refused = is_refused(p)
        assumed = p.get("assumed") or {}
        rows.append([
            rank_text(result, n),
            safe_str(n),
            "refused" if refused else fmt(p.get("estimate")) if p.get("estimate") is not None else "-",
            "refused" if refused else fmt_ci(p.get("ci")) if p.get("ci") else "",
            claim_text(p),
            safe_str(p.get("basis_code") or "n/a"),
            VERDICT_STYLE[verdict_of(p)][1],
            (fmt(assumed.get("estimate")) if assumed.get("level_claim") != "refused" else "refused")
            if assumed else "",
            fmt(p.get("raw_judge_mean")),
            fmt(p.get("oracle_mean")),
        ])
    lines = ["Policy estimates (oracle scale)"]
    raw_head = "raw judge" if same_scale(result) else f"raw judge ({scale_text(scales_of(result)[0])})"
    lines += text_table(["rank", "policy", "estimate", f"{conf} CI", "claim", "basis", "audit", "assumes transport",
                         raw_head, "oracle mean"], rows, right={2, 3, 7, 8, 9})
    if any(pols[n].get("level_claim") == "assumes_transport" for n in order):
        lines.append("claim 'assumes transport': no verified level; the plug-in shown rests on the calibration "
                     "transporting to the policy, which its labels did not verify (labels_to_verify in the result)")
    if any("-" in r[0] and r[0] != "-" for r in rows):
        lines.append("rank: 1 + policies significantly better; a range (1-3) when the comparisons leave it open")
    comps = [c for c in result.get("comparisons") or [] if isinstance(c, dict)]
    mult = result.get("multiplicity") or {}
    method = str(mult.get("method") or (result.get("config") or {}).get("multiplicity") or "n/a")
    lines.append("")
    if comps:
        lines.append(f"Pairwise comparisons (a - b; p adjusted by {method.upper()}, "
                     f"alpha {fmt(mult.get('alpha', alpha), 2)})")
        crow = []
        any_refused = False
        for c in comps:
            a, b = str(c.get("a")), str(c.get("b"))
            why = not_estimable_reason(c)
            if why is not None:  # never a number: the engine threw it out (issue 16)
                crow.append([safe_str(a), safe_str(b), f"not estimable: {safe_str(why)}", "", "", "", "", "", "", ""])
                continue
            involves = bool(c.get("involves_refused")) or any(
                is_refused(pols[x]) for x in (a, b) if x in pols)
            any_refused |= involves
            crow.append([safe_str(a), safe_str(b), signed(c.get("diff")), fmt_ci(c.get("ci")),
                         fmt_p(c.get("p_value")), fmt_p(c.get("p_adjusted")),
                         "yes" if c.get("significant") else "no",
                         fmt(c.get("prob_a_better"), 2),
                         "assumes transport" if c.get("claim_kind") == "assumes_transport" else
                         "verified" if c.get("claim_kind") == "verified" else "",
                         "*" if involves else ""])
        lines += text_table(["a", "b", "diff", f"{conf} CI", "p", "p adj", "sig", "P(a better)", "claim", ""],
                            crow, right={3, 4, 5, 7})
        if any_refused:
            lines.append("* involves a refused policy: relative comparison only, no level implied")
    else:
        lines.append("Pairwise comparisons: none")
    lines.append("")
    best = result.get("best_policy")
    if best is not None:
        reason = safe_str(result.get("best_policy_reason") or "")
        lines.append(f"Best policy: {safe_str(best)}" + (f" ({reason})" if reason else ""))
    else:
        reason = safe_str(strip_winner_prefix(result.get("best_policy_reason")))
        lines.append("Best policy: none, no clear winner" + (f" ({reason})" if reason else ""))
    lines += _baseline_lines(result, conf)
    assumed = result.get("assumes_transport")
    if isinstance(assumed, dict):
        best = assumed.get("best_policy")
        lines.append("Assuming transport (the paper's protocol, not verified): best policy "
                     + (safe_str(best) if best else "none") + f" ({safe_str(strip_winner_prefix(assumed.get('best_policy_reason')))})")
    return "\n".join(lines)


def claim_text(p: dict) -> str:
    """How a policy's level claim reads for people: verified, assumes transport, refused (off-policy: ok)."""
    claim = str(p.get("level_claim"))
    if claim == "ok" and p.get("verified") is not None:
        return "verified"
    return {"assumes_transport": "assumes transport"}.get(claim, claim)


def _baseline_lines(result: dict, conf: str) -> list[str]:
    rows = [c for c in result.get("baseline_comparisons") or [] if isinstance(c, dict)]
    if not rows:
        return []
    base = safe_str(rows[0].get("baseline"))
    out = ["", f"Against the baseline {base} (simultaneous {conf} intervals, max-T)"]
    body = []
    for c in rows:
        if not c.get("reported"):
            body.append([safe_str(c.get("policy")), f"not estimable: {safe_str(c.get('not_estimable'))}", "", "", ""])
            continue
        verdict = "better" if c.get("better") else "worse" if c.get("worse") else \
            "non-inferior" if c.get("non_inferior") else "undecided"
        body.append([safe_str(c.get("policy")), signed(c.get("diff")), fmt_ci(c.get("ci")), verdict,
                     "assumes transport" if c.get("claim_kind") == "assumes_transport" else "verified"])
    out += text_table(["policy", "diff", f"{conf} CI (simultaneous)", "verdict", "claim"], body, right={1, 2})
    return out


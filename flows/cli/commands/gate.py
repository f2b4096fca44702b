"""`cje gate RESULT --baseline NAME --fail-if EXPR`: a CI gate on an evaluation result.

Expressions (``--fail-if`` and ``--pass-if`` may each be repeated):

``worse``              a candidate is significantly worse than the baseline
``better``             a candidate is significantly better (mostly as ``--pass-if better``)
``refused``            the level of the baseline or a candidate was refused
``audit-fail``         the transport audit of the baseline or a candidate failed
``cand - base OP T``   a claim about the true difference, OP one of < <= > >=, T a number in label
                       units (``base - cand`` also works; spaces are optional)

A claim about a difference counts as *established* when the data show it after the result's
multiplicity adjustment: for T = 0 (``worse``, ``better``, ``cand - base < 0``) that is the result's
own adjusted comparison (``significant`` and the sign of ``diff``); for T != 0 a one-sided z test of
the shifted null (``p = Phi((diff - T) / se)`` for ``<``), adjusted with the result's
``multiplicity.method`` over the gate's comparisons. ``--fail-if`` fails when its claim is
established for some candidate; ``--pass-if`` fails unless its claim is established for every
candidate. A comparison the result does not report (``reported: false`` or ``not_estimable``)
establishes nothing: it fails every ``--pass-if``, and fails ``--fail-if`` too unless
``--allow-not-estimable`` (a gate fails closed). The reasons are printed either way.

The comparisons are the result's *verified* ones (levels corrected by each policy's own labels): a
policy without a verified level is not estimable there, so the gate fails closed on it.
``--assume-transport`` gates on the result's assumes-transport comparisons instead (the paper's
protocol: calibrated plug-ins where the audits did not fail), for a team that decided to trust it; every
check then says so.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_cdf, norm_sf
from cje_engine.result.model import AssumedClaims, Audit, Comparison, EvaluationModel, Multiplicity
from cje_engine.result.validate import typed_view
from flows.config import did_you_mean

from flows.cli.exits import EXIT_GATE_FAILED, EXIT_OK
from flows.cli.terminal import err, escape, out, out_json

_SIDE = r"(cand|candidate|base|baseline)"
_EXPR = re.compile(rf"^\s*{_SIDE}\s*-\s*{_SIDE}\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
KEYWORDS = ("worse", "better", "refused", "audit-fail")


@dataclass(frozen=True)
class Claim:
    """``cand - base OP threshold`` (``OP`` in < <= > >=)."""

    op: str
    threshold: float
    text: str

    @property
    def below(self) -> bool:
        """Does the claim pass when the value is below its threshold?"""
        return self.op in ("<", "<=")


def parse_expression(text: str) -> str | Claim:
    """A keyword of `KEYWORDS` or a `Claim`; anything else is a usage error."""
    t = " ".join(str(text).split()).lower()
    if t in KEYWORDS:
        return t
    m = _EXPR.match(t)
    if not m:
        raise argparse.ArgumentTypeError(f"not a gate expression: {text!r}; expected one of {', '.join(KEYWORDS)} or "
                                         f"'cand - base < -0.01' (operators < <= > >=)")
    left, right, op, value = m.groups()
    left_cand, right_cand = left.startswith("cand"), right.startswith("cand")
    if left_cand == right_cand:
        raise argparse.ArgumentTypeError(f"{text!r}: compare the candidate with the baseline ('cand - base')")
    threshold = float(value)
    if not math.isfinite(threshold):
        raise argparse.ArgumentTypeError(f"{text!r}: the threshold must be a finite number")
    if not left_cand:  # base - cand OP T  <=>  cand - base OP' -T
        op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
        threshold = -threshold
    return Claim(op, threshold, f"cand - base {op} {threshold:g}")


def _keyword_claim(keyword: str) -> Claim:
    return Claim("<", 0.0, "cand - base < 0") if keyword == "worse" else Claim(">", 0.0, "cand - base > 0")


@dataclass
class Check:
    """The outcome of one expression for one candidate (or for the policies involved)."""

    rule: str
    expression: str
    candidate: str | None
    failed: bool
    reason: str
    diff: float | None = None
    se: float | None = None
    p_value: float | None = None
    p_adjusted: float | None = None


def _comparison(m: EvaluationModel, cand: str, base: str) -> Comparison | None:
    """The result's comparison of ``cand`` and ``base`` oriented as ``cand - base``."""
    for c in m.comparisons or []:
        if not isinstance(c, Comparison) or {c.a, c.b} != {cand, base}:
            continue
        if c.a == base:
            return c.model_copy(update={"diff": -c.diff if c.diff is not None else None,
                                        "ci": [-c.ci[1], -c.ci[0]] if c.ci else c.ci})
        return c
    return None


def _not_estimable(c: Comparison) -> str | None:
    reason = c.not_estimable
    if c.reported is False or reason:
        return f"not estimable: {reason}" if isinstance(reason, str) and reason else "not reported by the result"
    if c.diff is None:
        return "not estimable: the result has no difference for this pair"
    return None


def _alpha_method(m: EvaluationModel) -> tuple[float, str]:
    """The result's alpha and multiplicity method (multiplicity block, else config alpha; 0.05 / bh)."""
    mult = m.multiplicity if isinstance(m.multiplicity, Multiplicity) else None
    config = m.config if isinstance(m.config, dict) else {}
    alpha = float((mult.alpha if mult else None) or config.get("alpha", 0.05))
    return alpha, (mult.method if mult and mult.method else "bh")


def _claim_checks(m: EvaluationModel, base: str, cands: Sequence[str], claim: Claim, rule: str,
                  expression: str, allow_not_estimable: bool) -> list[Check]:
    alpha, method = _alpha_method(m)
    comps = {c: _comparison(m, c, base) for c in cands}
    usable = [c for c in cands if comps[c] is not None and _not_estimable(comps[c]) is None]
    p_one = {}
    if claim.threshold != 0.0:
        from cje_engine.inference.multiplicity import adjust

        for c in usable:
            d, se = float(comps[c].diff), comps[c].se
            if se is None or not se > 0:
                p_one[c] = 0.0 if (d < claim.threshold if claim.below else d > claim.threshold) else 1.0
            else:
                z = (d - claim.threshold) / float(se)
                p_one[c] = float(norm_cdf(z) if claim.below else norm_sf(z))
        adj = dict(zip(usable, adjust(np.array([p_one[c] for c in usable]), method).tolist())) if usable else {}
    checks = []
    for cand in cands:
        c = comps[cand]
        if c is None:
            raise CJEInputError(f"the result has no comparison of {cand!r} with {base!r}", column="comparisons")
        why = _not_estimable(c)
        if why is not None:
            fails = rule == "pass-if" or not allow_not_estimable
            checks.append(Check(rule, expression, cand, fails, f"{cand} vs {base}: {why}; the gate cannot tell"
                                + ("" if fails else " (allowed by --allow-not-estimable)")))
            continue
        d, se = float(c.diff), c.se
        if claim.threshold == 0.0:
            p, p_adj = c.p_value, c.p_adjusted
            established = bool(c.significant) and (d < 0 if claim.below else d > 0)
            test = f"adjusted p {p_adj:.3g} ({method})" if isinstance(p_adj, (int, float)) else "adjusted p n/a"
        else:
            p, p_adj = p_one[cand], adj[cand]
            established = p_adj <= alpha
            test = f"one-sided p {p:.3g}, adjusted {p_adj:.3g} ({method}, {len(usable)} comparison(s))"
        shown = "shown" if established else "not shown"
        ci = c.ci
        ci_txt = f", CI [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci and None not in ci else ""
        reason = (f"{cand} - {base} = {d:+.4f}{ci_txt}; {claim.text} {shown} at alpha {alpha:g} ({test})")
        failed = established if rule == "fail-if" else not established
        checks.append(Check(rule, expression, cand, failed, reason, d, se, p, p_adj))
    return checks


def _policy_checks(m: EvaluationModel, names: Sequence[str], keyword: str, rule: str) -> list[Check]:
    checks = []
    for name in names:
        p = m.policies[name]
        if keyword == "refused":
            bad = p.level_claim == "refused"
            why = ("level refused: " + "; ".join(p.refusal_reasons or [])) if bad else "level claimed"
        else:
            audit = p.audit if isinstance(p.audit, Audit) else None
            verdict = (audit.verdict if audit else None) or "not_run"
            bad = verdict == "fail"
            why = f"audit {verdict}" + (f": {audit.reason}" if bad and audit.reason else "")
        failed = bad if rule == "fail-if" else not bad
        checks.append(Check(rule, keyword, name, failed, f"{name}: {why}"))
    return checks


def judge(result: Mapping[str, Any] | EvaluationModel, baseline: str, *, fail_if: Sequence[Any] = (),
          pass_if: Sequence[Any] = (), candidates: Sequence[str] | None = None, allow_not_estimable: bool = False,
          assume_transport: bool = False) -> list[Check]:
    """Every check of the gate (pure; `cmd_gate` prints them and sets the exit code).

    ``result``: a result dict (``result.json``), an `EvaluationResult` or its `EvaluationModel`; read through
    the typed model (`cje_engine.result.validate.typed_view`). ``assume_transport``: judge the result's
    assumes-transport comparisons (``assumes_transport.comparisons``) instead of its verified ones; each
    check's reason then starts with "assumes transport".
    """
    if isinstance(result, Mapping) and not result.get("policies"):
        raise CJEInputError("the result has no policies: expected a result.json of `cje evaluate` or `cje run`",
                            column="policies")
    m = typed_view(result, partial=True)
    if assume_transport:
        block = m.assumes_transport
        if not isinstance(block, AssumedClaims):
            raise CJEInputError("the result has no assumes-transport claims (a Direct result of this version has "
                                "them); drop --assume-transport", column="assumes_transport")
        checks = judge(m.model_copy(update={"comparisons": block.comparisons or []}), baseline, fail_if=fail_if,
                       pass_if=pass_if, candidates=candidates, allow_not_estimable=allow_not_estimable)
        for c in checks:
            c.reason = "assumes transport: " + c.reason
        return checks
    pols = list(m.policies)
    for name in [baseline, *(candidates or [])]:
        if name not in pols:
            raise CJEInputError(f"policy {name!r} is not in the result{did_you_mean(name, pols)}"
                                f" (policies: {', '.join(pols)})", column="policies")
    cands = list(candidates) if candidates else [p for p in pols if p != baseline]
    if baseline in cands:
        raise CJEInputError(f"the baseline {baseline!r} cannot also be a candidate")
    if not cands:
        raise CJEInputError("the result has no policy besides the baseline to gate")
    checks: list[Check] = []
    for rule, exprs in (("fail-if", fail_if), ("pass-if", pass_if)):
        for e in exprs:
            e = parse_expression(e) if isinstance(e, str) else e
            if isinstance(e, str) and e in ("refused", "audit-fail"):
                checks += _policy_checks(m, [baseline, *cands], e, rule)
            else:
                claim = _keyword_claim(e) if isinstance(e, str) else e
                checks += _claim_checks(m, baseline, cands, claim, rule, e if isinstance(e, str) else e.text,
                                        allow_not_estimable)
    return checks


def register(sub: Any) -> None:
    """Add ``cje gate`` to the command-line parser."""
    p = sub.add_parser("gate", help="a CI gate on a result.json: exit 1 when a --fail-if holds (docs/ci.md)",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="result.json of `cje evaluate` (or a published result)")
    p.add_argument("--baseline", required=True, help="the policy the candidates are compared with")
    p.add_argument("--candidate", action="append", metavar="NAME",
                   help="a candidate policy (repeat or separate by commas; default: every other policy)")
    p.add_argument("--fail-if", action="append", type=parse_expression, metavar="EXPR", default=[],
                   help="fail when this holds: worse, refused, audit-fail or 'cand - base < -0.01'")
    p.add_argument("--pass-if", action="append", type=parse_expression, metavar="EXPR", default=[],
                   help="fail unless this holds for every candidate, e.g. better or 'cand - base > -0.01'")
    p.add_argument("--allow-not-estimable", action="store_true",
                   help="a comparison the result does not report does not fail a --fail-if")
    p.add_argument("--assume-transport", action="store_true",
                   help="gate on the assumes-transport comparisons (the paper's protocol) instead of the verified ones")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (shape in docs/cli.md)")
    p.set_defaults(handler=cmd_gate)


def cmd_gate(ns: argparse.Namespace) -> int:
    """``cje gate``: check a published result's claims; returns the exit code (1 when a claim fails)."""
    if not ns.fail_if and not ns.pass_if:
        raise CJEInputError("give at least one --fail-if or --pass-if expression (e.g. --fail-if worse)")
    from flows.storage.publish import read_result_file

    src = Path(ns.result)
    read = read_result_file(src)  # a published result is verified against its manifest (docs/ci.md)
    result = read.result
    if not read.verified:
        err(f"warning: {escape(src)} has no manifest.json beside it: an unverified result (fine for the output "
            "of `cje evaluate --out`; a published result is checked against its manifest's sha256)")
    cands = [c.strip() for arg in (ns.candidate or []) for c in arg.split(",") if c.strip()] or None
    checks = judge(result, ns.baseline, fail_if=ns.fail_if, pass_if=ns.pass_if, candidates=cands,
                   allow_not_estimable=ns.allow_not_estimable, assume_transport=ns.assume_transport)
    failed = [c for c in checks if c.failed]
    if ns.json:
        from flows.cli.terminal import json_doc

        out_json(json_doc("gate", result_path=str(src), result_verified=read.verified, baseline=ns.baseline,
                          passed=not failed,
                          checks=[asdict(c) for c in checks]))
    else:
        for c in checks:
            out(f"{'FAIL' if c.failed else 'ok  '} {c.rule} {escape(c.expression)}: {escape(c.reason)}")
        out(f"gate {'FAILED' if failed else 'passed'}: {len(failed)} of {len(checks)} check(s) failed "
            f"(baseline {escape(ns.baseline)})")
    return EXIT_GATE_FAILED if failed else EXIT_OK

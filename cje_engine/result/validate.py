"""`validate_result`: the one check of a result dict (used by the engine, the report and the publisher)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from pydantic import ValidationError

from cje_engine.errors import CJEInputError
from cje_engine.result.model import SCHEMA_VERSION, EvaluationModel

LEVEL_CLAIMS = ("ok", "assumes_transport", "refused")


def _bad(msg: str, column: str) -> CJEInputError:
    return CJEInputError(msg, source="result", column=column)


def _finite_or_null(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def _check_rules(d: Any, *, partial: bool) -> None:
    """The rules that make a result safe to show or publish (they hold for partial results too)."""
    if not isinstance(d, Mapping):
        raise _bad(f"expected the result dict of docs/result-schema.md, got {type(d).__name__}", "result")
    version = d.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise _bad(f"unsupported schema_version {version!r}; this engine reads version {SCHEMA_VERSION}",
                   "schema_version")
    policies = d.get("policies")
    if not isinstance(policies, Mapping) or not policies:
        raise _bad("expected a non-empty mapping of policy name -> policy result", "policies")
    for name, pol in policies.items():
        if not isinstance(pol, Mapping):
            raise _bad(f"policy {name!r} is not an object (got {type(pol).__name__})", f"policies.{name}")
        claim = pol.get("level_claim")
        if claim not in LEVEL_CLAIMS:
            raise _bad(f"policy {name!r} has level_claim {claim!r}; expected one of {LEVEL_CLAIMS}",
                       f"policies.{name}.level_claim")
        reasons = pol.get("refusal_reasons")
        if claim == "refused" and not partial and not (
                isinstance(reasons, list) and reasons and all(isinstance(r, str) and r.strip() for r in reasons)):
            raise _bad(f"policy {name!r} is refused but carries no refusal reasons; a refused level must say why",
                       f"policies.{name}.refusal_reasons")
        if not _finite_or_null(pol.get("estimate")):
            raise _bad(f"policy {name!r}: estimate must be a finite number or null, got {pol.get('estimate')!r}",
                       f"policies.{name}.estimate")
        ci = pol.get("ci")
        if ci is not None and not (isinstance(ci, (list, tuple)) and len(ci) == 2
                                   and all(_finite_or_null(v) for v in ci)):
            raise _bad(f"policy {name!r}: ci must be [low, high] or null, got {ci!r}", f"policies.{name}.ci")
    best = d.get("best_policy")
    if best is not None:
        if best not in policies:
            raise _bad(f"best_policy {best!r} is not one of the policies", "best_policy")
        if policies[best].get("level_claim") == "refused":
            raise _bad(f"best_policy {best!r} has a refused level claim; a refused policy is never crowned best",
                       "best_policy")


def validate_result(d: Any, *, partial: bool = False) -> EvaluationModel | None:
    """Check a result dict; raise `CJEInputError` naming the field when it is not a valid result.

    Parameters
    ----------
    d : dict
        ``EvaluationResult.to_dict()`` or a stored ``result.json``.
    partial : bool
        Only the safety rules (the report renders hand-made partial results): level claims are
        ``ok``/``refused``, estimates finite or null, intervals pairs, the best policy exists and is
        not refused. Otherwise also the full
        schema (cje_engine/result/result.schema.json), and refused policies must carry reasons.

    Returns
    -------
    EvaluationModel or None
        The typed result (None when ``partial``).
    """
    _check_rules(d, partial=partial)
    if partial:
        return None
    try:
        return EvaluationModel.model_validate(d)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise _bad(f"{loc}: {err['msg']} (got {err.get('input')!r:.80}); "
                   f"{exc.error_count()} problem(s) in all", loc) from None

"""`validate_result`: the one check of a result dict (used by the engine, the report and the publisher)."""
from __future__ import annotations

import math
from types import UnionType
from typing import Any, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

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


def _lenient(annotation: Any, value: Any) -> Any:
    """``value`` typed by ``annotation`` as far as it goes: mappings of models become models whose missing
    fields are None (`typed_view`); anything else is kept as it is."""
    if value is None:
        return None
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        for arg in args:
            if arg is type(None):
                continue
            out = _lenient(arg, value)
            if out is not value or isinstance(arg, type) and isinstance(value, arg):
                return out
        return value
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _construct(annotation, value) if isinstance(value, Mapping) else value
    if origin is list and args and isinstance(value, list):
        return [_lenient(args[0], v) for v in value]
    if origin is dict and len(args) == 2 and isinstance(value, Mapping):
        return {k: _lenient(args[1], v) for k, v in value.items()}
    return value


def _construct(cls: type[BaseModel], data: Mapping) -> BaseModel:
    values = {}
    for name, field in cls.model_fields.items():
        key = field.alias or name
        values[name] = _lenient(field.annotation, data.get(key, data.get(name)))
    return cls.model_construct(**values)


def typed_view(d: Any, *, partial: bool = False, rules: bool = True) -> EvaluationModel:
    """The typed model of a result dict, for code that reads results (reports, the gate).

    Parameters
    ----------
    d : dict, `EvaluationModel` or an object with a ``model`` (`EvaluationResult`)
    partial : bool
        Accept hand-made partial results (as `validate_result` with ``partial``): a dict that passes the
        safety rules but not the full schema is typed without validation, its missing fields None
        (nested blocks typed too), so readers use attributes throughout.

    Raises
    ------
    CJEInputError
        As `validate_result`.
    """
    if isinstance(d, EvaluationModel):
        return d
    if isinstance(getattr(d, "model", None), EvaluationModel):
        return d.model
    if not partial:
        return validate_result(d)
    if rules:
        _check_rules(d, partial=True)
    elif not isinstance(d, Mapping):
        d = {}
    try:
        return EvaluationModel.model_validate(d)
    except ValidationError:
        return _construct(EvaluationModel, d)

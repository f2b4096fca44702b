"""The one result builder: the top-level result dict of every mode, in one field order."""
from __future__ import annotations

from typing import Any

from cje_engine import __version__
from cje_engine.result.model import SCHEMA_VERSION


def assemble(*, mode: str, config: dict, data: dict, calibration: dict, inference: dict, policies: dict,
             relative: dict, warnings: list[str], offpolicy: dict | None = None) -> dict[str, Any]:
    """The result of an evaluation (validated by `cje_engine.result.EvaluationResult`).

    Parameters
    ----------
    mode : "direct", "logs-only" or "hybrid"
    relative : the fields of `cje_engine.inference.comparisons.relative_claims`
    offpolicy : the off-policy run block (logs-only and hybrid only)
    """
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "engine_version": __version__,
        "mode": mode,
        "config": config,
        "data": data,
        "calibration": calibration,
        "inference": inference,
        "policies": policies,
        **relative,
    }
    if offpolicy is not None:
        result["offpolicy"] = offpolicy
    result["warnings"] = warnings
    return result

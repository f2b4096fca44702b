"""CJE engine: calibrated judge evaluation with honest uncertainty (no orchestration imports).

The public names are imported on first use (PEP 562), so that ``import cje_engine.errors`` (the command
line's ``cje --help``, a flow's worker) does not pay for numpy, scipy, pandas and scikit-learn.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "load_frame": "cje_engine.data.io",
    "CJEInputError": "cje_engine.errors",
    "EvaluationOptions": "cje_engine.options",
    "evaluate": "cje_engine.pipeline.direct",
    "prepare": "cje_engine.pipeline.direct",
    "bootstrap_chunk": "cje_engine.pipeline.direct",
    "finalize": "cje_engine.pipeline.direct",
    "evaluate_offpolicy": "cje_engine.pipeline.offpolicy",
    "EvaluationResult": "cje_engine.result",
    "validate_result": "cje_engine.result",
}

__all__ = ["evaluate", "prepare", "bootstrap_chunk", "finalize", "evaluate_offpolicy", "EvaluationResult",
           "EvaluationOptions", "CJEInputError", "load_frame", "validate_result", "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from cje_engine.data.io import load_frame
    from cje_engine.errors import CJEInputError
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline.direct import bootstrap_chunk, evaluate, finalize, prepare
    from cje_engine.pipeline.offpolicy import evaluate_offpolicy
    from cje_engine.result import EvaluationResult, validate_result


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first access."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cje_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

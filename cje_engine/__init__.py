"""CJE engine: calibrated judge evaluation with honest uncertainty (no orchestration imports)."""
__version__ = "0.1.0"

from cje_engine.data.io import load_frame  # noqa: E402
from cje_engine.errors import CJEInputError  # noqa: E402
from cje_engine.options import EvaluationOptions  # noqa: E402
from cje_engine.pipeline.direct import bootstrap_chunk, evaluate, finalize, prepare  # noqa: E402
from cje_engine.pipeline.offpolicy import evaluate_offpolicy  # noqa: E402
from cje_engine.result import EvaluationResult, validate_result  # noqa: E402

__all__ = ["evaluate", "prepare", "bootstrap_chunk", "finalize", "evaluate_offpolicy", "EvaluationResult",
           "EvaluationOptions", "CJEInputError", "load_frame", "validate_result", "__version__"]

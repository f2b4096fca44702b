"""CJE engine: calibrated judge evaluation with honest uncertainty (no orchestration imports)."""
__version__ = "0.1.0"

from .errors import CJEInputError  # noqa: E402
from .options import EvaluationOptions  # noqa: E402
from .pipeline import bootstrap_chunk, evaluate, finalize, prepare  # noqa: E402
from .result import EvaluationResult  # noqa: E402

__all__ = ["evaluate", "prepare", "bootstrap_chunk", "finalize", "EvaluationResult", "EvaluationOptions",
           "CJEInputError", "load_frame", "__version__"]


def __getattr__(name: str):
    if name == "load_frame":
        from .io import load_frame

        return load_frame
    raise AttributeError(name)

"""CJE engine: calibrated judge evaluation with honest uncertainty (no orchestration imports)."""
__version__ = "0.1.0"

from cje_engine.errors import CJEInputError  # noqa: E402
from cje_engine.options import EvaluationOptions  # noqa: E402
from cje_engine.pipeline.direct import bootstrap_chunk, evaluate, finalize, prepare  # noqa: E402
from cje_engine.result import EvaluationResult  # noqa: E402

__all__ = ["evaluate", "prepare", "bootstrap_chunk", "finalize", "EvaluationResult", "EvaluationOptions",
           "CJEInputError", "load_frame", "__version__"]


def __getattr__(name: str):
    if name == "load_frame":
        from cje_engine.data.io import load_frame

        return load_frame
    raise AttributeError(name)

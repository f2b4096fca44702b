"""The evaluation result: typed model, JSON Schema, validation and the `EvaluationResult` wrapper."""
from cje_engine.result.evaluation import EvaluationResult
from cje_engine.result.jsonable import jsonable
from cje_engine.result.model import SCHEMA_VERSION, EvaluationModel
from cje_engine.result.validate import validate_result

__all__ = ["EvaluationResult", "EvaluationModel", "SCHEMA_VERSION", "jsonable", "validate_result"]

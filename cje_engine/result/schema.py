"""The JSON Schema of result.json and the field tables of docs/result-schema.md, generated from the model.

    python -m cje_engine.result.schema          # rewrite result.schema.json and the doc's tables

Both files are committed; ``tests/unit/test_result_schema.py`` regenerates them and fails when the
committed copies differ, so the model, the schema and the doc cannot disagree.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cje_engine.result.model import SCHEMA_VERSION, EvaluationModel

SCHEMA_PATH = Path(__file__).with_name("result.schema.json")
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "result-schema.md"
BEGIN = "<!-- BEGIN GENERATED FIELD TABLES (python -m cje_engine.result.schema) -->"
END = "<!-- END GENERATED FIELD TABLES -->"


def result_schema() -> dict:
    """The JSON Schema (draft 2020-12) of ``EvaluationResult.to_dict()``."""
    schema = EvaluationModel.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://cje.invalid/result.schema.v{SCHEMA_VERSION}.json",
            "schema_version": SCHEMA_VERSION, **schema}


def schema_text() -> str:
    """The result's JSON schema as the text stored in ``result.schema.json``."""
    return json.dumps(result_schema(), indent=1, sort_keys=True) + "\n"


def _type(p: dict) -> str:
    if "$ref" in p:
        return f"[{p['$ref'].rsplit('/', 1)[-1]}](#{p['$ref'].rsplit('/', 1)[-1].lower()})"
    if "anyOf" in p:
        return " or ".join(_type(x) for x in p["anyOf"])
    if "enum" in p:
        return " / ".join(f"`{v}`" for v in p["enum"])
    if "const" in p:
        return f"`{p['const']}`"
    t = p.get("type", "any")
    if t == "array":
        return f"list of {_type(p.get('items', {}))}"
    if t == "object" and "additionalProperties" in p and isinstance(p["additionalProperties"], dict):
        return f"map to {_type(p['additionalProperties'])}"
    return str(t)


def _table(name: str, spec: dict) -> str:
    req = set(spec.get("required", []))
    lines = [f"### {name}", "", spec.get("description", "").strip(), "",
             "| field | type | required | meaning |", "|---|---|---|---|"]
    for field, p in spec.get("properties", {}).items():
        desc = p.get("description", "").replace("|", "\\|")
        lines.append(f"| `{field}` | {_type(p).replace('|', '/')} | {'yes' if field in req else 'no'} | {desc} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def field_tables() -> str:
    """Markdown tables of every model in the schema (top level first)."""
    schema = result_schema()
    parts = [_table("EvaluationModel", schema)]
    for name in sorted(schema.get("$defs", {})):
        parts.append(_table(name, schema["$defs"][name]))
    return "\n".join(parts)


def doc_text(current: str) -> str:
    """``current`` with its generated section replaced by freshly generated tables."""
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{field_tables()}\n{END}{tail}"


def main() -> int:
    """Write ``result.schema.json`` and the field tables of docs/result-schema.md; returns the exit code 0."""
    SCHEMA_PATH.write_text(schema_text())
    DOC_PATH.write_text(doc_text(DOC_PATH.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

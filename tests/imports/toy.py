"""A toy importer for the framework's tests: JSON Lines of ``{id, model, prompt, judge, human, ts}``."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from flows.integrations.importers import HUMAN, JUDGE, Score, SourceRecord, bad_record, parse_ts
from flows.integrations.importers.jsonstream import iter_jsonl


class ToyImporter:
    """JSON Lines with one response a line (the framework's own test source)."""

    name = "toy"
    title = "toy JSON Lines (tests)"
    kinds = ("field",)
    default_kind = "field"
    default_policy = "field:model"
    default_prompt = "field:prompt_id"
    version = "1"

    def records(self, source: Path) -> Iterator[SourceRecord]:
        """One record a line; ``id`` and ``ts`` required."""
        for pos, (line, obj) in enumerate(iter_jsonl(source)):
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise bad_record(source, pos, "id", "a string", line=line)
            try:
                ts = parse_ts(obj.get("ts"))
            except ValueError:
                raise bad_record(source, pos, "ts", "an ISO-8601 timestamp", line=line) from None
            scores = [Score(k, obj[k], origin) for k, origin in (("judge", JUDGE), ("human", HUMAN)) if k in obj]
            yield SourceRecord(pos, obj["id"], ts, {f"field:{k}": v for k, v in obj.items()}, scores,
                               prompt=obj.get("prompt"))

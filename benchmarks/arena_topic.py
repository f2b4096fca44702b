"""Copy the Arena sample with a ``topic`` column derived from the prompt text (README, "Segments").

A keyword rule, first match wins: ``code`` (code words or a fenced block), ``math`` (math words or an
arithmetic expression), ``writing`` (write, story, poem, email, ...), else ``general``. Every ``*.jsonl`` of
the sample (fresh draws, probe slices, logged data) gets the column; nothing else changes.

Run ``python benchmarks/arena_topic.py ../shared/data/arena_sample out/arena_topic``.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

RULES = (
    ("code", re.compile(r"\b(code|python|javascript|java|sql|function|program|script|html|css|bash|regex|api|bug)\b|```")),
    ("math", re.compile(r"\b(calculate|solve|equation|math|integral|probability|how many|prove)\b|\d\s*[-+*/^=]\s*\d")),
    ("writing", re.compile(r"\b(write|story|poem|essay|email|letter|song|lyrics|rewrite|summarize|translate)\b")),
)


def topic(prompt: str) -> str:
    """The topic of a prompt by `RULES` (``general`` when none matches)."""
    text = prompt.lower()
    return next((name for name, rule in RULES if rule.search(text)), "general")


def main(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` and add ``topic`` to every row of every ``*.jsonl``."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in Path(dst).rglob("*.jsonl"):
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        f.write_text("".join(json.dumps({**r, "topic": topic(r["prompt"])}) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])

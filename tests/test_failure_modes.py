"""docs/failure-modes.md stays true: every row names a test that exists (or, until the branches are
merged, the file where another helper's branch adds it)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "failure-modes.md"
REF = re.compile(r"^`(?P<path>tests/[\w/]+\.py)::(?P<name>test_\w+)`$")
PENDING = re.compile(r"^\*pending \(helper (?P<helper>\w+)\)\* `(?P<path>tests/[\w/]+\.py)`$")
HELPERS = {"speed", "cli", "monitor"}


def _rows() -> list[list[str]]:
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not line.startswith("|---") and "| Test |" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append(cells)
    return rows


def test_every_row_of_the_failure_modes_table_names_an_existing_test():
    rows = _rows()
    assert len(rows) >= 30
    pending = []
    for cells in rows:
        assert len(cells) == 3 and all(cells), f"a row needs case, outcome and test: {cells}"
        test = cells[2]
        m = REF.match(test)
        if m:
            source = (REPO / m["path"]).read_text(encoding="utf-8")
            assert re.search(rf"^def {m['name']}\(", source, re.M), f"{test} does not exist (row: {cells[0]})"
            continue
        p = PENDING.match(test)
        assert p, f"test cell must be `path::test_name` or *pending (helper X)* `path`: {test!r}"
        assert p["helper"] in HELPERS, test
        pending.append((p["helper"], cells[0]))
    # the rows owned by this branch are all backed by tests; the others wait for their branches
    assert {h for h, _ in pending} <= HELPERS

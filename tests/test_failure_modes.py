"""docs/failure-modes.md stays true: every row names a test function that exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "failure-modes.md"
REF = re.compile(r"^`(?P<path>tests/[\w/]+\.py)::(?P<name>test_\w+)`$")


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
    for cells in rows:
        assert len(cells) == 3 and all(cells), f"a row needs case, outcome and test: {cells}"
        m = REF.match(cells[2])
        assert m, f"test cell must be `tests/path.py::test_name`: {cells[2]!r} (row: {cells[0]})"
        source = (REPO / m["path"]).read_text(encoding="utf-8")
        assert re.search(rf"^(async )?def {m['name']}\(", source, re.M), f"{cells[2]} does not exist (row: {cells[0]})"

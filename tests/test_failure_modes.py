"""docs/failure-modes.md stays true: every row names a test function that exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "failure-modes.md"
REF = re.compile(r"^`(?P<path>tests/[\w/]+\.py)::(?P<name>test_\w+)`$")
#: The Exit cell: exit codes of `flows/cli/exits.py` (several joined by " / "), or "—" (no process exit).
EXIT = re.compile(r"^(—|(0|1|2|64|69|70|130|137|143)( / (0|1|2|64|69|70|130|137|143))*)$")
EXIT_IN_TEXT = re.compile(r"\bexit(?:s|ed)?(?: with)?(?: code)? (\d+)", re.I)


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
        assert len(cells) == 4 and all(cells), f"a row needs case, outcome, exit and test: {cells}"
        case, outcome, exit_cell, test = cells
        assert EXIT.match(exit_cell), f"exit cell must be codes like `2` or `0 / 2`, or `—`: {exit_cell!r} (row: {case})"
        named = set(EXIT_IN_TEXT.findall(outcome))
        assert named <= set(exit_cell.split(" / ")), f"the outcome names exit {named} but the Exit cell says {exit_cell!r} (row: {case})"
        cells = [case, outcome, test]
        m = REF.match(cells[2])
        assert m, f"test cell must be `tests/path.py::test_name`: {cells[2]!r} (row: {cells[0]})"
        source = (REPO / m["path"]).read_text(encoding="utf-8")
        assert re.search(rf"^(async )?def {m['name']}\(", source, re.M), f"{cells[2]} does not exist (row: {cells[0]})"

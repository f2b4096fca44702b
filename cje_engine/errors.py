"""Errors raised on bad input.

Every error names where the problem is (file, column, row) and what was expected,
so that a user can fix the data without reading the code.
"""
from __future__ import annotations


class CJEInputError(ValueError):
    """Bad input data or options.

    Parameters
    ----------
    message : str
        What is wrong and what was expected.
    source : str, optional
        File (or object key, or "<DataFrame>") the problem was found in.
    column : str, optional
        Column concerned.
    row : int, optional
        Zero-based row number within ``source`` (first offending row).
    option : str, optional
        The Python keyword (option) a hint in the message refers to, e.g. ``"score_scale"``;
        the command line translates it to its flag (``--score-scale``).
    problems : list of CJEInputError, optional
        When one input has several problems, all of them (this error is the first).
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        column: str | None = None,
        row: int | None = None,
        option: str | None = None,
        problems: "list[CJEInputError] | None" = None,
    ) -> None:
        self.option = option
        self.problems = list(problems) if problems else []
        self.source = source
        self.column = column
        self.row = row
        self.detail = message
        where = []
        if source is not None:
            where.append(f"file {source}")
        if column is not None:
            where.append(f"column '{column}'")
        if row is not None:
            where.append(f"row {row}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)

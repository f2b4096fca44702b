"""Errors raised on bad input.

Every error names where the problem is (file, column, row) and what was expected,
so that a user can fix the data without reading the code.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


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


def did_you_mean(word: object, choices: Iterable[object], n: int = 1) -> str:
    """The one did-you-mean hint of the project: ``" (did you mean 'x'?)"`` or ``""``.

    Parameters
    ----------
    word : object
        The name given (an unknown key, option, policy, evaluation...).
    choices : iterable
        The names it could have meant.
    n : int
        Most suggestions (joined by ``or``).

    Returns
    -------
    str
        The closest ``n`` of ``choices`` (difflib, cutoff 0.6; else a case-insensitive match) as
        ``" (did you mean 'a' or 'b'?)"``, or ``""`` when none is close.
    """
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(word), names, n=n, cutoff=0.6)
    if not close:
        lower = {c.lower(): c for c in names}
        close = [lower[str(word).lower()]] if str(word).lower() in lower else []
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""

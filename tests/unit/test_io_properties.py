"""Property-based tests of the input layer (hypothesis): any table, in any supported format,
either evaluates with ``n_prompts`` = the number of distinct ids and the same numbers in every
format, or raises `CJEInputError` with a message; never another exception.

Bounded and derandomised so they stay in the default run (about 10 s).
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cje_engine import evaluate
from cje_engine.errors import CJEInputError

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Identifiers as users write them: digits with leading zeros, huge integers, words, punctuation,
# non-ASCII text, things that look like numbers or missing-value markers ("NA", "1e3", "0", "00").
ID_TEXT = st.one_of(
    st.text(alphabet="0123456789", min_size=1, max_size=25),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=8),
    st.sampled_from(["NA", "null", "nan", "1e3", "0", "00", "-0", "1.0", "1", " x ", "é", "a,b", 'q"q']),
)


@st.composite
def tables(draw):
    ids = draw(st.lists(ID_TEXT, min_size=2, max_size=40, unique=True))
    n_pol = draw(st.integers(1, 3))
    levels = draw(st.integers(2, 11))
    rows = []
    for k in range(n_pol):
        for pid in ids:
            if draw(st.booleans()) or k == 0:
                s = draw(st.integers(0, levels - 1)) / (levels - 1)
                # mostly labelled, so that many tables can be cross-fitted (others must be refused)
                lab = None if draw(st.integers(0, 9)) < 3 else draw(st.floats(0, 1, allow_nan=False))
                rows.append({"prompt_id": pid, "policy": f"pol{k}", "judge_score": s, "oracle_label": lab})
    frame = pd.DataFrame(rows, columns=["prompt_id", "policy", "judge_score", "oracle_label"])
    frame["oracle_label"] = frame["oracle_label"].astype(float)
    return frame


def _write(frame: pd.DataFrame, fmt: str, folder: Path):
    if fmt == "pandas":
        return frame
    if fmt == "pyarrow":
        return pa.Table.from_pandas(frame, preserve_index=False)
    path = folder / f"data.{fmt}"
    if fmt == "parquet":
        frame.to_parquet(path, index=False)
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    else:
        with open(path, "w", encoding="utf-8") as fh:
            for rec in frame.to_dict("records"):
                rec = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def _outcome(src):
    try:
        d = evaluate(src, inference="analytic").to_dict()
    except CJEInputError as exc:
        assert str(exc), "an input error must carry a message"
        return ("error", None)
    est = {p: (v["estimate"], v["se"]) for p, v in d["policies"].items()}
    return ("ok", (d["data"]["n_prompts"], est))


@SETTINGS
@given(tables())
def test_every_format_gives_the_same_answer_or_an_input_error(frame):
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = {fmt: _outcome(_write(frame, fmt, Path(tmp)))
                    for fmt in ("pandas", "pyarrow", "parquet", "csv", "jsonl")}
    kinds = {k for k, _ in outcomes.values()}
    assert len(kinds) == 1, outcomes  # all evaluate, or all refuse
    if kinds == {"ok"}:
        n_ids = frame.prompt_id.nunique()
        ref = outcomes["pandas"][1]
        assert ref[0] == n_ids
        for fmt, (_, got) in outcomes.items():
            assert got[0] == n_ids, fmt
            assert got[1].keys() == ref[1].keys(), fmt
            for p, (e, s) in got[1].items():
                assert e == pytest.approx(ref[1][p][0], rel=1e-12, abs=1e-12), (fmt, p)
                assert s == pytest.approx(ref[1][p][1], rel=1e-9, abs=1e-12), (fmt, p)


@SETTINGS
@given(st.binary(min_size=0, max_size=300), st.sampled_from(["csv", "jsonl", "parquet"]))
def test_arbitrary_bytes_give_an_input_error_or_a_result(blob, fmt):
    """Garbage in any file type: an input error with a message (or, by chance, a valid table)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"x.{fmt}"
        path.write_bytes(blob)
        kind, _ = _outcome(path)
    assert kind in ("ok", "error")


@SETTINGS
@given(tables(), st.sampled_from(["prompt_id", "policy", "judge_score", "oracle_label"]),
       st.one_of(st.none(), st.just(""), st.just("abc"), st.just(float("inf")), st.just(True), st.just(7.5)))
def test_a_damaged_cell_is_an_input_error_or_still_consistent(frame, col, value):
    frame = frame.copy()
    frame[col] = frame[col].astype(object)
    frame.iat[0, frame.columns.get_loc(col)] = value
    kind, _ = _outcome(frame)
    assert kind in ("ok", "error")

"""Loading and validation of logged data (cje_engine.data.offpolicy): shapes, and every bad input
named by file, column and row."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.data.offpolicy import load_offpolicy, projection_columns
from cje_engine.simulate.logs import simulate_logs


def _frames(n=60, seed=0):
    sim = simulate_logs(n_prompts=n, length=4, targets={"a": 0.1, "b": 0.3}, seed=seed, label_fraction=0.4)
    return sim, *sim.to_frames("base")


def _jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def test_wide_frame_defaults_and_arrays():
    sim, logged, _ = _frames()
    d = load_offpolicy(logged.drop(columns=["policy"]))
    assert d.logger == "logger" and d.targets == ("a", "b") and d.n_logged == 60
    np.testing.assert_array_equal(d.logger_logprob, sim.logger_logprob)
    np.testing.assert_array_equal(d.target_logprob["b"], sim.target_logprob["b"])
    np.testing.assert_array_equal(d.lengths, np.full(60, 4.0))  # n_tokens picked up for per-token TTC
    np.testing.assert_array_equal(d.frame["oracle_label"].notna().to_numpy(), sim.labelled)
    ld = d.logged_data("a")
    np.testing.assert_allclose(ld.log_w, sim.target_logprob["a"] - sim.logger_logprob)
    assert d.fresh_data("a") is None
    # with a policy column the logger is the policy whose rows carry the logger log-probability
    assert load_offpolicy(logged).logger == "base"
    assert load_offpolicy(logged, targets=["b"]).targets == ("b",)


def test_logger_logprob_aliases():
    _, logged, _ = _frames()
    for alias in ("logger_logprob", "base_policy_logprob"):
        d = load_offpolicy(logged.rename(columns={"base_logprob": alias}))
        assert d.logger_column == alias
    d = load_offpolicy(logged.rename(columns={"base_logprob": "lp0"}), logger_column="lp0")
    assert d.logger_column == "lp0"


def test_arena_shape_file_and_folder(arena_dir):
    d = load_offpolicy(arena_dir / "logged_data.jsonl", logger_policy="base")
    assert d.targets == ("clone", "parallel_universe_prompt", "unhelpful")
    assert d.n_logged == 1000 and int(d.frame["oracle_label"].notna().sum()) == 480
    first = json.loads(open(arena_dir / "logged_data.jsonl", encoding="utf-8").readline())
    assert d.frame["prompt_id"].iloc[0] == first["metadata"]["prompt_id"]
    assert d.target_logprob["unhelpful"][0] == pytest.approx(min(first["target_policy_logprobs"]["unhelpful"], 0))
    # the folder in hybrid mode: fresh draws of the candidates (probe labels joined), not of the logger
    h = load_offpolicy(arena_dir, mode="hybrid", logger_policy="base")
    assert {t: h.fresh_rows(t).size for t in h.targets} == {"clone": 1000, "parallel_universe_prompt": 1000,
                                                            "unhelpful": 1000}
    labels = h.frame["oracle_label"].to_numpy()[h.fresh_rows("unhelpful")]
    assert int(np.sum(~np.isnan(labels))) == 50  # the probe slice
    assert any("fresh draw(s) of base" in n for n in h.notes)


def test_long_format_equals_wide():
    _, logged, _ = _frames()
    long = []
    for pol, col in (("base", "base_logprob"), ("a", "logprob__a"), ("b", "logprob__b")):
        part = logged.drop(columns=["base_logprob", "logprob__a", "logprob__b"]).copy()
        part["policy"], part["logprob"] = pol, logged[col].to_numpy()
        long.append(part)
    long = pd.concat(long, ignore_index=True).sample(frac=1.0, random_state=1)  # any row order
    d_long = load_offpolicy(long, logger_policy="base")
    d_wide = load_offpolicy(logged)
    order = np.argsort(d_long.frame["response_id"].to_numpy())
    ref = np.argsort(d_wide.frame["response_id"].to_numpy())
    for t in ("a", "b"):
        np.testing.assert_array_equal(d_long.target_logprob[t][order], d_wide.target_logprob[t][ref])
    np.testing.assert_array_equal(d_long.logger_logprob[order], d_wide.logger_logprob[ref])
    with pytest.raises(CJEInputError, match="needs logger="):
        load_offpolicy(long)
    # a response without a log-probability under 'b': a length mismatch naming the logger's row
    drop = long.index[(long["policy"] == "b")][0]
    rid = long.loc[drop, "response_id"]
    short = long.drop(index=drop).reset_index(drop=True)
    with pytest.raises(CJEInputError, match="length mismatch") as err:
        load_offpolicy(short, logger_policy="base")
    row = int(np.flatnonzero((short["response_id"] == rid) & (short["policy"] == "base"))[0])
    assert err.value.column == "logprob" and err.value.row == row
    dup = pd.concat([long, long.iloc[[0]]], ignore_index=True)
    with pytest.raises(CJEInputError, match="two log-probabilities"):
        load_offpolicy(dup, logger_policy="base")


def _arena_rows(n=30):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        lp0 = float(-rng.uniform(5, 40))
        rows.append({"prompt": f"q{i}", "response": f"r{i}", "base_policy_logprob": lp0,
                     "target_policy_logprobs": {"x": lp0 + float(rng.normal()), "y": lp0 - 3.0},
                     "metadata": {"prompt_id": f"p{i}"}, "judge_score": float(rng.choice([0.2, 0.5, 0.8])),
                     **({"oracle_label": float(rng.choice([0.0, 0.5, 1.0]))} if i % 2 == 0 else {})})
    return rows


@pytest.mark.parametrize("field,value,column,what", [
    ("base_policy_logprob", float("nan"), "base_policy_logprob", "missing or NaN"),
    ("base_policy_logprob", None, "base_policy_logprob", "missing or NaN"),
    ("base_policy_logprob", 3.0, "base_policy_logprob", "positive"),
    ("base_policy_logprob", float("-inf"), "base_policy_logprob", "must be positive"),
    ("base_policy_logprob", float("inf"), "base_policy_logprob", r"\+inf"),
    ("x", float("nan"), "logprob__x", "missing or NaN"),
    ("x", float("inf"), "logprob__x", r"\+inf"),
    ("x", 0.5, "logprob__x", "positive"),
    ("x", "abc", "logprob__x", "not a number"),
])
def test_bad_log_probabilities_name_file_column_row(tmp_path, field, value, column, what):
    rows = _arena_rows()
    if field == "base_policy_logprob":
        rows[7][field] = value
    else:
        rows[7]["target_policy_logprobs"][field] = value
    path = _jsonl(tmp_path / "logged.jsonl", rows)
    with pytest.raises(CJEInputError, match=what) as err:
        load_offpolicy(path)
    e = err.value
    assert (e.source, e.column, e.row) == (str(path), column, 7)
    assert str(path) in str(e) and f"column '{column}'" in str(e) and "row 7" in str(e)


def test_candidate_minus_inf_is_a_zero_weight_but_all_zero_is_an_error(tmp_path):
    _, logged, _ = _frames()
    one = logged.copy()
    one.loc[3, "logprob__a"] = -np.inf
    d = load_offpolicy(one)
    assert d.logged_data("a").log_w[3] == -np.inf
    allzero = logged.copy()
    allzero["logprob__a"] = -np.inf
    path = tmp_path / "logs.parquet"
    allzero.to_parquet(path)
    with pytest.raises(CJEInputError, match="all importance weights are zero") as err:
        load_offpolicy(path)
    assert err.value.source == str(path) and err.value.column == "logprob__a"
    assert "collect fresh draws" in str(err.value)


def test_missing_columns_and_ambiguous_logger(tmp_path):
    _, logged, fresh = _frames()
    path = tmp_path / "logs.csv"
    logged.to_csv(path, index=False)
    with pytest.raises(CJEInputError, match="no log-probabilities for candidate 'c'") as err:
        load_offpolicy(path, targets=["a", "c"])
    assert err.value.column == "logprob__c" and err.value.source == str(path)
    with pytest.raises(CJEInputError, match="no logger log-probability column") as err:
        load_offpolicy(logged.drop(columns=["base_logprob"]))
    assert err.value.column == "base_logprob"
    with pytest.raises(CJEInputError, match="no candidate policies"):
        load_offpolicy(logged.drop(columns=["logprob__a", "logprob__b"]))
    two = pd.concat([logged, logged.assign(policy="other", response_id=lambda f: "o" + f["response_id"])])
    with pytest.raises(CJEInputError, match="several policies"):
        load_offpolicy(two)
    with pytest.raises(CJEInputError, match="is the logger"):
        load_offpolicy(logged, targets=["base"])
    with pytest.raises(CJEInputError, match="mode must be"):
        load_offpolicy(logged, mode="direct")


def test_engine_validation_names_the_original_row():
    """Errors found by cje_engine.data.io.load_frame (scores, labels, ids) point at the input's row even
    when logged rows and fresh draws are interleaved in one table."""
    _, logged, fresh = _frames()
    combined = pd.concat([fresh.iloc[:5], logged, fresh.iloc[5:]], ignore_index=True)
    bad = combined.copy()
    row = 5 + 10  # logged row 10
    bad.loc[row, "judge_score"] = 1.7
    with pytest.raises(CJEInputError, match="score") as err:
        load_offpolicy(bad, mode="hybrid")
    assert err.value.row == row and err.value.source == "<DataFrame>" and err.value.column == "judge_score"
    bad = combined.copy()
    bad.loc[2, "judge_score"] = np.nan  # a fresh draw
    with pytest.raises(CJEInputError) as err:
        load_offpolicy(bad, mode="hybrid")
    assert err.value.row == 2 and err.value.column == "judge_score"


def test_combined_table_hybrid_and_logs_only():
    sim, logged, fresh = _frames()
    combined = pd.concat([logged, fresh], ignore_index=True)
    h = load_offpolicy(combined, mode="hybrid")
    assert h.n_logged == 60 and h.fresh_rows("a").size == 60 and h.fresh_rows("b").size == 60
    fd = h.fresh_data("a")
    np.testing.assert_array_equal(fd.scores, sim.fresh["a"].scores)
    np.testing.assert_array_equal(fd.target_logprob, sim.fresh["a"].target_logprob)  # TTC's fresh reference
    lo = load_offpolicy(combined, mode="logs-only")
    assert lo.frame.shape[0] == 60 and any("fresh draws in the input were ignored" in n for n in lo.notes)
    # fresh draws given separately
    s = load_offpolicy(logged, fresh, mode="hybrid")
    np.testing.assert_array_equal(s.fresh_data("b").scores, sim.fresh["b"].scores)
    # hybrid without any fresh draw of a candidate is an error; one candidate without them is a note
    with pytest.raises(CJEInputError, match="hybrid mode needs fresh draws"):
        load_offpolicy(logged, mode="hybrid")
    part = load_offpolicy(logged, fresh[fresh["policy"] == "a"], mode="hybrid")
    assert part.fresh_data("b") is None and any("no fresh draws of b" in n for n in part.notes)
    clash = fresh.copy()
    clash.loc[0, "response_id"] = logged.loc[0, "response_id"]
    with pytest.raises(CJEInputError, match="response_id"):
        load_offpolicy(logged, clash, mode="hybrid")


def test_bad_token_counts_and_projection_columns():
    _, logged, _ = _frames()
    bad = logged.copy()
    bad.loc[4, "n_tokens"] = 0
    with pytest.raises(CJEInputError, match="token count") as err:
        load_offpolicy(bad)
    assert err.value.row == 4 and err.value.column == "n_tokens"
    assert projection_columns(["a", "b"]) == ["base_logprob", "logprob__a", "logprob__b"]
    assert projection_columns(["a"], logger_column="logger_logprob", length_column="n_tokens") == [
        "logger_logprob", "logprob__a", "n_tokens"]


def test_unreadable_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{not json\n')
    with pytest.raises(CJEInputError, match="not valid JSON") as err:
        load_offpolicy(bad)
    assert err.value.row == 1
    with pytest.raises(CJEInputError, match="does not exist"):
        load_offpolicy(tmp_path / "nope.jsonl")
    with pytest.raises(CJEInputError, match="unsupported"):
        load_offpolicy(42)

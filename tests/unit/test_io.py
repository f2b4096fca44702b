"""Loading and validating evaluation data (`cje_engine.data.io.load_frame`)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cje_engine.errors import CJEInputError
from cje_engine.data.io import load_frame

CANONICAL = ["prompt_id", "policy", "judge_score", "oracle_label", "label_probability", "response_id"]


# ----------------------------------------------------------------------------- helpers
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_frame(n_prompts: int = 6, policies=("a", "b")) -> pd.DataFrame:
    """A small valid frame: every row of policy a labelled, b unlabelled."""
    rows = []
    for pol in policies:
        for i in range(n_prompts):
            rows.append(
                {
                    "prompt_id": f"q{i}",
                    "policy": pol,
                    "judge_score": round(0.1 * (i % 5) + 0.1, 2),
                    "oracle_label": (0.2 * (i % 4)) if pol == policies[0] else None,
                }
            )
    return pd.DataFrame(rows)


def fresh_row(i: int, score: float = 0.5, label: float | None = None, response: str | None = None) -> dict:
    row = {"prompt_id": f"arena_{i}", "prompt": f"prompt {i}", "response": response or f"answer number {i}",
           "judge_score": score, "draw_idx": 0}
    if label is not None:
        row["oracle_label"] = label
    return row


def make_arena(root: Path, *, base_labels=True, probe_rows=None, extra_fresh=None) -> Path:
    """A tiny arena layout: base (labelled on even prompts) and 'other' (probe-labelled)."""
    base = [fresh_row(i, score=0.1 * (i % 9), label=(0.25 * (i % 4)) if base_labels and i % 2 == 0 else None)
            for i in range(10)]
    other = [fresh_row(i, score=0.05 * (i % 7), response=f"other says {i}") for i in range(10)]
    write_jsonl(root / "fresh_draws" / "base_responses.jsonl", base)
    write_jsonl(root / "fresh_draws" / "other_responses.jsonl", other)
    if extra_fresh:
        for name, rows in extra_fresh.items():
            write_jsonl(root / "fresh_draws" / f"{name}_responses.jsonl", rows)
    if probe_rows is None:
        probe_rows = [dict(other[i], oracle_label=0.1 * i) for i in (1, 3, 5)]
    write_jsonl(root / "probe_slice" / "other_probe.jsonl", probe_rows)
    write_jsonl(root / "logged_data.jsonl", [{"this": "is ignored"}])
    return root


def raises(match: str, **where):
    """pytest.raises for CJEInputError; also checks the source/column/row attributes given."""

    class _Ctx:
        def __enter__(self):
            self._ctx = pytest.raises(CJEInputError, match=match)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self._ctx.__exit__(*exc)
            err = self.info.value
            for key, value in where.items():
                assert getattr(err, key) == value, (key, getattr(err, key), str(err))
            return out

    return _Ctx()


# ----------------------------------------------------------------------------- the real arena sample
def test_arena_sample_joins_probes_onto_fresh_draws(arena_dir: Path):
    frame = load_frame(arena_dir, covariates=["response_length"])
    assert list(frame.columns[:6]) == CANONICAL
    assert "response" in frame.columns and "response_length" in frame.columns

    # Independent expectation read straight from the JSONL files.
    fresh = {p.name[: -len("_responses.jsonl")]: [json.loads(line) for line in p.open()]
             for p in (arena_dir / "fresh_draws").glob("*_responses.jsonl")}
    probes = {p.name[: -len("_probe.jsonl")]: [json.loads(line) for line in p.open()]
              for p in (arena_dir / "probe_slice").glob("*_probe.jsonl")}
    assert len(frame) == sum(len(v) for v in fresh.values())  # probes joined, not appended
    assert frame["response_id"].is_unique
    for pol, rows in fresh.items():
        sub = frame[frame["policy"] == pol]
        own = [r["oracle_label"] for r in rows if r.get("oracle_label") is not None]
        from_probe = [r["oracle_label"] for r in probes.get(pol, [])]
        labels = sub["oracle_label"].dropna()
        assert len(labels) == len(own) + len(from_probe)
        assert labels.sum() == pytest.approx(sum(own) + sum(from_probe))
        assert sub["judge_score"].mean() == pytest.approx(np.mean([r["judge_score"] for r in rows]))
    # Every probe label sits on the fresh row with the same prompt and response.
    for pol, rows in probes.items():
        sub = frame[frame["policy"] == pol].set_index(["prompt_id", "response"])
        for r in rows:
            assert sub.loc[(r["prompt_id"], r["response"]), "oracle_label"] == r["oracle_label"]
    # response_length is the whitespace token count of the response text.
    expect = frame["response"].map(lambda t: len(t.split()))
    assert (frame["response_length"] == expect).all()
    # Labelled rows get probability 1 (MCAR within policy), unlabelled NaN.
    lab = frame["oracle_label"].notna()
    assert (frame.loc[lab, "label_probability"] == 1.0).all()
    assert frame.loc[~lab, "label_probability"].isna().all()
    assert frame["response_id"].str.match(r"^[a-z_]+:arena_\d+:0$").all()
    assert frame.attrs["sources"][0].endswith("_responses.jsonl")


def test_arena_policies_filter(arena_dir: Path):
    frame = load_frame(arena_dir, policies=["base", "unhelpful"])
    assert sorted(frame["policy"].unique()) == ["base", "unhelpful"]
    assert len(frame) == 2000


# ----------------------------------------------------------------------------- formats
def test_parquet_jsonl_csv_table_and_frame_agree(tmp_path: Path):
    df = good_frame()
    pq.write_table(pa.Table.from_pandas(df), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", [{k: v for k, v in r.items() if v is not None and v == v}
                                       for r in df.to_dict("records")])
    df.to_csv(tmp_path / "d.csv", index=False)
    ref = load_frame(df)
    for src in (tmp_path / "d.parquet", str(tmp_path / "d.jsonl"), tmp_path / "d.csv", pa.Table.from_pandas(df)):
        got = load_frame(src)
        pd.testing.assert_frame_equal(got, ref, check_dtype=True)
    assert ref["judge_score"].dtype == np.float64 and ref["oracle_label"].dtype == np.float64
    assert ref["response_id"].tolist()[:2] == ["a:q0:0", "a:q1:0"]


def test_parquet_folder_with_hive_partitions(tmp_path: Path):
    df = good_frame()
    for pol, sub in df.groupby("policy"):
        folder = tmp_path / "data" / f"policy={pol}"
        folder.mkdir(parents=True)
        pq.write_table(pa.Table.from_pandas(sub.drop(columns="policy"), preserve_index=False), folder / "part-0.parquet")
    (tmp_path / "data" / "_SUCCESS").write_text("")
    got = load_frame(tmp_path / "data")
    assert len(got) == len(df)
    assert sorted(got["policy"].unique()) == ["a", "b"]
    assert got["oracle_label"].notna().sum() == df["oracle_label"].notna().sum()


def test_parquet_folder_skips_work_folders_and_names_a_dangling_symlink(tmp_path: Path):
    """Spark's ``_temporary/`` and ``.staging/`` inside a partition are not data; a dangling link is an error."""
    import os

    df = good_frame()
    folder = tmp_path / "data" / "dt=2025-03-01"
    for sub in (folder, folder / "_temporary" / "0" / "task_1", folder / ".staging"):
        sub.mkdir(parents=True)
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), sub / "part-0.parquet")
    assert len(load_frame(tmp_path / "data")) == len(df)
    os.symlink(tmp_path / "gone.parquet", folder / "part-1.parquet")
    with raises("symbolic link whose target does not exist", source=str(folder / "part-1.parquet")):
        load_frame(tmp_path / "data")


def test_hive_partition_disagreeing_with_column(tmp_path: Path):
    folder = tmp_path / "data" / "policy=a"
    folder.mkdir(parents=True)
    df = good_frame(policies=("b", "c"))
    pq.write_table(pa.Table.from_pandas(df), folder / "x.parquet")
    with raises("disagrees with the hive partition policy=a", column="policy", row=0):
        load_frame(tmp_path / "data")


def test_list_of_sources_concatenates_and_names_each(tmp_path: Path):
    df = good_frame()
    a, b = df[df.policy == "a"], df[df.policy == "b"]
    got = load_frame([a, b.assign(judge_score=b.judge_score.astype(str))])
    assert len(got) == len(df)
    bad = b.copy()
    bad.loc[bad.index[2], "judge_score"] = 7.0
    with raises("outside the declared score_scale", source="<DataFrame #1>", column="judge_score", row=2):
        load_frame([a, bad])


def test_numeric_strings_and_keep_columns(tmp_path: Path):
    df = good_frame().assign(ts=pd.date_range("2024-01-01", periods=12, freq="D"))
    df["judge_score"] = df["judge_score"].astype(str)
    got = load_frame(df, keep_columns=["ts"])
    assert got["judge_score"].dtype == np.float64
    assert (got["ts"] == df["ts"]).all()
    with raises("keep_columns asks for 'nope'", column="nope"):
        load_frame(df, keep_columns=["nope"])


def test_label_probability_kept_on_labelled_rows_only():
    df = good_frame().assign(label_probability=0.25)
    got = load_frame(df)
    lab = got["oracle_label"].notna()
    assert (got.loc[lab, "label_probability"] == 0.25).all()
    assert got.loc[~lab, "label_probability"].isna().all()


def test_given_response_ids_are_kept():
    df = good_frame().assign(response_id=[f"r{i}" for i in range(12)])
    assert load_frame(df)["response_id"].tolist() == [f"r{i}" for i in range(12)]


def test_several_draws_per_prompt_distinguished_by_text_or_draw_idx():
    df = good_frame()
    two = pd.concat([df.assign(response="x"), df.assign(response="y")], ignore_index=True)
    got = load_frame(two)
    assert got["response_id"].is_unique
    assert set(got["response_id"].str.rsplit(":", n=1).str[1]) == {"0", "1"}
    same_text = pd.concat([df.assign(response="x", draw_idx=0), df.assign(response="x", draw_idx=1)])
    assert load_frame(same_text)["response_id"].is_unique


# ----------------------------------------------------------------------------- covariates
def test_covariates_present_derived_missing_and_nonfinite():
    df = good_frame().assign(response=["one two  three"] * 12, x=np.arange(12.0))
    got = load_frame(df, covariates=["response_length", "x"])
    assert (got["response_length"] == 3).all() and got["x"].dtype == np.float64
    with raises("covariate 'z' was requested but is not a column", column="z"):
        load_frame(df, covariates=["z"])
    with raises("can be derived only from a 'response' text column", column="response_length"):
        load_frame(good_frame(), covariates=["response_length"])
    bad = df.assign(x=np.r_[np.arange(5.0), np.inf, np.arange(6.0)])
    with raises("covariates must be finite numbers", column="x", row=5):
        load_frame(bad, covariates=["x"])
    nan = df.assign(x=np.r_[np.arange(3.0), np.nan, np.arange(8.0)])
    with raises("covariates must be finite numbers", column="x", row=3):
        load_frame(nan, covariates=["x"])
    text_missing = df.copy()
    text_missing.loc[4, "response"] = None
    with raises("response_length cannot be derived", column="response", row=4):
        load_frame(text_missing, covariates=["response_length"])


# ----------------------------------------------------------------------------- failure modes: columns and types
@pytest.mark.parametrize("col", ["prompt_id", "policy", "judge_score"])
def test_missing_required_column(col):
    with raises("required column is missing", column=col, source="<DataFrame>"):
        load_frame(good_frame().drop(columns=col))


def test_mistyped_judge_score_names_first_bad_row(tmp_path: Path):
    rows = good_frame().to_dict("records")
    rows[4]["judge_score"] = "great"
    rows[7]["judge_score"] = "bad"
    for r in rows:
        if r["oracle_label"] != r["oracle_label"]:
            del r["oracle_label"]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with raises("expected a number, got 'great'", source=str(path), column="judge_score", row=4):
        load_frame(path)
    csv = tmp_path / "mixed.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    with raises("expected a number, got 'great'", source=str(csv), column="judge_score", row=4):
        load_frame(csv)


def test_boolean_scores_are_refused():
    df = good_frame()
    df["judge_score"] = [True, False] * 6
    with raises("got booleans", column="judge_score"):
        load_frame(df)


def test_missing_prompt_id_value():
    df = good_frame()
    df.loc[3, "prompt_id"] = None
    with raises("missing value", column="prompt_id", row=3):
        load_frame(df)


def test_nan_and_inf_judge_scores():
    df = good_frame()
    df.loc[2, "judge_score"] = np.nan
    with raises("judge score is missing", column="judge_score", row=2):
        load_frame(df)
    df.loc[2, "judge_score"] = np.inf
    with raises("expected a finite number", column="judge_score", row=2):
        load_frame(df)


def test_judge_score_outside_scale_suggests_declaring_it():
    df = good_frame()
    df["judge_score"] = df["judge_score"] * 100
    with raises(r"outside the declared score_scale \[0, 1\].*score_scale='0-100'", column="judge_score", row=0):
        load_frame(df)
    assert load_frame(df, score_scale="0-100")["judge_score"].max() == pytest.approx(50.0)
    assert load_frame(df, score_scale=None)["judge_score"].max() == pytest.approx(50.0)


def test_oracle_label_outside_scale_or_inf():
    df = good_frame()
    df["oracle_label"] = df["oracle_label"] * 10 + 1  # labels 1..7 on a 1-10 scale
    with raises(r"outside the declared label_scale.*label_scale=.0-10. or label_scale=.1-10..*never guessed", column="oracle_label", row=1):
        load_frame(df)
    assert load_frame(df, label_scale="1-10")["oracle_label"].max() == pytest.approx(7.0)
    df2 = good_frame()
    df2["oracle_label"] = df2["oracle_label"] * 100
    with raises(r"label_scale='0-100'", column="oracle_label"):
        load_frame(df2)
    df3 = good_frame()
    df3.loc[1, "oracle_label"] = -np.inf
    with raises("expected a finite number", column="oracle_label", row=1):
        load_frame(df3)
    with raises("label_scale must be declared"):
        load_frame(good_frame(), label_scale=None)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.2, np.nan])
def test_label_probability_outside_unit_interval_on_labelled_rows(bad):
    df = good_frame().assign(label_probability=0.5)
    df.loc[3, "label_probability"] = bad  # row 3 is labelled (policy a)
    with raises("expected a probability in", column="label_probability", row=3):
        load_frame(df)
    # The same value on an unlabelled row is ignored.
    df2 = good_frame().assign(label_probability=0.5)
    df2.loc[8, "label_probability"] = bad  # policy b, unlabelled
    assert np.isnan(load_frame(df2)["label_probability"].iloc[8])


def test_bad_draw_idx():
    df = good_frame().assign(draw_idx=[0] * 5 + [1.5] + [0] * 6)
    with raises("non-negative whole number", column="draw_idx", row=5):
        load_frame(df)


# ----------------------------------------------------------------------------- failure modes: duplicates
def test_duplicate_rows_within_one_input():
    df = good_frame().assign(response="same text")
    dup = pd.concat([df, df.iloc[[7]]], ignore_index=True)
    with raises("duplicate row.*same as row 7 of <DataFrame>", row=12):
        load_frame(dup)


def test_duplicate_prompt_policy_without_any_identity_suggests_draw_idx():
    df = good_frame()
    dup = pd.concat([df, df.iloc[[9]]], ignore_index=True)
    with raises("add a draw_idx or response_id", row=12):
        load_frame(dup)


def test_duplicate_response_id():
    df = good_frame().assign(response_id=[f"r{i}" for i in range(12)])
    df.loc[10, "response_id"] = "r3"
    with raises(r"same response_id", row=10):
        load_frame(df)


def test_labelled_row_supplied_twice_across_inputs(tmp_path: Path):
    df = good_frame().assign(response=[f"t{i}" for i in range(12)])
    path = tmp_path / "extra.parquet"
    pq.write_table(pa.Table.from_pandas(df.iloc[[2]]), path)
    with raises("same labelled row.*supplied twice.*counted twice", source=str(path), row=0):
        load_frame([df, path])


def test_row_in_fresh_file_with_label_and_again_in_probe(tmp_path: Path):
    root = tmp_path / "arena"
    base_row = fresh_row(2, score=0.2, label=0.5)
    make_arena(root)
    write_jsonl(root / "probe_slice" / "base_probe.jsonl", [base_row])
    with raises("same labelled row is supplied twice.*base_responses.jsonl", source=str(root / "probe_slice" / "base_probe.jsonl"), row=0):
        load_frame(root)


# ----------------------------------------------------------------------------- arena layout specifics
def test_tiny_arena_probe_join(tmp_path: Path):
    root = make_arena(tmp_path / "arena")
    got = load_frame(root)
    assert len(got) == 20
    other = got[got.policy == "other"].set_index("prompt_id")
    assert other["oracle_label"].notna().sum() == 3
    assert other.loc["arena_3", "oracle_label"] == pytest.approx(0.3)
    assert other.loc["arena_3", "response_id"] == "other:arena_3:0"


def test_probe_row_without_matching_fresh_row(tmp_path: Path):
    probe = [dict(fresh_row(1, score=0.05, response="other says 1"), oracle_label=0.4),
             dict(fresh_row(4, score=0.2, response="a different answer"), oracle_label=0.4)]
    root = make_arena(tmp_path / "arena", probe_rows=probe)
    with raises("no matching fresh-draw row of policy 'other'", source=str(root / "probe_slice" / "other_probe.jsonl"), row=1):
        load_frame(root)


def test_probe_score_disagreeing_with_fresh_row(tmp_path: Path):
    probe = [dict(fresh_row(1, score=0.9, response="other says 1"), oracle_label=0.4)]
    root = make_arena(tmp_path / "arena", probe_rows=probe)
    with raises("differs from the matching fresh-draw row", column="judge_score", row=0):
        load_frame(root)


def test_probe_rows_repeated(tmp_path: Path):
    r = dict(fresh_row(1, score=0.05, response="other says 1"), oracle_label=0.4)
    root = make_arena(tmp_path / "arena", probe_rows=[r, dict(r, oracle_label=0.6)])
    with raises("repeats an earlier probe row", row=1):
        load_frame(root)


def test_probe_without_label(tmp_path: Path):
    r = fresh_row(1, score=0.05, response="other says 1")
    root = make_arena(tmp_path / "arena", probe_rows=[dict(r, oracle_label=0.2), r])
    with raises("probe row has no oracle label", column="oracle_label", row=1):
        load_frame(root)


def test_probe_for_policy_without_fresh_draws(tmp_path: Path):
    root = make_arena(tmp_path / "arena")
    write_jsonl(root / "probe_slice" / "ghost_probe.jsonl", [dict(fresh_row(1), oracle_label=0.2)])
    with raises("no fresh_draws/ghost_responses.jsonl", source=str(root / "probe_slice" / "ghost_probe.jsonl")):
        load_frame(root)


def test_policy_field_disagreeing_with_file_name(tmp_path: Path):
    rows = [dict(fresh_row(i, score=0.1 * i), policy="x" if i == 3 else "extra") for i in range(5)]
    root = make_arena(tmp_path / "arena", extra_fresh={"extra": rows})
    with raises("disagrees with the file name", column="policy", row=3):
        load_frame(root)


def test_arena_without_fresh_files(tmp_path: Path):
    (tmp_path / "arena" / "fresh_draws").mkdir(parents=True)
    with raises("no fresh-draw files"):
        load_frame(tmp_path / "arena")


# ----------------------------------------------------------------------------- whole-data checks
def test_requested_policy_without_rows():
    with raises("policy 'zeta' was requested but has no rows", column="policy"):
        load_frame(good_frame(), policies=["a", "zeta"])


def test_no_labelled_rows():
    with raises("no row has an oracle label", column="oracle_label"):
        load_frame(good_frame().assign(oracle_label=np.nan))


def test_single_distinct_label_value():
    df = good_frame()
    df.loc[df.oracle_label.notna(), "oracle_label"] = 0.7
    with raises("same oracle label 0.7", column="oracle_label"):
        load_frame(df)


def test_single_distinct_judge_score():
    with raises("every judge score is 0.4", column="judge_score"):
        load_frame(good_frame().assign(judge_score=0.4))


def test_labels_only_in_filtered_out_policy():
    with raises("no row has an oracle label"):
        load_frame(good_frame(), policies=["b"])


# ----------------------------------------------------------------------------- failure modes: files
def test_empty_inputs(tmp_path: Path):
    (tmp_path / "e.jsonl").write_text("")
    with raises("file is empty", source=str(tmp_path / "e.jsonl")):
        load_frame(tmp_path / "e.jsonl")
    (tmp_path / "h.csv").write_text("prompt_id,policy,judge_score\n")
    with raises("0 rows", source=str(tmp_path / "h.csv")):
        load_frame(tmp_path / "h.csv")
    pq.write_table(pa.Table.from_pandas(good_frame().iloc[:0]), tmp_path / "z.parquet")
    with raises("0 rows", source=str(tmp_path / "z.parquet")):
        load_frame(tmp_path / "z.parquet")
    with raises("0 rows", source="<DataFrame #1>"):
        load_frame([good_frame(), good_frame().iloc[:0]])
    with raises("no input was given"):
        load_frame([])


def test_corrupt_parquet_names_file(tmp_path: Path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"this is not parquet at all" * 10)
    with raises("not a readable Parquet file", source=str(bad)):
        load_frame(bad)
    folder = tmp_path / "folder"
    folder.mkdir()
    pq.write_table(pa.Table.from_pandas(good_frame()), folder / "ok.parquet")
    (folder / "zz.parquet").write_bytes(b"PAR1 garbage")
    with raises("not a readable Parquet file", source=str(folder / "zz.parquet")):
        load_frame(folder)


def test_invalid_json_line(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_id": "a", "policy": "p", "judge_score": 0.5}\n{"prompt_id": "b", oops}\n')
    with raises("line 2 is not valid JSON", source=str(path), row=1):
        load_frame(path)
    path.write_text('{"prompt_id": "a", "policy": "p", "judge_score": 0.5}\n[1, 2]\n')
    with raises("expected one JSON object per line", source=str(path), row=1):
        load_frame(path)


def test_unsupported_extension_missing_path_and_bad_objects(tmp_path: Path):
    (tmp_path / "data.xlsx").write_text("x")
    with raises("unsupported file type '.xlsx'", source=str(tmp_path / "data.xlsx")):
        load_frame(tmp_path / "data.xlsx")
    with raises("path does not exist", source=str(tmp_path / "nope.parquet")):
        load_frame(tmp_path / "nope.parquet")
    with raises("unsupported source of type int"):
        load_frame(42)
    with raises("folder has no Parquet files", source=str(tmp_path)):
        load_frame(tmp_path)


# ----------------------------------------------------------------------------- scale
@pytest.mark.slow
def test_ten_million_rows_validate_in_seconds():
    from cje_engine.simulate.direct import simulate

    frame = simulate(2_000_000, seed=3).frame  # 5 policies -> 10 million rows
    start = time.process_time()
    got = load_frame(frame, covariates=["response_length"])
    cpu = time.process_time() - start
    assert len(got) == 10_000_000
    # Budget: measured ~4 s of CPU on a busy 2-core machine; 30 s means something went quadratic.
    assert cpu < 30, cpu


# ----------------------------------------------------------------------------- smaller rules
def test_numeric_prompt_ids_become_stable_strings():
    df = good_frame()
    df["prompt_id"] = df["prompt_id"].str[1:].astype(float)  # 0.0, 1.0, ... as read from some CSVs
    got = load_frame(df)
    assert got["prompt_id"].iloc[:3].tolist() == ["0", "1", "2"]
    assert got["response_id"].iloc[1] == "a:1:0"


def test_empty_string_policy():
    df = good_frame()
    df.loc[5, "policy"] = ""
    with raises("empty string", column="policy", row=5):
        load_frame(df)


def test_booleans_mixed_into_an_object_column():
    df = good_frame()
    df["judge_score"] = df["judge_score"].astype(object)
    df.loc[6, "judge_score"] = True
    with raises("expected a number, got True", column="judge_score", row=6):
        load_frame(df)


def test_option_errors():
    with raises("canonical column"):
        load_frame(good_frame(), covariates=["judge_score"])
    with raises("nested list"):
        load_frame([good_frame(), [good_frame()]])
    with raises("must be a list of column names"):
        load_frame(good_frame(), covariates=3)
    df = good_frame()
    df.columns = ["prompt_id", "policy", "judge_score", "policy"]
    with raises("column appears more than once", column="policy"):
        load_frame(df)


def test_probe_matching_several_fresh_rows(tmp_path: Path):
    root = make_arena(tmp_path / "arena", probe_rows=[{"prompt_id": "arena_2", "oracle_label": 0.5}])
    rows = [json.loads(x) for x in (root / "fresh_draws" / "other_responses.jsonl").read_text().splitlines()]
    rows.append(dict(rows[2], response="second draw", draw_idx=1))
    write_jsonl(root / "fresh_draws" / "other_responses.jsonl", rows)
    with raises("matches 2 fresh-draw rows", row=0):
        load_frame(root)
    # With the draw index the match is unique again.
    write_jsonl(root / "probe_slice" / "other_probe.jsonl", [{"prompt_id": "arena_2", "draw_idx": 1, "oracle_label": 0.5}])
    got = load_frame(root)
    assert got.set_index("response_id").loc["other:arena_2:1", "oracle_label"] == 0.5


def test_csv_with_a_bad_value_after_the_first_block(tmp_path: Path):
    # A bad value far from the start of a numeric column is still reported by its row.
    n = 60_000
    df = pd.DataFrame({"prompt_id": [f"p{i}" for i in range(n)], "policy": "a",
                       "judge_score": np.tile([0.25, 0.5, 0.75], n // 3), "oracle_label": 0.5})
    df.loc[::2, "oracle_label"] = 1.0
    df["judge_score"] = df["judge_score"].astype(object)
    df.loc[n - 7, "judge_score"] = "n/a?"
    path = tmp_path / "big.csv"
    df.to_csv(path, index=False)
    with raises("expected a number, got 'n/a\\?'", source=str(path), column="judge_score", row=n - 7):
        load_frame(path)


def test_sparse_integer_keys_use_the_hash_path():
    from cje_engine.data.identity import repeated_values

    key = np.array([5, 10**12, 7, 10**12 + 1, 5], dtype=np.int64)
    assert repeated_values(key, 10**13).tolist() == [True, False, False, False, True]
    assert repeated_values(np.array([0, 3, 2, 3]), 4).tolist() == [False, True, False, True]


def test_malformed_and_empty_csv(tmp_path: Path):
    path = tmp_path / "ragged.csv"
    path.write_text("prompt_id,policy,judge_score\np1,a,0.5\np2,a,0.5,9,9\n")
    with raises("not a readable CSV file", source=str(path)):
        load_frame(path)
    (tmp_path / "empty.csv").write_text("")
    with raises("file is empty", source=str(tmp_path / "empty.csv")):
        load_frame(tmp_path / "empty.csv")


def test_jsonl_blank_lines_and_single_covariate_name(tmp_path: Path):
    rows = [dict(r, response="a b") for r in good_frame().to_dict("records")]
    for r in rows:
        if r["oracle_label"] != r["oracle_label"]:
            del r["oracle_label"]
    rows[3]["judge_score"] = "0.3"  # mixed types force the line-by-line reader
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n".join(json.dumps(r) + "\n" for r in rows))
    got = load_frame(path, covariates="response_length")
    assert len(got) == 12 and (got["response_length"] == 2).all()
    assert got["judge_score"].iloc[3] == pytest.approx(0.3)


def test_mistyped_oracle_label():
    df = good_frame()
    df["oracle_label"] = df["oracle_label"].astype(object)
    df.loc[2, "oracle_label"] = "good"
    with raises("expected a number, got 'good'", column="oracle_label", row=2):
        load_frame(df)


def test_keep_columns_keep_their_dtype():
    ts = pd.date_range("2024-01-01", periods=12, freq="h", tz="UTC")
    got = load_frame(good_frame().assign(ts=ts), keep_columns=["ts"])
    assert got["ts"].dtype == ts.dtype and (got["ts"] == ts).all()

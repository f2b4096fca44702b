"""The input layer (issue 11): identifiers as text, refused inputs with file/line/hint, column mapping."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cje_engine import evaluate
from cje_engine.data.io import load_frame
from cje_engine.errors import CJEInputError



def _frame(ids, n_pol=2, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n_pol):
        s = rng.integers(0, 11, len(ids)) / 10
        for i, pid in enumerate(ids):
            rows.append({"prompt_id": pid, "policy": f"p{k}", "judge_score": s[i],
                         "oracle_label": float(np.clip(s[i] + rng.normal(0, .1), 0, 1)) if i % 2 == 0 else None})
    return pd.DataFrame(rows)


def _write_jsonl(path: Path, frame: pd.DataFrame, raw_ids: bool = False) -> Path:
    with open(path, "w") as fh:
        for rec in frame.to_dict("records"):
            rec = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in rec.items()}
            line = json.dumps(rec)
            if raw_ids:  # ids as bare JSON numbers (every digit)
                line = line.replace(f'"prompt_id": "{rec["prompt_id"]}"', f'"prompt_id": {rec["prompt_id"]}')
            fh.write(line + "\n")
    return path


def test_ids_beyond_int64_stay_distinct_in_csv_and_jsonl(tmp_path):
    ids = [str(2**70 + i) for i in range(200)]  # floats would merge these
    f = _frame(ids)
    f.to_csv(tmp_path / "a.csv", index=False)
    _write_jsonl(tmp_path / "a.jsonl", f, raw_ids=True)
    for src in (tmp_path / "a.csv", tmp_path / "a.jsonl"):
        out = load_frame(src)
        assert out.prompt_id.nunique() == 200
        assert set(out.prompt_id) == set(ids)


def test_leading_zeros_are_kept_and_distinct(tmp_path):
    ids = [f"{i}" for i in range(100)] + [f"0{i}" for i in range(100)]  # "0" vs "00", "1" vs "01"
    f = _frame(ids)
    f.to_csv(tmp_path / "a.csv", index=False)
    assert load_frame(tmp_path / "a.csv").prompt_id.nunique() == 200


def test_mixed_format_arena_pairs_the_same_ids(tmp_path):
    """Base in CSV with ids 00001, the other policy in JSONL: the prompts pair (200, not 400)."""
    ids = [f"{i:05d}" for i in range(200)]
    f = _frame(ids)
    fresh = tmp_path / "fresh_draws"
    fresh.mkdir()
    f[f.policy == "p0"].drop(columns="policy").to_csv(fresh / "base_responses.csv", index=False)
    _write_jsonl(fresh / "other_responses.jsonl", f[f.policy == "p1"].drop(columns="policy"))
    res = evaluate(tmp_path, inference="analytic").to_dict()
    assert res["data"]["n_prompts"] == 200
    # the folder of <policy>_responses files itself is accepted too, with the same result
    assert evaluate(fresh, inference="analytic").to_dict()["data"]["n_prompts"] == 200


def test_arena_fresh_draws_folder_is_accepted_directly(arena_dir):
    a = load_frame(arena_dir / "fresh_draws")
    assert sorted(a.policy.unique()) == ["base", "clone", "parallel_universe_prompt", "unhelpful"]
    assert len(a) == 4000


def test_jsonl_duplicate_key_names_file_line_and_key(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt_id": "a", "policy": "x", "judge_score": 0.5}\n'
                 '{"prompt_id": "b", "policy": "x", "judge_score": 0.5, "judge_score": 0.9}\n')
    with pytest.raises(CJEInputError) as e:
        load_frame(p)
    assert e.value.source == str(p) and e.value.column == "judge_score" and e.value.row == 1
    assert "line 2" in str(e.value) and "more than once" in str(e.value)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_latin1_text_gets_an_encoding_hint(tmp_path, suffix):
    p = tmp_path / f"l{suffix}"
    if suffix == ".csv":
        text = "prompt_id,policy,judge_score,response\na,x,0.5,ok\nb,x,0.7,caf\xe9\n"
    else:
        text = '{"prompt_id": "a", "policy": "x", "judge_score": 0.5}\n{"prompt_id": "b", "policy": "x", "r": "caf\xe9"}\n'
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(CJEInputError) as e:
        load_frame(p)
    msg = str(e.value)
    assert "not UTF-8" in msg and "line" in msg and "iconv" in msg and e.value.source == str(p)


def test_semicolon_csv_gets_a_delimiter_hint(tmp_path):
    p = tmp_path / "s.csv"
    p.write_text("prompt_id;policy;judge_score\na;x;0.5\n")
    with pytest.raises(CJEInputError, match="semicolon-delimited") as e:
        load_frame(p)
    assert e.value.source == str(p)


def test_csv_inside_a_parquet_folder_is_an_error_naming_it(tmp_path):
    f = _frame([f"q{i}" for i in range(40)])
    f.to_parquet(tmp_path / "part-0.parquet", index=False)
    f.head(3).to_csv(tmp_path / "extra.csv", index=False)
    with pytest.raises(CJEInputError, match="extra.csv"):
        load_frame(tmp_path)


def test_column_mapping_and_all_problems_at_once():
    f = _frame([f"q{i}" for i in range(40)]).rename(
        columns={"prompt_id": "id", "policy": "model", "oracle_label": "human_rating"})
    out = load_frame(f, columns={"prompt_id": "id", "policy": "model", "oracle_label": "human_rating"})
    assert {"prompt_id", "policy", "oracle_label"} <= set(out.columns)
    assert out.oracle_label.notna().sum() == 40
    with pytest.raises(CJEInputError) as e:
        load_frame(f, columns={"prompt_id": "idd", "policy": "modle"})
    msg = str(e.value)
    assert "2 problems" in msg and "did you mean 'id'" in msg and "did you mean 'model'" in msg
    assert e.value.option == "columns" and len(e.value.problems) == 2
    with pytest.raises(CJEInputError, match="not a canonical column") as e:
        load_frame(f, columns={"promt_id": "id"})


def test_missing_columns_reported_together_with_hints():
    f = pd.DataFrame({"prompt": ["a"], "Policy": ["x"], "judge_score": [0.5]})
    with pytest.raises(CJEInputError) as e:
        load_frame(f)
    assert len(e.value.problems) == 2
    assert "did you mean 'prompt'" in str(e.value) and "did you mean 'Policy'" in str(e.value)


def test_scale_errors_name_the_option():
    f = _frame([f"q{i}" for i in range(20)])
    f["judge_score"] *= 100
    with pytest.raises(CJEInputError) as e:
        load_frame(f)
    assert e.value.option == "score_scale" and "score_scale='0-100'" in str(e.value)


def test_response_ids_built_in_chunks_equal_one_pass(monkeypatch):
    """Canonical ids are built and compared a chunk of rows at a time; chunking changes nothing."""
    import cje_engine.data.identity as identity

    f = _frame([f"q{i}" for i in range(30)], n_pol=3)
    f["response_id"] = [None if i % 3 else f"{pol}:{pid}:0" for i, (pol, pid) in enumerate(zip(f.policy, f.prompt_id))]
    whole = load_frame(f)
    monkeypatch.setattr(identity, "_CHUNK", 7)
    np.testing.assert_array_equal(load_frame(f).response_id.to_numpy(), whole.response_id.to_numpy())
    dup = f.copy()
    dup.loc[dup.index[50], "response_id"] = dup.loc[dup.index[0], "response_id"] = "same"
    with pytest.raises(CJEInputError, match="same response_id"):
        load_frame(dup)


# ----------------------------------------------------------------------------- identifier hygiene (issue 25)
def test_nfc_and_nfd_spellings_of_the_same_id_pair(tmp_path):
    """Policy p0 writes ``café-i`` in NFC, p1 in NFD: one set of 150 prompts, not 300 (comparisons paired)."""
    import unicodedata

    ids = [f"caf\u00e9-{i}" for i in range(150)]
    frame = _frame(ids)
    nfd = frame["policy"] == "p1"
    frame.loc[nfd, "prompt_id"] = frame.loc[nfd, "prompt_id"].map(lambda t: unicodedata.normalize("NFD", t))
    frame["response_id"] = frame["policy"] + "/" + frame["prompt_id"]
    frame.loc[nfd, "policy"] = "clo\u0302ne"  # a policy name in NFD: read as its NFC spelling "clône"
    assert frame["prompt_id"].nunique() == 300  # the bytes differ
    got = load_frame(frame)
    assert got["prompt_id"].nunique() == 150 and set(got["policy"]) == {"p0", "cl\u00f4ne"}
    assert all(unicodedata.is_normalized("NFC", r) for r in got["response_id"])
    assert load_frame(frame, policies=["clo\u0302ne"])["prompt_id"].nunique() == 150
    _write_jsonl(tmp_path / "mixed.jsonl", frame)
    res = evaluate(tmp_path / "mixed.jsonl", inference="analytic").to_dict()
    assert res["data"]["n_prompts"] == 150
    assert res["data"]["n_rows"] == 300 and [(c["a"], c["b"]) for c in res["comparisons"]] in ([("p0", "cl\u00f4ne")], [("cl\u00f4ne", "p0")])


@pytest.mark.parametrize("column,bad", [("policy", "clo\u200bne"), ("prompt_id", "q\u200d7"),
                                        ("response_id", "\ufeffr7"), ("policy", "clo\x1b[31mne")])
def test_an_id_with_an_invisible_or_control_character_is_refused_naming_the_row(tmp_path, column, bad):
    frame = _frame([f"q{i}" for i in range(20)])
    frame["response_id"] = [f"r{i}" for i in range(len(frame))]
    frame.loc[7, column] = bad
    src = frame.to_parquet(tmp_path / "in.parquet") or tmp_path / "in.parquet"
    with pytest.raises(CJEInputError, match="invisible or control character U\\+") as err:
        load_frame(src)
    assert (err.value.source, err.value.column, err.value.row) == (str(src), column, 7)
    assert repr(bad) in str(err.value)  # shown escaped: `clo\u200bne` never prints like `clone`

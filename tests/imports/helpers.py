"""Shared steps of the end-to-end import tests: `cje import`, then `cje evaluate` on its output."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

from flows.cli import main as cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
N_BOOT = 200


def import_and_evaluate(capsys, tmp_path: Path, fmt: str, source: Path, *flags: str,
                        evaluate_flags: tuple[str, ...] = ()) -> tuple[dict, dict, Path]:
    """Run ``cje import`` then ``cje evaluate`` on the logs written; the import report, the result, the logs."""
    logs = tmp_path / "logs"
    code = cli.main(["import", fmt, str(source), "--out", str(logs), "--json", *flags])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(text)
    out = tmp_path / "out"
    code = cli.main(["evaluate", str(logs), "--out", str(out), "--n-bootstrap", str(N_BOOT), "--seed", "0",
                     "--exit-zero", "-q", *evaluate_flags])
    capsys.readouterr()
    assert code == 0
    return report, json.loads((out / "result.json").read_text()), logs


def direct_result(frame: pd.DataFrame, **options) -> dict:
    """The engine on a frame built without the importer (the direct computation), as result JSON."""
    from cje_engine import evaluate

    res = evaluate(frame, n_bootstrap=N_BOOT, seed=0, **options)
    return json.loads(res.to_json()) if hasattr(res, "to_json") else res.to_dict()


def text_id(text: str) -> str:
    """The prompt id the importers derive from a prompt's text (recomputed here on purpose)."""
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def assert_same_numbers(result: dict, direct: dict, frame: pd.DataFrame) -> None:
    """Every policy's estimate, SE and CI equal the direct computation's; the raw means equal pandas'
    (estimates and the oracle mean are on the labels' own scale)."""
    assert set(result["policies"]) == set(direct["policies"]) == set(frame["policy"])
    for name, pol in result["policies"].items():
        ref = direct["policies"][name]
        assert abs(pol["estimate"] - ref["estimate"]) < 1e-12, name
        assert abs(pol["se"] - ref["se"]) < 1e-12, name
        assert pol["ci"] == ref["ci"], name
        sub = frame[frame["policy"] == name]
        assert abs(pol["raw_judge_mean"] - sub["judge_score"].mean()) < 1e-9
        assert abs(pol["oracle_mean"] - sub["oracle_label"].dropna().mean()) < 1e-9
        assert pol["n_rows"] == len(sub) and pol["n_labelled"] == int(sub["oracle_label"].notna().sum())

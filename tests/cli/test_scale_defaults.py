"""Defaults that fit the data (issue 26): the planner's default effect is relative to the label scale
and printed in label units; a declared label scale far wider than the labels gets one warning."""
from __future__ import annotations

import importlib
import json

import pytest

cli = importlib.import_module("flows.cli.main")

TEAM = ["--columns", "prompt_id=id,policy=model,oracle_label=human_rating", "--score-scale", "1-10"]


def test_plan_default_effect_is_relative_to_the_label_scale(team_csv, capsys, in_tmp):
    """On 1-5 labels the default target MDE is 0.02 of the scale's width = 0.08 label units (it was 0.02
    label units, a quarter of a percent of the scale, which asked for tens of thousands of labels); the
    header and the note say the same number in label units."""
    assert cli.main(["plan", str(team_csv), *TEAM, "--label-scale", "1-5", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["target_mde"] == pytest.approx(0.08) and plan["label_scale"] == [1.0, 5.0]
    assert plan["allocation_for_mde"]["mde"] <= 0.08 * (1 + 1e-9)
    assert plan["notes"][0] == ("target MDE 0.08 label units: the default, 0.02 of the label scale 1-5 "
                                "(a target MDE given is in label units)")
    assert cli.main(["plan", str(team_csv), *TEAM, "--label-scale", "1-5"]) == 0
    text = capsys.readouterr().out
    assert "cheapest design for MDE 0.08 label units (0.02 of the label scale 1-5)" in text
    assert "target MDE 0.08 label units: the default, 0.02 of the label scale 1-5" in text
    # a given --target-mde is in label units, as before
    assert cli.main(["plan", str(team_csv), *TEAM, "--label-scale", "1-5", "--target-mde", "0.2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["target_mde"] == 0.2 and not any("the default" in n for n in plan["notes"])


@pytest.mark.parametrize("scale,warned", [("0-10", True), ("1-5", False), ("0-6", False)])
def test_a_label_scale_far_wider_than_the_labels_is_warned_once(scale, warned, team_csv, tmp_path, capsys, in_tmp):
    """1-5 labels declared on 0-10 (they span 40% of it): the audit margin is a fraction of the declared
    scale, 2.5x looser on the labels' own range; one warning on stderr and in the result's warnings."""
    out = tmp_path / "out"
    assert cli.main(["evaluate", str(team_csv), *TEAM, "--label-scale", scale, "--out", str(out),
                     "--n-bootstrap", "50", "--exit-zero"]) == 0
    err = capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    hits = [w for w in result["warnings"] if "under half of the declared label scale" in w]
    if warned:
        assert err.count("under half of the declared label scale") == 1
        assert len(hits) == 1 and "0.05 of the declared scale = 0.5 label units" in hits[0] and "2.5x" in hits[0]
    else:
        assert not hits and "under half of the declared label scale" not in err

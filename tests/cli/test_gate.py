"""`cje gate`: expressions, multiplicity-adjusted judgement, not-estimable comparisons, exit codes."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from scipy.stats import norm

from cje_engine.inference.multiplicity import adjust
from flows.cli.commands.gate import Claim, judge, parse_expression

from .conftest import REPO, run_cje

cli = importlib.import_module("flows.cli.main")
FIXTURE = REPO / "tests" / "fixtures" / "result_example.json"


def _result(**pairs):
    """A result with policies base, a, b, c and comparisons given as name -> (diff a-base, se, p_adj, significant)."""
    pols = {n: {"level_claim": "ok", "refusal_reasons": [], "audit": {"verdict": "pass"}} for n in ("base", "a", "b", "c")}
    comps = []
    for name, (diff, se, p_adj, sig) in pairs.items():
        comps.append({"a": "base", "b": name, "diff": -diff, "se": se, "ci": [-diff - 2 * se, -diff + 2 * se],
                      "p_value": p_adj, "p_adjusted": p_adj, "significant": sig})
    return {"policies": pols, "comparisons": comps, "multiplicity": {"method": "holm", "alpha": 0.05}}


@pytest.mark.parametrize("text,op,t", [
    ("cand - base < -0.01", "<", -0.01), ("cand-base<-0.01", "<", -0.01), ("candidate - baseline >= 0.02", ">=", 0.02),
    ("base - cand > 0.01", "<", -0.01), ("  Cand - Base <= 0 ", "<=", 0.0),
])
def test_parse_claims(text, op, t):
    c = parse_expression(text)
    assert isinstance(c, Claim) and c.op == op and c.threshold == pytest.approx(t)


@pytest.mark.parametrize("text", ["cand - cand < 0", "cand < 0", "worst", "cand - base < x", "cand - base = 0"])
def test_bad_expressions_are_usage_errors(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_expression(text)


def test_worse_uses_the_results_adjusted_comparison():
    r = _result(a=(-0.05, 0.01, 0.001, True), b=(-0.05, 0.04, 0.3, False), c=(0.05, 0.01, 0.001, True))
    checks = {c.candidate: c for c in judge(r, "base", fail_if=["worse"])}
    assert checks["a"].failed and not checks["b"].failed and not checks["c"].failed
    assert "shown" in checks["a"].reason and "not shown" in checks["b"].reason and "holm" in checks["a"].reason
    better = {c.candidate: c for c in judge(r, "base", pass_if=["better"])}
    assert better["c"].failed is False and better["a"].failed and better["b"].failed


def test_threshold_claims_are_one_sided_tests_adjusted_over_the_gate():
    r = _result(a=(-0.04, 0.01, 0.01, True), b=(-0.012, 0.01, 0.5, False), c=(0.0, 0.01, 1.0, False))
    checks = {c.candidate: c for c in judge(r, "base", fail_if=["cand - base < -0.01"])}
    # reference: H0 d >= -0.01, p = Phi((d + 0.01) / se), Holm over the three candidates
    p = np.array([norm.cdf((d + 0.01) / 0.01) for d in (-0.04, -0.012, 0.0)])
    p_adj = adjust(p, "holm")
    for name, pa_, pr in zip("abc", p_adj, p):
        assert checks[name].p_value == pytest.approx(pr) and checks[name].p_adjusted == pytest.approx(pa_)
        assert checks[name].failed == (pa_ <= 0.05)
    assert checks["a"].failed and not checks["b"].failed  # b: below -0.01 by point estimate, not shown


def test_not_estimable_never_passes_and_fails_closed():
    r = _result(a=(0.2, 0.01, 1e-6, True), b=(0.0, 0.01, 1.0, False), c=(0.1, 0.01, 1e-4, True))
    r["comparisons"][0]["reported"] = False
    r["comparisons"][0]["not_estimable"] = "overlap refused"
    better = {c.candidate: c for c in judge(r, "base", pass_if=["better"], allow_not_estimable=True)}
    assert better["a"].failed and "not estimable: overlap refused" in better["a"].reason  # never passes "better"
    worse = {c.candidate: c for c in judge(r, "base", fail_if=["worse"])}
    assert worse["a"].failed and "cannot tell" in worse["a"].reason
    allowed = {c.candidate: c for c in judge(r, "base", fail_if=["worse"], allow_not_estimable=True)}
    assert not allowed["a"].failed


def test_refused_and_audit_fail_on_the_fixture():
    d = json.loads(FIXTURE.read_text())  # unhelpful: refused, audit fail
    refused = judge(d, "base", fail_if=["refused"])
    assert [c.candidate for c in refused if c.failed] == ["unhelpful"]
    assert "level refused" in next(c for c in refused if c.failed).reason
    audit = judge(d, "base", fail_if=["audit-fail"], candidates=["clone", "parallel_universe_prompt"])
    assert not any(c.failed for c in audit)


def test_gate_command_exit_codes_and_json(tmp_path, capsys, in_tmp):
    d = json.loads(FIXTURE.read_text())
    path = tmp_path / "result.json"
    path.write_text(json.dumps(d))
    assert cli.main(["gate", str(path), "--baseline", "base", "--candidate", "clone", "--fail-if", "worse"]) == 0
    out = capsys.readouterr().out
    assert "gate passed" in out and "clone - base = +0.0090" in out
    assert cli.main(["gate", str(path), "--baseline", "base", "--fail-if", "refused", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "gate" and doc["passed"] is False
    assert [c["candidate"] for c in doc["checks"] if c["failed"]] == ["unhelpful"]
    # unhelpful is far worse than base: shown by the adjusted comparison
    assert cli.main(["gate", str(path), "--baseline", "base", "--fail-if", "cand - base < -0.01"]) == 1
    assert "FAIL fail-if cand - base < -0.01: unhelpful - base" in capsys.readouterr().out
    assert cli.main(["gate", str(path), "--baseline", "bse", "--fail-if", "worse"]) == 2
    assert "did you mean 'base'?" in capsys.readouterr().err
    assert cli.main(["gate", str(path), "--baseline", "base"]) == 2  # nothing to judge
    assert cli.main(["gate", str(path), "--baseline", "base", "--fail-if", "nonsense"]) == 64


def test_gate_escapes_names(tmp_path, capsys, in_tmp):
    d = json.loads(FIXTURE.read_text())
    evil = "clone\x1b[2J\u202e"
    d = json.loads(json.dumps(d).replace('"clone"', json.dumps(evil)))
    path = tmp_path / "result.json"
    path.write_text(json.dumps(d))
    cli.main(["gate", str(path), "--baseline", "base", "--fail-if", "worse"])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "clone\\x1b[2J\\u202e" in out


def test_gate_as_a_ci_step(tmp_path):
    """What docs/ci.md runs: a process, its exit code and its reasons on stdout."""
    d = json.loads(FIXTURE.read_text())
    path = tmp_path / "result.json"
    path.write_text(json.dumps(d))
    r = run_cje("gate", str(path), "--baseline", "base", "--fail-if", "worse", "--fail-if", "refused",
                "--candidate", "clone,parallel_universe_prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok   fail-if") == 5 and "gate passed" in r.stdout  # 2 worse + 3 refused (base too)


def test_gate_is_verified_by_default_and_assume_transport_is_named(tmp_path, capsys, in_tmp):
    """A candidate without own labels whose judge is inflated: the verified gate cannot pass it as better
    (fails closed, naming the missing verification); --assume-transport judges the protocol's comparison and
    says so in every reason."""
    from cje_engine import evaluate
    from cje_engine.simulate.direct import PolicySpec, simulate

    pols = (PolicySpec("base", 0.8), PolicySpec("clone", 0.8), PolicySpec("cand", 0.7, verbosity=3.0))
    sim = simulate(600, pols, oracle_fraction=0.3, label_design="calibration_policy", audit_labels=40, seed=3)
    frame = sim.frame.copy()
    frame.loc[frame["policy"] == "cand", ["oracle_label", "label_probability"]] = np.nan
    d = evaluate(frame, n_bootstrap=200, seed=0).to_dict()
    assert d["policies"]["cand"]["level_claim"] == "assumes_transport"
    verified = judge(d, "base", pass_if=["better"], candidates=["cand"])
    assert verified[0].failed and "no verified level" in verified[0].reason
    assumed = judge(d, "base", fail_if=["worse"], candidates=["cand"], assume_transport=True)
    assert assumed and all(c.reason.startswith("assumes transport: ") for c in assumed)
    path = tmp_path / "result.json"
    path.write_text(json.dumps(d))
    assert cli.main(["gate", str(path), "--baseline", "base", "--candidate", "cand", "--pass-if", "better"]) == 1
    assert "no verified level" in capsys.readouterr().out
    cli.main(["gate", str(path), "--baseline", "base", "--candidate", "cand", "--fail-if", "worse",
              "--assume-transport"])
    assert "assumes transport: cand - base" in capsys.readouterr().out
# ----------------------------------------------------------------------------- published results are verified


def _publish(root, evaluation="ev", window="2025-03-01_2025-03-01", key="k1", result=None):
    from flows.storage.objects import Storage
    from flows.storage.publish import publish_run

    raw = json.dumps(result if result is not None else json.loads(FIXTURE.read_text()), indent=1).encode()
    outcome = publish_run(Storage.for_uri(str(root)), evaluation, window, key, artifacts={"result.json": raw},
                          manifest={"seed": 0})
    assert outcome.published
    [path] = list((root / "results" / evaluation / window / key).glob("*/result.json"))
    return path


def test_gate_refuses_a_hand_edited_published_result(tmp_path, capsys, in_tmp):
    """A significant regression turned into `significant: false` by hand: exit 2 "checksum mismatch", not a pass."""
    path = _publish(tmp_path / "svc")
    gate = ["gate", str(path), "--baseline", "base", "--candidate", "unhelpful", "--fail-if", "worse"]
    assert cli.main(gate) == 1  # the published result: unhelpful is significantly worse
    cap = capsys.readouterr()
    assert "unverified" not in cap.err
    d = json.loads(path.read_text())
    for c in d["comparisons"]:
        if {c["a"], c["b"]} == {"base", "unhelpful"}:
            c["significant"] = False
    path.write_text(json.dumps(d, indent=1))
    assert cli.main(gate) == 2  # was: 0, the gate passed
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and str(path) in err and "Traceback" not in err
    assert cli.main([*gate, "--json"]) == 2


def test_gate_on_a_bare_result_says_it_is_unverified(tmp_path, capsys, in_tmp):
    path = tmp_path / "out" / "result.json"
    path.parent.mkdir()
    path.write_text(FIXTURE.read_text())
    assert cli.main(["gate", str(path), "--baseline", "base", "--candidate", "unhelpful", "--fail-if", "worse",
                     "--json"]) == 1
    cap = capsys.readouterr()
    assert "has no manifest.json beside it: an unverified result" in cap.err
    assert json.loads(cap.out)["result_verified"] is False
    # another attempt's folder of a published run (not the one its manifest commits) is refused
    published = _publish(tmp_path / "svc")
    other = published.parent.parent / "20250101T000000Z-deadbeef" / "result.json"
    other.parent.mkdir()
    other.write_bytes(published.read_bytes())
    assert cli.main(["gate", str(other), "--baseline", "base", "--fail-if", "worse"]) == 2
    assert "not the result its run published" in capsys.readouterr().err


def test_diff_refuses_a_run_whose_published_result_was_edited(tmp_path, capsys, in_tmp):
    root = tmp_path / "svc"
    d = json.loads(FIXTURE.read_text())
    _publish(root, window="2025-03-01_2025-03-01", key="k1", result=d)
    second = _publish(root, window="2025-03-02_2025-03-02", key="k2", result=d)
    cfg = tmp_path / "evaluations.yaml"
    cfg.write_text(f"evaluations:\n  - name: ev\n    logs_uri: {tmp_path / 'logs'}\n    results_uri: {root}\n")
    assert cli.main(["diff", "ev", "--config", str(cfg)]) == 0
    capsys.readouterr()
    second.write_text(second.read_text().replace('"significant": true', '"significant": false'))
    assert cli.main(["diff", "ev", "--config", str(cfg)]) == 2  # was: 0, a run with no policies compared
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "result.json" in err and "k2" in err
    assert cli.main(["plan", "--evaluation", "ev", "--config", str(cfg)]) == 2  # re-reads of a published result
    assert "checksum mismatch" in capsys.readouterr().err

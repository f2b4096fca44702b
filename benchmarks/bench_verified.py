"""Verified and assumes-transport claims on simulated data with known truth (issue 24).

Scenarios (`cje_engine.simulate.direct`, judge noise 0 and no length bias, so every honest policy's
calibration E[Y | S] is base's (up to the judge's 21-level rounding) and the monotone calibration
transports; ``--length``: the judge's length bias 0.5 and ``response_length`` as the covariate
(two-stage calibration, ~3x the CPU per evaluation)):

* ``a_inflated_nolabels``: ``inflated`` (true value 0.03 below ``base``) is scored by a judge that
  inflates it (``adversarial`` with a boost that puts its borrowed plug-in ~0.04 *above* base); its
  audit slice is removed, so it has NO own labels;
* ``b_inflated_labels``: the same with its 50-label audit slice;
* ``c_mild``: ``mild`` is 0.013 below base and its judge inflation puts the plug-in ~0.015 above
  base (a plug-in bias of ~0.028, about one audit SE at 50 labels: inside the audit's resolution);
* ``d_clean``: five honest policies at base -0.06, -0.03, 0, +0.03, +0.06 (steps of 0.03, different
  lengths); everything transports;
* ``e_adversary``: ``adversary`` (0.10 below base) fools the judge strongly (plug-in ~0.10 above
  base: +0.20 off) with its 50 audit labels, and ``adversary_few`` (same policy) with 8 of them.

Every scenario also has ``better`` (+0.03) and ``worse`` (-0.03), honest. The judge boosts are
computed from the exact truth (``true_value(shift + boost)``: with judge noise 0 the calibration
learned on base maps an inflated judge latent ``q + b`` to about ``E[Y | q + b]``); the measured
plug-in bias of each fooled policy is printed with the tables. Cells: n prompts x label fraction of
base (``label_design="calibration_policy"``, 50-label audit slices on every other policy).

Per dataset, the engine at its defaults (``evaluate(frame, n_bootstrap=B, seed=s, baseline="base")``,
with ``covariates=["response_length"]`` under ``--length``) and, on the clean design, once more with
``level_estimator="augmented"`` (plain own-label levels, the efficiency comparator). Measured per cell:

* coverage of the verified intervals (``level_claim == "ok"``), all policies together and per
  policy, beside the share of policies that have a verified level and the coverage of the
  assumes-transport intervals (``assumed``);
* wrong verified decisions (per dataset): a named ``best_policy`` that is not the true best; any
  significant comparison of the wrong sign or on a true tie; a baseline comparison ``better`` for a
  policy not truly better, or ``non_inferior`` for one worse by more than the margin; read over all
  entries of the lists (as a consumer does) and over the entries whose ``claim_kind`` is
  ``verified``, with the share of datasets where an assumes-transport entry of a verified list is
  flagged; beside the same for the assumes-transport claims (``assumes_transport``);
* a judge-fooled policy reported as a verified level at its borrowed value: equal to the plug-in,
  or nearer the plug-in than the truth (a valid level does that with probability
  Phi(-bias / (2 SE)): meaningful for the adversary's +0.20), beside the same for ``assumed``;
* efficiency (clean design): decision rate (share of pairs with different true values decided
  significant with the right sign) and pairwise ranking accuracy (share of those pairs the levels
  order rightly; a policy without a level orders nothing) of verified vs ``augmented`` vs assumes-
  transport, and the paired per-dataset gains of verified over ``augmented`` with the ratio of
  their interval widths.

Monte Carlo SEs: a rate over R datasets: sqrt(p (1-p) / R). A pooled rate over intervals or pairs
of several policies per dataset: the ratio-estimator SE over datasets (the intervals of one dataset
share the calibrator, so they are clustered by dataset), printed as ``p (se)``. Missing result
fields print ``n/a``.

Usage::

    .venv/bin/python benchmarks/bench_verified.py --datasets 10 --B 200           # quick
    nohup .venv/bin/python benchmarks/bench_verified.py --datasets 100 --B 500 \\
        --json benchmarks/_work/verified.json > benchmarks/_work/verified.log 2>&1 &  # the grid
    .venv/bin/python benchmarks/bench_verified.py --rescore benchmarks/_work/verified.json
    .venv/bin/python benchmarks/bench_verified.py --datasets 100 --first-rep 100 ...   # 100 fresh datasets
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported; each worker is single-threaded

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from scipy.optimize import brentq  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY  # noqa: E402
from cje_engine.simulate.direct import PolicySpec, SimSpec, simulate, true_value  # noqa: E402

log = logging.getLogger("bench_verified")

BASE_SHIFT = 0.8
#: Simulation settings shared by every scenario: judge noise 0 (see bench_protocol.JUDGE_NOISE) and
#: no length bias; ``--length`` adds LENGTH_SIM and the covariate.
SIM = {"judge_noise_sd": 0.0, "length_bias": 0.0}
LENGTH_SIM = {"length_bias": 0.5}
LENGTH_COVARIATES = ["response_length"]
DEFAULT_CELLS = "250:0.05,5000:0.05,1000:0.10"


def shift_for(delta: float) -> float:
    """Quality shift whose exact true value is ``delta`` away from base's."""
    spec = SimSpec(n_prompts=1, **SIM)
    target = true_value(BASE_SHIFT, spec) + delta
    return float(brentq(lambda m: true_value(m, spec) - target, -5.0, 5.0))


def boost_for(shift: float, plug_in_delta: float) -> float:
    """Judge boost that puts a policy of ``shift`` at a borrowed plug-in ``plug_in_delta`` from base."""
    return shift_for(plug_in_delta) - shift


@dataclass(frozen=True)
class Scenario:
    """One simulated situation: policies, the judge's boost, and per-policy own-label counts."""

    name: str
    policies: tuple[PolicySpec, ...]
    boost: float = 0.0
    keep_labels: dict[str, int] = field(default_factory=dict)  # policy -> own labels kept (<= 50)

    @property
    def fooled(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.policies if p.adversarial)


def _honest() -> tuple[PolicySpec, ...]:
    return (PolicySpec("base", BASE_SHIFT), PolicySpec("better", shift_for(0.03), 1.2),
            PolicySpec("worse", shift_for(-0.03), 0.8))


def scenarios() -> dict[str, Scenario]:
    """The five situations of issue 24 (module docstring)."""
    strong = shift_for(-0.03)
    mild = shift_for(-0.013)
    adv = shift_for(-0.10)
    out = [
        Scenario("a_inflated_nolabels", (*_honest(), PolicySpec("inflated", strong, adversarial=True)),
                 boost_for(strong, 0.04), {"inflated": 0}),
        Scenario("b_inflated_labels", (*_honest(), PolicySpec("inflated", strong, adversarial=True)),
                 boost_for(strong, 0.04)),
        Scenario("c_mild", (*_honest(), PolicySpec("mild", mild, adversarial=True)), boost_for(mild, 0.015)),
        Scenario("d_clean", (PolicySpec("base", BASE_SHIFT), PolicySpec("up3", shift_for(0.03), 1.2),
                             PolicySpec("up6", shift_for(0.06), 0.8), PolicySpec("down3", shift_for(-0.03), 1.5),
                             PolicySpec("down6", shift_for(-0.06), 0.7))),
        Scenario("e_adversary", (*_honest(), PolicySpec("adversary", adv, adversarial=True),
                                 PolicySpec("adversary_few", adv, adversarial=True)),
                 boost_for(adv, 0.10), {"adversary_few": 8}),
    ]
    return {s.name: s for s in out}


def _seed(scen_idx: int, n: int, frac: float, rep: int) -> int:
    return 24_000_000 + scen_idx * 1_000_000 + (round(frac * 100) * 10_000 + n) * 10 + rep * 7919


def simulate_dataset(scen: Scenario, n: int, frac: float, seed: int, length: bool = False):
    """Simulate one dataset; thin the audit slices named in ``keep_labels`` (a simple random
    subsample of the slice is a simple random sample of the rows: inclusion probability k / n)."""
    sim = simulate(n, scen.policies, oracle_fraction=frac, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=50, seed=seed,
                   adversarial_boost=scen.boost if scen.boost else 2.5, **{**SIM, **(LENGTH_SIM if length else {})})
    frame = sim.frame
    rng = np.random.default_rng(seed + 1)
    for pol, k in scen.keep_labels.items():
        rows = np.flatnonzero((frame[POLICY] == pol).to_numpy() & frame[LABEL].notna().to_numpy())
        drop = rng.choice(rows, size=max(len(rows) - k, 0), replace=False)
        frame.loc[frame.index[drop], [LABEL, LABEL_PROB]] = np.nan
        if k:
            keep = frame.index[(frame[POLICY] == pol) & frame[LABEL].notna()]
            frame.loc[keep, LABEL_PROB] = min(k, n) / n
    return sim


# ----------------------------------------------------------------------------------------------
# one dataset


def _get(d, *keys):
    """Nested lookup that returns None where a field is missing."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _compact(d: dict) -> dict:
    """The fields the scoring needs from one `to_dict()` (missing fields stay None)."""
    pols = {}
    for p, e in (d.get("policies") or {}).items():
        pols[p] = {
            "level_claim": e.get("level_claim"), "estimate": e.get("estimate"), "ci": e.get("ci"),
            "basis_code": e.get("basis_code"),
            "verified": {k: _get(e, "verified", k) for k in ("method", "lambda", "n_labels")}
            if e.get("verified") else None,
            "assumed": {k: _get(e, "assumed", k) for k in ("estimate", "ci", "basis_code")}
            if e.get("assumed") else None,
            "plug_in": _get(e, "plug_in", "estimate"), "audit": _get(e, "audit", "verdict"),
        }

    def comps(cs):
        if cs is None:
            return None
        return [{"a": c.get("a"), "b": c.get("b"), "diff": c.get("diff"), "significant": c.get("significant"),
                 "claim_kind": c.get("claim_kind")} for c in cs]

    at = d.get("assumes_transport")
    base = d.get("baseline_comparisons")
    return {
        "policies": pols, "comparisons": comps(d.get("comparisons")), "best_policy": d.get("best_policy"),
        "assumes_transport": None if not isinstance(at, dict) else {
            "comparisons": comps(at.get("comparisons")), "best_policy": at.get("best_policy")},
        "baseline_comparisons": None if base is None else [
            {k: c.get(k) for k in ("policy", "baseline", "diff", "better", "worse", "non_inferior", "margin", "claim_kind")}
            for c in base],
        "level_estimator": _get(d, "config", "level_estimator"),
        "margin": _get(d, "config", "noninferiority_margin"),
    }


def _supports(option: str) -> bool:
    from cje_engine.options import EvaluationOptions

    return option in getattr(EvaluationOptions, "__dataclass_fields__", {})


def run_engine(frame, seed: int, B: int, options: dict, covariates: list[str]) -> dict:
    from cje_engine import evaluate
    from cje_engine.errors import CJEInputError

    t0 = time.process_time()
    try:
        d = evaluate(frame, covariates=covariates, n_bootstrap=B, seed=seed, **options).to_dict()
        out = _compact(d)
    except CJEInputError as exc:  # the whole evaluation refused: nothing claimed
        out = {"policies": {}, "error": str(exc)[:300]}
    out["cpu_s"] = time.process_time() - t0
    return out


def run_task(task: tuple) -> dict:
    scen_name, n, frac, rep, B, options, augmented, length = task
    logging.getLogger("cje_engine").setLevel(logging.ERROR)
    scen = scenarios()[scen_name]
    idx = sorted(scenarios()).index(scen_name)
    seed = _seed(idx, n, frac, rep)
    sim = simulate_dataset(scen, n, frac, seed, length)
    cov = LENGTH_COVARIATES if length else []
    opts = dict(options)
    if _supports("baseline"):
        opts.setdefault("baseline", "base")
    out = {"scenario": scen_name, "n": n, "frac": frac, "rep": rep, "truth": sim.true_values,
           "default": run_engine(sim.frame, seed % 2**31, B, opts, cov)}
    if augmented:
        out["augmented"] = run_engine(sim.frame, seed % 2**31, B, {**opts, "level_estimator": "augmented"}, cov)
    return out


# ----------------------------------------------------------------------------------------------
# scoring


@dataclass
class Rate:
    """A Monte Carlo rate: per-dataset (hits, trials); SE by the ratio estimator over datasets."""

    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def add(self, hits: float, trials: float) -> None:
        self.hits.append(float(hits))
        self.trials.append(float(trials))

    @property
    def n(self) -> int:
        return int(sum(self.trials))

    def value(self) -> tuple[float, float]:
        h, t = np.array(self.hits), np.array(self.trials)
        if t.sum() == 0:
            return float("nan"), float("nan")
        p = h.sum() / t.sum()
        R = len(t)
        if R < 2:
            return p, float("nan")
        if np.all(t <= 1):  # one trial per dataset at most: binomial
            return p, math.sqrt(p * (1 - p) / t.sum())
        resid = h - p * t
        return p, float(np.sqrt(np.sum(resid**2) / (R * (R - 1))) / t.mean())

    def fmt(self) -> str:
        p, se = self.value()
        if math.isnan(p):
            return "n/a"
        return f"{p:.3f} ({se:.3f})" if not math.isnan(se) else f"{p:.3f}"


def _covers(ci, truth) -> bool | None:
    if not ci or ci[0] is None or ci[1] is None:
        return None
    return ci[0] <= truth <= ci[1]


def _pairs(truth: dict) -> list[tuple[str, str, float]]:
    names = sorted(truth)
    return [(a, b, truth[a] - truth[b]) for i, a in enumerate(names) for b in names[i + 1:]
            if abs(truth[a] - truth[b]) > 1e-9]


def _sig_index(comps) -> dict | None:
    """(a, b) -> signed difference a - b of each significant comparison."""
    if comps is None:
        return None
    out = {}
    for c in comps:
        if c.get("significant") and c.get("diff") is not None:
            out[(c["a"], c["b"])] = c["diff"]
            out[(c["b"], c["a"])] = -c["diff"]
    return out


def _decisions(comps, truth) -> tuple[int, int, int] | None:
    """(right decisions, pairs with different truth, wrong-sign significant comparisons)."""
    sig = _sig_index(comps)
    if sig is None:
        return None
    right = wrong = 0
    pairs = _pairs(truth)
    for a, b, dt in pairs:
        if (a, b) in sig:
            if np.sign(sig[(a, b)]) == np.sign(dt):
                right += 1
            else:
                wrong += 1
    # a significant claim on a true tie is wrong too
    for (a, b), diff in sig.items():
        if a < b and abs(truth.get(a, 0) - truth.get(b, 0)) <= 1e-9:
            wrong += 1
    return right, len(pairs), wrong


def _ranking(levels: dict, truth: dict) -> tuple[int, int]:
    right = 0
    pairs = _pairs(truth)
    for a, b, dt in pairs:
        ea, eb = levels.get(a), levels.get(b)
        right += int(ea is not None and eb is not None and np.sign(ea - eb) == np.sign(dt))
    return right, len(pairs)


def _true_best(truth: dict) -> str:
    return max(truth, key=truth.get)


def _best_name(best) -> str | None:
    if isinstance(best, dict):
        return best.get("policy") or best.get("name")
    return best if isinstance(best, str) else None


def _verified_levels(res: dict) -> dict:
    return {p: e["estimate"] for p, e in res["policies"].items()
            if e.get("level_claim") == "ok" and e.get("estimate") is not None}


def _assumed_levels(res: dict) -> dict:
    return {p: (e.get("assumed") or {}).get("estimate") for p, e in res["policies"].items()
            if (e.get("assumed") or {}).get("estimate") is not None}


def score_cell(runs: list[dict], scen: Scenario) -> dict:
    """Every figure of one (scenario, n, fraction) cell."""
    names = [p.name for p in scen.policies]
    r = {k: Rate() for k in ("cover_all", "cover_assumed", "has_level", "best_wrong", "best_named",
                             "sig_wrong", "gate_wrong", "any_wrong", "best_wrong_at", "sig_wrong_at",
                             "any_wrong_at", "borrowed", "borrowed_at", "at_plugin", "at_plugin_at", "dec_ver", "dec_aug", "dec_at",
                             "rank_ver", "rank_aug", "rank_at", "cmp_wrong_share", "cmp_wrong_share_at",
                             "sig_wrong_tagged", "gate_wrong_tagged", "leak")}
    per_pol = {p: {"cover": Rate(), "has": Rate(), "cover_at": Rate()} for p in names}
    plug_bias = {p: [] for p in scen.fooled}
    lambdas = {p: [] for p in names}
    cpu = []
    margin = None
    gains = {"dec": [], "rank": [], "width": []}
    for run in runs:
        truth, res = run["truth"], run["default"]
        cpu.append(res.get("cpu_s", float("nan")))
        pols = res.get("policies", {})
        c_hit = c_n = a_hit = a_n = has = 0
        for p in names:
            e = pols.get(p, {})
            ok = e.get("level_claim") == "ok" and _covers(e.get("ci"), truth[p]) is not None
            has += ok
            per_pol[p]["has"].add(ok, 1)
            if ok:
                cov = _covers(e["ci"], truth[p])
                c_hit += cov
                c_n += 1
                per_pol[p]["cover"].add(cov, 1)
            acov = _covers((e.get("assumed") or {}).get("ci"), truth[p])
            if acov is not None:
                a_hit += acov
                a_n += 1
                per_pol[p]["cover_at"].add(acov, 1)
            lam = (e.get("verified") or {}).get("lambda")
            if lam is not None:
                lambdas[p].append(lam)
        r["cover_all"].add(c_hit, c_n)
        r["cover_assumed"].add(a_hit, a_n)
        r["has_level"].add(has, len(names))
        # wrong decisions, verified
        best = _best_name(res.get("best_policy"))
        tb = _true_best(truth)
        r["best_named"].add(best is not None, 1)
        best_wrong = best is not None and best != tb
        r["best_wrong"].add(best_wrong, 1)
        dec = _decisions(res.get("comparisons"), truth)
        sig_wrong = bool(dec and dec[2])
        tagged = [c for c in res.get("comparisons") or [] if c.get("claim_kind") in (None, "verified")]
        dec_tagged = _decisions(tagged, truth) if res.get("comparisons") is not None else None
        if dec_tagged is not None:
            r["sig_wrong_tagged"].add(bool(dec_tagged[2]), 1)
        leak = any(c.get("significant") and c.get("claim_kind") not in (None, "verified")
                   for c in res.get("comparisons") or [])
        leak |= any((c.get("better") or c.get("non_inferior")) and c.get("claim_kind") not in (None, "verified")
                    for c in res.get("baseline_comparisons") or [])
        r["leak"].add(leak, 1)
        if dec is not None:
            r["sig_wrong"].add(sig_wrong, 1)
            r["dec_ver"].add(dec[0], dec[1])
            n_sig = sum(bool(c.get("significant")) for c in res.get("comparisons") or [])
            r["cmp_wrong_share"].add(dec[2], n_sig)
        gate_wrong = None
        if res.get("baseline_comparisons") is not None:
            margin = res.get("margin") if res.get("margin") is not None else margin
            gw = gw_tagged = False
            for c in res["baseline_comparisons"]:
                p, bl = c.get("policy"), c.get("baseline")
                m = c.get("margin") if c.get("margin") is not None else (res.get("margin") or 0.0)
                margin = m
                if p not in truth or bl not in truth:
                    continue
                dt = truth[p] - truth[bl]
                wrong = (bool(c.get("better")) and dt <= 1e-9) or (bool(c.get("non_inferior")) and dt < -m - 1e-9)
                gw |= wrong
                gw_tagged |= wrong and c.get("claim_kind") in (None, "verified")
            gate_wrong = gw
            r["gate_wrong"].add(gw, 1)
            r["gate_wrong_tagged"].add(gw_tagged, 1)
        r["any_wrong"].add(best_wrong or sig_wrong or bool(gate_wrong), 1)
        r["rank_ver"].add(*_ranking(_verified_levels(res), truth))
        # assumes transport
        at = res.get("assumes_transport")
        if at is not None:
            bat = _best_name(at.get("best_policy"))
            bw = bat is not None and bat != tb
            r["best_wrong_at"].add(bw, 1)
            dat = _decisions(at.get("comparisons"), truth)
            if dat is not None:
                r["sig_wrong_at"].add(bool(dat[2]), 1)
                r["dec_at"].add(dat[0], dat[1])
                n_sig = sum(bool(c.get("significant")) for c in at.get("comparisons") or [])
                r["cmp_wrong_share_at"].add(dat[2], n_sig)
            r["any_wrong_at"].add(bw or bool(dat and dat[2]), 1)
        lv_at = _assumed_levels(res)
        if lv_at:
            r["rank_at"].add(*_ranking(lv_at, truth))
        # fooled policies at their borrowed value
        for p in scen.fooled:
            e = pols.get(p, {})
            plug = e.get("plug_in")
            if plug is not None:
                plug_bias[p].append(plug - truth[p])
            est = e.get("estimate")
            borrowed = (e.get("level_claim") == "ok" and est is not None and plug is not None
                        and abs(est - plug) < abs(est - truth[p]))
            r["borrowed"].add(borrowed, 1)
            r["at_plugin"].add(e.get("level_claim") == "ok" and est is not None and plug is not None
                               and abs(est - plug) < 1e-9, 1)
            aest = (e.get("assumed") or {}).get("estimate")
            if aest is not None and plug is not None:
                r["borrowed_at"].add(abs(aest - plug) < abs(aest - truth[p]), 1)
                r["at_plugin_at"].add(abs(aest - plug) < 1e-9, 1)
        aug = run.get("augmented")
        if aug is not None and aug.get("policies"):
            daug = _decisions(aug.get("comparisons"), truth)
            if daug is not None:
                r["dec_aug"].add(daug[0], daug[1])
                if dec is not None and dec[1]:
                    gains["dec"].append((dec[0] - daug[0]) / dec[1])
            lv = {p: e["estimate"] for p, e in aug["policies"].items()
                  if e.get("estimate") is not None and e.get("level_claim") != "refused"}
            ra, rn = _ranking(lv, truth)
            r["rank_aug"].add(ra, rn)
            rv, _ = _ranking(_verified_levels(res), truth)
            if rn:
                gains["rank"].append((rv - ra) / rn)
            for p in names:
                cv, ca = (pols.get(p) or {}).get("ci"), (aug["policies"].get(p) or {}).get("ci")
                if (pols.get(p) or {}).get("level_claim") == "ok" and cv and ca and None not in (*cv, *ca) \
                        and ca[1] > ca[0]:
                    gains["width"].append((cv[1] - cv[0]) / (ca[1] - ca[0]))
    return {"rates": r, "per_policy": per_pol, "plug_bias": {p: float(np.mean(v)) if v else float("nan")
                                                              for p, v in plug_bias.items()},
            "lambda": {p: float(np.mean(v)) if v else float("nan") for p, v in lambdas.items()},
            "cpu_s": float(np.nanmean(cpu)) if cpu else float("nan"), "datasets": len(runs), "margin": margin,
            "gains": {k: _mean_se(v) for k, v in gains.items()}}


def _mean_se(v: list[float]) -> str:
    if not v:
        return "n/a"
    a = np.asarray(v, dtype=float)
    se = a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return f"{a.mean():+.3f} ({se:.3f})"


def report(runs: list[dict], cells: list[tuple[int, float]], scen_names: list[str]) -> str:
    """The tables as Markdown."""
    scs = scenarios()
    lines = []
    scored = {}
    for s in scen_names:
        for n, f in cells:
            rs = [x for x in runs if x["scenario"] == s and x["n"] == n and abs(x["frac"] - f) < 1e-9]
            if rs:
                scored[(s, n, f)] = score_cell(rs, scs[s])
    if not scored:
        return "no runs"
    lines.append("### Coverage of verified intervals (ratio SE over datasets in brackets)\n")
    lines.append("| scenario | n / base labels | sets | verified coverage, all | min per-policy coverage (policy) "
                 "| share with a verified level | assumes-transport coverage | CPU s / eval |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        r = c["rates"]
        pp = {p: v["cover"].value() for p, v in c["per_policy"].items() if v["cover"].n}
        if pp:
            worst = min(pp, key=lambda p: pp[p][0])
            worst_txt = f"{pp[worst][0]:.3f} ({pp[worst][1]:.3f}) {worst}"
        else:
            worst_txt = "n/a"
        lines.append(f"| {s} | {n} / {f:.0%} | {c['datasets']} | {r['cover_all'].fmt()} | {worst_txt} | "
                     f"{r['has_level'].fmt()} | {r['cover_assumed'].fmt()} | {c['cpu_s']:.2f} |")
    lines.append("\n### Per policy: share with a verified level / verified coverage (binomial SE) / "
                 "assumes-transport coverage; mean verified lambda\n")
    lines.append("| scenario | n / base labels | policy | has verified | verified coverage | assumed coverage | lambda |")
    lines.append("|---|---|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        for p, v in c["per_policy"].items():
            lam = c["lambda"].get(p, float("nan"))
            lines.append(f"| {s} | {n} / {f:.0%} | {p} | {v['has'].fmt()} | {v['cover'].fmt()} | "
                         f"{v['cover_at'].fmt()} | {'n/a' if math.isnan(lam) else f'{lam:.2f}'} |")
    lines.append("\n### Wrong decisions per dataset: verified | assumes transport (binomial SE)\n")
    lines.append("| scenario | n / base labels | best named (verified) | best wrong | sig. wrong (all entries) "
                 "| sig. wrong (verified-tagged) | gate passes worse (all) | gate passes worse (verified-tagged) "
                 "| any wrong (all) | assumes-transport entries flagged in the verified lists "
                 "| best wrong (assumed) | sig. wrong (assumed) | any wrong (assumed) "
                 "| share of sig. comparisons wrong: verified / assumed |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        r = c["rates"]
        lines.append(f"| {s} | {n} / {f:.0%} | {r['best_named'].fmt()} | {r['best_wrong'].fmt()} | "
                     f"{r['sig_wrong'].fmt()} | {r['sig_wrong_tagged'].fmt()} | {r['gate_wrong'].fmt()} | "
                     f"{r['gate_wrong_tagged'].fmt()} | {r['any_wrong'].fmt()} | {r['leak'].fmt()} | "
                     f"{r['best_wrong_at'].fmt()} | {r['sig_wrong_at'].fmt()} | {r['any_wrong_at'].fmt()} | "
                     f"{r['cmp_wrong_share'].fmt()} / {r['cmp_wrong_share_at'].fmt()} |")
    lines.append("\n### Judge-fooled policies: reported at the borrowed (plug-in) value\n")
    lines.append("| scenario | n / base labels | mean plug-in bias (policy) | verified level = plug-in "
                 "| verified level nearer plug-in than truth | assumed level = plug-in | assumed nearer plug-in |")
    lines.append("|---|---|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        if not c["plug_bias"]:
            continue
        r = c["rates"]
        bias = ", ".join(f"{b:+.3f} ({p})" for p, b in c["plug_bias"].items())
        lines.append(f"| {s} | {n} / {f:.0%} | {bias} | {r['at_plugin'].fmt()} | {r['borrowed'].fmt()} | "
                     f"{r['at_plugin_at'].fmt()} | {r['borrowed_at'].fmt()} |")
    lines.append("\n### Efficiency: decision rate and pairwise ranking accuracy (ratio SE over datasets)\n")
    lines.append("| scenario | n / base labels | decision rate: verified | augmented | assumes transport "
                 "| ranking: verified | augmented | assumes transport |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        r = c["rates"]
        lines.append(f"| {s} | {n} / {f:.0%} | {r['dec_ver'].fmt()} | {r['dec_aug'].fmt()} | {r['dec_at'].fmt()} | "
                     f"{r['rank_ver'].fmt()} | {r['rank_aug'].fmt()} | {r['rank_at'].fmt()} |")
    lines.append("\n### Verified minus augmented, paired per dataset (mean (SE over datasets)); "
                 "verified / augmented CI width\n")
    lines.append("| scenario | n / base labels | decision rate gain | ranking accuracy gain | CI width ratio |")
    lines.append("|---|---|---|---|---|")
    for (s, n, f), c in scored.items():
        g = c["gains"]
        if g["dec"] == "n/a" and g["width"] == "n/a":
            continue
        w = g["width"].replace("+", "")
        lines.append(f"| {s} | {n} / {f:.0%} | {g['dec']} | {g['rank']} | {w} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="n:fraction,... (default %(default)s)")
    ap.add_argument("--scenarios", default=",".join(sorted(scenarios())))
    ap.add_argument("--datasets", type=int, default=100)
    ap.add_argument("--first-rep", type=int, default=0, help="index of the first dataset (fresh seeds for a re-run)")
    ap.add_argument("--B", type=int, default=500, help="bootstrap replicates per evaluation")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--option", action="append", default=[], help="extra engine option key=value (JSON value)")
    ap.add_argument("--length", action="store_true", help="judge length bias 0.5, response_length covariate")
    ap.add_argument("--no-augmented", action="store_true", help="skip the augmented run on the clean design")
    ap.add_argument("--json", type=Path, help="write every run here (and stream them to <json>.jsonl)")
    ap.add_argument("--rescore", help="print the tables of --json files (or their .jsonl), comma-separated, together; "
                    "no runs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    cells = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in args.cells.split(",")]
    scen_names = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scen_names) - set(scenarios()))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(scenarios())}")
    options = {}
    for kv in args.option:
        k, _, v = kv.partition("=")
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    if args.rescore:
        runs = []
        for path in map(Path, args.rescore.split(",")):
            text = path.read_text()
            if path.suffix == ".jsonl":
                runs += [json.loads(ln) for ln in text.splitlines() if ln.strip()]
            else:
                runs += json.loads(text)["runs"]
        print(report(runs, cells, scen_names))
        return 0
    tasks = [(s, n, f, rep, args.B, options, s == "d_clean" and not args.no_augmented, args.length)
             for rep in range(args.first_rep, args.first_rep + args.datasets) for s in scen_names for n, f in cells]
    stream = None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        stream = open(args.json.with_suffix(".jsonl"), "w")  # noqa: SIM115
    t0, c0 = time.perf_counter(), time.process_time()
    runs = []
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for i, out in enumerate(pool.imap_unordered(run_task, tasks)):
            runs.append(out)
            if stream:
                stream.write(json.dumps(out, default=float) + "\n")
                stream.flush()
            if (i + 1) % 50 == 0:
                log.info("%d / %d datasets, %.0f s, load %s", i + 1, len(tasks), time.perf_counter() - t0,
                         os.getloadavg())
    wall = time.perf_counter() - t0
    log.info("%d datasets in %.0f s wall (load %s)", len(runs), wall, os.getloadavg())
    header = (f"{len(tasks)} datasets ({args.datasets} per cell), B={args.B}, options {options or 'defaults'}, "
              f"{'length bias + response_length covariate' if args.length else 'no length bias, no covariate'}, "
              f"baseline option {'on' if _supports('baseline') else 'n/a (engine has none)'}; wall {wall:.0f} s")
    print(header)
    print(report(runs, cells, scen_names))
    if args.json:
        stream.close()
        args.json.write_text(json.dumps({"options": options, "B": args.B, "cells": cells, "runs": runs},
                                        default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

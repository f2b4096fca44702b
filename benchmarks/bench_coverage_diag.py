"""Why the transported policies' intervals under-cover at 25% labels (issue 9): a precise, cheap experiment.

One cell of `bench_protocol.py` (same simulator, same datasets and seeds), many datasets, small B. For every
transported policy it records the estimate, the reported SE and CI, both routes' SEs (bootstrap and analytic
influence function), the level basis (plug-in audited / recalibrated / unaudited), the calibration mode chosen
and, in the pooled design, the sources robust pooling excluded. It prints, per policy, the empirical SD of the
estimate across datasets against the mean reported SE, split by mode and basis, and the coverage.

``--option calibration_mode=monotone`` forces a mode (no selection), which separates the selection's share of the
spread from a fixed estimator's.

Audits (issue 9, small calibration sets): every run also records each policy's audit -- residual mean, SE, its
route, the t reference's df, the clustered variances of its two parts (the audit slice's residual term and the
borrowed calibrator's term, from the influence terms) -- and the calibration labels; the report gives, per audited
transported policy, the mean (bias: a real non-transport of the fitted calibrator) and SD (against 1: SE under-
statement) of z = residual_mean / se, its tails, the false-fail rate by mode, and the false-fail rate recomputed
with a normal and with an offline Welch-t reference (``welch_t``: parts from the influence terms, labelled rows as
df; an approximation of the engine's `audit_degrees_of_freedom`). ``--table A.json B.json ...``: one line per run
(audits run, false fails, adversary fails, adversary at a borrowed level, coverage, ranking accuracy).

``--replay`` (pooled design): robust pooling rerun inside every bootstrap replicate (``pooling_bootstrap="rerun"``,
`cje_engine.pipeline.pooling_replay`) against the default fixed sources, on the same replicate weights: how often
the replicates' selection differs from the full data's (replicates that differ from the fixed ones) and the coverage
and width of the reported levels' percentile intervals from either set of replicates.

Usage::

    nice -n 10 .venv/bin/python benchmarks/bench_coverage_diag.py --n 500 --fraction 0.25 --datasets 200 -B 200 \
        --json benchmarks/_work/diag_500_25.json
    nice -n 10 .venv/bin/python benchmarks/bench_coverage_diag.py --design pooled --n 1000 --fraction 0.05 ...
    .venv/bin/python benchmarks/bench_coverage_diag.py --rescore benchmarks/_work/diag_500_25.json
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_protocol as bp  # noqa: E402
from cje_engine.errors import CJEInputError  # noqa: E402

log = logging.getLogger("bench_coverage_diag")


def _audit_parts(prep) -> tuple[np.ndarray, np.ndarray]:
    """Clustered variances of each policy's audit-statistic parts: its residual term (the audit slice's
    noise) and the borrowed calibrator's term (influence ``audit`` minus the residual term)."""
    from cje_engine.pipeline.calibration import _column_var

    K = prep.design.n_policies
    res_term = prep.infl["calibration"][:, K:]
    return _column_var(res_term), _column_var(res_term - prep.infl["audit"])


def run_one(n: int, frac: float, rep: int, B: int, design: str, options: dict) -> dict:
    from cje_engine import bootstrap_chunk, finalize, prepare

    sim = bp.simulate_dataset(n, frac, rep, bp.JUDGE_NOISE, design)
    seed = bp._seed(n, frac, rep) % (2**31)
    # base-only by default (unlike bench_protocol.py): the audit decomposed here is the one against a borrowed
    # calibrator; --option calibration_policies=null gives the engine's default pooling
    kwargs = {"covariates": ["response_length"], "calibration_policies": None if design == "pooled" else ["base"],
              **options}
    t0 = time.process_time()
    prep = prepare(sim.frame, n_bootstrap=B, seed=seed, **kwargs)
    res = finalize(prep, [bootstrap_chunk(prep, 0, B)] if prep.options.inference == "bootstrap" else [])
    cpu = time.process_time() - t0
    var_res, var_calib = _audit_parts(prep)
    d = res.to_dict()
    pols = {}
    for k, (p, e) in enumerate(d["policies"].items()):
        pi, au = e["plug_in"], e.get("augmented") or {}
        pols[p] = {"estimate": e["estimate"], "se": e["se"], "ci": e["ci"], "basis": e["basis_code"],
                   "ci_method": e.get("ci_method"), "refused": e["level_claim"] == "refused",
                   "ci_unconditional": (e.get("selective") or {}).get("ci_unconditional", e["ci"]),
                   "audit": e["audit"]["verdict"], "se_analytic": e["se_analytic"], "se_bootstrap": e.get("se_bootstrap"),
                   "plug_in": pi["estimate"], "plug_in_se_boot": pi.get("se_bootstrap"),
                   "plug_in_se_analytic": pi["se_analytic"], "plug_in_ci": pi["ci"],
                   "augmented": au.get("estimate"), "augmented_se_boot": au.get("se_bootstrap"),
                   "var_cal_jackknife": e["var_cal_jackknife_plug_in"], "var_cal_influence": e["var_cal_influence_plug_in"],
                   "refused": e["level_claim"] == "refused"}
        a = e["audit"]
        pols[p].update(audit_delta=a["residual_mean"], audit_se=a["se"], audit_route=a.get("se_route"),
                       audit_p_adj=a["p_adjusted"], audit_df=a.get("df"), audit_var_residual=float(var_res[k]),
                       audit_var_calibrator=float(var_calib[k]), n_labelled=e["n_labelled"])
    cal_d = d["calibration"]
    return {"rep": rep, "truth": sim.true_values, "mode": cal_d["mode"], "cpu_s": cpu, "n_cal": cal_d["n_train"],
            "excluded": [x["policy"] for x in cal_d.get("excluded_sources", [])],
            "selection": {k: cal_d["selection"].get(k) for k in ("paired_difference", "paired_se", "chosen")},
            "policies": pols}


def run_replay(n: int, frac: float, rep: int, B: int) -> dict:
    """One pooled dataset: the engine's intervals with the sources fixed (the default) and with robust pooling
    rerun in every replicate (``pooling_bootstrap="rerun"``), on the same replicate weights."""
    from cje_engine import bootstrap_chunk, finalize, prepare

    sim = bp.simulate_dataset(n, frac, rep, bp.JUDGE_NOISE, "pooled")
    seed = bp._seed(n, frac, rep) % (2**31)
    prep = prepare(sim.frame, covariates=["response_length"], n_bootstrap=B, seed=seed, pooling_bootstrap="rerun")
    replay, prep.replay = prep.replay, None
    t0 = time.process_time()
    fixed = bootstrap_chunk(prep, 0, B)
    cpu_fixed = time.process_time() - t0
    res = finalize(prep, [fixed])
    prep.replay = replay
    t0 = time.process_time()
    reps = bootstrap_chunk(prep, 0, B) if replay is not None else fixed
    cpu_replay = time.process_time() - t0
    pols = {}
    d = res.to_dict()["policies"]
    for k, p in enumerate(prep.design.data.policies):
        col = int(res.columns[k])
        r = reps[:, col][np.isfinite(reps[:, col])]
        e = d[p]
        pols[p] = {"estimate": e["estimate"], "ci": e["ci"], "ci_replay": np.percentile(r, [2.5, 97.5]).tolist(),
                   "se": e["se"], "se_replay": float(np.std(r, ddof=1)), "basis": e["basis_code"]}
    other = np.mean([not np.array_equal(a, b, equal_nan=True) for a, b in zip(reps, fixed)])
    return {"rep": rep, "truth": sim.true_values, "excluded": [e["policy"] for e in prep.excluded],
            "share_replicates_other_sources": float(other), "cpu_fixed": cpu_fixed, "cpu_replay": cpu_replay,
            "policies": pols}


def report_replay(runs: list[dict]) -> None:
    share = np.array([r["share_replicates_other_sources"] for r in runs])
    clean = np.array([r["excluded"] == ["unhelpful"] for r in runs])
    print(f"datasets {len(runs)}; with a clean source excluded: {int((~clean).sum())}")
    print(f"replicates whose rerun pooling picks other sources than the full data: mean {share.mean():.3f} "
          f"(datasets with only the adversary excluded {share[clean].mean():.3f})")
    print(f"CPU of B replicates: fixed {np.sum([r['cpu_fixed'] for r in runs]):.1f} s, "
          f"rerun pooling {np.sum([r['cpu_replay'] for r in runs]):.1f} s")
    for key in ("ci", "ci_replay"):
        for name, sel in (("all", np.ones(len(runs), bool)), ("clean", clean), ("clean source excluded", ~clean)):
            c = [r["policies"][p][key][0] <= r["truth"][p] <= r["policies"][p][key][1]
                 for r, s_ in zip(runs, sel) if s_ for p in bp.TRANSPORTED]
            w = [r["policies"][p][key][1] - r["policies"][p][key][0] for r, s_ in zip(runs, sel) if s_
                 for p in bp.TRANSPORTED]
            if c:
                print(f"  {key:10s} {name:22s} coverage {np.mean(c):.3f} over {len(c)}, mean width {np.mean(w):.4f}")


def report_selective(runs: list[dict]) -> None:
    """Selective intervals (issue 9, cause 1): each reported interval against the unconditional one it replaced
    (``ci_unconditional``: the same dataset, the same replicates), for the transported policies, for those
    reported after a (false) failed audit, and for the adversary."""
    if not runs or "ci_method" not in next(iter(runs[0]["policies"].values())):
        return
    adv = bp.ADVERSARY

    def cov_w(rows: list[tuple[dict, float]], key: str) -> str:
        c = [e[key][0] <= t <= e[key][1] for e, t in rows]
        w = [e[key][1] - e[key][0] for e, t in rows]
        return f"coverage {np.mean(c):.3f} ({int(np.sum(c))}/{len(c)}), mean width {np.mean(w):.4f}" if c else "none"

    tr = [(r["policies"][p], r["truth"][p]) for r in runs for p in bp.TRANSPORTED]
    sel = [(e, t) for e, t in tr if e["ci_method"] == "selective"]
    print("\nselective intervals (issue 9, cause 1); 'before' = the unconditional interval of the same run")
    for name, rows in (("transported, all", tr), ("transported, after a false fail", sel)):
        print(f"  {name:34s} before {cov_w(rows, 'ci_unconditional')}")
        print(f"  {'':34s} after  {cov_w(rows, 'ci')}")
    a = [(r["policies"][adv], r["truth"][adv]) for r in runs if adv in r["policies"]]
    for key, lab in (("ci_unconditional", "before"), ("ci", "after ")):
        safe = [e["refused"] or (e["audit"] == "fail" and e[key][0] <= t <= e[key][1]) for e, t in a]
        print(f"  {adv} safe {lab} {np.mean(safe):.3f} ({int(np.sum(safe))}/{len(safe)}); "
              f"{cov_w([x for x in a if x[0]['ci_method'] == 'selective'], key)} over its selective intervals")
    n_sel = sum(e["ci_method"] == "selective" for e, _ in a)
    print(f"  {adv}: selective in {n_sel} of {len(a)} datasets")


def _stats(rows: list[tuple[float, float, float, bool]]) -> str:
    if len(rows) < 3:
        return f"{len(rows):4d} sets"
    err = np.array([r[0] for r in rows])
    se = np.array([r[1] for r in rows])
    cov = np.mean([r[3] for r in rows])
    sd = err.std(ddof=1)
    rel = 1 / np.sqrt(2 * (len(rows) - 1))  # relative SE of an SD estimate (normal)
    return (f"{len(rows):4d} sets  bias {err.mean():+.4f} (se {sd / np.sqrt(len(rows)):.4f})  SD {sd:.4f} "
            f"(+/-{rel * sd:.4f})  mean SE {se.mean():.4f}  rms SE {np.sqrt(np.mean(se**2)):.4f}  "
            f"ratio SD/rmsSE {sd / np.sqrt(np.mean(se**2)):.3f}  coverage {cov:.3f}")


def report(runs: list[dict], key_est: str = "estimate", key_se: str = "se", key_ci: str = "ci") -> None:
    modes = sorted({r["mode"] for r in runs})
    print(f"datasets {len(runs)}; modes chosen: " + ", ".join(f"{m} {sum(r['mode'] == m for r in runs)}" for m in modes))
    exc = {}
    for r in runs:
        for p in r["excluded"]:
            exc[p] = exc.get(p, 0) + 1
    if exc:
        print("excluded by robust pooling: " + ", ".join(f"{p} {c}" for p, c in sorted(exc.items())))
    allcov = []
    for p in bp.TRANSPORTED:
        rows = []
        for r in runs:
            e = r["policies"][p]
            t = r["truth"][p]
            ci = e[key_ci]
            rows.append((e[key_est] - t, e[key_se], r["mode"], ci[0] <= t <= ci[1], e["basis"],
                         e.get("se_analytic"), e.get("se_bootstrap")))
        allcov += [x[3] for x in rows]
        print(f"\n{p}: " + _stats([(a, b, c, d) for a, b, c, d, *_ in rows]))
        for m in modes:
            sub = [(a, b, c, d) for a, b, c, d, *_ in rows if c == m]
            print(f"   mode {m:10s} " + _stats(sub))
        for bc in sorted({x[4] for x in rows}):
            sub = [(a, b, c, d) for a, b, c, d, e, *_ in rows if e == bc]
            print(f"   basis {bc:12s} " + _stats(sub))
        sa = np.array([x[5] for x in rows], float)
        sb = np.array([x[6] for x in rows if x[6] is not None], float)
        if sb.size:
            print(f"   rms SE bootstrap {np.sqrt(np.mean(sb**2)):.4f}  analytic {np.sqrt(np.nanmean(sa**2)):.4f}")
    print(f"\ncoverage of the six transported policies: {np.mean(allcov):.3f} over {len(allcov)} intervals")


def welch_df(var_res: np.ndarray, var_cal: np.ndarray, df_res: np.ndarray, df_cal: np.ndarray) -> np.ndarray:
    """Welch-Satterthwaite degrees of freedom of a sum of two independent variance estimates (for the
    offline rescoring below; the engine's own is `cje_engine.audit.satterthwaite_df`)."""
    tot = var_res + var_cal
    with np.errstate(invalid="ignore", divide="ignore"):
        return tot**2 / (var_res**2 / df_res + var_cal**2 / df_cal)


def _holm_fail(p: dict[str, float], alpha: float = 0.05) -> dict[str, bool]:
    from cje_engine.inference.multiplicity import holm

    names = [k for k, v in p.items() if v is not None and np.isfinite(v)]
    adj = holm(np.array([p[k] for k in names])) if names else []
    return {k: bool(a <= alpha) for k, a in zip(names, adj)}


def audit_rows(runs: list[dict], reference: str = "engine") -> list[dict]:
    """One row per audited transported policy (base excluded: it trains the calibrator): z, route, mode, the
    verdict under ``reference`` (``engine``: as reported; ``normal`` / ``welch_t``: recomputed from the recorded
    SE and variance parts, Holm over every audited policy of the dataset)."""
    from scipy.stats import norm, t as student_t

    out = []
    for r in runs:
        pol = r["policies"]
        z = {p: (e["audit_delta"] / e["audit_se"]) if e.get("audit_se") else None for p, e in pol.items()}
        if reference == "engine":
            fail = {p: e["audit"] == "fail" for p, e in pol.items()}
        else:
            pv = {}
            for p, e in pol.items():
                if z[p] is None:
                    continue
                if reference == "normal" or p == "base":
                    pv[p] = 2 * norm.sf(abs(z[p]))
                else:
                    df = welch_df(np.array(e["audit_var_residual"]), np.array(e["audit_var_calibrator"]),
                                  np.array(max(e["n_labelled"] - 1, 1)), np.array(max(r["n_cal"] - 1, 1)))
                    pv[p] = 2 * student_t.sf(abs(z[p]), float(df))
            fail = _holm_fail(pv)
        for p in bp.TRANSPORTED:
            if p == "base" or z.get(p) is None:
                continue
            e = pol[p]
            out.append({"policy": p, "z": z[p], "fail": bool(fail.get(p, False)), "mode": r["mode"],
                        "route": e["audit_route"], "df": e.get("audit_df"),
                        "share_cal": e["audit_var_calibrator"] / (e["audit_var_calibrator"] + e["audit_var_residual"])})
        adv = pol.get(bp.ADVERSARY)
        if adv is not None and z.get(bp.ADVERSARY) is not None:  # audited (not not_run)
            out.append({"policy": bp.ADVERSARY, "z": z.get(bp.ADVERSARY), "fail": bool(fail.get(bp.ADVERSARY)),
                        "mode": r["mode"], "route": adv["audit_route"], "df": adv.get("audit_df"), "share_cal": None})
    return out


def report_audit(runs: list[dict]) -> None:
    """Per transported policy: mean and SD of the audit z, its tails and the false-fail rate; then the
    protocol scores (bench_protocol.score) of the reported levels."""
    n_cal = np.array([r["n_cal"] for r in runs])
    print(f"\naudits: calibration labels median {np.median(n_cal):.0f} (range {n_cal.min()}-{n_cal.max()})")
    for ref in ("engine", "normal", "welch_t"):
        rows = audit_rows(runs, ref)
        tr = [x for x in rows if x["policy"] != bp.ADVERSARY]
        ff = np.mean([x["fail"] for x in tr])
        mc = np.sqrt(ff * (1 - ff) / len(tr))
        adv = np.mean([x["fail"] for x in rows if x["policy"] == bp.ADVERSARY])
        n_adv = sum(x["policy"] == bp.ADVERSARY for x in rows)
        print(f"  [{ref:7s}] false fails {ff:.3f} (MC se {mc:.3f}) over {len(tr)} audits; adversary fails {adv:.3f} "
              f"of {n_adv} audited")
        if ref != "engine":
            continue
        for p in [q for q in bp.TRANSPORTED if q != "base"]:
            sub = [x for x in tr if x["policy"] == p]
            z = np.array([x["z"] for x in sub])
            share = np.mean([x["share_cal"] for x in sub])
            modes = ", ".join(f"{m} {sum(x['mode'] == m for x in sub)}" for m in sorted({x["mode"] for x in sub}))
            sd = z.std(ddof=1)
            print(f"    {p:8s} z mean {z.mean():+.3f} (se {sd / np.sqrt(z.size):.3f})  SD {sd:.3f}  "
                  f"|z|>1.96 {np.mean(np.abs(z) > 1.96):.3f}  |z|>2.58 {np.mean(np.abs(z) > 2.58):.3f}  "
                  f"fail {np.mean([x['fail'] for x in sub]):.3f}  calibrator share of var {share:.2f}  ({modes})")
            for m in sorted({x["mode"] for x in sub}):
                zm = np.array([x["z"] for x in sub if x["mode"] == m])
                if zm.size > 2:
                    print(f"        mode {m:9s} n {zm.size:3d}  z mean {zm.mean():+.3f}  SD {zm.std(ddof=1):.3f}  "
                          f"fail {np.mean([x['fail'] for x in sub if x['mode'] == m]):.3f}")
    scored = [{"truth": r["truth"], "ours": {"policies": {p: {"estimate": e["estimate"], "ci": e["ci"],
                                                                "refused": e.get("refused", False),
                                                                "audit": e["audit"], "basis": e["basis"]}
                                                            for p, e in r["policies"].items()}}} for r in runs]
    sc = bp.score(scored, "ours")
    print("  protocol scores: " + ", ".join(f"{k} {v:.3f}" for k, v in sc.items() if k != "datasets"))


def table(files: list[Path]) -> None:
    """One line per diag JSON: the audit and protocol figures of issue 9's table (same datasets: same cell)."""
    print("| run | datasets | calibration labels (median) | audits run | false audit fails (MC se) | adversary "
          "audit fails (of audited) | adversary at a borrowed level | coverage, 6 transported | ranking accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in files:
        runs = json.loads(f.read_text())["runs"]
        rows = audit_rows(runs)
        tr = [x["fail"] for x in rows if x["policy"] != bp.ADVERSARY]
        ff = float(np.mean(tr))
        adv = float(np.mean([x["fail"] for x in rows if x["policy"] == bp.ADVERSARY]))
        scored = [{"truth": r["truth"], "ours": {"policies": {p: {"estimate": e["estimate"], "ci": e["ci"],
                                                                    "refused": e.get("refused", False),
                                                                    "audit": e["audit"], "basis": e["basis"]}
                                                                for p, e in r["policies"].items()}}} for r in runs]
        sc = bp.score(scored, "ours")
        print(f"| {f.stem} | {len(runs)} | {np.median([r['n_cal'] for r in runs]):.0f} | {len(tr)} | {ff:.3f} "
              f"({np.sqrt(ff * (1 - ff) / len(tr)):.3f}) | {adv:.3f} | {1 - sc['adversary_unbiased']:.3f} | "
              f"{sc['coverage']:.3f} | {sc['rank_acc']:.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--datasets", type=int, default=200)
    ap.add_argument("--first", type=int, default=0, help="first dataset index")
    ap.add_argument("-B", type=int, default=200)
    ap.add_argument("--design", choices=["protocol", "pooled"], default="protocol")
    ap.add_argument("--option", action="append", default=[], help="engine option key=value (JSON value)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rescore", type=Path, action="append", default=None)
    ap.add_argument("--table", type=Path, nargs="+", help="diag JSON files: one summary line each (issue 9 table)")
    ap.add_argument("--replay", action="store_true", help="pooled design: the rerun-pooling experiment (above)")
    ap.add_argument("--plug-in", action="store_true", help="report the plug-in column instead of the reported level")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("cje_engine").setLevel(logging.WARNING)
    if args.table:
        table(args.table)
        return 0
    if args.rescore:
        runs = [r for f in args.rescore for r in json.loads(f.read_text())["runs"]]
    else:
        options = bp.parse_options(args.option)
        runs = []
        skipped = 0
        t0 = time.perf_counter()
        for rep in range(args.first, args.first + args.datasets):
            try:
                runs.append(run_replay(args.n, args.fraction, rep, args.B) if args.replay else
                            run_one(args.n, args.fraction, rep, args.B, args.design, options))
            except CJEInputError as exc:  # e.g. too few calibration labels to cross-fit: nothing estimated
                log.info("dataset %d refused: %s", rep, exc)
                skipped += 1
            if (rep + 1) % 25 == 0:
                log.info("%d datasets, %.0f s", len(runs), time.perf_counter() - t0)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "rescore": None},
                                             "runs": runs}, default=float))
        print(f"datasets the engine refused outright (too few labels to cross-fit): {skipped}")
        if not args.replay:
            print(f"mean CPU per dataset {np.mean([r['cpu_s'] for r in runs]):.2f} s")
    if runs and "share_replicates_other_sources" in runs[0]:
        report_replay(runs)
    elif args.plug_in:
        report(runs, "plug_in", "plug_in_se_boot", "plug_in_ci")
    else:
        report(runs)
        if "n_cal" in runs[0]:
            report_audit(runs)
        report_selective(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Statistics: coverage, interval width and pairwise ranking accuracy on simulated data.

Grid: oracle fractions x prompts per policy (default {0.05, 0.10, 0.25, 0.50} x {500, 1000, 5000}),
``--datasets`` simulated datasets per cell (default 200), five policies each
(`cje_engine.simulate.direct.default_policies`: base and clone identical, a verbose, a concise and an
adversarial policy; judge bias grows with response length; labels MCAR). Every dataset is
evaluated with `cje_engine.evaluate` (covariate ``response_length``, calibration mode ``auto``)
and compared with the exact true values ``E[Y]`` of the simulator.

Per cell and method:

* coverage: share of (dataset, policy) 95% intervals containing the true value;
* width: mean interval width;
* ranking accuracy: share of policy pairs with different true values (9 of the 10 pairs; base and
  clone are a true tie) that the point estimates order correctly.

The paper's audited protocol (labels on one calibration policy plus 50-label audit slices, the
reference package side by side) and the pooled design with an adversary are in
``benchmarks/bench_protocol.py``; this grid is the MCAR design, where every policy's labels calibrate.

Methods: ``cje`` = the reported level (``estimate`` / ``ci`` under ``level_estimator``: by default
the calibrated plug-in where the audit does not fail, else the own-label level) on the chosen route (``--route analytic``: influence
function + fold jackknife, t quantiles on label-dominated columns; ``--route bootstrap``:
calibration-aware cluster bootstrap with ``--B`` replicates, percentile intervals; the bootstrap
run also reports the analytic interval of the same fits as ``cje-analytic``); ``raw judge`` =
mean judge score +/- 1.96 SE (SE = sd / sqrt(n)); ``oracle only`` = mean of the policy's own labels
+/- t_{m-1} SE (m labels; fewer than two labels count as a miss).

Monte Carlo error: a coverage p over N intervals has SE ~ sqrt(p (1 - p) / N); with N = 200 x 5 =
1000, SE = 0.0069 at p = 0.95, so an observed coverage outside [0.936, 0.964] is evidence (at ~95%)
that the true coverage is not 0.95 (the five policies of a dataset share prompts, so N is a
little smaller effectively).

Usage::

    .venv/bin/python benchmarks/bench_statistics.py                          # analytic, 200/cell
    .venv/bin/python benchmarks/bench_statistics.py --route bootstrap --B 500 --datasets 50 \\
        --n 500,1000 --fractions 0.05,0.25                                     # bootstrap check
    .venv/bin/python benchmarks/bench_statistics.py --datasets 5 --n 500 --fractions 0.1   # smoke
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported; each worker is single-threaded

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from scipy.stats import t as student_t  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

log = logging.getLogger("bench_statistics")
Z = 1.959963984540054


def _seed(n: int, frac: float, rep: int) -> int:
    """Seed of dataset ``rep`` of cell (n, frac): independent of the grid, so any run that
    includes the cell (e.g. the bootstrap check) simulates the same datasets."""
    return (round(frac * 1000) * 100_000 + n) * 10_000 + rep


def run_one(task: tuple) -> dict:
    """Simulate one dataset, evaluate it, and return per-policy intervals for every method."""
    cell, rep, n, frac, route, B, covariates, mode = task
    import logging as _logging

    _logging.getLogger("cje_engine").setLevel(_logging.WARNING)
    from cje_engine import evaluate
    from cje_engine.simulate.direct import simulate

    seed = _seed(n, frac, rep)
    sim = simulate(n, oracle_fraction=frac, seed=seed)
    frame = sim.frame
    t0 = time.perf_counter()
    res = evaluate(frame, covariates=list(covariates), calibration_mode=mode, inference=route,
                   n_bootstrap=B, seed=seed)
    secs = time.perf_counter() - t0
    d = res.to_dict()
    names = list(d["policies"])
    truth = np.array([sim.true_values[p] for p in names])
    out: dict = {"cell": cell, "rep": rep, "seconds": secs, "truth": truth.tolist(), "policies": names,
                 "mode": d["calibration"]["mode"], "methods": {}}

    est, lo, hi, a_lo, a_hi, refused, basis = [], [], [], [], [], [], []
    for p in names:
        e = d["policies"][p]
        sub = e["augmented"] if e["basis_code"] in ("augmented", "recalibrated") else e["plug_in"]
        est.append(e["estimate"])
        lo.append(e["ci"][0])
        hi.append(e["ci"][1])
        a_lo.append(sub["ci_analytic"][0])
        a_hi.append(sub["ci_analytic"][1])
        refused.append(e["level_claim"] == "refused")
        basis.append(e["basis_code"])
    out["methods"]["cje"] = {"est": est, "lo": lo, "hi": hi}
    if route == "bootstrap":
        out["methods"]["cje-analytic"] = {"est": est, "lo": a_lo, "hi": a_hi}
    out["refused"] = refused
    out["basis"] = basis

    pol = frame["policy"].to_numpy()
    s = frame["judge_score"].to_numpy(dtype=float)
    y = frame["oracle_label"].to_numpy(dtype=float)
    raw, ora = {"est": [], "lo": [], "hi": []}, {"est": [], "lo": [], "hi": []}
    for p in names:
        sk = s[pol == p]
        m_, se = sk.mean(), sk.std(ddof=1) / np.sqrt(sk.size)
        raw["est"].append(m_)
        raw["lo"].append(m_ - Z * se)
        raw["hi"].append(m_ + Z * se)
        yk = y[pol == p]
        yk = yk[~np.isnan(yk)]
        if yk.size >= 2:
            m_, se = yk.mean(), yk.std(ddof=1) / np.sqrt(yk.size)
            c = student_t.ppf(0.975, yk.size - 1)
            ora["est"].append(m_)
            ora["lo"].append(m_ - c * se)
            ora["hi"].append(m_ + c * se)
        else:
            ora["est"].append(np.nan if yk.size == 0 else float(yk[0]))
            ora["lo"].append(np.nan)
            ora["hi"].append(np.nan)
    out["methods"]["raw judge"] = {k: [float(v) for v in vals] for k, vals in raw.items()}
    out["methods"]["oracle only"] = {k: [float(v) for v in vals] for k, vals in ora.items()}
    return out


def _pair_accuracy(est: np.ndarray, truth: np.ndarray) -> tuple[int, int]:
    right = total = 0
    for a in range(truth.size):
        for b in range(a + 1, truth.size):
            dt = truth[a] - truth[b]
            if abs(dt) < 1e-12:
                continue  # a true tie (base vs clone): no correct order
            total += 1
            de = est[a] - est[b]
            right += int(np.isfinite(de) and np.sign(de) == np.sign(dt))
    return right, total


def summarise(results: list[dict], cells: list[tuple[int, float]]) -> list[dict]:
    """Aggregate per (cell, method): coverage, its MC SE, mean width, ranking accuracy."""
    by_cell: dict[int, list[dict]] = defaultdict(list)
    for r in results:
        by_cell[r["cell"]].append(r)
    rows = []
    for ci, (n, frac) in enumerate(cells):
        rs = by_cell.get(ci, [])
        if not rs:
            continue
        methods = list(rs[0]["methods"])
        for meth in methods:
            cover, width, right, total, per_pol = [], [], 0, 0, defaultdict(list)
            for r in rs:
                m = r["methods"][meth]
                truth = np.array(r["truth"])
                lo, hi, est = np.array(m["lo"]), np.array(m["hi"]), np.array(m["est"])
                ok = np.isfinite(lo) & np.isfinite(hi)
                c = ok & (lo <= truth) & (truth <= hi)
                cover.extend(c.tolist())
                width.extend((hi - lo)[ok].tolist())
                for p, cc in zip(r["policies"], c):
                    per_pol[p].append(cc)
                a, t = _pair_accuracy(est, truth)
                right, total = right + a, total + t
            N = len(cover)
            p = float(np.mean(cover))
            worst = min(per_pol, key=lambda q: np.mean(per_pol[q]))
            rows.append({
                "n": n, "fraction": frac, "labels_per_policy": n * frac, "method": meth, "datasets": len(rs),
                "coverage": p, "mc_se": float(np.sqrt(max(p * (1 - p), 1e-12) / N)),
                "width": float(np.mean(width)) if width else float("nan"),
                "rank_acc": right / total if total else float("nan"),
                "worst_policy": worst, "worst_policy_coverage": float(np.mean(per_pol[worst])),
                "refused_share": float(np.mean([x for r in rs for x in r["refused"]])) if meth.startswith("cje") else None,
                "seconds_per_dataset": float(np.mean([r["seconds"] for r in rs])) if meth == "cje" else None,
                "modes": dict(sorted({m_: sum(r["mode"] == m_ for r in rs) for m_ in {r["mode"] for r in rs}}.items()))
                if meth == "cje" else None,
            })
    return rows


def table(rows: list[dict], markdown: bool = False) -> str:
    head = ["n", "oracle frac", "labels/policy", "method", "datasets", "coverage", "(MC SE)", "in [0.93,0.97]",
            "mean width", "rank acc", "worst policy (cov)"]
    lines = []
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
    else:
        lines.append(f"{'n':>5s} {'frac':>5s} {'lab/pol':>7s} {'method':>13s} {'sets':>4s} {'coverage':>8s} "
                     f"{'MC SE':>6s} {'ok':>3s} {'width':>7s} {'rankacc':>7s}  worst policy (cov)")
    for r in rows:
        ok = "yes" if 0.93 <= r["coverage"] <= 0.97 else "NO"
        if not r["method"].startswith("cje"):
            ok = "-"
        cells = [f"{r['n']}", f"{r['fraction']:.2f}", f"{r['labels_per_policy']:.0f}", r["method"], f"{r['datasets']}",
                 f"{r['coverage']:.3f}", f"{r['mc_se']:.3f}", ok, f"{r['width']:.4f}", f"{r['rank_acc']:.3f}",
                 f"{r['worst_policy']} ({r['worst_policy_coverage']:.3f})"]
        if markdown:
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append(f"{cells[0]:>5s} {cells[1]:>5s} {cells[2]:>7s} {cells[3]:>13s} {cells[4]:>4s} {cells[5]:>8s} "
                         f"{cells[6]:>6s} {cells[7]:>3s} {cells[8]:>7s} {cells[9]:>7s}  {cells[10]}")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0.05,0.10,0.25,0.50")
    ap.add_argument("--n", default="500,1000,5000", help="prompts per policy")
    ap.add_argument("--datasets", type=int, default=200, help="simulated datasets per cell")
    ap.add_argument("--route", choices=["analytic", "bootstrap"], default="analytic")
    ap.add_argument("--B", type=int, default=500, help="bootstrap replicates (--route bootstrap)")
    ap.add_argument("--covariates", default="response_length", help="comma list; empty for none")
    ap.add_argument("--mode", default="auto", choices=["auto", "monotone", "two_stage"])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write rows (and per-dataset results) to this JSON file")
    ap.add_argument("--markdown", type=Path, help="write the table as Markdown to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    ns = [int(x) for x in _floats(args.n)]
    cells = [(n, f) for f in _floats(args.fractions) for n in ns]
    covs = tuple(c.strip() for c in args.covariates.split(",") if c.strip())
    tasks = [(ci, rep, n, f, args.route, args.B, covs, args.mode)
             for ci, (n, f) in enumerate(cells) for rep in range(args.datasets)]
    # Largest datasets first so the two workers finish together.
    tasks.sort(key=lambda t: -t[2] * (args.B if args.route == "bootstrap" else 1))
    log.info("%d cells x %d datasets = %d evaluations, route=%s%s, %d processes", len(cells), args.datasets,
             len(tasks), args.route, f" (B={args.B})" if args.route == "bootstrap" else "", args.processes)
    t0 = time.perf_counter()
    results = []
    with mp.get_context("fork").Pool(args.processes) as pool:
        for i, r in enumerate(pool.imap_unordered(run_one, tasks, chunksize=2)):
            results.append(r)
            if (i + 1) % max(1, len(tasks) // 20) == 0:
                log.info("%d / %d done (%.0f s)", i + 1, len(tasks), time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    rows = summarise(results, cells)
    rows.sort(key=lambda r: (r["fraction"], r["n"], ["cje", "cje-analytic", "raw judge", "oracle only"].index(r["method"])))
    cmd = "python benchmarks/bench_statistics.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"route={args.route}{f' B={args.B}' if args.route == 'bootstrap' else ''}, covariates={list(covs)}, "
              f"mode={args.mode}, {args.datasets} datasets/cell, {args.processes} processes, wall {wall:.0f} s, "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    print("\n" + header + "\n" + table(rows))
    cje_rows = [r for r in rows if r["method"] == "cje"]
    misses = [r for r in cje_rows if not 0.93 <= r["coverage"] <= 0.97]
    print(f"\ncje coverage within [0.93, 0.97] in {len(cje_rows) - len(misses)} of {len(cje_rows)} cells"
          + ("" if not misses else "; outside: " + ", ".join(f"n={r['n']} f={r['fraction']} ({r['coverage']:.3f})"
                                                                for r in misses)))
    for r in cje_rows:
        print(f"  n={r['n']:5d} f={r['fraction']:.2f}: {r['seconds_per_dataset']:.2f} s/dataset, modes {r['modes']}, "
              f"refused share {r['refused_share']:.3f}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"Command: `{cmd}`\n\n{header}\n\n{table(rows, markdown=True)}\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": cmd, "header": header, "rows": rows, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

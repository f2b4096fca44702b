"""Coverage of own-label (augmented / recalibrated) intervals with 25 and 50 own labels.

Design: ``cje_engine.simulate`` with the default five policies (``unhelpful`` fools the judge, so
the calibration borrowed from ``base`` leaves it bimodal, skewed residuals; ``clone``, ``verbose``
and ``concise`` have near-symmetric residuals), ``label_design="calibration_policy"``: ``base``
labels ``--fraction`` of its rows and calibrates (``calibration_policies=["base"]``), every other
policy gets a random sample of exactly ``L`` own labels (L = 25, 50). Each dataset is prepared once,
``B`` bootstrap replicates are drawn with the engine's own ``bootstrap_chunk``, and every candidate
interval for each policy's own-label column (``K + k``) is computed from the same numbers:

* ``percentile``     today's bootstrap interval;
* ``t``              today's analytic interval: influence SE x t(labelled prompts - 1);
* ``bca``            BCa, acceleration from the influence values (nothing new from replicates);
* ``bca_expanded``   BCa with the expanded t quantile (`cje_engine.inference.intervals`);
* ``t_bootstrap_se`` bootstrap SE x t(labelled prompts - 1);
* ``skew_t``         analytic t with the Edgeworth skewness correction.

``--scenario symmetric`` replaces the policies by five centred, non-adversarial ones (near-symmetric
residuals everywhere): the check that a method does not over-cover where there is no skew.

Coverage = share of datasets whose 95% interval contains the exact true value. Monte Carlo SE of a
coverage near 0.95 from R datasets: sqrt(0.95 * 0.05 / R) = 0.0069 at R = 1000.

Usage::

    nice -n 10 .venv/bin/python benchmarks/bench_intervals.py --datasets 40 -B 200       # smoke
    nice -n 10 .venv/bin/python benchmarks/bench_intervals.py                           # 1000 per cell, B=400
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
from scipy.stats import skew  # noqa: E402
from scipy.stats import t as student_t  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from cje_engine.inference import intervals as iv  # noqa: E402
from cje_engine.inference.variance import cluster_cov  # noqa: E402
from cje_engine.pipeline.direct import bootstrap_chunk, prepare  # noqa: E402
from cje_engine.simulate.direct import PolicySpec, default_policies, simulate  # noqa: E402

log = logging.getLogger("bench_intervals")
METHODS = ("percentile", "t", "bca", "bca_expanded", "t_bootstrap_se", "skew_t")


def scenario_policies(scenario: str) -> tuple[PolicySpec, ...]:
    """``adversarial``: the simulator's defaults; ``symmetric``: every policy centred on Y ~ 0.5 and
    none adversarial, so every residual distribution is near-symmetric."""
    if scenario == "adversarial":
        return default_policies()
    return (PolicySpec("base", 0.0), PolicySpec("clone", 0.0), PolicySpec("verbose", -0.1, verbosity=2.0),
            PolicySpec("concise", 0.1, verbosity=0.6), PolicySpec("shifted", 0.25))


def intervals_of(est: float, reps: np.ndarray, infl: np.ndarray, se_a: float, df: float,
                 alpha: float) -> dict[str, tuple[float, float]]:
    """Every candidate interval of one own-label statistic."""
    q = float(student_t.ppf(1 - alpha / 2, df))
    return {
        "percentile": iv.percentile_interval(reps, alpha),
        "t": (est - q * se_a, est + q * se_a),
        "bca": iv.bca_interval(est, reps, infl, alpha),
        "bca_expanded": iv.bca_interval(est, reps, infl, alpha, df=df),
        "t_bootstrap_se": iv.t_bootstrap_se_interval(est, reps, alpha, df),
        "skew_t": iv.skew_t_interval(est, se_a, infl, alpha, df),
    }


def run_dataset(n: int, frac: float, labels: int, rep: int, B: int, alpha: float,
                covariates: tuple[str, ...] = (), scenario: str = "adversarial") -> dict:
    seed = 9_100_000 + labels * 10_000 + rep
    sim = simulate(n, scenario_policies(scenario), oracle_fraction=frac, label_design="calibration_policy",
                   calibration_policy="base", audit_labels=labels, seed=seed)
    prep = prepare(sim.frame, calibration_policies=["base"], n_bootstrap=B, seed=seed, alpha=alpha,
                   covariates=list(covariates))
    reps = bootstrap_chunk(prep, 0, B)
    d = prep.design.data
    K = len(d.policies)
    cov = cluster_cov(prep.infl["total"])
    lab = d.labelled
    out = {}
    for name in d.policies:
        if name == "base":
            continue
        k = d.policies.index(name)
        col = K + k
        sel = lab & (d.policy == k)
        df = float(np.unique(d.prompt[sel]).size - 1)
        est = float(prep.stats[col])
        ivs = intervals_of(est, reps[:, col], prep.infl["total"][:, col], float(np.sqrt(cov[col, col])), df, alpha)
        truth = sim.true_values[name]
        out[name] = {
            "cover": {m: bool(lo <= truth <= hi) for m, (lo, hi) in ivs.items()},
            "miss_low": {m: bool(hi < truth) for m, (lo, hi) in ivs.items()},
            "width": {m: hi - lo for m, (lo, hi) in ivs.items()},
            "skew": float(skew(d.label[sel] - prep.f[sel])),
            "accel": iv.acceleration(prep.infl["total"][:, col]),
        }
    return out


def timing(n: int, frac: float, B: int, repeats: int = 20) -> list[str]:
    """CPU time of Direct's summary step with today's and the new own-label intervals, same data.

    Replicates are untouched by the method (`cje_engine.direct.estimators.replicate` is not changed);
    their cost is printed beside the summary step's for scale.
    """
    from cje_engine.pipeline import policies as pol

    sim = simulate(n, oracle_fraction=frac, label_design="calibration_policy", calibration_policy="base",
                   audit_labels=50, seed=1)
    prep = prepare(sim.frame, calibration_policies=["base"], n_bootstrap=B, seed=1)
    t0 = time.process_time()
    reps = bootstrap_chunk(prep, 0, B)
    per_rep = (time.process_time() - t0) / B
    out = {}
    saved = (pol.OWN_LABEL_BOOTSTRAP, pol.OWN_LABEL_ANALYTIC)
    for label, methods in (("before (percentile / t)", ("percentile", "t")), ("after", saved)):
        pol.OWN_LABEL_BOOTSTRAP, pol.OWN_LABEL_ANALYTIC = methods
        t0 = time.process_time()
        for _ in range(repeats):
            pol.summarize_direct(prep, reps)
        out[label] = (time.process_time() - t0) / repeats
    pol.OWN_LABEL_BOOTSTRAP, pol.OWN_LABEL_ANALYTIC = saved
    return [f"timing (n={n}, B={B}): one replicate {1e3 * per_rep:.2f} ms CPU; summarize_direct "
            + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in out.items())
            + f"; ratio {out['after'] / out['before (percentile / t)']:.3f}"]


def table(runs: list[dict], labels: int) -> list[str]:
    lines = [f"### {labels} own labels, {len(runs)} datasets",
             "| policy | residual skewness (median) | " + " | ".join(METHODS) + " |",
             "|---|---|" + "---|" * len(METHODS)]
    R = len(runs)
    for name in runs[0]:
        cov = {m: np.mean([r[name]["cover"][m] for r in runs]) for m in METHODS}
        wid = {m: np.mean([r[name]["width"][m] for r in runs]) for m in METHODS}
        low = {m: np.mean([r[name]["miss_low"][m] for r in runs]) for m in METHODS}
        sk = np.median([r[name]["skew"] for r in runs])
        cells = [f"{cov[m]:.3f} (w {wid[m]:.3f}, lo-miss {low[m]:.3f})" for m in METHODS]
        lines.append(f"| {name} | {sk:+.2f} | " + " | ".join(cells) + " |")
    lines.append(f"Monte Carlo SE of a coverage near 0.95: {np.sqrt(0.95 * 0.05 / R):.4f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="prompts per policy")
    ap.add_argument("--fraction", type=float, default=0.25, help="labelled share of base's rows")
    ap.add_argument("--labels", default="25,50", help="own labels per other policy")
    ap.add_argument("--datasets", type=int, default=1000)
    ap.add_argument("-B", type=int, default=400)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--covariates", default="", help="comma-separated, e.g. response_length")
    ap.add_argument("--scenario", choices=("adversarial", "symmetric"), default="adversarial")
    ap.add_argument("--timing", action="store_true", help="only time the summary step, before vs after")
    ap.add_argument("--out", type=Path, default=HERE / "_work" / "intervals.json")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("cje_engine").setLevel(logging.WARNING)
    if ns.timing:
        print("\n".join(timing(ns.n, ns.fraction, ns.B)))
        return 0
    all_runs = {}
    covs = tuple(c for c in ns.covariates.split(",") if c)
    t0 = time.process_time()
    for L in [int(x) for x in ns.labels.split(",")]:
        runs = []
        for rep in range(ns.datasets):
            runs.append(run_dataset(ns.n, ns.fraction, L, rep, ns.B, ns.alpha, covs, ns.scenario))
            if (rep + 1) % 100 == 0:
                log.info("L=%d: %d datasets, %.0f s CPU", L, rep + 1, time.process_time() - t0)
        all_runs[L] = runs
        print("\n".join(table(runs, L)), flush=True)
    print(f"CPU {time.process_time() - t0:.0f} s; n={ns.n}, base fraction {ns.fraction}, B={ns.B}, "
          f"covariates {list(covs)}, scenario {ns.scenario}")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({str(k): v for k, v in all_runs.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speed: the arena sample with a B=2000 refitting bootstrap, our engine vs the reference package.

Both run on ONE core (``taskset``/``sched_setaffinity`` to ``--core``, BLAS/OpenMP threads = 1):

* ours: ``cje_engine.prepare`` / ``bootstrap_chunk`` / ``finalize`` in this process, for the
  monotone mode and the two-stage mode (covariate ``response_length``);
* the reference (``cje-eval``, the CJE authors' package) in its own virtualenv
  (``benchmarks/_work/refvenv``, made by ``benchmarks/reference_env.sh``) through a subprocess
  that times itself: ``analyze_dataset`` in Direct mode on the fresh draws, calibration forced to
  monotone (two-stage with ``--ref-two-stage``), ``inference_method="bootstrap"`` (cluster
  bootstrap with calibrator refit), B replicates, probe slices as held-out transport audits.

Configuration matched between the two: base's 480 labels calibrate (the other policies have
no labels in the fresh draws; their probe labels audit), 5 prompt-hashed folds, prompt-clustered
bootstrap refitting the calibrator in every replicate, paired across policies. Differences that
remain: fold hash functions differ (base's out-of-fold residuals, hence its augmented value,
differ in the 4th decimal); the reference draws positive exponential prompt weights, we draw
multinomial prompt counts; we also use the probe labels for the other policies' reported levels
(augmented / recalibrated), so the like-for-like numbers are OUR PLUG-IN columns for clone,
parallel_universe_prompt and unhelpful and our augmented column for base.

Usage::

    bash benchmarks/reference_env.sh                      # once
    .venv/bin/python benchmarks/bench_speed.py             # B=2000, ours + reference
    .venv/bin/python benchmarks/bench_speed.py -B 200 --ref-B 100    # quick smoke run
    .venv/bin/python benchmarks/bench_speed.py --skip-reference
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_speed")

DEFAULT_ARENA = Path("/work/shared/data/arena_sample")
REF_PYTHON = HERE / "_work" / "refvenv" / "bin" / "python"

# The reference runner: executed by the reference venv's interpreter. It only CALLS the
# reference's public entry point (analyze_dataset) and wraps two of its functions to (a) force
# the calibration mode and (b) time the bootstrap; it prints one JSON line.
REF_RUNNER = r'''
import functools, json, sys, time
from pathlib import Path
arena, B, mode, seed = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
t_import = time.perf_counter()
import cje
from cje import TransportAuditConfig
from cje.interface import analysis as A
from cje.diagnostics import robust_inference as RI
import_s = time.perf_counter() - t_import
# analyze_dataset does not expose calibration_mode; pin it on the calibrate_dataset it calls.
A.calibrate_dataset = functools.partial(A.calibrate_dataset, calibration_mode=mode)
timing = {}
_boot = RI.cluster_bootstrap_direct_with_refit
def _timed_boot(*a, **k):
    t0, c0 = time.perf_counter(), time.process_time()
    out = _boot(*a, **k)
    timing["bootstrap_wall_s"] = time.perf_counter() - t0
    timing["bootstrap_cpu_s"] = time.process_time() - c0
    return out
RI.cluster_bootstrap_direct_with_refit = _timed_boot
probes = {}
for f in sorted((arena / "probe_slice").glob("*_probe.jsonl")):
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    probes[f.name[: -len("_probe.jsonl")]] = rows
t0, c0 = time.perf_counter(), time.process_time()
res = cje.analyze_dataset(
    fresh_draws_dir=str(arena / "fresh_draws"), estimator="direct",
    include_response_length=(mode == "two_stage"),
    estimator_config={"inference_method": "bootstrap", "n_bootstrap": B, "bootstrap_seed": seed},
    transport=TransportAuditConfig(probes_by_policy=probes, delta_max_by_policy={p: 0.05 for p in probes}),
)
total_wall, total_cpu = time.perf_counter() - t0, time.process_time() - c0
md = res.metadata
inf = md.get("inference", {})
pols = list(md.get("target_policies") or sorted(probes) )
ci = md.get("bootstrap_ci", {})
audits = md.get("transport_audits") or {}
out = {
    "version": cje.__version__, "import_s": import_s, "total_wall_s": total_wall, "total_cpu_s": total_cpu,
    **timing, "n_bootstrap": B, "mode": mode,
    "refit_mode": inf.get("bootstrap_refit_mode"), "scheme": inf.get("bootstrap_scheme"),
    "n_bootstrap_valid": inf.get("n_bootstrap_valid"), "routes": inf.get("effective_estimator_routes"),
    "policies": {p: {"estimate": float(res.estimates[i]), "se": float(res.standard_errors[i]),
                     "ci": [ci.get("lower", [None] * len(pols))[i], ci.get("upper", [None] * len(pols))[i]],
                     "audit": (audits.get(p) or {}).get("status") if isinstance(audits.get(p), dict) else audits.get(p)}
                 for i, p in enumerate(pols)},
}
print("REF_JSON " + json.dumps(out))
'''


def _pin(core: int) -> None:
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError) as exc:  # not Linux: run unpinned, say so
        log.warning("could not pin to core %d (%s); timings are unpinned", core, exc)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_ours(arena: Path, mode: str, B: int, seed: int, repeats: int) -> dict:
    """Time prepare / bootstrap_chunk / finalize of our engine (best of ``repeats``)."""
    from cje_engine import bootstrap_chunk, finalize, prepare

    opts = dict(calibration_policies=["base"], calibration_mode=mode, n_bootstrap=B, seed=seed,
                covariates=["response_length"] if mode == "two_stage" else [])
    best: dict | None = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        prep = prepare(arena, **opts)
        t1, c1 = time.perf_counter(), time.process_time()
        reps = bootstrap_chunk(prep, 0, B)
        t2, c2 = time.perf_counter(), time.process_time()
        res = finalize(prep, [reps])
        t3, c3 = time.perf_counter(), time.process_time()
        run = {"prepare_s": t1 - t0, "bootstrap_wall_s": t2 - t1, "bootstrap_cpu_s": c2 - c1,
               "finalize_s": t3 - t2, "total_wall_s": t3 - t0, "total_cpu_s": c3 - c0}
        if best is None or run["bootstrap_wall_s"] < best["bootstrap_wall_s"]:
            best = run
            d = res.to_dict()
    assert best is not None
    best.update(mode=mode, n_bootstrap=B, repeats=repeats, chosen_mode=d["calibration"]["mode"],
                policies={p: {"estimate": e["estimate"], "se": e["se"], "ci": e["ci"], "basis": e["basis_code"],
                              "level_claim": e["level_claim"], "audit": e["audit"]["verdict"],
                              "plug_in": {k: e["plug_in"][k] for k in ("estimate", "se", "ci", "se_analytic")},
                              "augmented": None if e["augmented"] is None else
                              {k: e["augmented"][k] for k in ("estimate", "se", "ci", "se_analytic")}}
                          for p, e in d["policies"].items()})
    best["ms_per_replicate"] = 1e3 * best["bootstrap_wall_s"] / B
    best["cpu_ms_per_replicate"] = 1e3 * best["bootstrap_cpu_s"] / B
    return best


def run_reference(arena: Path, mode: str, B: int, seed: int, core: int, timeout: float) -> dict:
    """Run the reference in its own venv on one core; returns its self-reported timings and numbers."""
    if not REF_PYTHON.exists():
        raise SystemExit(f"reference venv missing: run `bash {HERE / 'reference_env.sh'}` first "
                         f"(or pass --skip-reference)")
    runner = HERE / "_work" / "ref_runner.py"
    runner.write_text(REF_RUNNER)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [str(REF_PYTHON), str(runner), str(arena), str(B), mode, str(seed)]
    if _has_taskset():
        cmd = ["taskset", "-c", str(core)] + cmd
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REF_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"reference run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("REF_JSON "):])
    out["process_wall_s"] = wall
    out["ms_per_replicate"] = 1e3 * out["bootstrap_wall_s"] / B
    out["cpu_ms_per_replicate"] = 1e3 * out["bootstrap_cpu_s"] / B
    return out


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def _fmt_ci(ci) -> str:
    return "[" + ", ".join("  n/a " if v is None else f"{v:.4f}" for v in ci) + "]"


def report(ours: dict[str, dict], ref: dict[str, dict]) -> str:
    """A plain-text report: timings, speed-ups and the side-by-side statistics."""
    lines = ["", "== timings (one core) =="]
    lines.append(f"{'run':28s} {'B':>5s} {'boot wall s':>11s} {'ms/rep':>8s} {'cpu ms/rep':>10s} {'total s':>8s}")
    for name, r in [(f"ours {m}", r) for m, r in ours.items()] + [(f"reference {m}", r) for m, r in ref.items()]:
        lines.append(f"{name:28s} {r['n_bootstrap']:5d} {r['bootstrap_wall_s']:11.2f} {r['ms_per_replicate']:8.3f} "
                     f"{r['cpu_ms_per_replicate']:10.3f} {r['total_wall_s']:8.2f}")
    for m, r in ref.items():
        if m in ours:
            o = ours[m]
            lines.append(f"speed-up {m}: {r['ms_per_replicate'] / o['ms_per_replicate']:.1f}x per replicate (wall), "
                         f"{r['cpu_ms_per_replicate'] / o['cpu_ms_per_replicate']:.1f}x (CPU), "
                         f"{r['total_wall_s'] / o['total_wall_s']:.1f}x end to end")
    for m, r in ref.items():
        o = ours.get(m)
        if o is None:
            continue
        lines += ["", f"== same statistics, {m} calibration: reference (cje-eval {r['version']}, refit mode "
                      f"{r['refit_mode']}, {r['scheme']}) vs ours =="]
        lines.append(f"{'policy':26s} {'ref route':>9s} {'ref est':>8s} {'ref SE':>7s} {'ref 95% CI':>18s} | "
                     f"{'our col':>9s} {'our est':>8s} {'our SE':>7s} {'our 95% CI':>18s} | {'our level':>8s} {'basis':>12s} "
                     f"{'audit ref/ours':>20s}")
        for i, (p, rp) in enumerate(r["policies"].items()):
            route = (r.get("routes") or [None] * len(r["policies"]))[i]
            op = o["policies"][p]
            col = "augmented" if route == "augmented" and op["augmented"] else "plug_in"
            oc = op[col]
            lines.append(f"{p:26s} {route or '?':>9s} {rp['estimate']:8.4f} {rp['se']:7.4f} {_fmt_ci(rp['ci']):>18s} | "
                         f"{col:>9s} {oc['estimate']:8.4f} {oc['se']:7.4f} {_fmt_ci(oc['ci']):>18s} | "
                         f"{op['estimate']:8.4f} {op['basis']:>12s} {str(rp['audit']) + '/' + op['audit']:>20s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arena", type=Path, default=DEFAULT_ARENA, help="arena-layout folder")
    ap.add_argument("-B", "--n-bootstrap", type=int, default=2000, help="our replicates (default 2000)")
    ap.add_argument("--ref-B", type=int, default=None, help="reference replicates (default: same as -B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0, help="CPU core both engines are pinned to")
    ap.add_argument("--repeats", type=int, default=3, help="our runs per mode (best bootstrap time kept)")
    ap.add_argument("--modes", default="monotone,two_stage", help="our calibration modes")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--ref-two-stage", action="store_true", help="also time the reference's two-stage mode")
    ap.add_argument("--timeout", type=float, default=1800.0, help="reference subprocess timeout (s)")
    ap.add_argument("--json", type=Path, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("cje_engine",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _pin(args.core)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "load_before": _load(), "core": args.core}
    log.info("load average before: %s", meta["load_before"])
    ours: dict[str, dict] = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        log.info("ours: mode=%s B=%d (%d repeats)", mode, args.n_bootstrap, args.repeats)
        ours[mode] = run_ours(args.arena, mode, args.n_bootstrap, args.seed, args.repeats)
        log.info("ours %s: %.3f ms/replicate", mode, ours[mode]["ms_per_replicate"])
    ref: dict[str, dict] = {}
    if not args.skip_reference:
        ref_modes = ["monotone"] + (["two_stage"] if args.ref_two_stage else [])
        for mode in ref_modes:
            B = args.ref_B or args.n_bootstrap
            log.info("reference: mode=%s B=%d (subprocess, core %d)", mode, B, args.core)
            ref[mode] = run_reference(args.arena, mode, B, args.seed, args.core, args.timeout)
            log.info("reference %s: %.2f ms/replicate", mode, ref[mode]["ms_per_replicate"])
    meta["load_after"] = _load()
    text = report(ours, ref)
    print(text)
    print(f"\nload average before/after: {meta['load_before']} / {meta['load_after']}  ({meta['date']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "ours": ours, "reference": ref}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

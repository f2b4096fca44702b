"""The paper's audited protocol on simulated data, this engine beside the reference package.

Design (like the paper's study): seven policies on shared prompts, a judge that rewards length
(``length_bias``), labels on the calibration policy ``base`` (``--fractions`` of its rows) plus a
50-label audit slice on every other policy (``label_design="calibration_policy"``). Six policies'
calibration transports given the length covariate (``base``, ``clone`` = base, ``verbose``,
``concise``, ``better``, ``worse``); ``unhelpful`` fools the judge (``adversarial``).

Per cell (n prompts per policy x calibration fraction), ``--datasets`` datasets, both engines on
the same data with the length covariate:

* ranking accuracy: share of pairs of *transported* policies with different true values that the
  reported estimates order correctly (base and clone are a true tie and are skipped);
* coverage: share of the transported policies' reported 95% intervals that contain the truth;
* adversary unbiased: ``unhelpful`` is refused or reported at an own-label level (recalibrated), never at
  its borrowed plug-in (the issue's "never reported at a biased level");
* adversary safe: ``unhelpful`` is refused, or its audit fails and its reported interval covers (so it
  also counts the ~5% an honest 95% interval misses);
* false audit fails: share of the audits of transported policies other than base that fail (at the
  defaults their slices also calibrate, and each is audited out of fold; in ``pooled``, base's audit counts too).

Ours: ``cje_engine.evaluate(frame, covariates=["response_length"], n_bootstrap=B)`` at its defaults plus
any ``--option key=value``: no ``calibration_policies``, so base's labels and the audit slices calibrate
together and robust pooling removes a slice that fails its own audit (the adversary's);
``--option 'calibration_policies=["base"]'`` gives the paper's protocol to the letter (only base's labels
calibrate, the slices only audit). Reference: ``cje-eval`` in its own venv
(``bash benchmarks/reference_env.sh``), ``analyze_dataset`` in Direct mode with
``include_response_length=True``, the base labels in the fresh draws and each other policy's 50
labels as its transport probe (``TransportAuditConfig``, margin 0.05), bootstrap with B replicates.

Monte Carlo error: with D datasets, coverage over 6 D intervals has SE ~ sqrt(p (1-p) / (6 D))
(0.011 at D = 60, p = 0.95); ranking accuracy over 14 D pairs likewise.

Usage::

    .venv/bin/python benchmarks/bench_protocol.py --n 250,1000 --fractions 0.1 --datasets 5 -B 500   # smoke
    .venv/bin/python benchmarks/bench_protocol.py                              # the grid, 20 per cell
    .venv/bin/python benchmarks/bench_protocol.py --skip-reference --option 'calibration_policies=["base"]'
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported; each worker is single-threaded

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing as mp  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from cje_engine.simulate.direct import PROTOCOL_TRANSPORTED, protocol_policies  # noqa: E402

REF_PYTHON = HERE / "_work" / "refvenv" / "bin" / "python"
log = logging.getLogger("bench_protocol")

TRANSPORTED = PROTOCOL_TRANSPORTED
ADVERSARY = "unhelpful"

REF_RUNNER = r'''
import json, sys
from pathlib import Path
root, B, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import cje
from cje import TransportAuditConfig
probes = {}
for f in sorted((root / "probe_slice").glob("*_probe.jsonl")):
    probes[f.name[: -len("_probe.jsonl")]] = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
res = cje.analyze_dataset(
    fresh_draws_dir=str(root / "fresh_draws"), estimator="direct", include_response_length=True,
    estimator_config={"inference_method": "bootstrap", "n_bootstrap": B, "bootstrap_seed": seed},
    transport=TransportAuditConfig(probes_by_policy=probes, delta_max_by_policy={p: 0.05 for p in probes}),
)
md = res.metadata
pols = list(md.get("target_policies") or [])
ci = md.get("bootstrap_ci", {})
audits = md.get("transport_audits") or {}
def _status(a):
    return a.get("status") if isinstance(a, dict) else a
print("REF_JSON " + json.dumps({
    "version": cje.__version__,
    "policies": {p: {"estimate": float(res.estimates[i]),
                     "ci": [ci.get("lower", [None] * len(pols))[i], ci.get("upper", [None] * len(pols))[i]],
                     "audit": _status(audits.get(p))} for i, p in enumerate(pols)}}))
'''


def policies():
    return protocol_policies()


def parse_options(pairs: list[str]) -> dict:
    """``--option key=value`` pairs as engine options (a value is JSON where it parses, else text)."""
    options = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    return options


def _seed(n: int, frac: float, rep: int) -> int:
    return 7_000_000_000 + (round(frac * 1000) * 100_000 + n) * 1_000 + rep


#: Judge noise on the latent quality (``SimSpec.judge_noise_sd``). 0: the judge sees the quality the
#: oracle's label is drawn around (plus its length bias and rounding), so E[Y | S, length] is the same
#: function for every non-adversarial policy and their calibration transports (up to the judge's
#: 21-level rounding). With judge noise, E[Y | S] shrinks towards each policy's own mean quality, so
#: policies of different quality do NOT share it (biases of ~0.01, see RESULTS.md): ``--judge-noise``.
JUDGE_NOISE = 0.0


#: Distinct judge scores - 1 (``SimSpec.judge_levels``). At 20 (21 scores, like a 0-10 judge in half
#: points) the rounding leaves E[Y | S, length] slightly different between policies of different
#: quality: the base calibration applied to ``better`` is off by -0.0027 (exact integral, RESULTS.md
#: "Issue 9: the judge's rounding"), 0.5 SE at n=5000/25%. 100 (a 0-100 judge): -0.0004.
JUDGE_LEVELS = 20


def simulate_dataset(n: int, frac: float, rep: int, judge_noise: float = JUDGE_NOISE, design: str = "protocol",
                     judge_levels: int = JUDGE_LEVELS):
    """The paper's protocol (labels on base + 50-label audit slices), or ``pooled``: every policy's
    rows labelled at random at ``frac``, the adversary's labels among them, all training the
    calibrator (then ``frac`` is the share of every policy)."""
    from cje_engine.simulate.direct import simulate

    if design == "pooled":
        return simulate(n, policies(), oracle_fraction=frac, seed=_seed(n, frac, rep) + 500,
                        judge_noise_sd=judge_noise, judge_levels=judge_levels)
    return simulate(n, policies(), oracle_fraction=frac, label_design="calibration_policy",
                    calibration_policy="base", audit_labels=50, seed=_seed(n, frac, rep),
                    judge_noise_sd=judge_noise, judge_levels=judge_levels)


def run_ours(frame, seed: int, B: int, options: dict, claims: str = "reported") -> dict:
    """This engine at its defaults (every labelled row may calibrate) plus ``options``; ``claims="assumed"``
    scores every policy's assumes-transport level (the result's ``assumed`` block: the paper's protocol)
    instead of the reported (verified) one."""
    from cje_engine import evaluate

    res = evaluate(frame, n_bootstrap=B, seed=seed, **{"covariates": ["response_length"], **options})
    d = res.to_dict()
    out = {}
    for p, e in d["policies"].items():
        lvl = e["assumed"] if claims == "assumed" and e.get("assumed") else e
        out[p] = {"estimate": lvl["estimate"], "ci": lvl["ci"], "refused": lvl["level_claim"] == "refused",
                  "audit": e["audit"]["verdict"], "basis": lvl["basis_code"]}
    return {"policies": out, "mode": d["calibration"]["mode"]}


def write_reference_layout(frame, root: Path) -> None:
    """Fresh draws (labels on base only; response text with the row's word count) and probes."""
    (root / "fresh_draws").mkdir(parents=True)
    (root / "probe_slice").mkdir()
    for pol, g in frame.groupby("policy", sort=False):
        rows, probe = [], []
        for r in g.itertuples(index=False):
            rec = {"prompt_id": str(r.prompt_id), "prompt": "", "response": " ".join(["w"] * int(r.response_length)),
                   "judge_score": float(r.judge_score), "draw_idx": 0}
            labelled = not np.isnan(r.oracle_label)
            if labelled and pol == "base":
                rec["oracle_label"] = float(r.oracle_label)
            elif labelled:
                probe.append({**rec, "oracle_label": float(r.oracle_label)})
            rows.append(rec)
        (root / "fresh_draws" / f"{pol}_responses.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
        if probe:
            (root / "probe_slice" / f"{pol}_probe.jsonl").write_text("\n".join(json.dumps(x) for x in probe) + "\n")


def run_reference(frame, seed: int, B: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="cje-ref-") as tmp:
        root = Path(tmp)
        write_reference_layout(frame, root)
        runner = root / "runner.py"
        runner.write_text(REF_RUNNER)
        proc = subprocess.run([str(REF_PYTHON), str(runner), str(root), str(B), str(seed)], capture_output=True,
                              text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reference failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REF_JSON "))
    out = json.loads(line[len("REF_JSON "):])
    for e in out["policies"].values():
        e["refused"] = False
        e["audit"] = {"PASS": "pass", "FAIL": "fail", "WARN": "inconclusive"}.get(str(e["audit"]).upper(),
                                                                                   str(e["audit"]).lower())
    return out


def cached_reference(frame, n: int, frac: float, rep: int, seed: int, B: int, timeout: float,
                     cache: Path | None, judge_noise: float, judge_levels: int = JUDGE_LEVELS) -> tuple[dict, float]:
    """The reference's result on one dataset, from ``cache`` when it was run before (same n, fraction,
    dataset and B: the datasets are deterministic), else run and stored."""
    levels = "" if judge_levels == JUDGE_LEVELS else f"_L{judge_levels}"
    path = None if cache is None else cache / f"ref_n{n}_f{frac:.3f}_r{rep}_B{B}_j{judge_noise:g}{levels}.json"
    if path is not None and path.exists():
        d = json.loads(path.read_text())
        return d["reference"], d["wall_s"]
    t1 = time.perf_counter()
    try:
        ref = run_reference(frame, seed, B, timeout)
    except RuntimeError as exc:  # the reference could not evaluate this dataset: nothing reported
        truth = {p: None for p in frame["policy"].unique()}
        ref = _nothing(truth, str(exc)[-500:])
    wall = time.perf_counter() - t1
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"reference": ref, "wall_s": wall}))
    return ref, wall


def _nothing(truth: dict, why: str) -> dict:
    """The record of an evaluation that refused the dataset: every policy refused, no estimate."""
    return {"policies": {p: {"estimate": None, "ci": None, "refused": True, "audit": "not_run", "basis": "none"}
                         for p in truth}, "mode": None, "error": why}


def run_task(task: tuple) -> dict:
    n, frac, rep, B, options, with_ref, timeout, ref_B, cache, ours, judge_noise, ref_datasets, design, levels, claims = task
    logging.getLogger("cje_engine").setLevel(logging.WARNING)
    with_ref = with_ref and rep < ref_datasets
    sim = simulate_dataset(n, frac, rep, judge_noise, design, levels)
    seed = _seed(n, frac, rep) % (2**31)
    out = {"n": n, "frac": frac, "rep": rep, "truth": sim.true_values}
    if ours:
        from cje_engine.errors import CJEInputError

        t0 = time.process_time()
        try:
            out["ours"] = run_ours(sim.frame, seed, B, options, claims)
        except CJEInputError as exc:  # e.g. 5 calibration labels: nothing can be estimated, all refused
            out["ours"] = _nothing(sim.true_values, str(exc))
        out["ours_cpu_s"] = time.process_time() - t0
    if with_ref:
        out["reference"], out["reference_wall_s"] = cached_reference(sim.frame, n, frac, rep, seed, ref_B, timeout,
                                                                     cache, judge_noise, levels)
    return out


def score(runs: list[dict], engine: str, design: str = "protocol") -> dict:
    """Ranking accuracy, coverage, adversary safety and false audit fails of one engine."""
    right = pairs = cover = n_ci = safe = unbiased = false_fail = audits = 0
    for r in runs:
        pol, truth = r[engine]["policies"], r["truth"]
        names = [p for p in TRANSPORTED if p in pol]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                dt = truth[a] - truth[b]
                if abs(dt) < 1e-12:
                    continue
                pairs += 1
                ea, eb = pol[a]["estimate"], pol[b]["estimate"]
                right += int(ea is not None and eb is not None and np.sign(ea - eb) == np.sign(dt))
        for p in names:
            ci = pol[p]["ci"]
            if ci and ci[0] is not None:
                n_ci += 1
                cover += int(ci[0] <= truth[p] <= ci[1])
            if (p != "base" or design == "pooled") and pol[p]["audit"] not in (None, "not_run"):
                audits += 1
                false_fail += int(pol[p]["audit"] == "fail")
        adv = pol.get(ADVERSARY)
        if adv is not None:
            ci = adv["ci"]
            covers = bool(ci and ci[0] is not None and ci[0] <= truth[ADVERSARY] <= ci[1])
            safe += int(adv["refused"] or (adv["audit"] == "fail" and covers))
            unbiased += int(adv["refused"] or adv.get("basis") in ("recalibrated", "augmented"))
    d = len(runs)
    return {"rank_acc": right / pairs if pairs else float("nan"), "coverage": cover / n_ci if n_ci else float("nan"),
            "adversary_safe": safe / d if d else float("nan"),
            "adversary_unbiased": unbiased / d if d else float("nan"),
            "false_audit_fail": false_fail / audits if audits else float("nan"), "datasets": d}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="250,500,1000,5000")
    ap.add_argument("--fractions", default="0.05,0.10,0.25")
    ap.add_argument("--datasets", type=int, default=20)
    ap.add_argument("-B", "--n-bootstrap", type=int, default=2000)
    ap.add_argument("--option", action="append", default=[], help="extra engine option key=value (JSON value)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reference-B", type=int, default=None,
                    help="bootstrap replicates of the reference (default: -B); its estimates and audits do not depend on it")
    ap.add_argument("--reference-cache", type=Path, default=None,
                    help="folder of the reference's per-dataset results, reused across runs")
    ap.add_argument("--reference-only", action="store_true", help="only fill the reference cache")
    ap.add_argument("--reference-datasets", type=int, default=None,
                    help="run the reference on the first K datasets of each cell only (default: all)")
    ap.add_argument("--design", choices=["protocol", "pooled"], default="protocol",
                    help="protocol: labels on base + 50-label audit slices; pooled: every policy labelled at random, "
                         "all labels calibrate (no reference run: it has no pooled robust mode)")
    ap.add_argument("--rescore", type=Path, default=None, help="print the table of a --json file again (no runs)")
    ap.add_argument("--judge-noise", type=float, default=JUDGE_NOISE, help="SimSpec.judge_noise_sd (see JUDGE_NOISE)")
    ap.add_argument("--judge-levels", type=int, default=JUDGE_LEVELS, help="SimSpec.judge_levels (see JUDGE_LEVELS)")
    ap.add_argument("--claims", choices=["reported", "assumed"], default="reported",
                    help="score our reported (verified) levels, or every policy's assumes-transport level (the "
                         "paper's protocol, the result's 'assumed' block)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    options = parse_options(args.option)
    with_ref = not args.skip_reference and args.design == "protocol"
    if with_ref and not REF_PYTHON.exists():
        raise SystemExit(f"reference venv missing: run `bash {HERE / 'reference_env.sh'}` (or --skip-reference)")
    cells = [(int(n), float(f)) for n in args.n.split(",") for f in args.fractions.split(",")]
    ref_B = args.reference_B or args.n_bootstrap
    tasks = [(n, f, rep, args.n_bootstrap, options, with_ref, args.timeout, ref_B, args.reference_cache,
              not args.reference_only, args.judge_noise, args.reference_datasets or args.datasets, args.design,
              args.judge_levels, args.claims)
             for rep in range(args.datasets) for n, f in cells]  # every cell early
    t0 = time.perf_counter()
    if args.rescore is not None:
        runs = json.loads(args.rescore.read_text())["runs"]
    else:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            runs = list(pool.imap_unordered(run_task, tasks))
        log.info("%d datasets in %.0f s (load %s)", len(runs), time.perf_counter() - t0, os.getloadavg())
    if args.reference_only:
        return 0
    rows = []
    for n, f in cells:
        rs = [r for r in runs if r["n"] == n and r["frac"] == f]
        row = {"n": n, "fraction": f, "ours": score(rs, "ours", args.design)}
        if with_ref:
            common = [r for r in rs if "reference" in r]
            row["reference"] = score(common, "reference", args.design)
            row["ours_common"] = score(common, "ours", args.design)
        rows.append(row)
    keys = ("rank_acc", "coverage", "adversary_unbiased", "adversary_safe", "false_audit_fail")
    print(f"judge noise {args.judge_noise:g}, judge levels {args.judge_levels}; ours on every dataset of a cell; 'ours=' and 'ref' on the datasets "
          "the reference ran on")
    print(f"{'n':>5s} {'frac':>5s} {'sets':>4s} |" + "|".join(f"{k:>26s}" for k in keys))
    print(" " * 16 + "|" + "|".join(f"{'ours':>8s} {'ours=':>8s} {'ref':>8s}" for _ in keys))
    for row in rows:
        o, oc, r = row["ours"], row.get("ours_common", {}), row.get("reference", {})
        cells_txt = [f"{o[k]:8.3f} {oc.get(k, float('nan')):8.3f} {r.get(k, float('nan')):8.3f}" for k in keys]
        print(f"{row['n']:5d} {row['fraction']:5.2f} {o['datasets']:4d}/{r.get('datasets', 0):<2d}|"
              + "|".join(cells_txt))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"options": options, "B": args.n_bootstrap, "rows": rows, "runs": runs},
                                        indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Logs-only and hybrid evaluation of the Arena sample's three candidate policies, next to Direct.

Runs the engine's off-policy mode (`cje_engine.pipeline.offpolicy.evaluate_offpolicy`) on
``logged_data.jsonl`` (1000 responses of the base policy, the logger, with teacher-forced
log-probabilities under each candidate; 480 oracle labels):

- **logs-only**: the logs alone (headline: SIMCal-calibrated IPS, gated);
- **hybrid**: the logs plus each candidate's 1000 fresh draws and its 50-label probe slice
  (headline: the IF stack of SNIPS, calibrated IPS, DR and Direct, gated, plus the transport audit);

and Direct (`cje_engine.evaluate`) on the fresh draws of all four policies, with the same options
as the README's Arena run (calibration on base, ``response_length`` covariate). Every interval is a
calibration-aware cluster-bootstrap percentile interval (the calibrator, and for off-policy
estimators SIMCal, refitted per replicate).

Usage::

    .venv/bin/python benchmarks/offpolicy_arena.py [--arena-dir DIR] [--n-boot 2000] [--seed 0] [--out FILE.json]

The tables in docs/offpolicy.md were produced with ``--n-boot 2000 --seed 0``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cje_engine import evaluate  # noqa: E402
from cje_engine.pipeline.offpolicy import evaluate_offpolicy  # noqa: E402

log = logging.getLogger("offpolicy_arena")

TARGETS = ("clone", "parallel_universe_prompt", "unhelpful")
DEFAULT_DIR = Path(os.environ.get("CJE_ARENA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "arena_sample"))
OPTIONS = {"calibration_policies": ["base"], "covariates": ["response_length"]}


def probe_mean(path: Path) -> float | None:
    if not path.exists():
        return None
    labels = [json.loads(line).get("oracle_label") for line in open(path, encoding="utf-8") if line.strip()]
    labels = [x for x in labels if x is not None]
    return float(np.mean(labels)) if labels else None


def run(arena_dir: Path, n_boot: int, seed: int) -> dict:
    out: dict = {"n_boot": n_boot, "seed": seed, "options": OPTIONS, "timings_s": {}}
    for mode in ("logs-only", "hybrid"):
        t0 = time.perf_counter()
        res = evaluate_offpolicy(arena_dir, mode=mode, logger="base", n_bootstrap=n_boot, seed=seed, **OPTIONS)
        out[mode] = res.to_dict()
        out["timings_s"][mode] = round(time.perf_counter() - t0, 1)
        log.info("%s done in %.1f s", mode, out["timings_s"][mode])
    t0 = time.perf_counter()
    out["direct"] = evaluate(arena_dir, n_bootstrap=n_boot, seed=seed, **OPTIONS).to_dict()
    out["timings_s"]["direct"] = round(time.perf_counter() - t0, 1)
    out["probe_oracle_mean"] = {t: probe_mean(arena_dir / "probe_slice" / f"{t}_probe.jsonl") for t in TARGETS}
    return out


def _ci(p: dict) -> str:
    if p.get("estimate") is None:
        return "n/a"
    lo, hi = p["ci"] if p.get("ci") else (float("nan"), float("nan"))
    return f"{p['estimate']:.3f} [{lo:.3f}, {hi:.3f}]"


def _claim(p: dict) -> str:
    c = p.get("claim") or ("level" if p["level_claim"] == "ok" else "refused")
    return "**refused**" if p["level_claim"] == "refused" else c


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    lo_, hy_, di_ = res["logs-only"]["policies"], res["hybrid"]["policies"], res["direct"]["policies"]
    lines = [
        "| policy | logs-only: calibrated IPS [95% CI] | verdict | hybrid: IF stack [95% CI] | verdict | "
        "Direct (fresh draws) [95% CI] | Direct basis / level | probe oracle mean (50 labels) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    b = di_["base"]
    lines.append(f"| base (logger) | {_ci(lo_['base'])} | {_claim(lo_['base'])} (Direct on the logs) | "
                 f"{_ci(hy_['base'])} | {_claim(hy_['base'])} | {_ci(b)} | {b['basis_code']} / {b['level_claim']} | "
                 f"oracle mean of the 480 labels {b['oracle_mean']:.3f} |")
    for t in TARGETS:
        d = di_[t]
        pm = res["probe_oracle_mean"][t]
        lines.append(f"| {t} | {_ci(lo_[t])} | {_claim(lo_[t])} | {_ci(hy_[t])} | {_claim(hy_[t])} | {_ci(d)} | "
                     f"{d['basis_code']} / {d['level_claim']} | {_f(pm, '.3f')} |")
    lines += ["", "All logs-only estimators (bootstrap 95% CI; gate verdict):", "",
              "| policy | IPS | SNIPS | calibrated IPS | stacked (logs only) |", "|---|---|---|---|---|"]
    for t in TARGETS:
        e = lo_[t]["offpolicy"]["estimates"]

        def cell(k: str) -> str:
            x = e[k]
            if x["value"] is None:
                return f"overflow ({x['claim']})"
            ci = x["ci"] or [float("nan")] * 2
            return f"{x['value']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] ({x['claim']})"

        lines.append(f"| {t} | " + " | ".join(cell(k) for k in ("ips", "snips", "calibrated_ips", "stacked")) + " |")
    lines += ["", "Diagnostics (hybrid run; the Arena's fresh draws carry no log-probabilities, so TTC's typical set comes "
              "from the importance-weighted logs; the affinity compares with the fresh draws' judge scores):", "",
              "| policy | ESS/n raw | ESS/n SIMCal | max-weight share | 99.5th pct weight | Hill tail index | "
              "log10 weight span | TTC | Bhattacharyya affinity | CLE factor | CLE floor SE | DR orthogonality [CI] | "
              "gates failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in TARGETS:
        p = hy_[t]["offpolicy"]
        d = p["diagnostics"]
        o = d.get("dr_orthogonality")
        orth = f"{o['mean']:.4f} [{o['ci'][0]:.4f}, {o['ci'][1]:.4f}]" if o else "n/a"
        failed = ", ".join(g["gate"] for g in p["gate_checks"] if not g["passed"]) or "none"
        lines.append(f"| {t} | {d['ess_raw']:.4f} | {d['ess_stabilised']:.3f} | {d['max_share_raw']:.3f} | "
                     f"{d['q995_raw']:.2f} | {_f(d['hill_index'], '.2f')} | {d['log10_weight_span']:.1f} | "
                     f"{d['ttc']:.3f} ({d['ttc_reference']}) | {d['affinity']:.3f} | {_f(d['cle_factor'], '.1f')} | "
                     f"{_f(d['cle_floor_se'], '.4f')} | {orth} | {failed} |")
    return "\n".join(lines)


def reasons(res: dict) -> str:
    out = []
    for mode in ("logs-only", "hybrid"):
        for t in TARGETS:
            p = res[mode]["policies"][t]
            if p["level_claim"] == "refused":
                out.append(f"- {mode}, {t}: " + " / ".join(p["refusal_reasons"]))
    return "\n".join(out)


def relative_table(results: dict[str, dict]) -> str:
    """Markdown: per mode, which policies are ranked, which comparisons are reported, and why not."""
    lines = ["| mode | ranked (rank) | reported comparisons | not estimable (why) | levels of the candidates |",
             "|---|---|---|---|---|"]
    for mode, r in results.items():
        ranked = ", ".join(f"{e['policy']} ({e['rank']})" for e in r["ranking"])
        comps = r["comparisons"]
        rep = [c for c in comps if c.get("reported", True)]
        rep_txt = f"{len(rep)}/{len(comps)}: " + "; ".join(
            f"{c['a']} - {c['b']} {c['diff']:+.3f}{' (sig)' if c['significant'] else ''}" for c in rep)
        why = "; ".join(f"{n}: {p['relative_reason']}" for n, p in r["policies"].items()
                        if p.get("relative_claim") == "not_estimable") or "none"
        levels = "; ".join(f"{n} {_ci(p)} {p['level_claim']} ({p['basis_code']}, relative {p.get('relative_claim')})"
                           for n, p in r["policies"].items() if n in TARGETS)
        lines.append(f"| {mode} | {ranked} | {rep_txt} | {why} | {levels} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arena-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the three full results as JSON here")
    ap.add_argument("--relative-from", nargs=3, type=Path, metavar=("DIRECT", "LOGS_ONLY", "HYBRID"),
                    help="only print the ranked/reported/not-estimable table from three result.json files")
    args = ap.parse_args(argv)
    if args.relative_from:
        res = {m: json.loads(p.read_text()) for m, p in zip(("direct", "logs-only", "hybrid"), args.relative_from)}
        sys.stdout.write(relative_table(res) + "\n")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    res = run(args.arena_dir, args.n_boot, args.seed)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=2, allow_nan=False))
    sys.stdout.write(markdown(res) + "\n\nRefusals:\n" + reasons(res) + "\n\n"
                     + relative_table({m: res[m] for m in ("direct", "logs-only", "hybrid")}) + "\n")
    sys.stdout.write(f"\ntimings (s): {res['timings_s']}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

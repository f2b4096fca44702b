"""Logs-only and hybrid (off-policy) evaluation of the Arena sample's three target policies.

Reads ``logged_data.jsonl`` (base-policy responses with teacher-forced log-probabilities under
each target), fits an isotonic calibration of the oracle label on the judge score over the
labelled logged rows, and for each target reports the logs-only estimates (IPS, SNIPS,
SIMCal-calibrated IPS), the hybrid estimates with the target's fresh draws (calibrated DR,
Direct, IF stack), a calibration-aware cluster bootstrap, the diagnostics and the gate verdicts.

Usage::

    .venv/bin/python benchmarks/offpolicy_arena.py [--arena-dir DIR] [--n-boot 2000] [--seed 0] [--out FILE.json]

The figures recorded in docs/offpolicy.md were produced with ``--n-boot 2000 --seed 0``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cje_engine.data import fold_of  # noqa: E402
from cje_engine.errors import CJEInputError  # noqa: E402
from cje_engine.offpolicy import (  # noqa: E402
    FreshData,
    LoggedData,
    OffPolicyConfig,
    Rewards,
    bootstrap_target,
    evaluate_target,
    target_typical_coverage,
)
from cje_engine.weights import isotonic_fit, isotonic_predict  # noqa: E402

log = logging.getLogger("offpolicy_arena")

TARGETS = ("clone", "parallel_universe_prompt", "unhelpful")
DEFAULT_DIR = Path(os.environ.get("CJE_ARENA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "arena_sample"))


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CJEInputError(f"not valid JSON ({exc.msg})", source=str(path), row=i) from None
    return rows


def load_logged(path: Path, targets: tuple[str, ...] = TARGETS) -> dict:
    """Arrays of the logged file; errors name the file, field and row."""
    rows = _read_jsonl(path)
    out: dict = {"prompt_id": [], "judge_score": [], "oracle_label": [], "base": [], "length": [],
                 "targets": {t: [] for t in targets}}
    for i, r in enumerate(rows):
        for key in ("judge_score", "base_policy_logprob", "target_policy_logprobs"):
            if r.get(key) is None:
                raise CJEInputError(f"field '{key}' is missing or null", source=str(path), column=key, row=i)
        pid = (r.get("metadata") or {}).get("prompt_id", r.get("prompt_id"))
        if pid is None:
            raise CJEInputError("no prompt id (expected metadata.prompt_id)", source=str(path),
                                column="metadata.prompt_id", row=i)
        tl = r["target_policy_logprobs"]
        for t in targets:
            if tl.get(t) is None:
                raise CJEInputError(f"no log-probability for target '{t}'", source=str(path),
                                    column=f"target_policy_logprobs.{t}", row=i)
            out["targets"][t].append(float(tl[t]))
        out["prompt_id"].append(str(pid))
        out["judge_score"].append(float(r["judge_score"]))
        lab = r.get("oracle_label")
        out["oracle_label"].append(np.nan if lab is None else float(lab))
        out["base"].append(float(r["base_policy_logprob"]))
        out["length"].append(max(1, len(r.get("response") or "")))
    arr = {k: np.asarray(v) for k, v in out.items() if k != "targets"}
    arr["targets"] = {t: np.asarray(v) for t, v in out["targets"].items()}
    arr["source"] = str(path)
    return arr


def load_fresh(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = _read_jsonl(path)
    pids, scores = [], []
    for i, r in enumerate(rows):
        if r.get("judge_score") is None or r.get("prompt_id") is None:
            raise CJEInputError("fresh draw needs prompt_id and judge_score", source=str(path), row=i)
        pids.append(str(r["prompt_id"]))
        scores.append(float(r["judge_score"]))
    return np.asarray(pids), np.asarray(scores)


def probe_mean(path: Path) -> float | None:
    if not path.exists():
        return None
    labels = [r["oracle_label"] for r in _read_jsonl(path) if r.get("oracle_label") is not None]
    return float(np.mean(labels)) if labels else None


class IsotonicRefit:
    """Refit callable for the bootstrap: isotonic Y ~ S on the replicate's labelled logged rows.

    Rewards R = f(S) (full fit on the replicate); the DR outcome model q is the cross-fitted
    f^(-k)(S), k = fold of the row's prompt, on logged rows and fresh draws alike.
    """

    def __init__(self, s_log: np.ndarray, y_log: np.ndarray, fold_log: np.ndarray,
                 s_fresh: np.ndarray | None, fold_fresh: np.ndarray | None, n_folds: int = 5) -> None:
        self.s_log, self.y_log, self.fold_log = s_log, y_log, fold_log
        self.s_fresh, self.fold_fresh, self.n_folds = s_fresh, fold_fresh, n_folds

    def __call__(self, li: np.ndarray, fi: np.ndarray | None) -> Rewards:
        s, y, fo = self.s_log[li], self.y_log[li], self.fold_log[li]
        lab = ~np.isnan(y)
        if lab.sum() < 2:
            raise CJEInputError("fewer than 2 labelled rows in a bootstrap replicate")
        knots, vals = isotonic_fit(s[lab], y[lab])
        R = isotonic_predict(knots, vals, s)
        if fi is None or self.s_fresh is None or self.fold_fresh is None:
            return Rewards(R)
        sf, ff = self.s_fresh[fi], self.fold_fresh[fi]
        Rf = isotonic_predict(knots, vals, sf)
        q, qf = R.copy(), Rf.copy()
        for k in range(self.n_folds):
            train = lab & (fo != k)
            if train.sum() < 2:
                continue
            kk, vv = isotonic_fit(s[train], y[train])
            q[fo == k] = isotonic_predict(kk, vv, s[fo == k])
            qf[ff == k] = isotonic_predict(kk, vv, sf[ff == k])
        return Rewards(R, Rf, q, qf)


def run(arena_dir: Path, n_boot: int, seed: int) -> dict:
    data = load_logged(arena_dir / "logged_data.jsonl")
    cfg = OffPolicyConfig()
    fold_log = fold_of(data["prompt_id"], cfg.n_folds)
    lab = ~np.isnan(data["oracle_label"])
    results: dict = {"n_logged": int(data["prompt_id"].shape[0]), "n_labelled": int(lab.sum()),
                     "n_boot": n_boot, "seed": seed, "targets": {}}
    for t in TARGETS:
        logged = LoggedData(data["prompt_id"], data["judge_score"], data["base"], data["targets"][t],
                            source=data["source"], target_column=f"target_policy_logprobs.{t}")
        fpath = arena_dir / "fresh_draws" / f"{t}_responses.jsonl"
        fp, fs = load_fresh(fpath)
        fresh = FreshData(fp, fs, source=str(fpath))
        refit_lo = IsotonicRefit(data["judge_score"], data["oracle_label"], fold_log, None, None, cfg.n_folds)
        refit_hy = IsotonicRefit(data["judge_score"], data["oracle_label"], fold_log, fs,
                                 fold_of(fp, cfg.n_folds), cfg.n_folds)
        rep_lo = evaluate_target(logged, refit_lo(np.arange(logged.n), None), target=t, config=cfg)
        rep_hy = evaluate_target(logged, refit_hy(np.arange(logged.n), np.arange(fresh.n)), fresh, target=t,
                                 config=cfg)
        boot = bootstrap_target(logged, refit_hy, fresh, n_boot=n_boot, seed=seed, config=cfg)
        per_char = target_typical_coverage(logged.logger_logprob, logged.target_logprob, mass=cfg.ttc_mass,
                                           lengths=data["length"].astype(float))
        entry = {
            "logs_only": rep_lo.to_dict(),
            "hybrid": rep_hy.to_dict(),
            "bootstrap": {k: {"se": boot.se(k), "ci": list(boot.ci(k))} for k in boot.replicates},
            "ttc_per_character": per_char.ttc,
            "probe_oracle_mean": probe_mean(arena_dir / "probe_slice" / f"{t}_probe.jsonl"),
        }
        results["targets"][t] = entry
        log.info("%s done", t)
    return results


def markdown(res: dict) -> str:
    lines = ["| target | IPS | SNIPS | cal-IPS | DR | Direct | stacked | probe oracle mean |",
             "|---|---|---|---|---|---|---|---|"]
    for t, e in res["targets"].items():
        h = e["hybrid"]["estimates"]
        b = e["bootstrap"]

        def cell(k: str) -> str:
            v = h[k]["value"]
            if v is None:
                return "overflow"
            lo, hi = b[k]["ci"]
            return f"{v:.3f} [{lo:.3f}, {hi:.3f}]"

        pm = e["probe_oracle_mean"]
        probe = f"{pm:.3f}" if pm is not None else "-"
        cells = " | ".join(cell(k) for k in ("ips", "snips", "calibrated_ips", "dr", "direct", "stacked"))
        lines.append(f"| {t} | {cells} | {probe} |")
    lines += ["", "| target | ESS raw | ESS SIMCal | max share raw | q99.5 raw | Hill | log10 span | TTC (total) |"
              " TTC (per char) | CLE factor | CLE floor SE | affinity (fresh) | SIMCal alpha / coef | DR orth. mean [CI] |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, e in res["targets"].items():
        d = e["hybrid"]["diagnostics"]
        o = d.get("dr_orthogonality")
        coef = ", ".join(f"{k} {v:.2f}" for k, v in d["simcal_coef"].items())

        def f(x: float | None, fmt: str) -> str:
            return "inf" if x is None else format(x, fmt)

        lines.append(
            f"| {t} | {d['ess_raw']:.4f} | {d['ess_stabilised']:.3f} | {d['max_share_raw']:.3f} | "
            f"{d['q995_raw']:.2f} | {f(d['hill_index'], '.2f')} | {d['log10_weight_span']:.1f} | {d['ttc']:.3f} | "
            f"{e['ttc_per_character']:.3f} | {f(d['cle_factor'], '.1f')} | {f(d['cle_floor_se'], '.4f')} | "
            f"{d['affinity']:.3f} | {d['simcal_alpha']:.2f} / {coef} | "
            f"{o['mean']:.4f} [{o['ci'][0]:.4f}, {o['ci'][1]:.4f}] |")
    lines += ["", "| target | logs-only verdict (calibrated IPS) | IPS | SNIPS | DR | stacked |", "|---|---|---|---|---|---|"]
    for t, e in res["targets"].items():
        v_lo = e["logs_only"]["verdicts"]
        v_hy = e["hybrid"]["verdicts"]
        lines.append(f"| {t} | {v_lo['calibrated_ips']['claim']} | {v_lo['ips']['claim']} | {v_lo['snips']['claim']} | "
                     f"{v_hy['dr']['claim']} | {v_hy['stacked']['claim']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arena-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the full results as JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    res = run(args.arena_dir, args.n_boot, args.seed)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=2))
    sys.stdout.write(markdown(res) + "\n")
    for t, e in res["targets"].items():
        v = e["logs_only"]["verdicts"]["calibrated_ips"]
        sys.stdout.write(f"\n{t}: logs-only {v['claim']}\n")
        for r in v["reasons"]:
            sys.stdout.write(f"  - {r}\n")
        if v["recommendation"]:
            sys.stdout.write(f"  recommendation: {v['recommendation']}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

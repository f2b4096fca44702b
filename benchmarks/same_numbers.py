"""Same numbers before and after a change: write a fixed set of results, or compare two sets.

    .venv/bin/python benchmarks/same_numbers.py write DIR      # run the cases, one result.json each
    .venv/bin/python benchmarks/same_numbers.py compare A B    # every number, verdict and claim agrees?

The cases go through the public command line (`cje evaluate`), so the script runs unchanged on any
revision that keeps the CLI: the Arena sample in Direct (base calibrates), logs-only and hybrid mode,
and three simulated datasets (random labels, calibration-policy labels with audit slices, a
stratified analytic run).  `compare` walks both JSON trees: numbers must agree to 1e-9 (relative) or
1e-12 (absolute), strings and booleans exactly; fields that only describe the run (versions, times)
are skipped.  Exit code 0 when everything agrees, 1 with a list of differences otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ARENA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "arena_sample"

# (name, input, extra CLI arguments); simulated inputs are written first by `_simulate`.
CASES: list[tuple[str, str, list[str]]] = [
    ("arena_direct", str(ARENA), ["--calibration-policies", "base", "--covariates", "response_length"]),
    ("arena_logs_only", str(ARENA), ["--mode", "logs-only", "--n-bootstrap", "500"]),
    ("arena_hybrid", str(ARENA), ["--mode", "hybrid", "--n-bootstrap", "500"]),
    ("sim_mcar", "sim_mcar.parquet", ["--covariates", "response_length", "--n-bootstrap", "500"]),
    ("sim_calpolicy", "sim_calpolicy.parquet", ["--calibration-policies", "base", "--n-bootstrap", "500"]),
    ("sim_stratified", "sim_stratified.parquet", ["--inference", "analytic"]),
]

SKIP_KEYS = {"engine_version", "code_version", "generated_at", "timings", "elapsed_s", "created_at",
             "schema_version"}


def _simulate(work: Path) -> None:
    from cje_engine.simulate import simulate

    specs = {
        "sim_mcar": dict(n_prompts=1000, oracle_fraction=0.10, label_design="mcar", seed=11),
        "sim_calpolicy": dict(n_prompts=2000, oracle_fraction=0.05, label_design="calibration_policy", seed=12),
        "sim_stratified": dict(n_prompts=800, oracle_fraction=0.15, label_design="stratified", seed=13),
    }
    for name, kw in specs.items():
        simulate(**kw).frame.to_parquet(work / f"{name}.parquet", index=False)


def write(out: Path) -> int:
    try:
        from flows.cli.main import main
    except ImportError:  # revisions before the package layout
        from flows.cli import main

    out.mkdir(parents=True, exist_ok=True)
    _simulate(out)
    for name, source, extra in CASES:
        src = source if Path(source).is_absolute() else str(out / source)
        code = main(["evaluate", src, "--out", str(out / name), *extra])
        if code not in (0, 1):  # 1 = a gate failed (newer CLIs); the result is still written
            print(f"{name}: cje evaluate exited {code}", file=sys.stderr)
            return 2
    return 0


def _walk(a, b, path: str, diffs: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in SKIP_KEYS:
                continue
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: only in {'A' if k in a else 'B'}")
                continue
            _walk(a[k], b[k], f"{path}.{k}", diffs)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{path}: length {len(a)} vs {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", diffs)
    elif isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
        if a != b:
            diffs.append(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            diffs.append(f"{path}: {a!r} vs {b!r}")
    elif a != b:
        diffs.append(f"{path}: {a!r} vs {b!r}")


def compare(a_dir: Path, b_dir: Path) -> int:
    failed = 0
    for name, _, _ in CASES:
        a = json.loads((a_dir / name / "result.json").read_text())
        b = json.loads((b_dir / name / "result.json").read_text())
        diffs: list[str] = []
        _walk(a, b, name, diffs)
        print(f"{name}: {'same' if not diffs else f'{len(diffs)} difference(s)'}")
        for d in diffs[:40]:
            print("   ", d)
        failed += bool(diffs)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    ns = p.parse_args(argv)
    return write(ns.out) if ns.cmd == "write" else compare(ns.a, ns.b)


if __name__ == "__main__":
    sys.exit(main())

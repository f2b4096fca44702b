"""CPU of a fresh process's imports: this tree against another revision of it, alternated in one run.

Every flow run (a process the Prefect worker starts), every `cje` command and every Ray worker a run starts
pays its imports before its first row: the chaos soak of the service tier runs ~44 flow runs and ~130 Ray workers,
and the default tier starts `cje` dozens of times. For each module named (default: the flow run's
`flows.pipelines.evaluate`, the CLI's `flows.cli.main`, a bootstrap worker's `cje_engine.pipeline.calibration`),
a fresh ``python -c "import M"`` in this tree and in ``--base`` (a git revision, checked out in a temporary
worktree), alternated ``--repeat`` times; the median user + system CPU of each, their difference, and whether
``scipy.stats`` was imported. The modules are compiled in both trees first (the machines set
``PYTHONDONTWRITEBYTECODE=1``; `.ci/run` compiles once after the install).

Usage::

    .venv/bin/python benchmarks/bench_startup.py --base 6aaba5e
    .venv/bin/python benchmarks/bench_startup.py --base HEAD~3 --repeat 9 flows.pipelines.evaluate
"""
from __future__ import annotations

import argparse
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("flows.pipelines.evaluate", "flows.cli.main", "cje_engine.pipeline.calibration")
log = logging.getLogger("bench_startup")


def import_cpu(tree: Path, module: str) -> tuple[float, bool]:
    """User + system CPU seconds of a fresh interpreter importing ``module`` from ``tree``, and whether it
    imported ``scipy.stats``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print('scipy.stats' in sys.modules)"],
                         cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, out.strip() == "True"


def main() -> None:
    """Print, per module, the median import CPU here and at ``--base``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES))
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            for tree in (ROOT, base):
                subprocess.run([sys.executable, "-m", "compileall", "-q", "cje_engine", "flows"], cwd=tree,
                               check=True, capture_output=True)
            log.info("| module | here (CPU s, median of %d) | base %s | saved | scipy.stats here / base |",
                     args.repeat, args.base)
            log.info("|---|---|---|---|---|")
            for module in args.modules:
                here, there, stats_here, stats_base = [], [], False, False
                for _ in range(args.repeat):
                    cpu, stats_here = import_cpu(ROOT, module)
                    here.append(cpu)
                    cpu, stats_base = import_cpu(base, module)
                    there.append(cpu)
                h, b = statistics.median(here), statistics.median(there)
                log.info("| `%s` | %.3f | %.3f | %.3f (%.0f%%) | %s / %s |", module, h, b, b - h, 100 * (b - h) / b,
                         stats_here, stats_base)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


if __name__ == "__main__":
    main()

"""CPU of the loopback stack's own processes (Ray's daemons, Prefect, PostgreSQL, radosgw), this tree against another.

For each tree (``--base``, the comparator, then this one): ``infra/stack/start.sh`` of that tree in a state folder
of its own, ``--runs`` fault-free scheduled runs of the chaos soak's size (`benchmarks/chaos_soak.py`: 1,000 prompts x
5 policies, five in flight), then ``--idle`` seconds with nothing running; meanwhile the CPU of every process of the
stack (its services' sessions and their descendants, the flow runs among them) is read from ``/proc`` every 0.5 s,
and summed per kind of process (by its command line: Ray's log monitor, raylets, GCS,
dashboard agents, Ray workers, flow-run processes, Prefect server, ...). Printed: each kind's CPU seconds during the
runs and during the idle spell, the base's beside this tree's. The stack is stopped after each tree.

Usage (a worktree of the commit to compare with as the base)::

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_stack_idle.py --base /tmp/base --runs 5 --idle 90

Only the stack's processes are counted, but they are slower on a busy machine: compare the two trees of one run.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

log = logging.getLogger("bench_stack_idle")
HZ = os.sysconf("SC_CLK_TCK")

#: Kinds of process, by a piece of their command line (the first that matches).
KINDS = (("log_monitor", "ray:log_monitor"), ("dashboard/agent.py", "ray:dashboard_agent"),
         ("ray::DashboardAgent", "ray:dashboard_agent"),
         ("specific-server", "ray:client_server"), ("ray.util.client.server", "ray:client_proxy"),
         ("ray::", "ray:worker"), ("default_worker.py", "ray:worker"), ("prefect.engine", "flow run"),
         ("prefect server", "prefect server"), ("prefect worker", "prefect worker"))


#: Kinds of process known by their executable's name (a raylet's command line names its agents' scripts).
BY_NAME = {"raylet": "ray:raylet", "gcs_server": "ray:gcs", "radosgw": "radosgw", "postgres": "postgres"}


def kind(name: str, cmd: str) -> str:
    """The kind of a process from its name (`BY_NAME`) or else its command line (`KINDS`; ``other``: neither)."""
    return BY_NAME.get(name) or next((k for piece, k in KINDS if piece in cmd), "other")


def stack_sessions(state: Path) -> set[int]:
    """The sessions of the stack's services: the PIDs its pid file records (each service is its session's leader)."""
    try:
        lines = (state / "pids").read_text().splitlines()
    except OSError:
        return set()
    return {int(w) for line in lines for w in line.split()[-1:] if w.isdigit()}


def snapshot(state: Path) -> dict[tuple[int, int], tuple[str, float]]:
    """The stack's processes (those of its services' sessions and their descendants: the flow runs its worker
    starts, in sessions of their own): (pid, start time) -> (its kind, its CPU seconds so far). Nothing else of the
    machine is counted (a test run's own Ray or Prefect, say)."""
    procs = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        procs[int(p)] = (int(fields[1]), int(fields[3]), int(fields[19]), kind(name, cmd),
                         (int(fields[11]) + int(fields[12])) / HZ)
    sessions, mine = stack_sessions(state), {}

    def of_stack(pid: int, depth: int = 0) -> bool:
        if pid not in mine:
            ppid, sid = procs[pid][0], procs[pid][1]
            mine[pid] = sid in sessions or (depth < 64 and ppid in procs and of_stack(ppid, depth + 1))
        return mine[pid]

    return {(pid, v[2]): (v[3], v[4]) for pid, v in procs.items() if of_stack(pid)}


class Sampler:
    """CPU seconds per kind of process between `start` and `stop` (processes that start and end between two reads,
    0.5 s apart, are missed)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.base: dict = {}
        self.seen: dict = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        self.base = snapshot(self.state)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.done.is_set():
            self.seen.update(snapshot(self.state))
            self.done.wait(0.5)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join()
        self.seen.update(snapshot(self.state))
        tot: collections.Counter = collections.Counter()
        for key, (k, cpu) in self.seen.items():
            tot[k] += cpu - (self.base[key][1] if key in self.base else 0.0)
        return {k: round(v, 2) for k, v in tot.items() if v > 0}


def measure(tree: Path, runs: int, idle: float, tag: str) -> dict:
    """Start a stack of ``tree``, ``runs`` fault-free runs, ``idle`` s of nothing; CPU per kind of each spell."""
    import chaos_soak
    from tests.stack.conftest import Stack, parse_env

    state = Path(f"/tmp/bench-stack-idle-{tag}")
    env = {**os.environ, "CJE_PYTHON": sys.executable, "CJE_STACK_DIR": str(state),
           "CJE_STACK_ENV": str(state / "env")}
    subprocess.run(["bash", str(tree / "infra/stack/start.sh")], env=env, check=True, stdout=subprocess.DEVNULL)
    try:
        time.sleep(20)  # the start's own tail (Ray's prestarted workers)
        stack = Stack(parse_env(state / "env"))
        faults = chaos_soak.FAULTS
        chaos_soak.FAULTS = {"none": 1.0}
        sampler = Sampler(state).start()
        try:
            report = chaos_soak.soak(stack, runs, 1, lanes=min(runs, 5))
        finally:
            chaos_soak.FAULTS = faults
        during = sampler.stop()
        sampler = Sampler(state).start()
        time.sleep(idle)
        quiet = sampler.stop()
        files = len(list((state / "ray" / "session_latest" / "logs").iterdir()))
    finally:
        subprocess.run(["bash", str(tree / "infra/stack/stop.sh")], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    return {"tree": str(tree), "published": report["published"], "runs": report["runs_scheduled"],
            "ray_log_files": files, "runs_cpu_s": during, "idle_cpu_s": quiet}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--base`` (the comparator's tree), ``--runs``, ``--idle``, ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--base", required=True, type=Path, help="the comparator's tree (a worktree of another commit)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle", type=float, default=90.0)
    ap.add_argument("--json", help="write both measurements here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for name in ("httpx", "prefect", "botocore", "urllib3", "chaos_soak", "flows", "cje_engine"):
        logging.getLogger(name).setLevel(logging.WARNING)
    base = measure(args.base.resolve(), args.runs, args.idle, "base")
    this = measure(ROOT, args.runs, args.idle, "this")
    for name, m in (("base", base), ("this", this)):
        log.info("%s: %s, %d runs scheduled, %d published, %d files in Ray's log folder", name, m["tree"], m["runs"],
                 m["published"], m["ray_log_files"])
    spells = (("runs_cpu_s", f"during {args.runs} fault-free runs"), ("idle_cpu_s", f"{args.idle:g} s idle"))
    for spell, title in spells:
        print(f"\nCPU s by kind of process, {title}:   base    this")
        for k in sorted(set(base[spell]) | set(this[spell]), key=lambda k: -base[spell].get(k, 0)):
            print(f"  {k:22s} {base[spell].get(k, 0):10.2f} {this[spell].get(k, 0):7.2f}")
        print(f"  {'all':22s} {sum(base[spell].values()):10.2f} {sum(this[spell].values()):7.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"base": base, "this": this}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

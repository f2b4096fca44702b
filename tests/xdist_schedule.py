"""How the default run's test files are spread over its two pytest-xdist workers (``-n 2 --dist loadfile``).

pytest-xdist's ``loadfile`` hands each worker one whole file at a time, from a queue ordered by the number of
tests in a file: the flow tests' files, few tests of 15 to 60 s each, came last and made the run's tail, and
both workers ran flow tests, so both started a Prefect API server and a two-node Ray cluster (about 36 CPU s
each to start, and about 0.08 CPU s per second idle for the rest of the run: docs/testing.md, "Time budget").

`ClusterFirstScheduling` keeps ``loadfile``'s rules (each file whole in one worker, in its usual order; a
worker asks for the next file when it has two tests or fewer left) and changes which file a worker gets:

- the files of `CLUSTER_DIRS` (the tests that use the session's Prefect server and Ray cluster) go to one
  worker only, the first one (another takes them over if it stops: a crashed worker is replaced by xdist);
  that worker starts them first, so the long ones are not at the end;
- every worker takes the other files, the costliest first (`COST`, CPU seconds measured in
  ``benchmarks/bench_test_tiers.py`` runs; a file not listed counts its tests), so that the last files,
  which make the tail, are short ones; the cluster worker takes them when its own files are done.

A serial run (``pytest`` without ``-n``) and other ``--dist`` modes are unchanged.
"""
from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: Folders whose files need the session's Prefect server and Ray cluster (tests/flows/conftest.py).
CLUSTER_DIRS = ("tests/flows/",)

#: Estimated CPU seconds of the costly files (4 December 2026: measured with `benchmarks/bench_test_tiers.py` for
#: tests/cli, tests/test_layers.py and the sharded unit tests; the others 0.31 x their wall seconds in a loaded
#: two-worker run, the ratio of that run's CPU to its summed test wall time). Only the order depends on it: a
#: file not listed counts 0.1 s per test (most of them take well under a second).
COST: dict[str, float] = {
    # the cluster worker's files (tests/flows)
    "tests/flows/test_cli.py": 155, "tests/flows/test_flow_faults.py": 42, "tests/flows/test_drift_flow.py": 38,
    "tests/flows/test_schedule.py": 31, "tests/flows/test_labels_flow.py": 27, "tests/flows/test_column_mapping.py": 17,
    "tests/flows/test_http_faults.py": 16, "tests/flows/test_sharded_ray.py": 14, "tests/flows/test_sharded_flow.py": 12,
    "tests/flows/test_notify.py": 11, "tests/flows/test_config.py": 10, "tests/flows/test_crash_between_steps.py": 9,
    "tests/flows/test_flow_modes.py": 9, "tests/flows/test_monitoring.py": 9, "tests/flows/test_journey.py": 9,
    "tests/flows/test_lifecycle.py": 8, "tests/flows/test_audit_loop_e2e.py": 7, "tests/flows/test_pages_agree.py": 6,
    # everyone's files
    "tests/unit/test_sharded.py": 22, "tests/unit/test_offpolicy_pipeline.py": 20, "tests/storage/test_http_faults.py": 15,
    "tests/storage/test_publish.py": 14, "tests/infra/test_infra.py": 13, "tests/infra/test_deploy.py": 13,
    "tests/unit/test_sharded_segments.py": 11, "tests/cli/test_terminal_conventions.py": 9,
    "tests/unit/test_fast_paths.py": 7, "tests/cli/test_cli_evaluate.py": 6, "tests/unit/test_verified_levels.py": 6,
    "tests/cli/test_cli_basics.py": 4.4, "tests/cli/test_anchors_and_service.py": 4, "tests/unit/test_result_schema.py": 4,
    "tests/test_dependencies.py": 4, "tests/unit/test_segments_report.py": 4, "tests/storage/test_logs.py": 4,
    "tests/unit/test_drift_monitor_speedup_identity.py": 3.5, "tests/labelling/test_budget.py": 3.5,
    "tests/cli/test_gate.py": 3.2, "tests/test_layers.py": 3.1, "tests/storage/test_labels.py": 3,
    "tests/unit/test_io_properties.py": 3, "tests/unit/test_artifact_links.py": 3,
}


def cost(path: str, n_tests: int) -> float:
    """The scheduling weight of a test file: its estimated CPU seconds (`COST`), else 0.1 s per test."""
    return COST.get(path, 0.1 * n_tests)


def needs_cluster(path: str) -> bool:
    """True for a test file that uses the session's Prefect server and Ray cluster."""
    return path.startswith(CLUSTER_DIRS)


class ClusterFirstScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the cluster files on one worker and the costliest files first (module doc)."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._cluster_node = None

    def _owner(self, node):
        """The worker that runs the cluster files: the first one to ask, as long as it is up."""
        alive = self._cluster_node is not None and self._cluster_node in self.assigned_work \
            and not self._cluster_node.shutting_down
        if not alive:
            self._cluster_node = node
        return self._cluster_node

    def _next_scope(self, node) -> str | None:
        """The file ``node`` should run next, None when nothing is left for it."""
        mine = self._owner(node) is node
        best, best_key = None, None
        for scope, tests in self.workqueue.items():
            cluster = needs_cluster(scope)
            if cluster and not mine:
                continue
            key = (cluster, cost(scope, len(tests)))  # the cluster worker: cluster files first
            if best_key is None or key > best_key:
                best, best_key = scope, key
        return best

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)  # pops the first unit of the queue: the one chosen

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self.workqueue and self._next_scope(node) is None and self._pending_of(self.assigned_work[node]) == 0:
            node.shutdown()  # only cluster files are left, and another worker runs them
            return
        super()._reschedule(node)

"""A Ray worker of the sharded pass imports no Prefect: the modules whose functions its tasks run (the readers,
the label join, the passes) load without it, so a fresh worker does not pay Prefect's import (~0.9 s of CPU a
worker, measured in round 19)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The modules of the functions the sharded pass sends to Ray workers (`flows.runtime.sharded_ray.split_file`,
#: `sample_file`, `check_response_ids`; `flows.runtime.label_index.build_label_index`; the passes of
#: `cje_engine.pipeline.sharded`; the readers' ``prepare_rows`` of `flows.pipelines.sharded_pass`).
WORKER_MODULES = ("flows.runtime.sharded_ray", "flows.runtime.label_index", "cje_engine.pipeline.sharded",
                  "flows.pipelines.sharded_pass", "flows.storage.logs", "flows.storage.labels")


def _loaded(modules: tuple[str, ...]) -> list[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'flows'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "DO_NOT_TRACK": "1"})
    return json.loads(out.stdout)


def test_the_sharded_pass_worker_modules_import_no_prefect():
    loaded = _loaded(WORKER_MODULES)
    assert "flows.runtime.label_index" in loaded  # the probe sees what it imported
    assert not [m for m in loaded if m.split(".")[0] == "prefect"], "a worker module imports Prefect"


def test_the_probe_sees_prefect_where_it_is_imported():
    assert "prefect" in _loaded(("flows.runtime.retries",))

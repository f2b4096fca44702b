"""A fresh Ray worker of the sharded row pass imports only what its tasks run: the modules of the readers, the label
index and passes 1-3 (`flows.runtime.sharded_ray`, `flows.pipelines.sharded_pass` for `FileRows`,
`flows.runtime.label_index`, `cje_engine.pipeline.sharded`) load without the driver's (the calibration fit, the
result's model, scipy.stats): ~0.7 s of CPU less a worker, two a run."""
from __future__ import annotations

import json
import subprocess
import sys

WORKER_MODULES = ("cje_engine.pipeline.sharded", "flows.runtime.sharded_ray", "flows.pipelines.sharded_pass",
                  "flows.runtime.label_index", "flows.pipelines.preflight", "flows.storage.logs")
DRIVER_ONLY = ("scipy.stats", "cje_engine.pipeline.calibration", "cje_engine.pipeline.direct",
               "cje_engine.pipeline.policies", "cje_engine.result.model", "cje_engine.pipeline.sharded_segments",
               # round 25: the calibration fit's solvers and the segments' sparse basis (scipy.optimize, scipy.linalg,
               # scipy.sparse: ~0.3 s of CPU a fresh worker), the flow's configuration and its pydantic models (~0.1 s)
               "scipy", "flows.config", "pydantic")


def test_the_workers_modules_load_without_the_drivers():
    code = ("import importlib, json, sys\n"
            f"for m in {WORKER_MODULES!r}: importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {DRIVER_ONLY!r} if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_driver_side_still_finds_what_it_imports_late():
    """The names moved into the driver's functions resolve (a typo there would fail only on the driver)."""
    from cje_engine.pipeline import sharded, sharded_segments
    from cje_engine.pipeline.calibration import fit_calibration
    from cje_engine.pipeline.direct import Prepared
    from cje_engine.pipeline.policies import RowTotals
    from cje_engine.result.model import RowPass
    from flows.pipelines import sharded_pass

    assert callable(fit_calibration) and Prepared and RowTotals and RowPass and sharded_segments
    assert sharded_pass.single_row_pass("x").path == "single"
    assert sharded._row_totals([], [], 0).n_rows.size == 0

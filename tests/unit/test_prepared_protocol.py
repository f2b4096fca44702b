"""Every evaluation mode's prepared state is a `Prepared`: the flow and the Ray fan-out call its methods
and never ask which mode they hold."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from cje_engine.pipeline import direct, offpolicy
from cje_engine.pipeline.prepared import Prepared, ReplicateSource
from cje_engine.simulate import simulate
from cje_engine.simulate.logs import simulate_logs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def preps():
    """A prepared state of every mode (small, seeded)."""
    frame = simulate(n_prompts=200, oracle_fraction=0.3, seed=5).frame
    sim = simulate_logs(n_prompts=120, length=8, targets={"near": 0.05}, seed=4, label_fraction=0.5)
    logged, fresh = sim.to_frames("base")
    return {
        "direct": direct.prepare(frame, n_bootstrap=60, seed=1),
        "direct_rerun": direct.prepare(frame, n_bootstrap=60, seed=1, pooling_bootstrap="rerun"),
        "logs-only": offpolicy.prepare(logged, mode="logs-only", n_bootstrap=60, seed=2),
        "hybrid": offpolicy.prepare(logged, fresh, mode="hybrid", n_bootstrap=60, seed=3),
    }


@pytest.mark.parametrize("mode", ["direct", "direct_rerun", "logs-only", "hybrid"])
def test_each_mode_runs_through_the_protocol_as_through_its_own_functions(preps, mode):
    from flows.runtime.ray_fanout import bootstrap_state, remote_bootstrap

    prep = preps[mode]
    assert isinstance(prep, Prepared)
    prep.check_bootstrap_memory()
    source = bootstrap_state(prep)
    assert isinstance(source, ReplicateSource)
    own = (offpolicy if mode in ("logs-only", "hybrid") else direct).bootstrap_chunk
    B = prep.options.n_bootstrap
    chunks = [remote_bootstrap(source, 0, 25), remote_bootstrap(source, 25, B)]
    np.testing.assert_array_equal(np.vstack(chunks), own(prep, 0, B))
    assert prep.finalize(chunks).to_dict() == (offpolicy if mode in ("logs-only", "hybrid") else direct).finalize(
        prep, [own(prep, 0, B)]).to_dict()


def test_a_direct_state_ships_its_bootstrap_view_unless_pooling_is_rerun(preps):
    from cje_engine.direct.estimators import BootstrapView

    assert isinstance(preps["direct"].bootstrap_source(), BootstrapView)
    assert preps["direct_rerun"].bootstrap_source() is preps["direct_rerun"]
    assert preps["hybrid"].bootstrap_source() is preps["hybrid"]


@pytest.mark.parametrize("path", ["flows/pipelines/evaluate.py", "flows/runtime/ray_fanout.py"])
def test_the_flow_and_the_fanout_do_not_branch_on_the_prepared_type(path):
    """No isinstance against a prepared type or a bootstrap view, and no import of those types."""
    tree = ast.parse((ROOT / path).read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not named & {"OffPolicyPrepared", "BootstrapView", "Prepared", "Design"}, path

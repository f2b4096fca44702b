"""The calibration fit's heap on the sharded driver, per labelled row (issue 29, boot30): tracemalloc over
`fit_calibration` on the merged labelled rows of a simulated window (``N`` prompts x 5 policies, 5% labelled, the
design of ``bench_sharded.py --stage write``; 4 shards in process), and its timeline: for each step (the design, its
cell index, the calibration plan, the fits, the residual terms, the source audits) the heap on entry and exit and
the peak so far, in bytes a labelled row (robust pooling: one round a line group).

    .venv/bin/python benchmarks/bench_fit_memory.py 400000
"""
import functools
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pyarrow as pa
from cje_engine.options import EvaluationOptions
from cje_engine.pipeline import sharded, calibration as cal
from cje_engine.direct import estimators as est
from cje_engine.simulate import simulate

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 400_000
table = pa.Table.from_pandas(simulate(n_prompts, seed=3, oracle_fraction=0.05).frame, preserve_index=False)
opts = EvaluationOptions.of(None, seed=1, inference="analytic")
L = [1]
events = []
def wrap(mod, name):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        c0, p0 = tracemalloc.get_traced_memory()
        r = f(*a, **k)
        c1, p1 = tracemalloc.get_traced_memory()
        events.append((name, c0 / L[0], c1 / L[0], p1 / L[0]))
        return r
    setattr(mod, name, g)
for mod, name in [(cal, "make_design"), (cal, "calibration_plan"), (cal, "cell_fits"), (cal, "fit_mode"),
                  (cal, "source_audits"), (cal, "_labelled_residual_terms"), (cal, "_paired"), (cal, "choose_mode"),
                  (est, "_cell_index"), (est, "_warm_start")]:
    wrap(mod, name)
def fit(data, o, rows):
    L[0] = data.n_rows
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    r = cal.fit_calibration(data, o, rows)
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"labelled rows {data.n_rows}: before {base/L[0]:.0f} B/row (data + rows), after {cur/L[0]:.0f}, peak {peak/L[0]:.0f}; excluded {[e['policy'] for e in r[2]]}")
    return r
sp = sharded.prepare_sharded(sharded.split_by_shard(table, 4), opts, keep_terms=False, fit=fit)
for name, c0, c1, p in events:
    print(f"  {name:26s} in {c0:6.0f} out {c1:6.0f} peak so far {p:6.0f}  (B a labelled row)")

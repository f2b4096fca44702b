"""`cje demo`: the README's main job on embedded defaults.

1. Simulate a realistic week of production logs with `cje_engine.simulate.direct` (five policies
   shaped like the Arena sample, one of which fools the judge; judge bias growing with
   response length; prompt effects shared across policies), spread over the ``days``
   full days before today (UTC), written as hive-partitioned Parquet to
   ``<data>/logs/dt=YYYY-MM-DD/``.
2. Put the oracle labels (the logger ``base`` labelled at 10 %, 100 audit labels per other
   policy and day) into the append-only label store under ``<data>/labels``, separately
   from the logs, as in production.
3. Run the `evaluate` flow end to end (embedded Prefect server, local Ray, local
   folders) and publish under ``<data>/results/demo/<window>/<run_key>/``.
4. Run the `drift` flow on the demo anchor set; the judge update on the last day alarms and
   raises a label request (anchors + the evaluation's recent traffic) under
   ``<data>/label_requests/``.

Re-running on the same day reuses the generated data (same run key: the published run is
not duplicated).  Only folders carrying the demo's marker file are ever replaced.
"""
from __future__ import annotations

import logging
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

MARKER = ".cje-demo"
EVALUATION = "demo"


def _dates(days: int, as_of=None):
    ref = as_of or datetime.now(timezone.utc).date()
    return [ref - timedelta(days=days - i) for i in range(days)]


def generate_logs(data: Path, days: int = 7, prompts_per_day: int = 1000, seed: int = 0,
                  as_of=None) -> dict:
    """Write the simulated logs and labels under ``data`` (idempotent for the same inputs).

    Returns
    -------
    dict
        ``logs_uri``, ``labels_uri``, ``results_uri``, ``dates``, ``n_rows``, ``n_labels``,
        ``true_values`` and whether the data was ``generated`` or reused.
    """
    from cje_engine.simulate.direct import simulate

    from flows.storage.labels import LabelStore
    from flows.storage.logs import opaque_response_ids, write_logs
    from flows.storage.objects import Storage

    if days < 1 or prompts_per_day < 10:
        raise CJEInputError("the demo needs days >= 1 and prompts_per_day >= 10")
    data = data.resolve()
    logs_dir, labels_dir = data / "logs", data / "labels"
    dates = _dates(days, as_of)
    stamp = f"days={days} prompts_per_day={prompts_per_day} seed={seed} first={dates[0]} ids=opaque"
    n = days * prompts_per_day
    # 100 audit labels per non-logger policy and day; the logger labelled at 10 %.
    sim = simulate(n, label_design="calibration_policy", oracle_fraction=0.10,
                   audit_labels=min(n, 100 * days), seed=seed)
    out = {"logs_uri": str(logs_dir), "labels_uri": str(labels_dir), "results_uri": str(data),
           "dates": [d.isoformat() for d in dates], "true_values": sim.true_values}
    marker = logs_dir / MARKER
    if marker.exists() and marker.read_text() == stamp:
        out.update(generated=False, n_rows=len(sim.frame), n_labels=int(sim.frame["oracle_label"].notna().sum()))
        log.info("reusing demo data in %s", data)
        return out
    for d in (logs_dir, labels_dir):
        if d.exists():
            if not (d / MARKER).exists() and any(d.iterdir()):
                raise CJEInputError(f"{d} exists and was not written by `cje demo`; choose another --data folder",
                                    source=str(d))
            shutil.rmtree(d)
        d.mkdir(parents=True)

    frame = sim.frame.copy()
    # opaque ids: the simulator's "policy:prompt:k" would show labellers the policy (docs/logs-layout.md)
    frame["response_id"] = opaque_response_ids([frame["response_id"]], salt=f"cje-demo-{seed}")
    rng = np.random.default_rng(seed + 1)
    # Prompt p is asked on day p // prompts_per_day at a random time of that day.
    codes = frame["prompt_id"].astype("category").cat.codes.to_numpy()
    day_of = codes % days
    start = datetime.combine(dates[0], datetime.min.time(), tzinfo=timezone.utc)
    seconds = rng.uniform(0, 86400, size=len(frame))
    frame["ts"] = [start + timedelta(days=int(k), seconds=float(s)) for k, s in zip(day_of, seconds)]
    labels = frame.loc[frame["oracle_label"].notna(), ["response_id", "oracle_label", "label_probability"]]
    logs = frame.drop(columns=["oracle_label", "label_probability"])

    write_logs(Storage.for_uri(str(logs_dir)), pa.Table.from_pandas(logs, preserve_index=False),
               basename="demo")
    LabelStore(Storage.for_uri(str(labels_dir))).append(
        pa.Table.from_pandas(labels.reset_index(drop=True), preserve_index=False), "demo-oracle")
    _write_demo_anchors(Storage.for_uri(str(data)), dates, seed)
    (labels_dir / MARKER).write_text(stamp)
    marker.write_text(stamp)
    out.update(generated=True, n_rows=len(frame), n_labels=len(labels))
    log.info("wrote %d log rows over %d day(s) and %d labels under %s", len(frame), days, len(labels), data)
    return out


ANCHOR_SET = "demo-anchors"
#: The demo's label budget: room for the audit requests of the evaluation and the drift alarm's request.
DEMO_REQUESTS = {"max_labels_per_period": 3000, "max_labels_per_request": 400}


def _write_demo_anchors(st, dates, seed: int, n_anchors: int = 200) -> None:
    """A versioned anchor set and one judge scoring of it per day.

    The judge is re-scored daily with fresh noise ("judge-v1"); on the last day (from three days
    on: reference, replicate, then at least one look) a judge update ("judge-v2") shifts every
    score up by one level (0.1), the case the drift monitor exists for: its alarm raises a label
    request for the anchors and the evaluation's recent traffic.
    """
    import pandas as pd

    from cje_engine.simulate.drift import Judge, make_anchor_set

    from flows.storage.anchors import write_anchor_set, write_anchor_scores

    rng = np.random.default_rng(seed + 7)
    anchors = make_anchor_set(n_anchors, label_fraction=0.5, rng=rng)
    ids = list(anchors.anchor_ids)
    write_anchor_set(st, ANCHOR_SET, pd.DataFrame({
        "anchor_id": ids, "prompt": [f"anchor prompt {i}" for i in ids],
        "response": [f"anchor response {i}" for i in ids], "oracle_label": anchors.labels().to_numpy()}),
        metadata={"source": "cje demo (cje_engine.simulate.drift)"})
    v1, v2 = Judge(), Judge(shift=0.1)
    for i, day in enumerate(dates):
        judge, judge_id = (v2, "judge-v2") if i == len(dates) - 1 and len(dates) >= 3 else (v1, "judge-v1")
        ts = datetime.combine(day, datetime.min.time(), tzinfo=timezone.utc) + timedelta(hours=5)
        write_anchor_scores(st, ANCHOR_SET, pd.DataFrame({
            "anchor_id": ids, "judge_id": judge_id, "ts": [ts] * len(ids),
            "judge_score": judge.score(anchors, rng).to_numpy()}), basename=f"demo-{day.isoformat()}")


def run_demo(data: Path = Path("cje-data"), days: int = 7, prompts_per_day: int = 1000,
             n_bootstrap: int = 2000, seed: int = 0) -> dict:
    """Generate the demo data, run the `evaluate` flow on embedded defaults, publish.

    Returns the flow's summary (``report`` is the path of report.html).
    """
    import os

    from flows.runtime import ray_fanout as ray_runtime
    from flows.pipelines.drift import drift
    from flows.pipelines.drift_config import DriftSettings
    from flows.pipelines.audit import evaluate_and_audit
    from flows.runtime.prefect_server import launch_server, prefect_api

    # The embedded Prefect server boots while the data is written and Ray starts.
    owns_server = not os.environ.get("PREFECT_API_URL")
    launched = launch_server() if owns_server else None
    try:
        info = generate_logs(Path(data), days=days, prompts_per_day=prompts_per_day, seed=seed)
        if launched is not None:  # Ray workers get the API URL at Ray start (see ray_runtime.worker_env)
            os.environ["PREFECT_API_URL"] = launched.url
        with ray_runtime.ray_session(), prefect_api(launched=launched):
            launched = None  # owned (and stopped) by prefect_api from here on
            summary = evaluate_and_audit(
                logs_uri=info["logs_uri"],
                labels_uri=info["labels_uri"],
                results_uri=info["results_uri"],
                window=f"{info['dates'][0]}..{info['dates'][-1]}",
                evaluation=EVALUATION,
                options={"covariates": ["response_length"], "calibration_policies": ["base"],
                         "n_bootstrap": n_bootstrap, "seed": seed},
                label_requests=DEMO_REQUESTS,
            )
            # The drift alarm of the judge update raises a label request on the anchors and on the
            # evaluation's recent traffic: the flow gets the evaluation's logs and label store.
            summary["drift"] = drift(DriftSettings(
                set_name=ANCHOR_SET, anchors_uri=info["results_uri"], evaluation=EVALUATION,
                results_uri=info["results_uri"], through=info["dates"][-1], evaluation_logs_uri=info["logs_uri"],
                labels_uri=info["labels_uri"], label_requests=DEMO_REQUESTS))
    finally:
        if launched is not None:  # failed before prefect_api took it over
            from flows.runtime.prefect_server import stop_server

            stop_server(launched)
        if owns_server:
            os.environ.pop("PREFECT_API_URL", None)
    summary["true_values"] = info["true_values"]
    return summary

"""`cje import otel` of N OpenTelemetry GenAI spans next to reading the same spans with json + pyarrow alone.

The spans (``--records``, default 1,000,000) are OTLP/JSON lines as the Collector's file exporter writes
them (500 spans a request, one request a line; each span a ``chat`` operation with ``gen_ai.request.model``,
``cje.prompt_id``, a short ``gen_ai.input.messages`` and one ``gen_ai.evaluation.result`` event) plus
the human ratings as log-based events (one ``ExportLogsServiceRequest`` line per 500 ratings, 20% of the
spans), written once under ``benchmarks/_work/import/``. Three cases, each in a fresh subprocess (its
own peak RSS), run ``--repeat`` times, best wall time shown with its CPU time:

* ``import``: `flows.integrations.importers.import_source` -- parse, map, stage, dedupe against the logs
  root, write the daily Parquet layout and the manifest (the whole of ``cje import``);
* ``json+pyarrow``: what a team's own converter does with the standard library and pyarrow: a first
  pass over the log lines for the ratings, then ``json.loads`` of every line, the same fields pulled
  out into Python lists (prompt id, policy, response id, judge score, timestamp, label, prompt text), one ``pyarrow`` table, one Parquet file (everything in memory);
* ``pyarrow.json``: ``pyarrow.json.read_json`` of the file (native, multi-threaded; reads the nested
  structs and maps nothing) -- for scale only.

The claim (issue 30): the import within 2x of ``json+pyarrow`` and its memory bounded (it does not grow
with the file: one batch of rows and one day's ids).

Usage::

    .venv/bin/python benchmarks/bench_import.py                          # 1,000,000 spans
    .venv/bin/python benchmarks/bench_import.py --records 100000 --repeat 1   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

WORK = HERE / "_work" / "import"
MODELS = ("gpt-4o-mini", "claude-3-5-haiku", "llama-3.1-70b", "mistral-large", "qwen-2.5-72b")
BATCH = 500
T0 = 1_740_787_200 * 10**9


def _kv(key: str, value) -> dict:
    if isinstance(value, str):
        return {"key": key, "value": {"stringValue": value}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"intValue": str(value)}}


def generate(path: Path, n: int) -> None:
    """Write ``n`` spans (and ratings for 20% of them) as OTLP/JSON lines."""
    rng = random.Random(0)
    resource_ = {"attributes": [_kv("service.name", "support-bot"), _kv("service.version", "2.3.0")]}
    logs = []
    with open(path, "w") as fh:
        for start in range(0, n, BATCH):
            spans = []
            for i in range(start, min(n, start + BATCH)):
                trace, span = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
                model = MODELS[i % len(MODELS)]
                ts = T0 + i * 600_000_000  # 1M spans over ~7 days
                spans.append({"traceId": trace, "spanId": span, "name": f"chat {model}", "kind": "SPAN_KIND_CLIENT",
                              "startTimeUnixNano": str(ts), "endTimeUnixNano": str(ts + 10**9),
                              "attributes": [_kv("gen_ai.operation.name", "chat"), _kv("gen_ai.provider.name", "x"),
                                             _kv("gen_ai.request.model", model), _kv("cje.prompt_id", f"p{i // 5}"),
                                             _kv("gen_ai.input.messages", f'[{{"role":"user","content":"question {i // 5}"}}]'),
                                             _kv("gen_ai.usage.output_tokens", 30)],
                              "events": [{"timeUnixNano": str(ts + 2 * 10**9), "name": "gen_ai.evaluation.result",
                                          "attributes": [_kv("gen_ai.evaluation.name", "relevance"),
                                                         _kv("gen_ai.evaluation.score.value", round(rng.random(), 3))]}],
                              "status": {}})
                if i % 5 == 0:
                    logs.append({"timeUnixNano": str(ts + 3600 * 10**9), "eventName": "gen_ai.evaluation.result",
                                 "traceId": trace, "spanId": span,
                                 "attributes": [_kv("gen_ai.evaluation.name", "human_rating"),
                                                _kv("gen_ai.evaluation.score.value", round(rng.random(), 3))]})
            fh.write(json.dumps({"resourceSpans": [{"resource": resource_, "scopeSpans": [
                {"scope": {"name": "support-bot.llm"}, "spans": spans}]}]}, separators=(",", ":")) + "\n")
            if len(logs) >= BATCH:
                fh.write(json.dumps({"resourceLogs": [{"resource": resource_, "scopeLogs": [
                    {"scope": {"name": "ratings"}, "logRecords": logs}]}]}, separators=(",", ":")) + "\n")
                logs = []
        if logs:
            fh.write(json.dumps({"resourceLogs": [{"resource": resource_, "scopeLogs": [
                {"scope": {"name": "ratings"}, "logRecords": logs}]}]}, separators=(",", ":")) + "\n")


# --------------------------------------------------------------------------- the cases (child processes)


def case_import(src: Path, out: Path) -> dict:
    """The whole of ``cje import otel SRC --out OUT --label-from human_rating``."""
    from flows.integrations.importers import ImportMapping, get, import_source
    from flows.storage.objects import Storage

    imp = get("otel")
    rep = import_source(imp, src, Storage.for_uri(str(out)), ImportMapping.build(imp, label_from="human_rating"))
    return {"rows": rep.written, "labels": sum(rep.labels.values()), "objects": len(rep.objects)}


def _attr(items, key):
    for kv in items:
        if kv["key"] == key:
            return next(iter(kv["value"].values()))
    return None


def case_json_pyarrow(src: Path, out: Path) -> dict:
    """A hand-written converter: json + pyarrow, the same fields, one Parquet file."""
    from datetime import datetime, timezone

    import pyarrow as pa
    import pyarrow.parquet as pq

    labels = {}
    with open(src) as fh:
        for line in fh:
            if '"resourceLogs"' in line:
                for rl in json.loads(line)["resourceLogs"]:
                    for sl in rl["scopeLogs"]:
                        for lr in sl["logRecords"]:
                            labels[lr["spanId"]] = _attr(lr["attributes"], "gen_ai.evaluation.score.value")
    cols = {k: [] for k in ("prompt_id", "policy", "response_id", "judge_score", "ts", "oracle_label", "prompt")}
    with open(src) as fh:
        for line in fh:
            doc = json.loads(line)
            for rs in doc.get("resourceSpans", ()):
                for ss in rs["scopeSpans"]:
                    for sp in ss["spans"]:
                        a = sp["attributes"]
                        cols["prompt_id"].append(_attr(a, "cje.prompt_id"))
                        cols["policy"].append(_attr(a, "gen_ai.request.model"))
                        cols["response_id"].append(f"{sp['traceId']}:{sp['spanId']}")
                        cols["judge_score"].append(_attr(sp["events"][0]["attributes"], "gen_ai.evaluation.score.value"))
                        ns = int(sp["startTimeUnixNano"])
                        cols["ts"].append(datetime.fromtimestamp(ns // 10**9, tz=timezone.utc))
                        cols["oracle_label"].append(labels.get(sp["spanId"]))
                        cols["prompt"].append(json.loads(_attr(a, "gen_ai.input.messages"))[-1]["content"])
    table = pa.table(cols)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "all.parquet", compression="zstd")
    return {"rows": table.num_rows, "labels": len(labels), "objects": 1}


def case_pyarrow_json(src: Path, out: Path) -> dict:
    """``pyarrow.json.read_json`` of the file (maps nothing)."""
    import pyarrow.json as pj

    table = pj.read_json(src, read_options=pj.ReadOptions(block_size=64 << 20))
    return {"rows": table.num_rows, "labels": 0, "objects": 0}


CASES = {"import": case_import, "json+pyarrow": case_json_pyarrow, "pyarrow.json": case_pyarrow_json}


def child(case: str, src: str, out: str) -> None:
    """Run one case and print its figures as JSON (this process: its own peak RSS)."""
    shutil.rmtree(out, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    got = CASES[case](Path(src), Path(out))
    got.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(got))


def run(case: str, src: Path, repeat: int) -> dict:
    """Best of ``repeat`` fresh subprocesses of ``case``."""
    best = None
    for _ in range(repeat):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, __file__, "--child", case, str(src), str(WORK / f"out-{case}")],
                             capture_output=True, text=True, env=env, check=True)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        if best is None or got["wall"] < best["wall"]:
            best = got
    return best


def main() -> None:
    """Generate the spans once, run the three cases, print the table and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run (default: all three)")
    ap.add_argument("--child", nargs=3, metavar=("CASE", "SRC", "OUT"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(*ns.child)
        return
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / f"spans-{ns.records}.jsonl"
    if not src.exists():
        generate(src, ns.records)
    size = src.stat().st_size / 2**20
    print(f"{ns.records:,} spans, {size:.0f} MiB of OTLP/JSON lines ({src})")
    rows = {c: run(c, src, ns.repeat) for c in ns.cases.split(",")}
    print(f"{'case':14} {'rows':>9} {'wall s':>7} {'cpu s':>7} {'peak RSS MB':>12}")
    for c, r in rows.items():
        print(f"{c:14} {r['rows']:>9,} {r['wall']:>7.1f} {r['cpu']:>7.1f} {r['peak_rss_mb']:>12.0f}")
    if "import" not in rows or "json+pyarrow" not in rows:
        return
    a, b = rows["import"], rows["json+pyarrow"]
    print(f"import / json+pyarrow: {a['wall'] / b['wall']:.2f}x wall, {a['cpu'] / b['cpu']:.2f}x CPU; "
          f"peak RSS {a['peak_rss_mb']:.0f} vs {b['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()

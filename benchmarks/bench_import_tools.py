"""`cje import promptfoo` of a large results.json next to reading it with json + pyarrow alone.

The file (``--records`` results, default 100,000) is promptfoo 0.121.20's own output scaled up: the 120 results
of ``tests/fixtures/imports/promptfoo/results.json.gz`` repeated with fresh result ids, test indices and
vars (so every repeat is a new test case), inside the real document's envelope (``evalId``,
``results.timestamp``, ``results.prompts``, ``config``). Written once under ``benchmarks/_work/import/``.
Two cases, each in a fresh subprocess (its own peak RSS):

* ``import``: `flows.integrations.importers.import_source` with ``--label-from score:expert`` (stream,
  map, stage, write the daily Parquet layout and the manifest: the whole of ``cje import``);
* ``json+pyarrow``: ``json.load`` of the document, the same fields into Python lists, one pyarrow table,
  one Parquet file (what a team's own converter does; the whole document in memory).

Usage::

    .venv/bin/python benchmarks/bench_import_tools.py --records 20000
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
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
FIXTURE = ROOT / "tests" / "fixtures" / "imports" / "promptfoo" / "results.json.gz"


def generate(path: Path, n: int) -> None:
    """Write ``n`` results: the fixture's, repeated with new ids, test indices and vars."""
    doc = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    base = doc["results"]["results"]
    head = {k: v for k, v in doc["results"].items() if k != "results"}
    with open(path, "w") as fh:
        fh.write('{"evalId":' + json.dumps(doc["evalId"]) + ',"results":{')
        fh.write(",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in head.items() if k != "stats"))
        fh.write(',"results":[')
        for i in range(n):
            rep, r = divmod(i, len(base))
            r = json.loads(json.dumps(base[r]))
            r["id"] = hashlib.md5(f"{i}".encode()).hexdigest()
            r["testIdx"] = r["testIdx"] + rep * 40
            r["testCase"]["vars"]["question"] += f" (#{rep})"
            r["vars"] = r["testCase"]["vars"]
            fh.write(("," if i else "") + json.dumps(r, separators=(",", ":")))
        fh.write('],"stats":' + json.dumps(doc["results"]["stats"]) + '},"config":' + json.dumps(doc["config"]) + "}")


def case_import(src: Path, out: Path) -> dict:
    """The whole of ``cje import promptfoo SRC --out OUT --label-from score:expert``."""
    from flows.integrations.importers import ImportMapping, get, import_source
    from flows.storage.objects import Storage

    imp = get("promptfoo")
    rep = import_source(imp, src, Storage.for_uri(str(out)), ImportMapping.build(imp, label_from="score:expert"))
    return {"rows": rep.written, "labels": sum(rep.labels.values())}


def case_json_pyarrow(src: Path, out: Path) -> dict:
    """A hand-written converter: json.load + pyarrow, the same fields, one Parquet file."""
    from datetime import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(src) as fh:
        doc = json.load(fh)
    ts = datetime.fromisoformat(doc["results"]["timestamp"].replace("Z", "+00:00"))
    cols = {k: [] for k in ("prompt_id", "policy", "response_id", "judge_score", "ts", "oracle_label", "prompt",
                            "response")}
    for r in doc["results"]["results"]:
        comps = {c["assertion"].get("metric"): c["score"] for c in r["gradingResult"]["componentResults"]}
        t = r["testCase"]
        key = json.dumps({"description": t.get("description"), "vars": t.get("vars")}, sort_keys=True)
        cols["prompt_id"].append("pf:" + hashlib.sha1(key.encode()).hexdigest()[:16])
        cols["policy"].append(r["provider"]["label"])
        cols["response_id"].append(r["id"])
        cols["judge_score"].append(comps["helpfulness"])
        cols["ts"].append(ts)
        cols["oracle_label"].append(comps.get("expert"))
        cols["prompt"].append(r["prompt"]["raw"])
        cols["response"].append(r["response"]["output"])
    table = pa.table(cols)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "all.parquet", compression="zstd")
    return {"rows": table.num_rows, "labels": sum(v is not None for v in cols["oracle_label"])}


CASES = {"import": case_import, "json+pyarrow": case_json_pyarrow}


def child(case: str, src: str, out: str) -> None:
    """Run one case and print its figures as JSON (this process: its own peak RSS)."""
    shutil.rmtree(out, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    got = CASES[case](Path(src), Path(out))
    got.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(got))


def main() -> None:
    """Generate the file once, run both cases, print the table and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--child", nargs=3, metavar=("CASE", "SRC", "OUT"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(*ns.child)
        return
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / f"promptfoo-{ns.records}.json"
    if not src.exists():
        generate(src, ns.records)
    print(f"{ns.records:,} promptfoo results, {src.stat().st_size / 2**20:.0f} MiB ({src})")
    rows = {}
    for case in CASES:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, __file__, "--child", case, str(src), str(WORK / f"out-pf-{case}")],
                             capture_output=True, text=True, env=env, check=True)
        rows[case] = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"{'case':14} {'rows':>9} {'wall s':>7} {'cpu s':>7} {'peak RSS MB':>12}")
    for c, r in rows.items():
        print(f"{c:14} {r['rows']:>9,} {r['wall']:>7.1f} {r['cpu']:>7.1f} {r['peak_rss_mb']:>12.0f}")
    a, b = rows["import"], rows["json+pyarrow"]
    print(f"import / json+pyarrow: {a['cpu'] / b['cpu']:.2f}x CPU, {a['wall'] / b['wall']:.2f}x wall; "
          f"peak RSS {a['peak_rss_mb']:.0f} vs {b['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()

"""`cje import FORMAT SOURCE --out LOGS_URI`: scores from eval and tracing tools into the service's logs.

    cje import otel spans.jsonl --out ./cje-data/logs
    cje import langfuse export.json --out s3://bucket/logs --judge-from helpfulness --label-from human
    cje evaluate ./cje-data/logs --out out/

FORMAT is one of the registered importers (docs/imports/). The rows go to ``LOGS_URI/dt=YYYY-MM-DD/``
(a folder or ``s3://bucket/prefix``), the layout `cje run` and `cje evaluate` read. The selectors choose
what identifies the policy, the prompt, the judge score and the human label: ``KIND:NAME`` terms
(``attr:gen_ai.request.model``, ``score:helpfulness``), ``+`` joins several into one value
(``attr:gen_ai.request.model+metadata:prompt_version``), ``|`` falls back to the next. Importing the same
file again writes nothing; an overlapping export writes only the responses not already in the logs.
What could not be mapped is listed per reason with record numbers. Bad input exits 2 naming the file,
record and field.
"""
from __future__ import annotations

import argparse
from typing import Any

from flows.cli.exits import EXIT_OK
from flows.cli.terminal import escape, out, out_json


def register(sub: Any) -> None:
    """Add ``cje import`` to the command-line parser."""
    from flows.integrations.importers import IMPORTERS

    formats = ", ".join(f"{n} ({imp.title})" for n, imp in IMPORTERS.items()) or "none registered"
    p = sub.add_parser("import", help="scores from eval and tracing tools into the logs layout (docs/imports/)",
                       description=__doc__.split("\n\n", 1)[1] + f"\nformats: {formats}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", metavar="FORMAT", help=f"the tool's format: {', '.join(IMPORTERS.names())}")
    p.add_argument("source", metavar="SOURCE", help="the tool's output file (or folder)")
    p.add_argument("--out", required=True, metavar="LOGS_URI",
                   help="the logs root: a folder or s3://bucket/prefix (dt=YYYY-MM-DD/ partitions are written)")
    p.add_argument("--policy-from", metavar="SELECTOR", help="what names the policy (default: the format's)")
    p.add_argument("--prompt-from", metavar="SELECTOR",
                   help="what identifies the prompt (default: the format's; else a hash of the prompt text)")
    p.add_argument("--judge-from", metavar="SELECTOR",
                   help="the judge score, e.g. score:NAME (default: the one score the source marks as a judge's)")
    p.add_argument("--label-from", metavar="SELECTOR",
                   help="the human label, e.g. score:NAME (default: the one score the source marks as a person's)")
    p.add_argument("--json", action="store_true", help="print the import report as one JSON document")
    p.set_defaults(handler=cmd_import)


def cmd_import(ns: argparse.Namespace) -> int:
    """``cje import``: map a tool's output and write it to the logs root; returns the exit code."""
    from flows.integrations.importers import ImportMapping, get, import_source
    from flows.storage.objects import Storage
    from flows.uris import check_uri

    importer = get(ns.format)
    mapping = ImportMapping.build(importer, policy_from=ns.policy_from, prompt_from=ns.prompt_from,
                                  judge_from=ns.judge_from, label_from=ns.label_from)
    st = Storage.for_uri(check_uri(ns.out, "--out"))
    report = import_source(importer, ns.source, st, mapping)
    hint = report.scale_hint()
    next_cmd = f"cje evaluate {ns.out} --out OUT" + (f" {hint}" if hint else "")
    if ns.json:
        from flows.cli.terminal import json_doc

        out_json(json_doc("import", out=st.url(), next=next_cmd, **report.to_dict()))
    else:
        for line in report.lines():
            out(escape(line))
        out(f"next: {escape(next_cmd)}")
    return EXIT_OK

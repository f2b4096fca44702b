"""The `cje` command line.

    cje evaluate INPUT --out DIR [options]   engine only (no Prefect, no Ray)
    cje demo [--data ./cje-data]             the README's main job, on embedded defaults
    cje run NAME [--config evaluations.yaml] run one declared evaluation now
    cje serve [--config evaluations.yaml]    deploy the declared evaluations and run their schedules

Exit codes: 0 success, 2 bad input (`CJEInputError`, message on stderr, no traceback),
1 any other failure.

Embedded defaults: without ``PREFECT_API_URL`` the Prefect commands start one local
Prefect API server for their lifetime (see `flows.runtime.prefect_server`); without ``RAY_ADDRESS`` the
flow starts a local Ray; local folders need no storage settings.  At scale set
``PREFECT_API_URL``, ``RAY_ADDRESS`` and an S3 endpoint (``AWS_ENDPOINT_URL``), nothing else.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from cje_engine.errors import CJEInputError

log = logging.getLogger("cje")

from flows.cli.exits import EXIT_BAD_INPUT, EXIT_OK

#: Command modules: each exposes ``register(subparsers)``, adding its sub-command(s) with
#: ``set_defaults(handler=fn)`` where ``fn(namespace) -> int`` returns the exit code.
COMMAND_MODULES: tuple[str, ...] = ()


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """Options mirroring `cje_engine.evaluate` keywords (unset ones keep engine defaults)."""
    g = p.add_argument_group("engine options (default: the engine's)")
    g.add_argument("--covariates", type=_csv, help="comma-separated covariate columns, e.g. response_length")
    g.add_argument("--n-bootstrap", type=int, help="bootstrap replicates (engine default 2000)")
    g.add_argument("--alpha", type=float, help="1 - confidence level (default 0.05)")
    g.add_argument("--audit-margin", type=float, help="transport audit margin as a fraction of the label scale (default 0.05)")
    g.add_argument("--seed", type=int, help="random seed (default 0)")
    g.add_argument("--calibration-policies", type=_csv,
                   help="comma-separated policies whose labels train the calibrator")
    g.add_argument("--calibration-mode", choices=["auto", "monotone", "two_stage"])
    g.add_argument("--inference", choices=["bootstrap", "analytic"])
    g.add_argument("--label-scale", help="declared oracle label scale, e.g. 0-1, 1-10, 0-100")
    g.add_argument("--score-scale", help="declared judge score scale, e.g. 0-1, 1-10, 0-100")
    g.add_argument("--multiplicity", choices=["bh", "holm"])


_ENGINE_KEYS = ("covariates", "n_bootstrap", "alpha", "audit_margin", "seed", "calibration_policies",
                "calibration_mode", "inference", "label_scale", "score_scale", "multiplicity")


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords given on the command line."""
    return {k: getattr(ns, k) for k in _ENGINE_KEYS if getattr(ns, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cje", description="Causal Judge Evaluation service.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("evaluate", help="evaluate a file or folder with the engine (no Prefect/Ray)")
    p.add_argument("input", help="Parquet file/folder, JSONL, CSV, or an arena-style folder")
    p.add_argument("--out", required=True, help="output folder (result.json is written there)")
    p.add_argument("--policies", type=_csv, help="only these policies")
    p.add_argument("--mode", choices=["direct", "logs-only", "hybrid"], default="direct",
                   help="direct (fresh draws, default), logs-only or hybrid (logged responses with "
                        "log-probabilities; see docs/offpolicy.md)")
    _add_engine_options(p)

    p = sub.add_parser("demo", help="simulate a week of logs, evaluate them end to end, publish a report")
    p.add_argument("--data", default="cje-data", help="local data folder (default ./cje-data)")
    p.add_argument("--days", type=int, default=7, help="days of logs (default 7)")
    p.add_argument("--prompts-per-day", type=int, default=1000, help="prompts per day (default 1000)")
    p.add_argument("--n-bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("plan", help="label/log allocation for a budget or a target MDE, from a pilot")
    p.add_argument("input", help="a pilot's result.json, or pilot data (anything `cje evaluate` reads)")
    p.add_argument("--out", help="folder for plan.json and plan.svg")
    p.add_argument("--budget", type=float, help="total budget in cost units (default: the pilot's own spend)")
    p.add_argument("--target-mde", type=float, help="minimum detectable effect to reach (label units)")
    p.add_argument("--c-s", type=float, default=1.0, help="cost of one judged response (default 1)")
    p.add_argument("--c-y", type=float, default=16.0, help="cost of one oracle label (default 16)")
    p.add_argument("--target", help="a policy or a difference 'a - b' (default: every pairwise difference)")
    p.add_argument("--power", type=float, default=0.8, help="power for the MDE (default 0.8)")
    _add_engine_options(p)

    p = sub.add_parser("run", help="run one evaluation declared in evaluations.yaml now")
    p.add_argument("name")
    p.add_argument("--config", help="evaluations file (default: evaluations.yaml of the repository)")
    p.add_argument("--as-of", help="reference date of a relative window (default today, UTC)")
    p.add_argument("--window", help="override the declared window")

    p = sub.add_parser("drift", help="run one judge-drift monitor declared in evaluations.yaml now")
    p.add_argument("name")
    p.add_argument("--config", help="evaluations file (default: evaluations.yaml of the repository)")
    p.add_argument("--through", help="last score date considered, YYYY-MM-DD (default today, UTC)")

    p = sub.add_parser("labels", help="ingest returned oracle labels and re-evaluate the windows they touch")
    p.add_argument("file", help="labels: Parquet, CSV or JSONL with response_id, oracle_label[, label_probability]")
    p.add_argument("--evaluation", required=True, help="the declared evaluation whose label store receives them")
    p.add_argument("--config", help="evaluations file (default: evaluations.yaml of the repository)")
    p.add_argument("--no-reevaluate", action="store_true", help="only ingest; do not re-run the evaluations")

    p = sub.add_parser("serve", help="deploy the declared evaluations and drift monitors and run their schedules")
    p.add_argument("--config", help="evaluations file (default: evaluations.yaml of the repository)")
    p.add_argument("--only", type=_csv, help="serve only these evaluations")
    p.add_argument("--no-drift", action="store_true", help="do not serve the declared drift monitors")
    p.add_argument("--limit", type=int, help="most flow runs at once")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "botocore", "urllib3", "asyncio", "numba"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_evaluate(ns: argparse.Namespace) -> int:
    """Engine only: write DIR/result.json and print the table."""
    from cje_engine import evaluate

    from flows.reports.evaluation import format_table, render_report

    kwargs = engine_kwargs(ns)
    if ns.policies:
        kwargs["policies"] = ns.policies
    if ns.mode == "direct":
        res = evaluate(ns.input, **kwargs)
    else:
        from cje_engine.pipeline.offpolicy import evaluate_offpolicy

        if "policies" in kwargs:
            kwargs["targets"] = kwargs.pop("policies")
        res = evaluate_offpolicy(ns.input, mode=ns.mode, **kwargs)
    d = res.to_dict()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".result.json.tmp"
    tmp.write_text(json.dumps(d, indent=2, allow_nan=False))
    os.replace(tmp, out / "result.json")
    (out / "report.html").write_text(render_report(d, title=f"CJE evaluation of {Path(ns.input).name}"))
    sys.stdout.write(format_table(d).rstrip("\n") + "\n")
    sys.stdout.write(f"result: {out / 'result.json'}\nreport: {out / 'report.html'}\n")
    return EXIT_OK


def cmd_plan(ns: argparse.Namespace) -> int:
    """Budget planner: from a pilot result.json or pilot data, print the plan; optionally write it."""
    from cje_engine.planning.planner import plan_from_data, plan_from_result, render_plan_svg, render_plan_text

    common = dict(budget=ns.budget, target_mde=ns.target_mde, c_S=ns.c_s, c_Y=ns.c_y, target=ns.target,
                  power=ns.power)
    src = Path(ns.input)
    if src.is_file() and src.suffix == ".json":
        try:
            result = json.loads(src.read_text())
        except json.JSONDecodeError as exc:
            raise CJEInputError(f"not a result.json: {exc}", source=str(src)) from None
        plan = plan_from_result(result, **common)
    else:
        opts = engine_kwargs(ns)
        opts.pop("n_bootstrap", None)
        opts.pop("inference", None)
        plan = plan_from_data(ns.input, **common, **opts)
    sys.stdout.write(render_plan_text(plan).rstrip("\n") + "\n")
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(plan, indent=2, allow_nan=False))
        (out / "plan.svg").write_text(render_plan_svg(plan))
        sys.stdout.write(f"plan: {out / 'plan.json'}\nplot: {out / 'plan.svg'}\n")
    return EXIT_OK


def _print_run(summary: dict) -> None:
    from flows.reports.evaluation import format_table

    sys.stdout.write(format_table(summary["result"]).rstrip("\n") + "\n")
    state = "published" if summary.get("published") else f"not published ({summary.get('reason')})"
    sys.stdout.write(f"evaluation {summary['evaluation']} window {summary['window']} run {summary['run_key']}: "
                     f"{state}\n")
    if summary.get("report"):
        sys.stdout.write(f"report: {summary['report']}\n")


def _spec(config: str | None, name: str):
    from flows.runtime.schedules import load_evaluations

    specs = load_evaluations(config)
    if name not in specs:
        raise CJEInputError(f"no evaluation named {name!r}; declared: {', '.join(sorted(specs))}",
                            source=str(config or "evaluations.yaml"))
    return specs[name]


def cmd_run(ns: argparse.Namespace) -> int:
    """Run one declared evaluation now, with its notifications and automatic label requests."""
    from flows.label_requests.requests import evaluate_and_audit
    from flows.runtime.prefect_server import prefect_api

    params = _spec(ns.config, ns.name).flow_parameters()
    params.update({k: v for k, v in {"as_of": ns.as_of, "window": ns.window}.items() if v is not None})
    with prefect_api():
        summary = evaluate_and_audit(**params)
    _print_run(summary)
    _print_requests(summary)
    return EXIT_OK


def _print_requests(summary: dict) -> None:
    for req in summary.get("label_requests") or []:
        sys.stdout.write(f"label request {req.get('request_id')}: {req.get('n_labels')} label(s) for "
                         f"{req.get('scope')} ({', '.join(r.get('trigger', '') for r in req.get('reasons', []))})\n")


def cmd_drift(ns: argparse.Namespace) -> int:
    from flows.pipelines.drift import format_summary, run_drift
    from flows.runtime.prefect_server import prefect_api

    with prefect_api():
        summary = run_drift(ns.name, ns.config, through=ns.through)
    sys.stdout.write(format_summary(summary).rstrip("\n") + "\n")
    return EXIT_OK


def cmd_labels(ns: argparse.Namespace) -> int:
    from flows.pipelines.labels import labels
    from flows.runtime.prefect_server import prefect_api

    spec = _spec(ns.config, ns.evaluation)
    with prefect_api():
        out = labels(ns.file, labels_uri=spec.labels_uri or spec.logs_uri, logs_uri=spec.logs_uri,
                     results_uri=spec.results_uri, evaluations_file=ns.config,
                     reevaluate=not ns.no_reevaluate)
    sys.stdout.write(f"ingested {out['rows']} label(s) from {out['source']}: label-store version {out['version']} "
                     f"({'new' if out['new'] else 'already stored'}, {len(out['conflicts'])} conflict(s))\n")
    for ev in out["reevaluations"]:
        sys.stdout.write(f"re-evaluated {ev.get('evaluation')} {ev.get('window')}: "
                         f"{'published ' + str(ev.get('run_key')) if ev.get('published') else ev.get('reason')}\n")
    return EXIT_OK


def cmd_serve(ns: argparse.Namespace) -> int:
    from flows.runtime import ray_fanout as ray_runtime
    from flows.runtime.schedules import load_evaluations, serve
    from flows.runtime.prefect_server import prefect_api

    specs = load_evaluations(ns.config)
    if ns.only:
        unknown = [n for n in ns.only if n not in specs]
        if unknown:
            raise CJEInputError(f"no evaluation named {unknown[0]!r}; declared: {', '.join(sorted(specs))}")
        specs = {n: specs[n] for n in ns.only}
    # Flow runs execute in subprocesses: they must find this code.
    paths = [str(ray_runtime.CODE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # An embedded server schedules new deployments within seconds instead of a minute.
    extra = []
    if not ns.no_drift:
        from flows.pipelines.drift import drift_deployments

        extra = drift_deployments(ns.config)
    with prefect_api(extra_env={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}):
        serve(specs, limit=ns.limit, extra_deployments=extra)
    return EXIT_OK


def cmd_demo(ns: argparse.Namespace) -> int:
    from flows.cli.demo import run_demo

    summary = run_demo(Path(ns.data), days=ns.days, prompts_per_day=ns.prompts_per_day,
                       n_bootstrap=ns.n_bootstrap, seed=ns.seed)
    _print_run(summary)
    _print_requests(summary)
    if summary.get("drift"):
        from flows.pipelines.drift import format_summary

        sys.stdout.write(format_summary(summary["drift"]).rstrip("\n") + "\n")
    if summary.get("report"):
        sys.stdout.write(f"\nThe published report: {summary['report']}\n")
    return EXIT_OK


COMMANDS = {"evaluate": cmd_evaluate, "plan": cmd_plan, "run": cmd_run, "drift": cmd_drift, "labels": cmd_labels,
            "serve": cmd_serve, "demo": cmd_demo}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cje` console script; returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    _setup_logging(ns.verbose)
    try:
        handler = getattr(ns, "handler", None) or COMMANDS[ns.command]
        return handler(ns)
    except CJEInputError as exc:
        sys.stderr.write(f"cje {ns.command}: error: {exc}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `cje` command line (reference: docs/cli.md, generated from this parser).

    cje evaluate INPUT --out DIR [options]   engine only (no Prefect, no Ray)
    cje plan INPUT [--target-mde 0.02]       labels and responses to buy next, from a pilot
    cje gate RESULT --baseline NAME --fail-if EXPR    a CI gate on a result.json
    cje demo [--data ./cje-data]             the README's main job, on embedded defaults
    cje run NAME                             run one declared evaluation now
    cje drift NAME                           run one declared drift monitor now
    cje serve                                deploy the declared evaluations and run their schedules
    cje anchors create | add-scores | list   anchor sets for the drift monitors

Global options, before or after the sub-command: ``-v`` (debug logging, tracebacks), ``-q``
(warnings only, no progress), ``--version``. Commands that print a table take ``--json`` (one
JSON document on stdout; logs on stderr). The evaluations file is ``--config``, else
``$CJE_CONFIG``, else ``./evaluations.yaml``; the path in use is printed on stderr.
Exit codes: `flows.cli.exits` (0 ok, 1 a gate failed, 2 bad input, 64 usage, 69 a service
unavailable, 70 internal error).

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
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from cje_engine.calibration import registry as calibration_modes
from cje_engine.errors import CJEInputError
from cje_engine.options import LEVEL_ESTIMATORS, LOOKS

from flows.cli import terminal
from flows.cli.common import (CONFIG_HELP, check_columns, check_out_dir, config_columns, declared_evaluations,
                              find_config, find_drift_monitor, find_evaluation, load_input, parse_columns,
                              result_problems, write_atomic)
from flows.cli.exits import (EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK,
                             EXIT_UNAVAILABLE, EXIT_USAGE, ServiceUnavailable)
from flows.cli.hints import message_of
from flows.cli.terminal import err, json_doc, out, out_json, progress

log = logging.getLogger("cje")

#: Command modules: each exposes ``register(subparsers)``, adding its sub-command(s) with
#: ``set_defaults(handler=fn)`` where ``fn(namespace) -> int`` returns the exit code.
COMMAND_MODULES: tuple[str, ...] = (
    "flows.cli.commands.gate",
    "flows.cli.commands.anchors",
    "flows.cli.commands.requests",
    "flows.cli.commands.labels",
    "flows.cli.commands.deploy",
    "flows.cli.commands.ui",
    "flows.cli.commands.monitor",
    "flows.cli.commands.imports",
)

#: Version of the ``--json`` documents (docs/cli.md); fields are only ever added within a version.


def version_string() -> str:
    """``cje <service version> (engine <engine version>)`` for ``cje --version``."""
    from cje_engine import __version__ as engine

    try:
        from importlib.metadata import version

        service = version("cje-service")
    except Exception:  # noqa: BLE001 - not installed: running from the source tree
        service = "source tree"
    return f"cje {service} (engine {engine})"


class CommandParser(argparse.ArgumentParser):
    """argparse with the global ``-v``/``-q`` on every (sub-)parser, no abbreviated options
    (``allow_abbrev=False``) and exit code 64 on usage errors.

    Sub-parsers created through ``subparsers.add_parser`` (also by the modules of
    `COMMAND_MODULES`) are of this class, so ``-v``/``-q`` work before or after any sub-command.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False  # `--n-boot` is a usage error, not --n-bootstrap
        super().__init__(*args, **kwargs)
        g = self.add_argument_group("global options")
        # SUPPRESS: a sub-parser leaves the value of the main parser alone unless given.
        g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="debug logging and tracebacks")
        g.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="warnings and errors only, no progress display")

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print the usage and the escaped message on stderr and exit with the usage code (64)."""
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {terminal.escape(message)}\n")
        raise SystemExit(EXIT_USAGE)


def add_json(p: argparse.ArgumentParser) -> None:
    """``--json``: one JSON document on stdout instead of the table (docs/cli.md has the shapes)."""
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the table "
                   "(shape in docs/cli.md); logs stay on stderr")


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
    g.add_argument("--calibration-mode", choices=calibration_modes.option_values())
    g.add_argument("--inference", choices=["bootstrap", "analytic"])
    g.add_argument("--level-estimator", choices=list(LEVEL_ESTIMATORS),
                   help="verified (default: each policy's level corrected by its own labels, power-tuned; "
                        "policies without enough labels only assume transport), audited (the paper's protocol: "
                        "the plug-in where the transport audit holds), robust, augmented or plug_in")
    g.add_argument("--trust-transport", type=_csv, metavar="POLICY,...",
                   help="policies whose assumes-transport level you trust as their reported level ('*': all)")
    g.add_argument("--baseline", help="compare every policy with this one (simultaneous intervals, "
                                      "non-inferiority)")
    g.add_argument("--noninferiority-margin", type=float,
                   help="non-inferiority margin against --baseline, a fraction of the label scale (default 0.02)")
    g.add_argument("--min-prompts", type=int, help="fewest prompts a policy needs for a level (default 10)")
    g.add_argument("--looks", choices=list(LOOKS),
                   help="one (default): claims hold for this evaluation looked at once; repeated: they hold at "
                        "every look, so you may re-evaluate after each round of labels and stop when a claim is made")
    g.add_argument("--planned-labels", type=int, metavar="N",
                   help="with --looks repeated: own labels per policy, fixed before the first look, where the "
                        "intervals are tightest (default 200)")
    g.add_argument("--label-scale", help="declared oracle label scale, e.g. 0-1, 1-5, 1-10, 0-100")
    g.add_argument("--score-scale", help="declared judge score scale, e.g. 0-1, 1-10, 0-100")
    g.add_argument("--multiplicity", choices=["bh", "holm"])
    g.add_argument("--segment-by", action="append", metavar="COL", dest="segment_by",
                   help="segment the evaluation by this column (repeatable: their combinations); prints the "
                        "segment table (docs/segments.md)")
    g.add_argument("--segment-min-rows", type=int, help="fewest rows of each policy for a segment of its own (default 50)")
    g.add_argument("--segment-min-labels", type=int, help="fewest labels for a segment of its own (default 20)")
    g.add_argument("--segment-claims", choices=["bh", "holm"], help="error control of segment claims (default bh)")


def _add_columns(p: argparse.ArgumentParser) -> None:
    p.add_argument("--columns", type=parse_columns, metavar="CANONICAL=SOURCE,...",
                   help="map your column names to the canonical ones, e.g. "
                        "prompt_id=id,policy=model,oracle_label=human_rating (default: the top-level "
                        "'columns:' of the evaluations file, if one is found)")
    p.add_argument("--config", help="evaluations file whose 'columns:' mapping applies (default: $CJE_CONFIG, "
                                    "else ./evaluations.yaml if present)")


_ENGINE_KEYS = ("covariates", "n_bootstrap", "alpha", "audit_margin", "seed", "calibration_policies",
                "calibration_mode", "inference", "level_estimator", "label_scale", "score_scale", "multiplicity",
                "trust_transport", "baseline", "noninferiority_margin", "min_prompts", "segment_by", "segment_min_rows",
                "segment_min_labels", "segment_claims", "looks", "planned_labels")
_CONFIG_HELP = CONFIG_HELP


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords given on the command line (whole-number options checked here)."""
    kw = {k: getattr(ns, k) for k in _ENGINE_KEYS if getattr(ns, k, None) is not None}
    if kw.get("seed") is not None and kw["seed"] < 0:
        raise CJEInputError(f"--seed must be a whole number >= 0, got {kw['seed']}", column="seed")
    if kw.get("n_bootstrap") is not None and kw["n_bootstrap"] < 1:
        raise CJEInputError(f"--n-bootstrap must be a whole number >= 1, got {kw['n_bootstrap']}",
                            column="n_bootstrap")
    return kw


def _add_builtin_commands(sub: Any) -> None:
    p = sub.add_parser("evaluate", help="evaluate a file or folder with the engine (no Prefect/Ray)",
                       description="Evaluate a file or folder with the engine only; write DIR/result.json and "
                                   "DIR/report.html and print the table. Exit 1 when an audit failed or a level "
                                   "was refused (unless --exit-zero).")
    p.add_argument("input", help="Parquet file/folder, JSONL, CSV, an arena folder or its fresh_draws/ folder")
    p.add_argument("--out", required=True, help="output folder (result.json, report.html and terms.npz, the "
                                                 "replicates and influence terms, are written there)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier result in --out")
    p.add_argument("--policies", type=_csv, help="only these policies")
    p.add_argument("--mode", choices=["direct", "logs-only", "hybrid"], default="direct",
                   help="direct (fresh draws, default), logs-only or hybrid (logged responses with "
                        "log-probabilities; see docs/offpolicy.md)")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when an audit failed or a level was refused")
    _add_columns(p)
    add_json(p)
    _add_engine_options(p)
    p.set_defaults(handler=cmd_evaluate)

    p = sub.add_parser("demo", help="simulate a week of logs, evaluate them end to end, publish a report")
    p.add_argument("--data", default="cje-data", help="local data folder (default ./cje-data)")
    p.add_argument("--days", type=int, default=7, help="days of logs (default 7)")
    p.add_argument("--prompts-per-day", type=int, default=1000, help="prompts per day (default 1000)")
    p.add_argument("--n-bootstrap", type=int, default=2000, help="bootstrap replicates (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    add_json(p)
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser("plan", help="label/log allocation for a target MDE or a budget, from a pilot",
                       description="Plan the next evaluation from a pilot: by default the cheapest design whose "
                                   "minimum detectable effect is --target-mde (default 0.02 of the label scale's "
                                   "width, e.g. 0.08 label units on 1-5) for the pairs you care about "
                                   "(--target, or every pair the pilot has not already resolved).")
    p.add_argument("input", nargs="?",
                   help="a pilot's result.json, or pilot data (anything `cje evaluate` reads); or use --evaluation")
    p.add_argument("--evaluation", metavar="NAME",
                   help="plan from a published run of this declared evaluation instead of INPUT")
    p.add_argument("--run", metavar="RUN",
                   help="with --evaluation: run key, prefix or window label (default: the newest publication)")
    p.add_argument("--out", help="folder for plan.json and plan.svg")
    p.add_argument("--budget", type=float, help="total budget in cost units (plans for the budget instead of an MDE)")
    p.add_argument("--target-mde", type=float,
                   help="minimum detectable effect to reach, in label units (default unless --budget: 0.02 of "
                        "the label scale's width, i.e. 0.02 on 0-1, 0.08 on 1-5, 2 on 0-100)")
    p.add_argument("--c-s", type=float, default=1.0, help="cost of one judged response (default 1)")
    p.add_argument("--c-y", type=float, default=16.0, help="cost of one oracle label (default 16)")
    p.add_argument("--target", action="append", metavar="TARGET",
                   help="a policy or a difference 'a - b' (spaces optional; repeat or separate by commas for "
                        "several; default: every pair not already resolved in the pilot)")
    p.add_argument("--power", type=float, default=0.8, help="power for the MDE (default 0.8)")
    _add_columns(p)
    add_json(p)
    _add_engine_options(p)
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("run", help="run one evaluation declared in the evaluations file now",
                       description="Check the inputs (logs layout, columns, covariates), then run the declared "
                                   "evaluation with Prefect and Ray and publish it. Exit 1 when an audit failed or "
                                   "a level was refused (unless --exit-zero).")
    p.add_argument("name")
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--as-of", help="reference date of a relative window (default today, UTC)")
    p.add_argument("--window", help="override the declared window")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when an audit failed or a level was refused")
    add_json(p)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("drift", help="run one judge-drift monitor declared in the evaluations file now",
                       description="Run one declared judge-drift monitor now: score and test the new looks, "
                                   "publish its report. Exit 1 when the monitor is in alarm (a look of this run or "
                                   "an earlier one alarmed; unless --exit-zero).")
    p.add_argument("name")
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--through", help="last score date considered, YYYY-MM-DD (default today, UTC)")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when the monitor is in alarm")
    add_json(p)
    p.set_defaults(handler=cmd_drift)

    p = sub.add_parser("serve", help="deploy the declared evaluations and drift monitors and run their schedules")
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--only", type=_csv, help="serve only these evaluations")
    p.add_argument("--no-drift", action="store_true", help="do not serve the declared drift monitors")
    p.add_argument("--limit", type=int, help="most flow runs at once")
    p.set_defaults(handler=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    """The ``cje`` argument parser with the built-in commands and those of `COMMAND_MODULES`."""
    parser = CommandParser(prog="cje", description="Causal Judge Evaluation service.",
                           epilog="Exit codes: 0 ok, 1 a gate failed, 2 bad input, 64 usage error, "
                                  "69 service unavailable, 70 internal error (docs/cli.md).")
    parser.add_argument("--version", action="version", version=version_string())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    _add_builtin_commands(sub)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


class StderrHandler(logging.StreamHandler):
    """Logs to the current ``sys.stderr`` (looked up at each record, so a replaced stream is followed).

    Its name must not start with ``_``: Prefect keeps the root handlers only when they look like the
    user's (`prefect.logging.configuration.setup_logging`).
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        """The current ``sys.stderr`` (looked up at each write, so a replaced stderr is followed)."""
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class QuietRunErrors(logging.Filter):
    """``-q``: one line per error.  The errors Prefect logs for a failing flow or task run (its exception with
    the traceback, then "Finished in state Failed") are left out of the terminal: the command reports the
    error itself, once, as one line with its exit code (they still reach the Prefect API's run logs).  Errors
    the flows log themselves (a failed label-request step of a published run) stay."""

    RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a flow- or task-run error that carries an exception, or a run's final failed state."""
        if record.levelno < logging.ERROR or not record.name.startswith(self.RUN_LOGGERS):
            return True
        return not (record.exc_info or str(record.msg).startswith("Finished in state"))


class QuietFormatter(logging.Formatter):
    """``-q``: a warning or error logged with its exception is one line, without the traceback (``-v`` shows it)."""

    def formatException(self, ei) -> str:  # noqa: N802 - logging's API
        """Nothing: no traceback under ``-q``."""
        return ""

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's API
        """Nothing: no stack under ``-q``."""
        return ""


#: Prefect's loggers with a level of their own (`prefect/logging/logging.yml`); the flow- and task-run
#: loggers inherit the level of ``prefect``.
PREFECT_LOGGERS = ("prefect", "prefect.extra", "prefect.client", "prefect.infrastructure")


def _setup_logging(verbose: bool, quiet: bool) -> Callable[[], None]:
    """Log to stderr at DEBUG (``-v``), WARNING (``-q``, Prefect included) or INFO; returns the undo of
    the Prefect settings (`_quiet_prefect`)."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    handler = StderrHandler()
    if quiet and not verbose:
        handler.addFilter(QuietRunErrors())
        handler.setFormatter(QuietFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "botocore", "urllib3", "asyncio", "numba"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return _quiet_prefect() if quiet else (lambda: None)


def _quiet_prefect() -> Callable[[], None]:
    """``-q``: Prefect logs warnings and errors only, in this process (``PREFECT_LOGGING_LEVEL``, read
    when Prefect is first imported; the loggers themselves when it already is) and in the flow-run
    and server processes started from it (they inherit the environment). Prefect's INFO lines then
    reach neither the terminal nor the Prefect API's flow-run logs. Returns the undo."""
    env = os.environ.get("PREFECT_LOGGING_LEVEL")
    levels = {name: logging.getLogger(name).level for name in PREFECT_LOGGERS}
    os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    for name in PREFECT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    def restore() -> None:
        if env is None:
            os.environ.pop("PREFECT_LOGGING_LEVEL", None)
        else:
            os.environ["PREFECT_LOGGING_LEVEL"] = env
        for name, lvl in levels.items():
            logging.getLogger(name).setLevel(lvl)

    return restore


# ------------------------------------------------------------------------------ evaluate


def _columns(ns: argparse.Namespace) -> dict[str, str]:
    """``--columns``, else the top-level ``columns:`` of the evaluations file found."""
    if ns.columns:
        return check_columns(ns.columns)
    return config_columns(find_config(ns.config, required=bool(ns.config)))


def _bootstrap(prep: Any) -> list:
    """Bootstrap replicates in chunks, with a progress bar (replicates depend on (seed, b) only,
    so the chunks give the numbers of one call)."""
    from cje_engine.pipeline.direct import bootstrap_chunk

    if prep.options.inference != "bootstrap":
        return []
    B = int(prep.options.n_bootstrap)
    step = max(1, B // 50)
    chunks = []
    with progress("bootstrap", total=B) as bar:
        for start in range(0, B, step):
            stop = min(B, start + step)
            chunks.append(bootstrap_chunk(prep, start, stop, with_segments=True))  # segment cells in the same pass
            bar.advance(stop - start)
    return chunks


def _evaluate_direct(ns: argparse.Namespace, opts: Any) -> Any:
    """Read the input with the options' scales and covariates, then prepare/bootstrap/finalize with ``opts``
    (the `EvaluationOptions` parsed from the flags, passed as they are)."""
    from cje_engine.pipeline.direct import finalize, prepare

    columns = _columns(ns)
    from cje_engine.pipeline.segments import segment_error

    with progress(f"reading {ns.input}"):
        try:
            frame = load_input(ns.input, columns, label_scale=opts.label_scale,
                               score_scale=opts.score_scale if opts.score_scale is not None else "none",
                               covariates=opts.covariates, policies=list(opts.policies) if opts.policies else None,
                               **({"keep_columns": list(opts.segment_by)} if opts.segment_by else {}))
        except CJEInputError as exc:
            raise segment_error(exc, opts.segment_by) from None
    with progress("calibrating"):
        prep = prepare(frame, opts)
    return finalize(prep, _bootstrap(prep))


def cmd_evaluate(ns: argparse.Namespace) -> int:
    """Engine only: write DIR/result.json, DIR/report.html and DIR/terms.npz (the replicates and influence
    terms behind the result's accessors) and print the table."""
    from flows.reports.evaluation import render_report
    from flows.reports.table import format_segment_table, format_table

    kwargs = engine_kwargs(ns)
    if ns.policies:
        kwargs["policies"] = ns.policies
    opts = _check_options(ns.mode, kwargs)  # parsed once; bad options: exit 2 before any output or data
    out_dir = check_out_dir(ns.out, overwrite=ns.overwrite)
    if ns.mode == "direct":
        res = _evaluate_direct(ns, opts)
    else:
        from cje_engine.pipeline.offpolicy import evaluate_offpolicy

        if ns.columns:
            raise CJEInputError("--columns applies to --mode direct; logged data must use the canonical names "
                                "(docs/offpolicy.md)")
        with progress(f"evaluating {ns.input} ({ns.mode})"):
            res = evaluate_offpolicy(ns.input, options=opts)
    d = res.to_dict()
    result_path, report_path = out_dir / "result.json", out_dir / "report.html"
    write_atomic(result_path, json.dumps(d, indent=2, allow_nan=False))
    write_atomic(report_path, render_report(d, title=f"CJE evaluation of {Path(ns.input).name}"))
    res.save_terms(out_dir / "terms.npz")  # replicates and influence terms: EvaluationResult.load(result.json)
    problems = result_problems(d)
    if ns.json:
        out_json(json_doc("evaluate", result_path=str(result_path), report_path=str(report_path),
                          problems=problems, result=d))
    else:
        out(format_table(d))
        if d.get("segments"):
            out(format_segment_table(d))
        out(f"result: {result_path}\nreport: {report_path}")
    return _problems_exit(problems, ns.exit_zero)


def _check_options(mode: str, kwargs: dict[str, Any]) -> Any:
    """The engine options of the flags parsed once (`EvaluationOptions` / `OffPolicyOptions`, ``--policies``
    naming the candidates off-policy); `CJEInputError` on a bad one."""
    from cje_engine.options import EvaluationOptions
    from cje_engine.pipeline.offpolicy_options import OffPolicyOptions

    if mode == "direct":
        return EvaluationOptions.build(**kwargs)
    opts = dict(kwargs)
    if "policies" in opts:
        opts["targets"] = opts.pop("policies")
    return OffPolicyOptions.build(mode=mode, **opts)


def _problems_exit(problems: list[str], exit_zero: bool, what: str = "an audit failed or a level was refused") -> int:
    for p in problems:
        err(f"cje: {p}")
    if problems and not exit_zero:
        err(f"cje: exit code 1 ({what}; --exit-zero to exit 0)")
        return EXIT_GATE_FAILED
    return EXIT_OK


# ------------------------------------------------------------------------------ plan


def cmd_plan(ns: argparse.Namespace) -> int:
    """Budget planner: from a pilot result.json or pilot data, print the plan; optionally write it."""
    from cje_engine.planning.planner import plan_from_data, plan_from_result

    targets = [t for arg in (ns.target or []) for t in _csv(arg)] or None
    # no --target-mde nor --budget: the planner's default, 0.02 of the label scale's width (in label units)
    common = dict(budget=ns.budget, target_mde=ns.target_mde, c_S=ns.c_s, c_Y=ns.c_y, targets=targets, power=ns.power)
    out_dir = check_out_dir(ns.out, overwrite=True, files=()) if ns.out else None
    if (ns.input is None) == (ns.evaluation is None):
        raise CJEInputError("give either INPUT (a result.json or pilot data) or --evaluation NAME, not both",
                            column="INPUT")
    if ns.run is not None and ns.evaluation is None:
        raise CJEInputError("--run needs --evaluation", column="--run")
    if ns.evaluation is not None:
        from flows.cli.commands.monitor import published_result

        with progress(f"reading the published result of {ns.evaluation}"):
            run = published_result(ns.evaluation, ns.config, ns.run)
        plan = plan_from_result(run["result"], **common)
        plan["published_run"] = {"evaluation": ns.evaluation, "window": run["window"], "run_key": run["run_key"],
                          "result_json": run["result_json"]}
        return _write_plan(ns, plan, out_dir)
    src = Path(ns.input)
    if src.is_file() and src.suffix == ".json":
        try:
            result = json.loads(src.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CJEInputError(f"not a result.json: {exc}", source=str(src)) from None
        plan = plan_from_result(result, **common)
    else:
        opts = engine_kwargs(ns)
        opts.pop("n_bootstrap", None)
        opts.pop("inference", None)
        columns = _columns(ns)
        with progress(f"reading {ns.input}"):
            frame = load_input(ns.input, columns, label_scale=opts.get("label_scale"),
                               score_scale=opts.get("score_scale"), covariates=opts.get("covariates") or ())
        with progress("planning"):
            plan = plan_from_data(frame, **common, **opts)
    return _write_plan(ns, plan, out_dir)


def _write_plan(ns: argparse.Namespace, plan: dict, out_dir: Path | None) -> int:
    """Print a plan (text or ``--json``) and write plan.json/plan.svg into ``--out``."""
    from flows.reports.plan import render_plan_svg, render_plan_text

    paths = {}
    if out_dir is not None:
        paths = {"plan_path": str(out_dir / "plan.json"), "plot_path": str(out_dir / "plan.svg")}
        write_atomic(out_dir / "plan.json", json.dumps(plan, indent=2, allow_nan=False))
        write_atomic(out_dir / "plan.svg", render_plan_svg(plan))
    if ns.json:
        out_json(json_doc("plan", plan=plan, **paths))
    else:
        src = plan.get("published_run")
        if src:
            out(f"Pilot: {src['evaluation']}, window {src['window']}, run {src['run_key']} ({src['result_json']})")
        out(render_plan_text(plan))
        if paths:
            out(f"plan: {paths['plan_path']}\nplot: {paths['plot_path']}")
    return EXIT_OK


# ------------------------------------------------------------------------------ service mode


def _run_doc(summary: dict) -> dict:
    keep = ("evaluation", "window", "run_key", "published", "reason", "path", "report", "label_requests",
            "label_requests_error", "timings", "result")
    return {k: summary.get(k) for k in keep if k in summary}


def _print_run(summary: dict) -> None:
    from flows.reports.table import format_table

    out(format_table(summary["result"]))
    state = "published" if summary.get("published") else f"not published ({summary.get('reason')})"
    out(f"evaluation {summary['evaluation']} window {summary['window']} run {summary['run_key']}: {state}")
    if summary.get("report"):
        out(f"report: {summary['report']}")


def _spec(config: str | None, name: str):
    return find_evaluation(name, config)[1]


def check_prefect_api(url: str, timeout: float = 5.0) -> None:
    """Raise `ServiceUnavailable` unless the configured Prefect API answers ``/health``."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=timeout)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise ServiceUnavailable(f"the Prefect API at PREFECT_API_URL={url} does not answer ({type(exc).__name__}: "
                                 f"{exc}); start it, or unset PREFECT_API_URL to use an embedded server") from None


def _services(extra_env: dict | None = None):
    """The Prefect API (embedded or ``PREFECT_API_URL``, checked first); failure is exit 69."""
    from flows.runtime.prefect_server import prefect_api

    if os.environ.get("PREFECT_API_URL"):
        check_prefect_api(os.environ["PREFECT_API_URL"])
    return _Unavailable(prefect_api(extra_env=extra_env) if extra_env else prefect_api(), "Prefect API")


class _Unavailable:
    """Turn a failure to enter a service context into `ServiceUnavailable` (exit 69)."""

    def __init__(self, cm: Any, what: str) -> None:
        self.cm, self.what = cm, what

    def __enter__(self) -> Any:
        try:
            return self.cm.__enter__()
        except (RuntimeError, OSError, TimeoutError) as exc:
            raise ServiceUnavailable(f"{self.what} unavailable: {str(exc).splitlines()[0] if str(exc) else exc}") \
                from exc

    def __exit__(self, *exc: Any) -> Any:
        return self.cm.__exit__(*exc)


def cmd_run(ns: argparse.Namespace) -> int:
    """Check the inputs, then run one declared evaluation now (notifications, label requests)."""
    from flows.pipelines.preflight import check_evaluation

    path, spec = find_evaluation(ns.name, ns.config)
    params = spec.flow_parameters()
    params.update({k: v for k, v in {"as_of": ns.as_of, "window": ns.window}.items() if v is not None})
    check_evaluation(params, str(path))  # before Prefect and Ray start
    from flows.pipelines.audit import evaluate_and_audit

    with _services(), progress(f"evaluation {ns.name}: running the flow (Prefect + Ray)"):
        summary = evaluate_and_audit(**params)
    problems = result_problems(summary.get("result") or {})
    if ns.json:
        out_json(json_doc("run", problems=problems, **_run_doc(summary)))
    else:
        _print_run(summary)
        _print_requests(summary)
    return _problems_exit(problems, ns.exit_zero)


def _print_requests(summary: dict) -> None:
    for req in summary.get("label_requests") or []:
        out(f"label request {req.get('request_id')}: {req.get('n_labels')} label(s) for "
            f"{req.get('scope')} ({', '.join(r.get('trigger', '') for r in req.get('reasons', []))})")


def cmd_drift(ns: argparse.Namespace) -> int:
    """``cje drift NAME``: run one look of a declared drift monitor; returns the exit code."""
    from flows.pipelines.drift import format_summary, run_drift

    path, _ = find_drift_monitor(ns.name, ns.config)  # a bad name fails before Prefect starts
    with _services(), progress(f"drift monitor {ns.name}"):
        summary = run_drift(ns.name, path, through=ns.through)
    if ns.json:
        out_json(json_doc("drift", summary=summary))
    else:
        out(format_summary(summary))
    return _problems_exit(drift_problems(summary), ns.exit_zero, "the drift monitor is in alarm")


def drift_problems(summary: dict) -> list[str]:
    """The reasons for exit code 1 of `cje drift`: the monitor is in alarm, by a look of this run or an
    earlier one (an alarm stays until the reference is reset, docs/drift.md)."""
    first = {m: v for m, v in (summary.get("first_alarm") or {}).items() if v is not None}
    if not summary.get("alarm") and not first:
        return []
    since = ", ".join(f"{m} since look {v}" for m, v in first.items()) or ", ".join(summary.get("alarms") or [])
    return [f"drift monitor {summary.get('monitor')!r} is in alarm ({since})"]


def cmd_serve(ns: argparse.Namespace) -> int:
    """``cje serve``: check and deploy the declared evaluations (and drift monitors) and run their schedules; returns the exit code."""
    from flows.runtime import ray_fanout as ray_runtime
    from flows.runtime.schedules import serve

    config, specs = declared_evaluations(ns.config, ns.only)
    from flows.pipelines.preflight import check_evaluation

    for spec in specs.values():
        check_evaluation(spec.flow_parameters(), str(config))
    # Flow runs execute in subprocesses: they must find this code.
    paths = [str(ray_runtime.CODE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    from flows.pipelines.deployments import drift_deployments, evaluation_deployments

    drifts = [] if ns.no_drift else drift_deployments(config)
    # An embedded server schedules new deployments within seconds instead of a minute.
    with _services({"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}):
        serve(evaluation_deployments(specs.values()) + drifts, limit=ns.limit)
    return EXIT_OK


def cmd_demo(ns: argparse.Namespace) -> int:
    """``cje demo``: simulate logs, evaluate and publish them in a local folder; returns the exit code."""
    from flows.cli.demo import run_demo

    with progress("demo: simulating, evaluating and publishing"):
        summary = run_demo(Path(ns.data), days=ns.days, prompts_per_day=ns.prompts_per_day,
                           n_bootstrap=ns.n_bootstrap, seed=ns.seed)
    if ns.json:
        out_json(json_doc("demo", **_run_doc(summary), drift=summary.get("drift")))
        return EXIT_OK
    _print_run(summary)
    _print_requests(summary)
    if summary.get("drift"):
        from flows.pipelines.drift import format_summary

        out(format_summary(summary["drift"]))
    if summary.get("report"):
        out(f"\nThe published report: {summary['report']}")
    return EXIT_OK


# ------------------------------------------------------------------------------ dispatch


def exit_code_of(exc: BaseException) -> int:
    """The exit code for an exception escaping a command."""
    if isinstance(exc, (CJEInputError, UnicodeDecodeError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, ServiceUnavailable):
        return EXIT_UNAVAILABLE
    text = str(exc)
    if isinstance(exc, RuntimeError) and text.startswith("Failed to reach API"):  # Prefect's client
        return EXIT_UNAVAILABLE
    if "node timed out during startup" in text or "Failed to connect to GCS" in text:  # Ray could not start
        return EXIT_UNAVAILABLE
    names = {c.__module__ + "." + c.__name__ for c in type(exc).__mro__}
    if names & {"flows.storage.objects.StorageError", "httpx.ConnectError", "httpx.ConnectTimeout",
                "prefect.exceptions.PrefectHTTPStatusError"} or isinstance(exc, (ConnectionError, TimeoutError)):
        return EXIT_UNAVAILABLE  # a timeout: a remote call (storage, Ray) or a run past its limit
    return EXIT_INTERNAL


#: The ``error.kind`` of the ``--json`` error document, per exit code.
ERROR_KINDS = {EXIT_BAD_INPUT: "bad input", EXIT_USAGE: "usage error", EXIT_UNAVAILABLE: "service unavailable",
               EXIT_INTERNAL: "internal error", EXIT_INTERRUPTED: "interrupted"}


def command_name(ns: argparse.Namespace | None, argv: Sequence[str] = ()) -> str:
    """``run``, ``requests status``, ``anchors create``: the command as the ``--json`` documents name it."""
    if ns is None:  # a usage error: the first word that names a command, if any
        words = [a for a in argv if not a.startswith("-")]
        return words[0] if words else "cje"
    sub = getattr(ns, "requests_command", None) or getattr(ns, "anchors_command", None)
    return f"{ns.command} {sub}" if sub else str(getattr(ns, "command", "cje"))


def json_error(command: str, code: int, lines: Sequence[str]) -> None:
    """``--json``: the error as one JSON document on stdout (the envelope of every document, with
    ``error``: ``exit_code``, ``kind``, ``message`` (the first line) and ``problems`` (every line))."""
    lines = [str(x) for x in lines] or ["error"]
    out_json(json_doc(command, error={"exit_code": code, "kind": ERROR_KINDS.get(code, "error"),
                                      "message": lines[0], "problems": lines}))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cje` console script; returns the exit code."""
    from flows.storage.arrow_threads import install_exit_wait

    install_exit_wait()  # every command: no Arrow worker may outlive the interpreter (exit code 134)
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # --help / --version (0) or a usage error (64)
        code = int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
        if code and "--json" in args:
            json_error(command_name(None, args), code, ["the command line is wrong; see the usage on stderr"])
        return code
    verbose, quiet = getattr(ns, "verbose", False), getattr(ns, "quiet", False)
    restore = _setup_logging(verbose, quiet)
    terminal.enable_progress(not quiet and not getattr(ns, "json", False))
    try:
        return _dispatch(ns, verbose)
    finally:
        restore()  # a caller in the same process (tests, notebooks) gets Prefect's logging back


def _dispatch(ns: argparse.Namespace, verbose: bool) -> int:
    """Run the command's handler; every failure becomes one line (and a JSON document) and an exit code."""
    command = getattr(ns, "command", "?")
    as_json = bool(getattr(ns, "json", False))
    try:
        return int(ns.handler(ns))
    except KeyboardInterrupt:
        err("interrupted")
        if as_json:
            json_error(command_name(ns), EXIT_INTERRUPTED, ["interrupted"])
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        code = exit_code_of(exc)
        context = "yaml" if command in ("run", "serve", "drift", "labels") else "cli"
        if isinstance(exc, UnicodeDecodeError):  # a reader met another encoding
            text = (f"the input is not UTF-8 text ({exc.encoding} cannot decode byte {exc.start}: {exc.reason}); "
                    "save it as UTF-8")
        elif code == EXIT_BAD_INPUT:
            text = message_of(exc, context=context)
        else:
            text = str(exc) or type(exc).__name__
        if verbose:
            traceback.print_exc(file=sys.stderr)
        lines = text.strip().splitlines() or [type(exc).__name__]
        if code != EXIT_BAD_INPUT:  # every problem of an input is listed; other failures: one line
            lines = lines[:1]
        kind = {EXIT_UNAVAILABLE: "service unavailable: ", EXIT_INTERNAL: f"internal error ({type(exc).__name__}): "
                }.get(code, "")
        more = "" if verbose or code == EXIT_BAD_INPUT else " (run with -v for the traceback)"
        err(f"cje {command}: error: {kind}{lines[0]}{more}")
        for line in lines[1:]:
            err(f"  {line}")
        if as_json:
            json_error(command_name(ns), code, [kind + lines[0], *lines[1:]])
        return code


if __name__ == "__main__":
    sys.exit(main())

"""docs/cli.md, generated from the parser: ``python -m flows.cli.docs --write`` (or ``--check``).

`tests/cli/test_cli_docs.py` fails when the committed file differs from what the parser gives,
so the reference cannot drift from the code.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from flows.cli.exits import EXIT_CODES

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
_WIDTH = "100"

INTRO = """\
# The `cje` command line

Generated from the parser by `python -m flows.cli.docs --write`; a test fails when this file and the
parser disagree. Every command also answers `cje COMMAND --help`.

## Conventions

* **Global options** work before or after the sub-command: `-v`/`--verbose` (debug logging, and the
  traceback of an unexpected error), `-q`/`--quiet` (warnings and errors only, no progress display, no
  `config:` line; Prefect's own INFO lines are silenced too, through `PREFECT_LOGGING_LEVEL=WARNING`, so
  the flow runs of a `-q` command keep no INFO logs in the Prefect UI either), `--version`. Options are
  never abbreviated: `--n-boot` is a usage error (exit 64), not `--n-bootstrap`.
* **Output.** Tables and results go to stdout; logs, progress and errors go to stderr. `--json` (on every
  command that prints a table) prints one JSON document on stdout instead (shapes below). Progress bars
  (reads, bootstrap, flows) appear only when stdout and stderr are terminals, and never with `-q` or `--json`.
* **Errors** are one line on stderr, `cje COMMAND: error: ...`, naming the file or object key, column and
  row; an input with several problems lists them all, one per line. Hints name the flag
  (`--score-scale 1-10`, `--columns oracle_label=human_rating`), or for `cje run` the key of the
  evaluations file. No traceback unless `-v`. With `--json`, an error is also one JSON document on stdout
  (below), so stdout is never empty.
* **Terminal safety.** Everything the CLI prints passes through `flows.cli.terminal.escape`: control
  characters (newlines inside names, ANSI escape sequences) and Unicode bidirectional controls (U+202E...)
  in user strings are shown as visible escapes (`\\n`, `\\x1b`, `\\u202e`).
* **The evaluations file** is `--config FILE`, else `$CJE_CONFIG`, else `./evaluations.yaml` in the current
  folder, for every command (`run`, `drift`, `serve`, `deploy`, `runs`, `diff`, `plan`, `evaluate`,
  `requests`, `labels`, `anchors --monitor`); never the repository's own file. Every command that reads it
  prints one line on stderr, `config: PATH (from --config|$CJE_CONFIG|./evaluations.yaml)` (not with `-q`),
  and an unknown evaluation or drift monitor is an error naming the file, the closest declared name and the
  declared ones (exit 2). Its top-level `columns:`
  mapping (e.g. `columns: {prompt_id: id, policy: model}`) is the default of `--columns` for
  `cje evaluate` and `cje plan`, and of every evaluation's own `columns:` for `cje run` and `cje serve`
  (merged key by key; docs/logs-layout.md).
* **Column mapping.** `--columns CANONICAL=SOURCE,...` renames your columns to the canonical ones
  (`prompt_id`, `policy`, `judge_score`, `oracle_label`, `label_probability`, `response_id`, `response`,
  `draw_idx`), e.g. `--columns prompt_id=id,policy=model,oracle_label=human_rating`.
* **`cje evaluate --out DIR`** checks before computing that DIR is (or can become) a writable folder and
  holds no earlier result (`--overwrite` replaces one); files are written through a temporary file and
  a rename, and no temporary file is left after a failed write. They get the mode of published files
  (0644 under the usual umask 022), not a temporary file's 0600.
* **Service mode** (`cje run`, `cje serve`) checks its inputs before starting Prefect and Ray: the logs
  layout (docs/logs-layout.md), the first partition's columns (every partition's, when the evaluation
  maps its columns), the covariates (`response_length` is derived from the `response` text, as in
  `cje evaluate`) and every partition's `judge_score` and inline `oracle_label` values against the
  declared `score_scale` and `label_scale` (the one-line error of `cje evaluate`, exit 2).
"""

JSON_SHAPES = """\
## `--json` documents

Every document is one JSON object with `cje_json` (the version of these shapes, `1`; fields are only
ever added within a version) and `command`, plus:

| command | fields |
|---|---|
| `evaluate` | `result_path`, `report_path`, `problems` (list of str: failed audits and refused levels, the reasons for exit code 1), `result` (the result, docs/result-schema.md) |
| `plan` | `plan` (the plan, docs/planner.md), and with `--out` `plan_path`, `plot_path` |
| `gate` | `result_path`, `result_verified` (bool: checked against the manifest of its published run; false for a bare result), `baseline`, `passed` (bool), `checks`: list of {`rule` (fail-if, pass-if), `expression`, `candidate`, `failed`, `reason`, `diff`, `se`, `p_value`, `p_adjusted`} |
| `run` | `evaluation`, `window`, `run_key`, `published`, `reason`, `path`, `report`, `label_requests`, `timings`, `result`, `problems` |
| `demo` | the fields of `run`, plus `drift` (the drift monitor's summary) |
| `drift` | `summary` (the drift flow's summary: `monitor`, `set_name`, `new_looks`, `n_looks`, `alarm`, `first_alarm`, `report`, ...); exit 1 when the monitor is in alarm |
| `runs` | `evaluation`, `results_uri`, `runs`: list (oldest first) of {`window`, `run_key`, `published_at`, `policies`, `best_policy`, `superseded`, `regression_alarms`, ...} |
| `diff` | `evaluation`, `a`, `b` ({`window`, `run_key`, `published_at`}), `changes`, `intervals` (per policy {`diff`, `se`, `ci`}) |
| `requests list` | `requests`: list of {`request_id`, `status`, `evaluation`, `window`, `scope`, `triggers`, `requested`, `received`, `rows`, `rows_received`, `anchors`, `anchors_received`, `created_at`, `deadline`} |
| `requests show` | the request's manifest fields, plus `progress` (as in `requests list`) |
| `requests status` | `requests`, `requested`, `received` (labels, each request once), `by_status`, `by_reasons` (per set of triggers, `audit_failed+thin_support`: each request once, so they add up), `by_reason` (per trigger: a request counts under each of its triggers), `items` |
| any, on an error | `error`: {`exit_code`, `kind` (bad input, usage error, service unavailable, internal error, interrupted), `message` (the first line), `problems` (every line)} |
| `anchors create` | `set`, `version`, `new`, `n_anchors`, `n_labelled`, `content_sha256`, `uri` |
| `anchors add-scores` | `set`, `rows`, `keys` |
| `anchors list` | `store`, `sets`: list of {`set`, `versions`, `latest`, `n_anchors`, `n_labelled`, `created_at`, `score_days`, `first_score_day`, `last_score_day`} |

The JSON is ASCII-only (non-ASCII characters are `\\u` escapes) and never holds NaN (`null` instead).
"""


def exit_codes_md() -> str:
    """The markdown table of the CLI's exit codes (docs/cli.md)."""
    rows = "\n".join(f"| {code} | {name} | {meaning} |" for code, name, meaning in EXIT_CODES)
    return f"## Exit codes\n\n| code | meaning | when |\n|---|---|---|\n{rows}\n"


@contextlib.contextmanager
def _fixed_width() -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _WIDTH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of sub-parsers
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return list(action.choices.items())
    return []


def _sections(parser: argparse.ArgumentParser, level: int = 2) -> list[str]:
    out = []
    for name, sub in _subcommands(parser):
        out.append(f"{'#' * level} `{sub.prog}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
        out += _sections(sub, level + 1)
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The text of docs/cli.md for ``parser`` (default: the `cje` parser)."""
    from flows.cli.main import build_parser

    with _fixed_width():
        parser = parser or build_parser()
        parts = [INTRO, exit_codes_md(), JSON_SHAPES, "## Commands\n",
                 f"```text\n{parser.format_help().rstrip()}\n```\n", *_sections(parser)]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.cli.docs [--write | --check]``: print, write or check docs/cli.md; returns the exit code."""
    args = argv if argv is not None else sys.argv[1:]
    text = render()
    if "--write" in args:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}")
        return 0
    if "--check" in args:
        same = DOC_PATH.is_file() and DOC_PATH.read_text(encoding="utf-8") == text
        print(f"{DOC_PATH} is {'up to date' if same else 'out of date: run python -m flows.cli.docs --write'}")
        return 0 if same else 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

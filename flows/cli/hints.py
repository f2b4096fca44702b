"""Error messages in the words of the command line.

The engine's hints name Python keywords (``score_scale='1-10'``,
``columns={'oracle_label': 'human_rating'}``) and may say which keyword they are about in
``CJEInputError.option``. The CLI prints the flag instead (``--score-scale 1-10``,
``--columns oracle_label=human_rating``), and for `cje run` the key of ``evaluations.yaml``.
"""
from __future__ import annotations

import ast
import re
from typing import Any

#: Python keyword -> command-line flag, for the options the CLI exposes.
FLAGS: dict[str, str] = {
    "covariates": "--covariates", "n_bootstrap": "--n-bootstrap", "alpha": "--alpha",
    "audit_margin": "--audit-margin", "seed": "--seed", "calibration_policies": "--calibration-policies",
    "calibration_mode": "--calibration-mode", "inference": "--inference", "level_estimator": "--level-estimator", "label_scale": "--label-scale",
    "score_scale": "--score-scale", "multiplicity": "--multiplicity", "policies": "--policies",
    "columns": "--columns", "budget": "--budget", "target_mde": "--target-mde", "target": "--target",
    "c_S": "--c-s", "c_Y": "--c-y", "power": "--power", "trust_transport": "--trust-transport",
    "baseline": "--baseline", "noninferiority_margin": "--noninferiority-margin", "min_prompts": "--min-prompts",
    "segment_by": "--segment-by", "segment_min_rows": "--segment-min-rows", "segment_min_labels": "--segment-min-labels",
    "segment_claims": "--segment-claims",
}

_VALUE = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\{[^}]*\}|\([^)]*\)|[\w.+\-]+)"""


def _flag_value(key: str, literal: str) -> str:
    try:
        value: Any = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        value = literal
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if key.endswith("scale") and len(value) == 2:
            return f"{value[0]:g}-{value[1]:g}" if all(isinstance(v, (int, float)) for v in value) else "-".join(
                map(str, value))
        return ",".join(map(str, value))
    return str(value)


def cli_hint(message: str, option: str | None = None, *, context: str = "cli") -> str:
    """Rewrite ``keyword=value`` hints in ``message`` as flags (``context="cli"``) or as
    ``evaluations.yaml`` keys (``context="yaml"``).

    ``option`` (from ``CJEInputError.option``) names the keyword a hint refers to; keywords of
    other options the CLI knows are rewritten too.
    """
    keys = set(FLAGS) | ({option} if option else set())
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(sorted(map(re.escape, keys), key=len, reverse=True)) + r")="
                         + _VALUE)

    def repl(m: re.Match) -> str:
        key, literal = m.group(1), m.group(2)
        value = _flag_value(key, literal)
        if context == "yaml":
            where = key if key in ("columns", "policies") else f"options.{key}"
            return f"{where}: {value}"
        flag = FLAGS.get(key, "--" + key.replace("_", "-"))
        return f"{flag} {value}"

    return pattern.sub(repl, message)


def message_of(exc: BaseException, *, context: str = "cli") -> str:
    """The one-line message of an input error, with its hints in CLI (or YAML) terms."""
    return cli_hint(str(exc), getattr(exc, "option", None), context=context)

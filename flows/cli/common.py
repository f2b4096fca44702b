"""Pieces shared by the `cje` sub-commands: column mapping, config discovery, output folders,
atomic writes and the audit/refusal status of a result."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from cje_engine.data.io import check_mapping
from cje_engine.errors import CJEInputError

from flows.cli.terminal import err
from flows.config import DEFAULT_FILE, pick_declared, read_yaml
from flows.storage.logs import SERVICE_COLUMNS

CONFIG_ENV = "CJE_CONFIG"
CONFIG_NAME = DEFAULT_FILE.name  # "evaluations.yaml": the one name of the evaluations file
#: ``--config`` help of every command that reads the evaluations file.
CONFIG_HELP = "evaluations file (default: $CJE_CONFIG, else ./evaluations.yaml of the current folder)"


# ------------------------------------------------------------------------------ column mapping


def parse_columns(text: str) -> dict[str, str]:
    """``"prompt_id=id,policy=model"`` -> ``{"prompt_id": "id", "policy": "model"}`` (canonical = source).

    Raises ``argparse.ArgumentTypeError`` (a usage error) on a malformed mapping.
    """
    out: dict[str, str] = {}
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        canonical, sep, source = (s.strip() for s in item.partition("="))
        if not sep or not canonical or not source:
            raise argparse.ArgumentTypeError(f"expected CANONICAL=SOURCE pairs separated by commas "
                                             f"(e.g. prompt_id=id,policy=model), got {item!r}")
        if canonical in out:
            raise argparse.ArgumentTypeError(f"column {canonical!r} is mapped twice")
        out[canonical] = source
    if not out:
        raise argparse.ArgumentTypeError("empty column mapping")
    return out


def check_columns(columns: Any, source: str = "--columns") -> dict[str, str]:
    """Validate a mapping canonical -> source column (``--columns``): the engine's rule
    (`cje_engine.data.io.check_mapping`, did-you-mean hints, no column mapped twice)."""
    if columns is None:
        return {}
    try:
        return check_mapping(columns)
    except CJEInputError as exc:
        raise CJEInputError(exc.detail, source=source, column="columns", option="columns") from None


def load_input(source: Any, columns: Mapping[str, str] | None, **options: Any):
    """The canonical frame of ``source`` with the column mapping applied (`load_frame`).

    ``options``: ``label_scale``, ``score_scale``, ``covariates``, ``policies`` (unset ones keep
    the engine's defaults).
    """
    from cje_engine.data.io import load_frame

    kw = {k: v for k, v in options.items() if v is not None}
    return load_frame(source, columns=dict(columns) if columns else None, **kw)


# ------------------------------------------------------------------------------ configuration


def find_config(given: str | os.PathLike | None, *, required: bool = True, quiet: bool = False) -> Path | None:
    """The evaluations file in use: ``--config``, else ``$CJE_CONFIG``, else ``./evaluations.yaml``.

    The one rule of every command (never the repository's own file). The path (and where it came
    from) is printed on stderr as one line ``config: PATH (from ...)``, unless ``quiet`` or ``-q``
    (the ``cje`` logger is not enabled for INFO). Without ``required`` a missing
    ``./evaluations.yaml`` gives ``None``.
    """
    if given:
        path, how = Path(given), "--config"
    elif os.environ.get(CONFIG_ENV):
        path, how = Path(os.environ[CONFIG_ENV]), f"${CONFIG_ENV}"
    else:
        path, how = Path.cwd() / CONFIG_NAME, f"./{CONFIG_NAME}"
        if not path.is_file() and not required:
            return None
    if not path.is_file():
        raise CJEInputError(f"evaluations file not found (from {how}); give --config FILE, set {CONFIG_ENV}, or "
                            f"create ./{CONFIG_NAME} in the current folder", source=str(path))
    path = path.resolve()
    if not quiet and logging.getLogger("cje").isEnabledFor(logging.INFO):
        err(f"config: {path} (from {how})")
    return path


def declared_evaluations(config: str | os.PathLike | None, only: Sequence[str] | None = None, *,
                         quiet: bool = False) -> tuple[Path, dict[str, Any]]:
    """The evaluations file in use (`find_config`) and its checked evaluations (all, or ``only``
    these: an unknown name is a `CJEInputError` naming the file)."""
    from flows.runtime.schedules import load_evaluations  # imports Prefect: `cje --help` should not pay for it

    path = find_config(config, quiet=quiet)
    specs = load_evaluations(path)
    if only:
        specs = {n: pick_declared(n, specs, what="evaluation", source=path) for n in only}
    return path, specs


def find_evaluation(name: str, config: str | os.PathLike | None, *, quiet: bool = False) -> tuple[Path, Any]:
    """(the evaluations file in use, the `EvaluationSpec` named ``name``); an unknown name is a
    `CJEInputError` naming the file, the closest declared name and the declared ones (`pick_declared`).

    The one lookup of a declared evaluation by name for every command (``quiet``: the file was named on
    stderr already)."""
    path, specs = declared_evaluations(config, quiet=quiet)
    return path, pick_declared(name, specs, what="evaluation", source=path)


def find_drift_monitor(name: str, config: str | os.PathLike | None) -> tuple[Path, Any]:
    """(the evaluations file in use, the declared drift monitor named ``name``); errors as
    `find_evaluation`."""
    from flows.pipelines.drift_config import find_drift_monitor as declared_monitor

    path = find_config(config)
    return path, declared_monitor(name, path)


def config_columns(path: Path | None) -> dict[str, str]:
    """The top-level ``columns:`` mapping of an evaluations file (empty without one), checked by
    `flows.config.read_yaml`; ``ts`` (a service log column the engine does not read) is left out."""
    if path is None:
        return {}
    _, doc = read_yaml(path)
    return {k: v for k, v in (doc.get("columns") or {}).items() if k not in SERVICE_COLUMNS}


# ------------------------------------------------------------------------------ output folders


RESULT_FILES = ("result.json", "report.html", "terms.npz")


def check_out_dir(path: str | os.PathLike, *, overwrite: bool, files: tuple[str, ...] = RESULT_FILES) -> Path:
    """Check, before any work, that ``path`` is (or can become) a writable folder without an
    earlier result (unless ``overwrite``). Creates the folder."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CJEInputError("--out must be a folder, but this is a file", source=str(out))
    earlier = [f for f in files if (out / f).exists()]
    if earlier and not overwrite:
        raise CJEInputError(f"holds an earlier result ({', '.join(earlier)}); give --overwrite to replace it or "
                            f"choose another --out folder", source=str(out))
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".cje-write-test-"):
            pass
    except OSError as exc:
        raise CJEInputError(f"--out folder is not writable ({exc.strerror or exc})", source=str(out)) from None
    return out


def _file_mode() -> int:
    """The mode of a file created with ``open()`` (0o666 less the umask; 0o644 under the usual 022),
    as the published files of local storage have it."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename;
    the temporary file never outlives a failure. The file gets the mode of a published file
    (`_file_mode`: 0644), not the 0600 of a temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), _file_mode())
            fh.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise CJEInputError(f"cannot write the file ({exc.strerror or exc})", source=str(path)) from None
        raise


def write_new_file(path: Path, data: bytes, *, force: bool = False, flag: str = "--force") -> None:
    """Write ``data`` to ``path`` without ever writing through a symbolic link or, unless ``force``,
    replacing an existing file.

    The bytes go to a temporary file in the same folder, which is then hard-linked to ``path``
    (fails if ``path`` appeared meanwhile: nothing is replaced) or, with ``force``, renamed over it
    (a rename replaces the name, never the target of a link).  The temporary file never outlives a
    failure.

    Raises
    ------
    CJEInputError
        ``path`` is a symbolic link, a folder, exists (without ``force``), or cannot be written.
    """
    path = Path(path)
    if path.is_symlink():
        raise CJEInputError("is a symbolic link; refusing to write through it (give a plain file path)",
                            source=str(path))
    if path.is_dir():
        raise CJEInputError("is a folder; give a file path", source=str(path))
    if path.exists() and not force:
        raise CJEInputError(f"exists already; give {flag} to replace it or choose another file", source=str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise CJEInputError(f"cannot write the file ({exc.strerror or exc})", source=str(path)) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # create-only: fails if the name appeared meanwhile
            os.unlink(tmp)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, FileExistsError):
            raise CJEInputError(f"exists already; give {flag} to replace it or choose another file",
                                source=str(path)) from None
        if isinstance(exc, OSError):
            raise CJEInputError(f"cannot write the file ({exc.strerror or exc})", source=str(path)) from None
        raise


# ------------------------------------------------------------------------------ result status


def result_problems(result: Mapping[str, Any]) -> list[str]:
    """Plain-language reasons for exit code 1: failed audits and refused levels."""
    problems = []
    for name, p in (result.get("policies") or {}).items():
        audit = (p.get("audit") or {}).get("verdict")
        if audit == "fail":
            problems.append(f"audit failed for {name!r}")
        if p.get("level_claim") == "refused":
            reasons = "; ".join(p.get("refusal_reasons") or []) or "no reason given"
            problems.append(f"level of {name!r} refused ({reasons})")
    return problems

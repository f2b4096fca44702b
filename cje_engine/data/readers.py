"""Readers: files, folders and in-memory tables -> one pandas frame per input, ids as text.

Used by `cje_engine.data.io.load_frame`, which validates and joins what these return.

* Identifier columns (``prompt_id``, ``response_id``, ``policy``, ``anchor_id``, or the source
  columns a ``columns=`` mapping names for them) are read as **text** in every format, never
  type-guessed: ``00001`` in a CSV stays ``"00001"``; a JSON number keeps all its digits
  (``12345678901234567890`` does not become a float); typed Parquet / pandas / Arrow ids become
  their decimal text (``17`` and ``17.0`` -> ``"17"``).
* JSON Lines are parsed line by line: a bad line, a line that is not an object, or an object
  with a repeated key is an error naming the file, line and key.
* Text files must be UTF-8; anything else is an error naming the line of the first undecodable
  byte, with a hint. A CSV whose header holds semicolons or tabs gets a delimiter hint.
* A folder is a Parquet dataset (recursive, hive partitions allowed; CSV or JSONL files inside
  it are an error naming them), the arena layout (``fresh_draws/`` and optional
  ``probe_slice/``), or a folder of ``<policy>_responses.jsonl`` files (the arena's
  ``fresh_draws/`` folder itself).
"""
from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from cje_engine.data.frame import POLICY, PROMPT, RESPONSE_ID
from cje_engine.errors import CJEInputError

PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIXES = (".csv",)
SUPPORTED_SUFFIXES = PARQUET_SUFFIXES + JSONL_SUFFIXES + CSV_SUFFIXES

FRESH_DIR, PROBE_DIR = "fresh_draws", "probe_slice"
FRESH_SUFFIX, PROBE_SUFFIX = "_responses", "_probe"

#: Identifier columns: always text, whatever the format.
ID_COLUMNS = (PROMPT, RESPONSE_ID, POLICY, "anchor_id")


@dataclass
class Part:
    """One input (file or in-memory table) before and after normalisation."""

    name: str
    frame: pd.DataFrame
    policy: str | None = None  # from the file name (arena layout)
    probe: bool = False
    owned: bool = True  # the frame was made here (read or converted), not handed in by the caller


def collect(source: Any, id_columns: Collection[str] = ID_COLUMNS) -> list[Part]:
    """Turn ``source`` (path, table or a list of them) into parts, one per file / table, in order."""
    if isinstance(source, (list, tuple)):
        parts: list[Part] = []
        for i, item in enumerate(source):
            if isinstance(item, (list, tuple)):
                raise CJEInputError(f"source #{i} is a nested list; give a flat list of sources")
            parts.extend(_collect_one(item, i, id_columns))
        return parts
    return _collect_one(source, None, id_columns)


def _collect_one(item: Any, index: int | None, ids: Collection[str]) -> list[Part]:
    tag = "" if index is None else f" #{index}"
    if isinstance(item, pd.DataFrame):
        return [Part(f"<DataFrame{tag}>", item, owned=False)]
    if isinstance(item, pa.Table):
        return [Part(f"<pyarrow.Table{tag}>", _arrow_to_pandas(item, ids))]
    if isinstance(item, (str, os.PathLike)):
        return _read_path(Path(item), ids)
    raise CJEInputError(
        f"unsupported source{tag} of type {type(item).__name__}: expected a path, "
        "a pandas DataFrame, a pyarrow Table, or a list of these"
    )


def _arrow_to_pandas(table: pa.Table, ids: Collection[str], own: bool = False) -> pd.DataFrame:
    """Arrow -> pandas keeping integer ids exact (an int column with nulls would become float).

    ``own``: the table was read here and is not used afterwards, so its buffers are released
    column by column during the conversion (lower peak memory for large files).
    """
    int_ids = {col: pd.Series(table.column(col).to_pylist(), dtype=object) for col in ids
               if col in table.column_names and pa.types.is_integer(table.schema.field(col).type)}
    df = table.to_pandas(self_destruct=True, split_blocks=True) if own else table.to_pandas()
    del table
    for col, values in int_ids.items():
        df[col] = values
    return df


def _read_path(path: Path, ids: Collection[str]) -> list[Part]:
    if not path.exists():
        raise CJEInputError("path does not exist", source=str(path))
    if path.is_dir():
        if (path / FRESH_DIR).is_dir():
            return _read_arena(path, ids)
        if _policy_files(path, FRESH_SUFFIX) and not _data_files(path, PARQUET_SUFFIXES):
            return _read_fresh(path, ids)
        return _read_parquet_folder(path, ids)
    return [Part(str(path), read_file(path, ids))]


def read_file(path: Path, id_columns: Collection[str] = ID_COLUMNS) -> pd.DataFrame:
    """One Parquet, JSONL or CSV file as a pandas frame (identifier columns as text)."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path, id_columns)
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, id_columns)
    if suffix in CSV_SUFFIXES:
        return _read_csv(path, id_columns)
    raise CJEInputError(
        f"unsupported file type '{suffix or '(no extension)'}'; supported: "
        + ", ".join(SUPPORTED_SUFFIXES)
        + " or a folder (Parquet files, or the arena layout with fresh_draws/)",
        source=str(path),
    )


def _read_parquet(path: Path, ids: Collection[str]) -> pd.DataFrame:
    import pyarrow.parquet as pq  # optional submodule, loaded on first use

    try:
        table = pq.read_table(path, pre_buffer=False)  # no read-ahead copy of the column chunks
    except (pa.ArrowException, OSError) as exc:
        raise CJEInputError(f"not a readable Parquet file ({exc})", source=str(path)) from None
    df = _arrow_to_pandas(table, ids, own=True)
    pa.default_memory_pool().release_unused()  # the table's buffers, freed during the conversion
    return df


# --------------------------------------------------------------------------------------
# Text formats
# --------------------------------------------------------------------------------------
def _utf8_error(path: Path, header_lines: int) -> CJEInputError | None:
    """The error for a file that is not UTF-8 (None if it decodes)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        byte = data[exc.start]
        guess = "Latin-1 / Windows-1252" if byte >= 0x80 else "another encoding"
        return CJEInputError(
            f"the file is not UTF-8 text: byte 0x{byte:02x} on line {line} cannot be decoded (it looks {guess} "
            "encoded). Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`",
            source=str(path), row=max(line - 1 - header_lines, 0),
        )
    return None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def read_jsonl_records(path: Path) -> list[dict]:
    """Parse a JSONL file line by line.

    A bad line, a line that is not a JSON object, an object with a repeated key, or bytes that
    are not UTF-8 are errors naming the file, the line and the (zero-based) row.
    """
    records = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line, object_pairs_hook=_no_duplicate_keys)
                except _DuplicateKey as exc:
                    raise CJEInputError(
                        f"line {lineno + 1}: key {exc.key!r} appears more than once in the same object; "
                        "each field must be given once", source=str(path), column=exc.key, row=len(records),
                    ) from None
                except json.JSONDecodeError as exc:
                    raise CJEInputError(
                        f"line {lineno + 1} is not valid JSON ({exc.msg}); expected one JSON object per line",
                        source=str(path), row=len(records),
                    ) from None
                if not isinstance(rec, dict):
                    raise CJEInputError(
                        f"line {lineno + 1} holds a {type(rec).__name__}; expected one JSON object per line",
                        source=str(path), row=len(records),
                    )
                records.append(rec)
    except UnicodeDecodeError:
        raise _utf8_error(path, 0) from None  # type: ignore[misc]
    return records


def _id_text(values: list, path: Path, col: str) -> pd.Series:
    """JSON values of an identifier column as text (numbers keep every digit)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        if v is None or isinstance(v, str):
            out[i] = v
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CJEInputError(f"expected an identifier (text or a number), got {v!r}", source=str(path),
                                column=col, row=i)
        elif isinstance(v, int):
            out[i] = str(v)
        elif v == v and v % 1 == 0 and abs(v) < 2**53:
            out[i] = str(int(v))
        else:
            out[i] = repr(v)
    return pd.Series(out, dtype=object)


def _read_jsonl(path: Path, ids: Collection[str]) -> pd.DataFrame:
    if path.stat().st_size == 0:
        raise CJEInputError("file is empty (0 rows)", source=str(path))
    records = read_jsonl_records(path)
    frame = pd.DataFrame.from_records(records)
    for col in ids:
        if col in frame.columns:
            frame[col] = _id_text([r.get(col) for r in records], path, col)
    return frame


_NULLS = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
          "<NA>", "N/A", "NA", "NULL", "NaN", "n/a", "nan", "null"]


def _read_csv(path: Path, ids: Collection[str]) -> pd.DataFrame:
    import pyarrow.csv as pcsv  # optional submodule, loaded on first use

    if path.stat().st_size == 0:
        raise CJEInputError("file is empty (0 rows)", source=str(path))
    convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in ids})
    try:
        table = pcsv.read_csv(path, convert_options=convert)
    except (pa.ArrowException, OSError):
        table = None  # e.g. a non-numeric value deep in a numeric column: let pandas read it as text
    if table is not None and any(pa.types.is_binary(f.type) for f in table.schema):
        err = _utf8_error(path, 1)
        if err is not None:
            raise err
    if table is not None:
        frame = table.to_pandas()
    else:
        err = _utf8_error(path, 1)
        if err is not None:
            raise err
        try:  # everything as text; missing-value markers only outside the identifier columns
            frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        except (ValueError, OSError, pd.errors.ParserError) as exc:
            raise CJEInputError(f"not a readable CSV file ({exc})", source=str(path)) from None
        for col in frame.columns:
            if col not in ids:
                frame[col] = frame[col].where(~frame[col].isin(_NULLS), None)
    if len(frame.columns) == 1:
        header = str(frame.columns[0])
        for sep, name in ((";", "semicolons"), ("\t", "tabs"), ("|", "pipes")):
            if sep in header:
                raise CJEInputError(
                    f"the header has one column {header!r}, which contains {name}: the file looks "
                    f"{name[:-1]}-delimited. CSV input must be comma-separated; re-export it with ',' as the "
                    "delimiter (e.g. pandas `read_csv(path, sep=';').to_csv(out, index=False)`)",
                    source=str(path),
                )
    return frame


# --------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------
#: Path parts starting with these are work folders or hidden files, never data (Hive, Spark, Arrow).
SKIPPED_PREFIXES = ("_", ".")


def is_work_path(relative: str | os.PathLike | Sequence[str]) -> bool:
    """True when a path below a dataset root is a work folder or hidden file, not data.

    The rule of Hive, Spark and Arrow datasets: any part of the path *below the root* that
    starts with ``_`` or ``.`` (``dt=2025-01-01/_temporary/0/part-0.parquet``,
    ``.staging/part-0.parquet``, ``_SUCCESS``, ``.part-0.parquet.crc``) is skipped.  Used by
    the folder reader here and by the object-storage log listing
    (`flows.storage.logs.discover_partitions`), so both read the same files.

    Parameters
    ----------
    relative : str, path or sequence of str
        The path relative to the dataset root: a ``/``-separated key, a `Path`, or its parts.

    Returns
    -------
    bool
    """
    if isinstance(relative, (str, os.PathLike)):
        parts: Sequence[str] = str(os.fspath(relative)).replace(os.sep, "/").split("/")
    else:
        parts = relative
    return any(part.startswith(SKIPPED_PREFIXES) for part in parts if part not in ("", "."))


def _walk_files(folder: Path) -> list[Path]:
    """Every file below ``folder`` (work paths excluded); a folder that cannot be listed or an
    entry that cannot be opened (a dangling or looping symlink) is an error naming it, never
    silently dropped."""

    def fail(exc: OSError) -> None:
        raise CJEInputError(f"cannot list this folder ({exc.strerror or exc})",
                            source=str(exc.filename or folder)) from None

    out = []
    for dirpath, dirnames, filenames in os.walk(folder, onerror=fail):
        rel = Path(dirpath).relative_to(folder)
        dirnames[:] = sorted(d for d in dirnames if not is_work_path(rel / d))
        for name in filenames:
            path = Path(dirpath) / name
            if is_work_path(rel / name):
                continue
            try:
                path.stat()
            except OSError as exc:
                what = "a symbolic link whose target does not exist" if path.is_symlink() else \
                    f"not readable ({exc.strerror or exc})"
                raise CJEInputError(f"is {what}; the data file cannot be read (remove it or fix the link)",
                                    source=str(path)) from None
            out.append(path)
    return out


def _data_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in _walk_files(folder) if p.suffix.lower() in suffixes and p.is_file())


def _read_parquet_folder(folder: Path, ids: Collection[str]) -> list[Part]:
    files = _data_files(folder, PARQUET_SUFFIXES)
    others = _data_files(folder, JSONL_SUFFIXES + CSV_SUFFIXES)
    if others:
        shown = ", ".join(str(p.relative_to(folder)) for p in others[:5]) + (" ..." if len(others) > 5 else "")
        raise CJEInputError(
            f"folder holds {len(others)} CSV/JSONL file(s) ({shown}) "
            + ("beside its Parquet files; a folder input is read as one Parquet dataset, so these would be "
               "ignored. Move them out, or pass the files explicitly as a list" if files else
               f"but no Parquet files; pass the files themselves (or a list of them), or use the arena layout "
               f"({FRESH_DIR}/<policy>{FRESH_SUFFIX}.jsonl)"),
            source=str(folder),
        )
    if not files:
        raise CJEInputError(
            f"folder has no Parquet files ({', '.join(PARQUET_SUFFIXES)}) and no {FRESH_DIR}/ "
            "subfolder (arena layout)",
            source=str(folder),
        )
    parts = []
    for f in files:
        df = _read_parquet(f, ids)
        for key, value in _hive_keys(f.relative_to(folder)).items():
            if key in df.columns:
                same = df[key].astype(str).eq(value)
                if not bool(same.all()):
                    row = int(np.flatnonzero(~same.to_numpy())[0])
                    raise CJEInputError(
                        f"value {df[key].iloc[row]!r} disagrees with the hive partition {key}={value}",
                        source=str(f), column=key, row=row,
                    )
            else:
                df[key] = value
        parts.append(Part(str(f), df))
    return parts


def _hive_keys(relative: Path) -> dict[str, str]:
    keys = {}
    for part in relative.parts[:-1]:
        if "=" in part:
            k, v = part.split("=", 1)
            keys[urllib.parse.unquote(k)] = urllib.parse.unquote(v)
    return keys


def _policy_files(folder: Path, suffix: str) -> list[tuple[str, Path]]:
    out = []
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES and f.stem.endswith(suffix):
            policy = f.stem[: -len(suffix)]
            if policy:
                out.append((policy, f))
    return out


def _read_fresh(folder: Path, ids: Collection[str]) -> list[Part]:
    fresh = _policy_files(folder, FRESH_SUFFIX)
    if not fresh:
        raise CJEInputError(f"no fresh-draw files named <policy>{FRESH_SUFFIX}.jsonl", source=str(folder))
    return [Part(str(f), read_file(f, ids), policy=pol) for pol, f in fresh]


def _read_arena(folder: Path, ids: Collection[str]) -> list[Part]:
    parts = _read_fresh(folder / FRESH_DIR, ids)
    fresh_policies = {p.policy for p in parts}
    if (folder / PROBE_DIR).is_dir():
        for pol, f in _policy_files(folder / PROBE_DIR, PROBE_SUFFIX):
            if pol not in fresh_policies:
                raise CJEInputError(
                    f"probe slice for policy '{pol}' but there is no {FRESH_DIR}/{pol}{FRESH_SUFFIX}.jsonl "
                    "whose rows it could label",
                    source=str(f),
                )
            parts.append(Part(str(f), read_file(f, ids), policy=pol, probe=True))
    return parts

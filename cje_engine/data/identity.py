"""Row identity across inputs: response ids, duplicate rows, probe-slice joins.

Part of `cje_engine.data.io.load_frame` (see its module docstring for the rules): after every
input is normalised, the inputs are concatenated, every row gets a response id, duplicate rows
are refused, and probe slices are joined onto the fresh-draw rows they label.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.data.frame import LABEL, LABEL_PROB, POLICY, PROMPT, RESPONSE_ID, SCORE, FrameCodes
from cje_engine.data.readers import Part
from cje_engine.errors import CJEInputError

logger = logging.getLogger("cje_engine.data.io")

RESPONSE = "response"
DRAW_IDX = "draw_idx"

#: Rows per chunk when building temporary text columns (bounds their memory).
_CHUNK = 1 << 20

# Internal bookkeeping columns (dropped before returning).
SOURCE_KEY, ROW_KEY = "__cje_source", "__cje_row"


def first_value(mask: np.ndarray) -> int:
    """Index of the first True in ``mask``."""
    return int(np.flatnonzero(mask)[0])



def null_str(n: int) -> pd.Series:
    """An all-missing string column of length ``n``."""
    return pa.nulls(n, pa.large_string()).to_pandas()



# --------------------------------------------------------------------------------------
# Cross-input checks
# --------------------------------------------------------------------------------------
def concat_tables(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate frames over the union of their columns (in first-seen order)."""
    if len(frames) == 1:
        return frames[0]
    cols: list[str] = []
    for f in frames:
        cols.extend(c for c in f.columns if c not in cols)
    if RESPONSE in cols:
        frames = [f if RESPONSE in f.columns else f.assign(**{RESPONSE: null_str(len(f))}) for f in frames]
    return pd.concat(frames, ignore_index=True, sort=False)


def _where(frame: pd.DataFrame, i: int, names: list[str]) -> tuple[str, int]:
    return names[int(frame[SOURCE_KEY].iat[i])], int(frame[ROW_KEY].iat[i])


def _codes(values: Any) -> tuple[np.ndarray, int]:
    codes, uniques = pd.factorize(values)
    return codes.astype(np.int64, copy=False), len(uniques)


def _small(codes: np.ndarray, size: int) -> np.ndarray:
    """``codes`` (all < ``size``) in the smallest of int8 / int16 / int32 / int64 that holds them
    (not copied when they already have that type)."""
    for dtype in (np.int8, np.int16, np.int32):
        if size <= np.iinfo(dtype).max:
            return codes.astype(dtype, copy=False)
    return codes.astype(np.int64, copy=False)


def _factorize_text(values: pd.Series) -> tuple[np.ndarray, pd.Index]:
    """``pandas.factorize(values)`` of a text column without missing values: the same codes (order of
    first appearance) and distinct values.

    For a pyarrow-backed column, Arrow's dictionary encoding is used directly and its int32 indices
    are taken as they are (pandas converts them to a copy and then to int64: at 10M rows that is half
    the cost); any other column goes through ``pandas.factorize``.
    """
    dtype = values.dtype
    if isinstance(dtype, pd.StringDtype) and dtype.storage == "pyarrow":
        arr = pa.array(values, from_pandas=True)  # the column's Arrow data (no copy)
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            enc = arr.dictionary_encode()
            enc = enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc
            if enc.indices.null_count == 0:
                uniques = pd.Index(enc.dictionary.to_pandas())
                if uniques.dtype == dtype:
                    return enc.indices.to_numpy(zero_copy_only=True), uniques
    codes, uniques = pd.factorize(values)
    return codes, uniques


def _combine(a: np.ndarray, na: int, b: np.ndarray, nb: int, *, into_b: bool = False) -> tuple[np.ndarray, int]:
    """Injective int64 code of the pair (a, b) given their ranges: ``a * nb + b``.

    ``into_b``: ``b`` (an int64 array the caller owns and drops) receives the code, a chunk of
    rows at a time, so no row-sized array is allocated (the same integers either way).
    """
    if na * nb >= 2**62:  # re-code densely (each code is < n rows) so the product fits
        a, na = _codes(a)
        b, nb = _codes(b)
    if not (into_b and b.dtype == np.int64 and b.flags.writeable):
        b = b.astype(np.int64)
    for lo in range(0, b.shape[0], _CHUNK):
        b[lo:lo + _CHUNK] += np.multiply(a[lo:lo + _CHUNK], nb, dtype=np.int64)  # int64 whatever a's type
    return b, na * nb


def repeated_values(key: np.ndarray, size: int) -> np.ndarray:
    """Mask of rows whose integer key occurs more than once (O(n))."""
    if size <= 4 * len(key) + 1_000_000:
        counts = np.bincount(key, minlength=size)
        return (counts > 1)[key]  # a bool gather, not an int64 one
    return pd.Series(key).duplicated(keep=False).to_numpy()


def _first_pair(keys: pd.DataFrame | pd.Series) -> tuple[int, int]:
    """Positions (earlier, later) of the first repeated key (the caller knows one exists)."""
    frame = keys.to_frame() if isinstance(keys, pd.Series) else keys
    later = first_value(frame.duplicated(keep="first").to_numpy())
    same = np.ones(len(frame), dtype=bool)
    for c in frame.columns:
        col = frame[c]
        v = col.iat[later]
        if pd.isna(v):
            same &= col.isna().to_numpy()
        else:
            same &= (col == v).to_numpy(dtype=bool, na_value=False)
    return first_value(same), later


def _duplicate_error(frame: pd.DataFrame, earlier: int, later: int, what: str, names: list[str]) -> CJEInputError:
    src_e, row_e = _where(frame, earlier, names)
    src_l, row_l = _where(frame, later, names)
    lab = frame[LABEL].to_numpy()
    rid = frame[RESPONSE_ID].iat[later]
    if not (np.isnan(lab[earlier]) and np.isnan(lab[later])):
        msg = (
            f"the same labelled row (response_id {rid!r}) is supplied twice: also row {row_e} of {src_e} "
            f"({what}); it would be counted twice. Supply each row and its label once"
        )
    else:
        msg = f"duplicate row (response_id {rid!r}): same as row {row_e} of {src_e} ({what})"
        if frame[DRAW_IDX].isna().iat[later] and (RESPONSE not in frame.columns or frame[RESPONSE].isna().iat[later]):
            msg += (
                "; rows without response text, draw_idx or response_id are identified by "
                "(prompt_id, policy): add a draw_idx or response_id column for several draws per prompt"
            )
    return CJEInputError(msg, source=src_l, row=row_l)


def identify_rows(frame: pd.DataFrame, names: list[str]) -> FrameCodes:
    """Fill missing response ids and refuse duplicate rows (see the module docstring).

    Fast path: integer codes of (policy, prompt, draw) and of (policy, prompt, k); strings are
    hashed only for rows whose integer key repeats, or when given response ids do not follow the
    canonical ``"{policy}:{prompt_id}:{k}"`` form.

    Returns the prompt and policy codes it computed (`FrameCodes`, in the smallest integer type
    that holds them), for `EvalData.from_frame`: the ids are factorised once per load.
    """
    n = len(frame)
    pol, pol_u = _factorize_text(frame[POLICY])
    pol = _small(pol, len(pol_u))  # a few policies: int8
    pid, pid_u = _factorize_text(frame[PROMPT])
    n_pid, n_pol = len(pid_u), len(pol_u)
    codes = FrameCodes(n, _small(pid, n_pid), pid_u, pol, pol_u)
    pid = pid.astype(np.int64)  # a new, writeable buffer for the pair codes below
    pa.default_memory_pool().release_unused()  # the encodings' hash tables: back to the system now
    pair, n_pair = _combine(pol, n_pol, pid, n_pid, into_b=True)  # pid's buffer: one row-sized int64 code
    del pol, pid
    draw = frame[DRAW_IDX].to_numpy(dtype=np.float64)
    has_draw = ~np.isnan(draw)
    has_text = frame[RESPONSE].notna().to_numpy() if RESPONSE in frame.columns else np.zeros(n, dtype=bool)

    # 1. (prompt, policy, response, draw_idx) must be unique. Only rows whose
    #    (policy, prompt, draw_idx) repeats can repeat the longer key: compare texts there only.
    if has_text.any():
        d_code, n_d = _codes(np.where(has_draw, draw, -1.0))
        base, n_base = _combine(pair, n_pair, d_code, n_d)
        rep = repeated_values(base, n_base)
        if rep.any():
            cols = [PROMPT, POLICY, RESPONSE, DRAW_IDX]
            sub = frame.loc[rep, cols]
            sub_text = sub[RESPONSE].notna().to_numpy()
            sub = sub.loc[sub_text]
            if sub.duplicated().any():
                e, l = _first_pair(sub)
                e, l = int(sub.index[e]), int(sub.index[l])
                raise _duplicate_error(frame, e, l, "same prompt_id, policy, response and draw_idx", names)

    # 2. k: draw_idx, else occurrence number among rows with text, else 0.
    k = np.zeros(n, dtype=np.int64)
    k[has_draw] = draw[has_draw].astype(np.int64)
    by_text = has_text & ~has_draw
    if by_text.any():
        k[by_text] = pd.Series(pair[by_text]).groupby(pair[by_text], sort=False).cumcount().to_numpy()
    given = frame[RESPONSE_ID].notna().to_numpy()
    pol_s, pid_s, rid_s = frame[POLICY], frame[PROMPT], frame[RESPONSE_ID]

    def canon(lo: int, hi: int) -> pa.Array:
        # built a chunk of rows at a time: the full column of canonical ids would be a
        # second copy of every id (~0.3 GB at 10M rows) just to be compared and dropped
        kc = k[lo:hi]
        k_text = (pa.scalar(str(int(kc[0])), pa.large_string()) if kc.size and kc.min() == kc.max()
                  else pc.cast(pa.array(kc), pa.large_string()))  # one k for the chunk (often all 0): a scalar
        return pc.binary_join_element_wise(
            _arrow_str(pol_s.iloc[lo:hi]), _arrow_str(pid_s.iloc[lo:hi]), k_text, pa.scalar(":", pa.large_string()))

    bounds = [(lo, min(lo + _CHUNK, n)) for lo in range(0, n, _CHUNK)]
    if given.all():
        rid = rid_s
    else:
        pieces = [pc.if_else(pa.array(given[lo:hi]), _arrow_str(rid_s.iloc[lo:hi]), canon(lo, hi))
                  for lo, hi in bounds]
        rid = pa.chunked_array(pieces, type=pa.large_string()).to_pandas()
        rid.index = frame.index
        frame[RESPONSE_ID] = rid

    # 3. Response ids must be unique.
    canonical_form = not (  # on the distinct values: a prompt id holds ':' iff one of its rows does
        pd.Series(pol_u).astype(str).str.contains(":", regex=False).any()
        or bool(pd.Series(pid_u).str.contains(":", regex=False).any())
    )
    if canonical_form and given.any():
        canonical_form = all(pc.all(pc.equal(_arrow_str(rid.iloc[lo:hi]), canon(lo, hi))).as_py()
                             for lo, hi in bounds)
    if canonical_form:
        # The id is an injective function of (policy, prompt, k): check integer codes.
        k_code, n_k = _codes(k)
        idk, n_idk = _combine(pair, n_pair, k_code, n_k, into_b=True)
        del k_code
        has_dup = bool(repeated_values(idk, n_idk).any())
    else:
        has_dup = not rid.is_unique
    if has_dup:
        e, l = _first_pair(rid.reset_index(drop=True))
        raise _duplicate_error(frame, e, l, "same response_id", names)
    pa.default_memory_pool().release_unused()  # the chunks of canonical ids
    return codes


def _arrow_str(s: pd.Series) -> pa.Array:
    """A string column as an Arrow large_string array (nulls kept)."""
    arr = pa.array(s, from_pandas=True)
    if isinstance(arr, pa.ChunkedArray):  # pragma: no cover - depends on the pandas storage
        arr = arr.combine_chunks()
    return pc.cast(arr, pa.large_string())


def join_probe(frame: pd.DataFrame, part: Part, names: list[str]) -> None:
    """Set oracle labels of fresh-draw rows from a probe slice (matched, not appended)."""
    probe, name, pol = part.frame, part.name, part.policy
    in_pol = (frame[POLICY] == pol).to_numpy(dtype=bool)
    keys = [PROMPT]
    if RESPONSE in probe.columns and RESPONSE in frame.columns:
        keys.append(RESPONSE)
    if probe[DRAW_IDX].notna().all() and frame.loc[in_pol, DRAW_IDX].notna().all():
        keys.append(DRAW_IDX)
    dup = probe.duplicated(subset=keys, keep="first").to_numpy()
    if dup.any():
        later = first_value(dup)
        raise CJEInputError(
            f"probe row repeats an earlier probe row ({', '.join(keys)}); each labelled row must be given once",
            source=name,
            row=later,
        )
    left = probe[keys].assign(__p=np.arange(len(probe)))
    right = frame.loc[in_pol, keys].assign(__f=np.flatnonzero(in_pol))
    m = left.merge(right, on=keys, how="left", sort=False)
    unmatched = m["__f"].isna().to_numpy()
    if unmatched.any():
        p = int(m["__p"].to_numpy()[first_value(unmatched)])
        raise CJEInputError(
            f"probe row has no matching fresh-draw row of policy '{pol}' (matched on {', '.join(keys)}); "
            "probe rows must label responses that are also in the fresh draws",
            source=name,
            row=p,
        )
    counts = np.bincount(m["__p"].to_numpy(dtype=np.int64), minlength=len(probe))
    if (counts > 1).any():
        p = first_value(counts > 1)
        raise CJEInputError(
            f"probe row matches {counts[p]} fresh-draw rows of policy '{pol}' on ({', '.join(keys)}); "
            "add response text or draw_idx so that the match is unique",
            source=name,
            row=p,
        )
    m = m.sort_values("__p")
    target = m["__f"].to_numpy(dtype=np.int64)
    lab = frame[LABEL].to_numpy(dtype=np.float64, copy=True)
    already = ~np.isnan(lab[target])
    if already.any():
        p = first_value(already)
        src_f, row_f = _where(frame, int(target[p]), names)
        raise CJEInputError(
            f"the same labelled row is supplied twice: row {row_f} of {src_f} already has an oracle label "
            "and this probe row labels it again; it would be counted twice. Supply each label once",
            source=name,
            row=p,
        )
    ps = probe[SCORE].to_numpy(dtype=np.float64)
    fs = frame[SCORE].to_numpy(dtype=np.float64)[target]
    differ = ~np.isnan(ps) & (ps != fs)
    if differ.any():
        p = first_value(differ)
        src_f, row_f = _where(frame, int(target[p]), names)
        raise CJEInputError(
            f"probe judge score {ps[p]:g} differs from the matching fresh-draw row {row_f} of {src_f} "
            f"({fs[p]:g}); the probe must label the same scored response",
            source=name,
            column=SCORE,
            row=p,
        )
    lab[target] = probe[LABEL].to_numpy(dtype=np.float64)
    frame[LABEL] = lab
    prob = frame[LABEL_PROB].to_numpy(dtype=np.float64, copy=True)
    prob[target] = probe[LABEL_PROB].to_numpy(dtype=np.float64)
    frame[LABEL_PROB] = prob
    logger.info("joined %d probe labels from %s onto policy '%s'", len(probe), name, pol)

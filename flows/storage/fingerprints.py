"""Fingerprints of id strings (issue 29): a 64-bit integer a string, computed from the Arrow buffers without a Python
string a row, and the positions of the repeated ones.

A fingerprint is a function of the string alone, so two different fingerprints are two different strings: a set of
ids whose fingerprints are distinct holds no repeated id (`repeated_fingerprints` finds none), and only ids whose
fingerprint repeats need a string comparison. The sharded row pass buckets and checks the response ids with them
(`flows.runtime.sharded_ray`), the label index sorts and probes by them (`flows.runtime.label_index`), and the label
store tells, with one of them a stored id, that no id repeats (`flows.storage.labels.LabelStore.read`).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from cje_engine.data.strings import BYTE_MASKS, byte_words, fixed_width

#: splitmix64's finalizer constants (`id_fingerprint`).
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


#: Rows of a block of `_fixed_fingerprint`: its steps run a block at a time, so that their operands stay in the
#: core's cache (256 KiB a uint64 array) rather than each step streaming every row through memory (~40% less CPU:
#: 4.6 against 8.1 ms a 1M-row file of 20-byte ids).
BLOCK_ROWS = 1 << 15


def _splitmix(h: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array (and returned); ``tmp``: a scratch array of its size."""
    tmp = np.empty_like(h) if tmp is None else tmp  # the shifts written into one buffer (no new temporary a step)
    for shift, mul in ((30, _MIX[0]), (27, _MIX[1])):
        np.right_shift(h, np.uint64(shift), out=tmp)
        h ^= tmp
        h *= np.uint64(mul)
    np.right_shift(h, np.uint64(31), out=tmp)
    h ^= tmp
    return h


def id_fingerprint(values) -> np.ndarray:
    """A 64-bit fingerprint of each string of an Arrow string column, a function of the string alone (not of its
    chunk, offset or place; nulls as the empty string): its length and its first, middle and last 8 bytes
    (three unaligned 8-byte loads a string; no Python string a row), combined by multiply-xor steps and mixed
    once by splitmix64's finalizer.

    Not a hash of every byte: two ids equal in length and in those 24 bytes (shorter than 8 bytes: in every
    byte) share a fingerprint. It buckets the response ids (every copy of an id in one bucket,
    `flows.runtime.sharded_ray.response_id_buckets`) and lets `flows.runtime.sharded_ray.check_response_ids` sort
    integers; ids with the same fingerprint are then compared as strings, so a shared fingerprint never hides nor invents a repeated id."""
    if isinstance(values, pa.ChunkedArray):
        if values.num_chunks > 1:  # chunk by chunk (a function of each string alone): no copy of the column
            return np.concatenate([id_fingerprint(c) for c in values.chunks])
        values = values.chunk(0) if values.num_chunks else pa.array([], pa.string())
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        values = values.cast(pa.string())
    n = len(values)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    fixed = fixed_width(values)
    if fixed is not None:
        h = _fixed_fingerprint(fixed)
    else:
        h = _fingerprint(values)
    if values.null_count:  # a null's slot may hold bytes: it is fingerprinted as the empty string
        h[np.asarray(values.is_null())] = id_fingerprint(pa.array([""]))[0]
    return h


def _fixed_fingerprint(fixed) -> np.ndarray:
    """`id_fingerprint` of strings all ``fixed.width`` (>= 8) bytes long (`cje_engine.data.strings.FixedWidth`):
    the same values as `_fingerprint`'s, its three words read as strided views of the data buffer, not gathered
    (fixed-width ids: ~5x less CPU), a block of `BLOCK_ROWS` at a time (the same steps)."""
    w = fixed.width
    first, middle, last = fixed.word_view(0), fixed.word_view(w // 2 - 4), fixed.word_view(w - 8)  # in place
    length = np.uint64((w * _MIX[0]) & 0xFFFFFFFFFFFFFFFF)
    out = np.empty(fixed.n, dtype=np.uint64)
    tmp = np.empty(min(fixed.n, BLOCK_ROWS), dtype=np.uint64)
    for lo in range(0, fixed.n, BLOCK_ROWS):
        hi = min(lo + BLOCK_ROWS, fixed.n)
        h = out[lo:hi]
        np.bitwise_xor(first[lo:hi], length, out=h)
        h *= np.uint64(_MIX[1])
        np.bitwise_xor(h, middle[lo:hi], out=h)  # the middle word: at (start + end) // 2 - 4
        h *= np.uint64(_MIX[0])
        np.bitwise_xor(h, last[lo:hi], out=h)
        _splitmix(h, tmp[:hi - lo])
    return out


def _fingerprint(values) -> np.ndarray:
    """`id_fingerprint` of any strings (nulls not fixed up): three gathers of unaligned words of the data."""
    bw = byte_words(values, pad=8)  # 8 zero bytes of padding: the word at ``size`` is 0 (a short string's middle
    words, size = bw.words, bw.size  # and last word)
    start, length = bw.start, bw.length
    end = start + length
    long_ = length >= 8
    # the first word keeps the string's own bytes only (a short string's neighbour follows it)
    h = words[start]
    h &= BYTE_MASKS[np.minimum(length, 8)]
    h ^= length.astype(np.uint64) * np.uint64(_MIX[0])
    h *= np.uint64(_MIX[1])
    # the middle and last words of strings of 8 bytes or more (else the zero word: the first holds every byte)
    h ^= words[np.where(long_, (start + end) // 2 - 4, size)]
    h *= np.uint64(_MIX[0])
    h ^= words[np.where(long_, end - 8, size)]
    return _splitmix(h)


def radix_sort_uint32(a: np.ndarray) -> np.ndarray:
    """``numpy.sort`` of a uint32 array (a sorted copy, the same values) by two stable passes of its 16-bit halves,
    low then high: numpy's stable sort of 16-bit keys is a radix sort, one pass over the keys. Measured on this
    service's machines (AMD EPYC, where numpy does not vectorise its sort): 4.8-4.9 against 10.8 ms of CPU for 0.4M
    random values (`benchmarks/bench_sorts.py`)."""
    a = np.ascontiguousarray(a, dtype=np.uint32)
    if a.size < 2:
        return a.copy()
    if not np.little_endian:  # (the halves' views below are of a little-endian word)
        return np.sort(a)
    out = a[np.argsort(a.view(np.uint16)[0::2], kind="stable")]  # by the low halves
    return out[np.argsort(out.view(np.uint16)[1::2], kind="stable")]  # then by the high ones, stably


def repeated_fingerprints(fp, skip_bits: int = 0) -> np.ndarray:
    """Positions (increasing) of the fingerprints that occur more than once in ``fp`` (uint64; or a sequence of
    uint64 arrays, positions in their concatenation, never made: a check task's pieces as they are in the object
    store): a sort of 32 of their bits (half the bytes of a sort of the whole: ~40% less CPU), then the whole
    fingerprints of the few whose 32 bits repeat (~n^2 / 2^33 of n) compared exactly
    (`repeated_fingerprints_reference`: a sort of the whole fingerprints). The 32 bits are the high half, or with
    ``skip_bits`` the 32 below the top ``skip_bits`` (when the caller knows those equal in every fingerprint: a run
    of `flows.runtime.sharded_ray.response_id_buckets`, whose bits then tell more apart). The same positions
    whatever ``skip_bits``: it changes only which fingerprints are compared whole."""
    parts = [np.asarray(fp, dtype=np.uint64)] if isinstance(fp, np.ndarray) else [
        np.asarray(a, dtype=np.uint64) for a in fp]
    sizes = np.array([a.size for a in parts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    high = np.empty(int(starts[-1]), dtype=np.uint32)
    skip = int(skip_bits)
    if not 0 <= skip <= 32:
        raise ValueError(f"skip_bits {skip_bits!r} not in 0..32")
    for a, o in zip(parts, starts[:-1].tolist()):
        if not a.size:
            continue
        if skip:
            high[o:o + a.size] = (a << np.uint64(skip)) >> np.uint64(32)
        elif np.little_endian and a.dtype.isnative and a.strides == (8,):  # the high halves by view: no shift pass
            high[o:o + a.size] = a.view(np.uint32)[1::2]
        else:
            high[o:o + a.size] = a >> np.uint64(32)
    s = radix_sort_uint32(high)
    rep = s[1:][s[1:] == s[:-1]]
    del s
    if rep.size == 0:
        return np.empty(0, dtype=np.int64)
    rep = np.unique(rep)
    # the positions of those halves: a flag per value of their top ``bits`` bits, 32 flags a repeated half (16 bits
    # for up to 2048 of them, 64 KiB: a gather a row that stays in the cache, ~4x cheaper than from 2^24 flags; up to
    # 24 bits), then the flagged rows (~3% of n) compared exactly
    bits = int(min(24, max(16, int(rep.size).bit_length() + 5)))
    flag = np.zeros(1 << bits, dtype=bool)
    flag[rep >> np.uint32(32 - bits)] = True
    maybe = np.flatnonzero(flag[high >> np.uint32(32 - bits)])
    maybe = maybe[np.isin(high[maybe], rep)]
    if len(parts) == 1:
        whole = parts[0][maybe]
    else:  # gathered from the parts they are in
        part = np.searchsorted(starts, maybe, side="right") - 1
        whole = np.empty(maybe.size, dtype=np.uint64)
        for j in np.unique(part).tolist():
            at = np.flatnonzero(part == j)
            whole[at] = parts[j][maybe[at] - starts[j]]
    ordered = np.sort(whole)
    again = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    return maybe[np.isin(whole, again)] if again.size else np.empty(0, dtype=np.int64)


def repeated_fingerprints_reference(fp: np.ndarray) -> np.ndarray:
    """`repeated_fingerprints` the obvious way (the tests' reference): the whole fingerprints sorted, the positions
    of those equal to a neighbour."""
    fp = np.asarray(fp, dtype=np.uint64)
    ordered = np.sort(fp)
    again = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    return np.flatnonzero(np.isin(fp, again)) if again.size else np.empty(0, dtype=np.int64)


def ids_distinct(values) -> bool:
    """True when no string of ``values`` (an Arrow string column) repeats, exactly: no `id_fingerprint` repeats, or
    the strings of the repeated ones (the ids sharing a fingerprint) are all different."""
    import pyarrow.compute as pc

    at = repeated_fingerprints(id_fingerprint(values))
    if at.size == 0:
        return True
    some = values.take(pa.array(at))
    return len(pc.unique(some)) == len(some)

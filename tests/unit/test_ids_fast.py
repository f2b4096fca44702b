"""The response-id paths made cheaper in round 19 (issue 29) against their slow references: the ASCII test of ids
(`cje_engine.data.strings.all_ascii`), the label index's probe (`flows.runtime.label_index.LabelIndex.lookup`) and the
response-id check (`flows.storage.fingerprints.repeated_fingerprints`, `flows.runtime.sharded_ray.check_response_ids`):
the same answers on ties of fingerprints, non-ASCII ids, NFC/NFD spellings, empty inputs, a repeated id across two
files and ids sharing a half-fingerprint."""
from __future__ import annotations

import unicodedata

import numpy as np
import pyarrow as pa
import pytest

from cje_engine.data.strings import all_ascii, all_ascii_reference


def _strings(rng: np.random.Generator, n: int, non_ascii: float) -> list:
    pool = ["caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9"), "\u65e5\u672c", "plain", "", "x" * 40]
    out = []
    for i in range(n):
        s = f"id-{i}-{rng.integers(1 << 20)}"
        if rng.random() < non_ascii:
            s += pool[int(rng.integers(0, 3))]
        elif rng.random() < 0.1:
            s = pool[int(rng.integers(3, 6))]
        out.append(None if rng.random() < 0.05 else s)
    return out


def test_all_ascii_is_the_per_string_test():
    """`all_ascii` (the character data's bytes tested first) gives `pyarrow.compute.string_is_ascii`'s answer on plain
    and large strings, slices (a non-ASCII id outside the slice), chunked columns, empty and all-null columns, and a
    non-ASCII byte left in a null's slot (the bytes say no, the strings yes)."""
    rng = np.random.default_rng(19)
    cases = []
    for frac in (0.0, 0.001, 0.3):
        for n in (0, 1, 7, 300):
            vals = _strings(rng, n, frac)
            for typ in (pa.string(), pa.large_string()):
                arr = pa.array(vals, typ)
                cases += [arr, arr.slice(1, max(0, n - 2)), pa.chunked_array([arr, arr.slice(3)], typ)]
    cases += [pa.nulls(5, pa.string()), pa.chunked_array([], pa.string()), pa.array(["abc", "d\u00e9f"]).slice(0, 1)]
    # a null whose slot holds non-ASCII bytes: built from buffers (the validity bit of row 1 cleared)
    data = "ab" + "\u00e9" + "cd"
    offsets = np.array([0, 2, 4, 6], dtype=np.int32)
    valid = pa.py_buffer(np.packbits(np.array([1, 0, 1], dtype=bool), bitorder="little").tobytes())
    hidden = pa.Array.from_buffers(pa.string(), 3, [valid, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.encode())],
                                   null_count=1)
    assert hidden.to_pylist() == ["ab", None, "cd"]
    cases.append(hidden)
    seen = set()
    for c in cases:
        want = all_ascii_reference(c)
        assert all_ascii(c) == want, c
        seen.add(want)
    assert seen == {True, False}

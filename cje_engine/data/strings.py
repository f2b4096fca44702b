"""8-byte words of an Arrow string column's UTF-8 bytes, read from its buffers without a Python string a row: the
shared mechanism of the response ids' fingerprints (`flows.storage.fingerprints.id_fingerprint`) and of the
sharded readers' prompt-id ranges (`cje_engine.pipeline.sharded.range_shard`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

#: The bits of a little-endian word that keep its first 0-8 bytes (index: how many bytes).
BYTE_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


@dataclass
class ByteWords:
    """A string column's bytes as an unaligned little-endian ``uint64`` word at every byte (`byte_words`)."""

    words: np.ndarray  # (size + pad - 7,) uint64: words[i] = bytes i..i+7 of the data, zero padded
    start: np.ndarray  # (n,) int64: each string's first byte
    length: np.ndarray  # (n,) int64: each string's bytes
    size: int  # bytes of the strings' data (words[size] and on read the padding only)


def byte_words(values: pa.Array, pad: int = 8) -> ByteWords:
    """`ByteWords` of ``values`` (``pyarrow.string`` or ``large_string``, one chunk), its data copied once into a
    buffer with ``pad`` (>= 8) zero bytes after it, so a word loaded at any byte of the data stays inside."""
    n = len(values)
    _, off_buf, data_buf = values.buffers()
    width = np.int64 if pa.types.is_large_string(values.type) else np.int32
    off = np.frombuffer(off_buf, dtype=width)[values.offset:values.offset + n + 1].astype(np.int64)
    base = int(off[0])
    if base:
        off -= base
    size = int(off[-1])
    data = np.empty(size + pad, dtype=np.uint8)
    data[size:] = 0
    if size:
        data[:size] = np.frombuffer(data_buf, dtype=np.uint8)[base:base + size]
    words = np.ndarray(shape=(size + pad - 7,), dtype="<u8", buffer=data, strides=(1,))  # a word at every byte
    return ByteWords(words=words, start=off[:-1], length=off[1:] - off[:-1], size=size)


@dataclass
class FixedWidth:
    """A string column whose strings all have the same length ``width`` (>= 8 bytes), read in place from its data
    buffer (`fixed_width`): the word at a given byte of every string is a strided copy, no gather by offset."""

    data: np.ndarray  # uint8 view of the column's data buffer (no copy)
    first: int  # byte of the data buffer where the first string starts
    width: int  # bytes of every string
    n: int  # strings

    def word(self, at: int) -> np.ndarray:
        """The little-endian ``uint64`` word of bytes ``at .. at + 7`` of every string (``0 <= at <= width - 8``), as
        a new array: what ``byte_words(values).words[start + at]`` gives, without the copy of the data and the
        gather."""
        return self.word_view(at).copy()

    def word_view(self, at: int) -> np.ndarray:
        """`word` as a read-only strided view of the data buffer (index it to gather the words of a few strings)."""
        if not 0 <= at <= self.width - 8:
            raise ValueError(f"a word at byte {at} of strings of {self.width} bytes")
        return np.ndarray(shape=(self.n,), dtype="<u8", buffer=self.data, offset=self.first + at,
                          strides=(self.width,))


def fixed_width(values: pa.Array, least: int = 8) -> FixedWidth | None:
    """`FixedWidth` of ``values`` (``pyarrow.string`` or ``large_string``, one chunk, at least one string) when all
    its strings (null slots included) have the same length of at least ``least`` (>= 8) bytes, else None (then
    `byte_words`): fixed-width ids (UUIDs, ids of one pattern) skip the copy of the data and the gathers."""
    n = len(values)
    if n == 0:
        return None
    _, off_buf, data_buf = values.buffers()
    width_t = np.int64 if pa.types.is_large_string(values.type) else np.int32
    off = np.frombuffer(off_buf, dtype=width_t)[values.offset:values.offset + n + 1]
    base = int(off[0])
    width = int(off[1]) - base
    if width < max(8, least) or int(off[-1]) - base != n * width or data_buf is None:
        return None
    if not bool((np.diff(off) == width).all()):
        return None
    return FixedWidth(data=np.frombuffer(data_buf, dtype=np.uint8), first=base, width=width, n=n)


def all_ascii(values) -> bool:
    """True when no string of ``values`` (an Arrow string column, chunked or not; nulls ignored) holds a byte
    outside ASCII: ``pyarrow.compute.all(pyarrow.compute.string_is_ascii(values))`` not False, the same answer.
    Each chunk's character data is tested as bytes first (their largest below 0x80: ~0.3 ms a 1M-id chunk
    against ~5 ms for the per-string test); only a chunk whose bytes are not all ASCII (which may lie in a null's
    slot) is tested string by string (`all_ascii_reference`)."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    for c in chunks:
        if len(c) == 0 or c.null_count == len(c):
            continue
        if not (pa.types.is_string(c.type) or pa.types.is_large_string(c.type)):
            if not all_ascii_reference(c):
                return False
            continue
        _, off_buf, data_buf = c.buffers()
        width = np.int64 if pa.types.is_large_string(c.type) else np.int32
        off = np.frombuffer(off_buf, dtype=width)[c.offset:c.offset + len(c) + 1]
        lo, hi = int(off[0]), int(off[-1])
        if hi <= lo or data_buf is None:
            continue  # empty strings only
        if int(np.frombuffer(data_buf, dtype=np.uint8)[lo:hi].max()) < 0x80:
            continue
        if not all_ascii_reference(c):
            return False
    return True


def all_ascii_reference(values) -> bool:
    """`all_ascii` string by string (``pyarrow.compute.string_is_ascii``): its reference."""
    import pyarrow.compute as pc

    return pc.all(pc.string_is_ascii(values)).as_py() is not False

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

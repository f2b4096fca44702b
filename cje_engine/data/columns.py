"""An Arrow column as one array without a copy: the readers' and the passes' columns arrive as one chunk (a
file's read, a piece from the object store), and `pyarrow.ChunkedArray.combine_chunks` copies even one."""
from __future__ import annotations

import pyarrow as pa


def one_chunk(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``col`` as one `pyarrow.Array`: its chunk when it has exactly one (no copy), else its chunks combined (an
    empty array of its type when it has none); an array as it is."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col

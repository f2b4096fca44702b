"""`cje_engine.data.columns.one_chunk`: one chunk read in place, several combined, none an empty array."""
import numpy as np
import pyarrow as pa

from cje_engine.data.columns import one_chunk


def test_one_chunk_is_the_chunk_itself():
    col = pa.chunked_array([pa.array(np.arange(1000, dtype=np.int64))])
    got = one_chunk(col)
    assert isinstance(got, pa.Array)
    assert got.buffers()[1].address == col.chunk(0).buffers()[1].address  # no copy
    assert col.combine_chunks().buffers()[1].address != col.chunk(0).buffers()[1].address  # what it avoids


def test_several_chunks_are_combined_and_none_is_empty():
    col = pa.chunked_array([pa.array([1, 2]), pa.array([3])])
    assert one_chunk(col).to_pylist() == [1, 2, 3]
    empty = one_chunk(pa.chunked_array([], pa.float64()))
    assert isinstance(empty, pa.Array) and len(empty) == 0 and empty.type == pa.float64()


def test_an_array_is_returned_as_it_is():
    arr = pa.array(["a", "b"])
    assert one_chunk(arr) is arr

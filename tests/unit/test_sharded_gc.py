"""The sharded driver's preparation runs with the objects older than it frozen out of the garbage collections
(`cje_engine.pipeline.sharded.heap_frozen`): undone after it, kept under an outer freeze, and the cycles it makes
itself still collected."""
from __future__ import annotations

import gc
import weakref

import pytest

from cje_engine.pipeline import sharded


class _Node:
    """A reference cycle's member, weakly referenceable."""

    def __init__(self) -> None:
        self.other = self


def test_prepare_sharded_is_frozen_and_undone_after():
    assert sharded.prepare_sharded.__wrapped__.__name__ == "prepare_sharded"  # the wrapper keeps its name and doc
    assert "shards" in (sharded.prepare_sharded.__doc__ or "")
    old = _Node()
    old_ref = weakref.ref(old)
    seen = {}

    @sharded.heap_frozen
    def body(fail: bool) -> int:
        seen["frozen"] = gc.get_freeze_count()
        young = _Node()  # a cycle made inside: still collected
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        seen["young_collected"] = young_ref() is None
        return 1 if not fail else 1 // 0

    try:
        assert gc.get_freeze_count() == 0
        body(False)
        assert seen["frozen"] > 0 and seen["young_collected"]
        assert gc.get_freeze_count() == 0  # undone
        with pytest.raises(ZeroDivisionError):
            body(True)
        assert gc.get_freeze_count() == 0  # undone after an error too
        del old
        gc.collect()
        assert old_ref() is None  # the objects frozen for a while are collected again after
    finally:
        gc.unfreeze()


def test_an_outer_freeze_is_left_as_it_is():
    @sharded.heap_frozen
    def body() -> int:
        return gc.get_freeze_count()

    gc.freeze()
    try:
        # the permanent generation's count falls as its objects are freed (by reference count), never to 0 here
        outer = gc.get_freeze_count()
        assert body() > outer // 2
        assert gc.get_freeze_count() > outer // 2  # not undone by the inner call
    finally:
        gc.unfreeze()


def test_the_flows_sharded_pass_runs_frozen():
    """The evaluate flow's sharded path (prepare, bootstrap, finalize) is the frozen call; prepare inside it runs
    under its freeze."""
    from flows.pipelines import sharded_pass

    assert sharded_pass.compute_sharded.__wrapped__.__name__ == "compute_sharded"

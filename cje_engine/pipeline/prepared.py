"""The evaluation modes' common shape: a prepared evaluation, its bootstrap and its finalize.

Every evaluation mode (Direct: `cje_engine.pipeline.direct.Prepared`; off-policy logs-only and
hybrid: `cje_engine.pipeline.offpolicy.OffPolicyPrepared`) is split into ``prepare`` (validate,
calibrate, point estimates), bootstrap chunks (replicate ``b`` depends only on ``(seed, b)``) and
``finalize`` (intervals, audits, gates, comparisons). An orchestrator (the Prefect flow, the Ray
fan-out) calls the methods of `Prepared` and never asks which mode it holds.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["Prepared", "ReplicateSource"]


@runtime_checkable
class ReplicateSource(Protocol):
    """What a bootstrap worker receives: it computes replicates ``start..stop-1``."""

    def replicates(self, start: int, stop: int) -> np.ndarray:
        """Bootstrap replicates ``start..stop-1``, shape (stop - start, n_replicate_stats)."""


@runtime_checkable
class Prepared(ReplicateSource, Protocol):
    """A prepared evaluation of any mode (picklable).

    Attributes
    ----------
    options : the mode's options; ``options.inference`` and ``options.n_bootstrap`` say whether and
        how many replicates `finalize` expects.
    """

    options: Any

    def check_bootstrap_memory(self) -> None:
        """Raise `cje_engine.errors.CJEInputError` before any replicate is allocated when the
        replicate matrix would not fit the memory budget."""

    def bootstrap_source(self) -> ReplicateSource:
        """The smallest state whose `ReplicateSource.replicates` equals this one's, bit for bit
        (what is shipped to bootstrap workers)."""

    def finalize(self, chunks: Sequence[np.ndarray]) -> Any:
        """The evaluation's typed result from the bootstrap chunks (in replicate order)."""

"""Deterministic sampling designs of a request: random, stratified by judge score, targeted."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from cje_engine.errors import CJEInputError

from flows.label_requests.config import DESIGNS


def _allocate(n: int, sizes: np.ndarray) -> np.ndarray:
    """Proportional allocation of n over strata (largest remainder), >= 1 per non-empty stratum
    when n allows, never more than the stratum size."""
    sizes = np.asarray(sizes, dtype=int)
    alloc = np.zeros(sizes.size, dtype=int)
    nonempty = sizes > 0
    n = int(min(n, sizes.sum()))
    if n <= 0:
        return alloc
    if n >= nonempty.sum():
        alloc[nonempty] = 1
    rest = n - alloc.sum()
    while rest > 0:
        room = sizes - alloc
        share = np.where(room > 0, sizes, 0).astype(float)
        if share.sum() == 0:
            break
        ideal = rest * share / share.sum()
        add = np.minimum(np.floor(ideal).astype(int), room)
        if add.sum() == 0:
            frac = np.where(room > 0, ideal - np.floor(ideal), -1.0)
            add = np.zeros_like(alloc)
            add[int(np.argmax(frac))] = 1
        alloc += add
        rest = n - alloc.sum()
    return alloc


def score_strata(scores: np.ndarray, n_strata: int) -> np.ndarray:
    """Stratum index per row: quantile bins of the judge score (ties keep a score in one stratum)."""
    if scores.size == 0:
        return np.zeros(0, dtype=int)
    edges = np.unique(np.quantile(scores, np.linspace(0, 1, n_strata + 1))[1:-1])
    return np.searchsorted(edges, scores, side="right").astype(int)


def sample(pool_ids: np.ndarray, pool_scores: np.ndarray, n: int, design: str, seed: int, *,
           n_strata: int = 5, regions: Sequence[dict] | None = None, bandwidth: float = 0.0,
           background_share: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw ``n`` rows of a pool without replacement.

    Returns indices into the pool, each chosen row's selection probability and stratum.
    ``random``: simple random sample (p = n / N).  ``stratified``: score strata, proportional
    allocation, SRS within (p = n_h / N_h).  ``targeted``: per region (a score value with a
    label deficit) SRS of its deficit among pool rows within ``bandwidth`` of it, plus a
    background SRS of the rest of the pool (``background_share`` of the request).
    """
    if design not in DESIGNS:
        raise CJEInputError(f"sampling design must be one of {DESIGNS}, got {design!r}")
    N = pool_ids.size
    n = int(min(n, N))
    if n <= 0:
        return np.zeros(0, dtype=int), np.zeros(0), np.zeros(0, dtype=int)
    order = np.argsort(pool_ids, kind="stable")  # sampling never depends on row order
    rng = np.random.default_rng(seed)
    if design == "random":
        strata = np.zeros(N, dtype=int)
    elif design == "stratified":
        strata = score_strata(pool_scores, max(1, min(n_strata, n)))
    else:
        strata = np.full(N, -1, dtype=int)  # -1: background
        want = []
        for j, r in enumerate(regions or []):
            free = (strata == -1) & (np.abs(pool_scores - r["score"]) <= bandwidth + 1e-12)
            strata[free] = j
            want.append(int(r["labels"]))
    chosen, probs, stra = [], [], []
    if design == "targeted":
        k = len(want)
        sizes = np.array([np.sum(strata == j) for j in range(k)], dtype=int)
        alloc = np.minimum(np.array(want, dtype=int), sizes)
        n_bg_pool = int(np.sum(strata == -1))
        min_bg = min(n_bg_pool, int(math.ceil(background_share * n))) if n_bg_pool else 0
        while alloc.sum() + min_bg > n and alloc.sum() > 0:  # the request cap binds: scale regions down
            alloc[int(np.argmax(alloc))] -= 1
        n_bg = min(n_bg_pool, n - int(alloc.sum()))  # whatever the regions cannot absorb
        spare = n - int(alloc.sum()) - n_bg
        for j in range(k):  # background too small: fill regions beyond their deficit
            add = min(spare, int(sizes[j] - alloc[j]))
            alloc[j] += add
            spare -= add
        plan = list(zip(range(k), alloc)) + [(-1, n_bg)]
    else:
        labels_ = np.unique(strata)
        alloc = _allocate(n, np.array([np.sum(strata == s) for s in labels_]))
        plan = list(zip(labels_.tolist(), alloc.tolist()))
    for s, m in plan:
        members = order[strata[order] == s]
        if m <= 0 or members.size == 0:
            continue
        pick = rng.choice(members.size, size=int(m), replace=False)
        chosen.append(members[np.sort(pick)])
        probs.append(np.full(int(m), m / members.size))
        stra.append(np.full(int(m), s))
    if not chosen:
        return np.zeros(0, dtype=int), np.zeros(0), np.zeros(0, dtype=int)
    return np.concatenate(chosen), np.concatenate(probs), np.concatenate(stra)

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


def region_strata(scores: np.ndarray, centres: np.ndarray, tol: float) -> np.ndarray:
    """Per score, the first region ``j`` (in the given order) with ``|score - centres[j]| <= tol``; -1
    when none.

    Vectorised over the rows (no rows x regions matrix): in score order the regions within
    ``tol`` of a score are one contiguous run (``fl(|s - r|)`` falls, then rises, in ``r``), found
    by binary search and corrected at its two ends with the exact test; the first region of a run
    is a range-minimum query on a sparse table of region indices.
    """
    scores = np.asarray(scores, dtype=float)
    centres = np.asarray(centres, dtype=float)
    out = np.full(scores.size, -1, dtype=int)
    k = centres.size
    if k == 0 or scores.size == 0:
        return out
    so = np.argsort(centres, kind="stable")
    rs = centres[so]

    def inside(pos: np.ndarray, s: np.ndarray) -> np.ndarray:
        return np.abs(s - rs[np.clip(pos, 0, k - 1)]) <= tol

    lo = np.searchsorted(rs, scores - tol, side="left")
    hi = np.searchsorted(rs, scores + tol, side="right")
    for _ in range(k + 1):  # the binary search's ends can be off by float rounding: move them to the exact test
        grow_lo = (lo > 0) & inside(lo - 1, scores)
        shrink_lo = ~grow_lo & (lo < hi) & ~inside(lo, scores)
        grow_hi = (hi < k) & inside(hi, scores)
        shrink_hi = ~grow_hi & (hi > lo) & ~inside(hi - 1, scores)
        if not (grow_lo.any() or shrink_lo.any() or grow_hi.any() or shrink_hi.any()):
            break
        lo = lo - grow_lo + shrink_lo
        hi = hi + grow_hi - shrink_hi
    length = hi - lo
    hit = length > 0
    if not hit.any():
        return out
    table = [so]
    while (1 << len(table)) <= k:
        prev, w = table[-1], 1 << (len(table) - 1)
        table.append(np.minimum(prev[:-w], prev[w:]))
    lvl = np.zeros(scores.size, dtype=int)
    lvl[hit] = np.floor(np.log2(length[hit])).astype(int)
    lvl[hit & ((1 << lvl) > length)] -= 1  # guard log2 rounding
    lvl[hit & ((1 << (lvl + 1)) <= length)] += 1
    for m in np.unique(lvl[hit]):
        sel = hit & (lvl == m)
        t = table[m]
        out[sel] = np.minimum(t[lo[sel]], t[hi[sel] - (1 << m)])
    return out


def _scale_down(alloc: np.ndarray, total: int) -> np.ndarray:
    """``alloc`` after taking one from its (first) largest entry until it sums to ``total``, in closed form.

    The repeated decrement levels the largest entries down to a common ``c`` and leaves ``c + 1``
    on the last of those that reached it (the first occurrence of the maximum is taken each time).
    """
    alloc = np.asarray(alloc, dtype=int).copy()
    if alloc.sum() <= total:
        return alloc
    total = max(int(total), 0)
    # the largest level c with sum(min(alloc, c)) <= total
    vals = np.sort(alloc)
    csum = np.concatenate(([0], np.cumsum(vals)))
    lo, hi = 0, int(vals[-1])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        j = np.searchsorted(vals, mid, side="left")
        if csum[j] + mid * (vals.size - j) <= total:
            lo = mid
        else:
            hi = mid - 1
    c = lo
    out = np.minimum(alloc, c)
    extra = total - int(out.sum())
    top = np.flatnonzero(alloc > c)
    if extra > 0:
        out[top[top.size - extra:]] = c + 1
    return out


def sample(pool_ids: np.ndarray, pool_scores: np.ndarray, n: int, design: str, seed: int, *,
           n_strata: int = 5, regions: Sequence[dict] | None = None, bandwidth: float = 0.0,
           background_share: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw ``n`` rows of a pool without replacement.

    Returns indices into the pool, each chosen row's selection probability and stratum.
    ``random``: simple random sample (p = n / N).  ``stratified``: score strata, proportional
    allocation, SRS within (p = n_h / N_h).  ``targeted``: per region (a score value with a
    label deficit) SRS of its deficit among pool rows within ``bandwidth`` of it (a row within
    reach of several regions belongs to the first), plus a background SRS of the rest of the pool
    (``background_share`` of the request).  ``pool_ids`` only order the pool (any sortable
    values: ids, or their ranks); the draw is the same for any row order of the pool.  Cost:
    sorts of the pool, no per-row Python and no rows x strata pass.
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
        regions = list(regions or [])
        strata = region_strata(pool_scores, np.array([float(r["score"]) for r in regions]), bandwidth + 1e-12)
        want = [int(r["labels"]) for r in regions]
    # members of each stratum in id order: one stable sort by stratum of the id-ordered pool
    by_stratum = order[np.argsort(strata[order], kind="stable")]
    labels_, starts, sizes_all = np.unique(strata[by_stratum], return_index=True, return_counts=True)
    where = {int(s): (int(a), int(a + c)) for s, a, c in zip(labels_, starts, sizes_all)}
    if design == "targeted":
        k = len(want)
        sizes = np.array([where.get(j, (0, 0))[1] - where.get(j, (0, 0))[0] for j in range(k)], dtype=int)
        alloc = np.minimum(np.array(want, dtype=int), sizes)
        lo_bg, hi_bg = where.get(-1, (0, 0))
        n_bg_pool = hi_bg - lo_bg
        min_bg = min(n_bg_pool, int(math.ceil(background_share * n))) if n_bg_pool else 0
        if alloc.sum() + min_bg > n and alloc.sum() > 0:  # the request cap binds: scale regions down
            alloc = _scale_down(alloc, max(n - min_bg, 0))
        n_bg = min(n_bg_pool, n - int(alloc.sum()))  # whatever the regions cannot absorb
        spare = n - int(alloc.sum()) - n_bg
        for j in range(k):  # background too small: fill regions beyond their deficit
            add = min(spare, int(sizes[j] - alloc[j]))
            alloc[j] += add
            spare -= add
        plan = list(zip(range(k), alloc)) + [(-1, n_bg)]
    else:
        alloc = _allocate(n, sizes_all)
        plan = list(zip(labels_.tolist(), alloc.tolist()))
    chosen, probs, stra = [], [], []
    for s, m in plan:
        a, b = where.get(int(s), (0, 0))
        members = by_stratum[a:b]
        if m <= 0 or members.size == 0:
            continue
        pick = rng.choice(members.size, size=int(m), replace=False)
        chosen.append(members[np.sort(pick)])
        probs.append(np.full(int(m), m / members.size))
        stra.append(np.full(int(m), s))
    if not chosen:
        return np.zeros(0, dtype=int), np.zeros(0), np.zeros(0, dtype=int)
    return np.concatenate(chosen), np.concatenate(probs), np.concatenate(stra)

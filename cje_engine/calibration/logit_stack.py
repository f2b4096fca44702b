"""The logit first stage of many two-stage fits at once: projected Newton on a stack of fits.

`newton_stack` runs `cje_engine.calibration.calibrators._logit_newton` for every row of per-cell
weights at once (a cross-fit's six fits, or the cross-fits of a batch of bootstrap replicates):
per step, the Gram matrices and gradients of each group of fits sharing a design (a knot vector)
from that design's cached products, one batched solve of every fit's Newton system on its free
set, step halving only where a step may change an index by more than log 2. A fit that has
converged leaves the stack (its coefficients are final; the others go on without it), so a
batch costs what its unconverged fits cost. Every operation is row-wise (einsum, batched LAPACK,
per-fit masks and step lengths): a fit's numbers do not depend on the other fits in the stack.
"""
from __future__ import annotations

import numpy as np
from numpy.linalg import _umath_linalg as _lapack  # the batched LAPACK gufuncs, without the wrappers' checks
from numpy._core._multiarray_umath import c_einsum as _einsum  # what np.einsum runs (optimize=False), no wrapper

from cje_engine.calibration.calibrators import LOG2, NEWTON_MAX, NEWTON_TOL, qp_ramp

__all__ = ["newton_stack"]

_EYE: dict[int, np.ndarray] = {}
_TRI: dict[int, tuple] = {}
_SYM: dict[int, np.ndarray] = {}


def eye_stack(P: int) -> np.ndarray:
    """The ``P x P`` identity (cached per size; read-only use)."""
    e = _EYE.get(P)
    if e is None:
        e = _EYE[P] = np.eye(P)
    return e


def triangle_index(P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Upper-triangle indices of a P x P matrix and their positions in its flattened form."""
    tri = _TRI.get(P)
    if tri is None:
        iu = np.triu_indices(P)
        tri = _TRI[P] = (iu[0], iu[1], iu[0] * P + iu[1])
    return tri


def _symmetric(P: int) -> np.ndarray:
    """For each entry of a flattened P x P matrix, its position in the upper triangle (`triangle_index`)."""
    sym = _SYM.get(P)
    if sym is None:
        iu0, iu1, _ = triangle_index(P)
        pos = np.empty((P, P), dtype=np.intp)
        pos[iu0, iu1] = np.arange(iu0.size)
        pos[iu1, iu0] = np.arange(iu0.size)
        sym = _SYM[P] = pos.ravel()
    return sym


def _parts(designs: list, counts: np.ndarray) -> list:
    """(rows, L, Lb, R') of each design with rows, the fits in design order (each design's fits a
    slice; one design: all rows)."""
    ends = np.cumsum(counts).tolist()
    parts = [(slice(e - c, e),) + tuple(d[:3]) for d, c, e in zip(designs, counts.tolist(), ends) if c]
    if len(parts) == 1:
        parts[0] = (slice(None),) + parts[0][1:]
    return parts


_SPARSE: dict[int, tuple] = {}
_SPARSE_MAX = 64


def _sparse_form(M: np.ndarray) -> tuple:
    """The non-zero structure of a constant design matrix ``M`` (S, Q) for `_product`: (``M`` itself, the
    columns with a single non-zero entry equal to 1 and that entry's row, the other non-zero columns, the rows
    non-zero in any of those, and ``M`` restricted to those rows and columns), cached per array."""
    hit = _SPARSE.get(id(M))
    if hit is not None and hit[0] is M:
        return hit
    nz = M != 0
    count = nz.sum(0)
    unit = np.flatnonzero((count == 1) & (M.max(0, initial=0.0) == 1.0) & (M.min(0, initial=0.0) == 0.0))
    src = nz[:, unit].argmax(0)
    is_unit = np.zeros(M.shape[1], dtype=bool)
    is_unit[unit] = True
    multi = np.flatnonzero((count > 0) & ~is_unit)
    rows = np.flatnonzero(nz[:, multi].any(1))
    if len(_SPARSE) >= _SPARSE_MAX:  # designs follow the refits' knots: keep the recent ones only
        _SPARSE.clear()
    form = _SPARSE[id(M)] = (M, unit, src, multi, rows, np.ascontiguousarray(M[np.ix_(rows, multi)]))
    return form


def _product(a: np.ndarray, M: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``einsum("js,sq->jq", a, M)`` with the same bits, skipping ``M``'s zeros: the einsum adds the products
    one ``s`` at a time onto a zero start, so a column with a single unit entry is that entry's ``a`` column
    (plus 0.0: the einsum's sign of a zero), an all-zero column is +0.0, and the other columns need only the
    rows where they are non-zero (the skipped products are zeros). ``a`` must be finite (a zero times an
    infinity is NaN): otherwise the full einsum. Pinned against the einsum in tests/unit/test_logit_stack_product.py."""
    if not np.isfinite(a).all():
        return _einsum("js,sq->jq", a, M) if out is None else _einsum("js,sq->jq", a, M, out=out)
    _, unit, src, multi, rows, Mr = _sparse_form(M)
    if out is None:
        out = np.zeros((a.shape[0], M.shape[1]))
    else:
        out[...] = 0.0
    if unit.size:
        out[:, unit] = a[:, src]
        out[:, unit] += 0.0
    if multi.size:
        out[:, multi] = _einsum("js,sq->jq", np.ascontiguousarray(a[:, rows]), Mr)
    return out


def _level_sums(levels: tuple, v: np.ndarray, products: bool) -> np.ndarray:
    """Per fit: the sums of ``v`` and of ``v x_k`` over each score level's cells (``[sum v (D), sum v x
    (D x p)]``), and with ``products`` also ``sum v x_k x_l`` over all cells."""
    starts, _, X, XX = levels
    p = X.shape[1]
    parts = [np.add.reduceat(v, starts, axis=1)]
    if p == 1:
        parts.append(np.add.reduceat(v * X[:, 0], starts, axis=1))
    elif p:
        parts.append(np.add.reduceat(v[:, :, None] * X, starts, axis=1).reshape(v.shape[0], -1))
    if products and p:
        parts.append(_product(v, XX))  # einsum "jg,gt->jt" (one-hot covariates: most products are zero)
    return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _gram(parts: list, levels: tuple, v: np.ndarray, r: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Upper triangles of ``F' diag(v) F`` and ``F' r`` of every fit (each with its design), from
    the per-score-level sums (`_level_sums`; the cells enter once per fit, not once per entry)."""
    sv, sr = _level_sums(levels, v, True), _level_sums(levels, r, False)
    # einsum, not BLAS: a threaded BLAS product's rounding depends on its thread count, and
    # replicates must be the same bits in every process (any node, any chunking)
    # (`_product`: the einsum's bits without its products with L's zeros)
    if len(parts) == 1:
        return _product(sv, parts[0][1]), _einsum("js,sp->jp", sr, parts[0][2])
    h = np.empty((v.shape[0], parts[0][1].shape[1]))
    b = np.empty((v.shape[0], P))
    for idx, L, Lb, _ in parts:
        h[idx] = _product(sv[idx], L)
        _einsum("js,sp->jp", sr[idx], Lb, out=b[idx])
    return h, b


def _apply(parts: list, levels: tuple, theta: np.ndarray, G: int) -> np.ndarray:
    """Index ``F theta`` of every fit at every cell (each fit with its design): the ramps and the
    intercept at the score levels, taken to the cells, plus the covariates' part."""
    _, level, X, _ = levels
    nr = parts[0][3].shape[0]
    p = X.shape[1]
    if len(parts) == 1:
        e = _einsum("jp,pd->jd", theta[:, :nr], parts[0][3])
    else:
        e = np.empty((theta.shape[0], parts[0][3].shape[1]))
        for idx, _, _, RT in parts:
            _einsum("jp,pd->jd", theta[idx, :nr], RT, out=e[idx])
    e += theta[:, -1:]
    eta = e[:, level]
    if p == 1:
        eta += theta[:, nr:nr + 1] * X[:, 0]
    elif p:
        eta += _einsum("jk,gk->jg", theta[:, nr:nr + p], X)
    return eta


def newton_stack(levels: tuple, designs: list, counts: np.ndarray, W: np.ndarray, WT: np.ndarray,
                 pen: np.ndarray, mu: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray:
    """`_logit_newton` on a stack of fits: rows of ``W``, ``WT`` (= W t), ``pen`` (the ridge per
    coefficient) and the start ``mu``; ``levels``: the cells' score levels and covariates, ``designs``:
    (L, Lb, R', largest |F| per column) of each group of ``counts`` consecutive fits sharing a design
    (`cje_engine.calibration.two_stage_batch._score_design`). Same steps as the scalar loop;
    returns the coefficients (N, P)."""
    N, P = pen.shape
    G = W.shape[1]
    out = np.empty((N, P))
    eta = np.log(mu / (1.0 - mu))
    theta = None
    sym, eye = _symmetric(P), eye_stack(P)
    group = np.repeat(np.arange(len(designs)), counts)
    act = np.arange(N)  # the fits still iterating (rows of the working arrays)
    parts = _parts(designs, counts)
    fmax = np.vstack([np.broadcast_to(d[3], (c, P)) for d, c in zip(designs, counts.tolist())])
    mask = np.ones((N, P), dtype=bool)  # free coefficients of each fit's Newton system
    for _ in range(NEWTON_MAX):
        n = W.shape[0]
        wmu = W * mu
        v = wmu - wmu * mu  # w mu (1 - mu)
        if theta is None:  # working response v eta + w (t - mu)
            r = v * eta
            r += WT
            r -= wmu
        else:  # eta = F theta, so F' v eta = (H - pen) theta: only w (t - mu) goes through the cells
            r = WT - wmu
        h, b = _gram(parts, levels, v, r, P)
        Hf = np.take(h, sym, axis=1)  # the symmetric matrices from their upper triangles
        H = Hf.reshape(n, P, P)
        if theta is not None:
            b += np.matmul(H, theta[:, :, None])[:, :, 0]
        Hf[:, ::P + 1] += pen
        if theta is None:  # the first step: the full active set from the start's free ramps
            new = _qp_rows(H, b, n_ramp, free)
        else:  # Newton on the current free set; the full active set only where a free ramp turns negative
            if mask.all():
                new = _lapack.solve1(H, b, signature="dd->d")
            else:
                new = _lapack.solve1(np.where(mask[:, :, None] & mask[:, None, :], H, eye), np.where(mask, b, 0.0),
                                     signature="dd->d")
            neg = (new[:, :n_ramp] < 0).any(1)
            if neg.any():
                rows = np.flatnonzero(neg)
                new[rows] = _qp_rows(H[rows], b[rows], n_ramp, free[rows])
        eta_c = _apply(parts, levels, new, G)
        if theta is None:  # the first step (from the data's start) is taken whole
            moved = np.inf
        else:
            step = new - theta
            # a step that moves no index by more than log 2 lowers the objective (the curvature
            # changes by less than a factor 2 along it, docs/statistics.md): no check needed
            size = np.abs(step)
            big = (size * fmax).sum(1) > LOG2
            if big.any():  # the bound is loose: the exact largest index change
                big &= np.abs(eta_c - eta).max(1) > LOG2
            s = None
            if big.any():
                s, new, eta_c = _halve(parts, levels, W, WT, pen, theta, eta, step, new, eta_c, big)
            moved = (size if s is None else np.abs(s[:, None] * step)).max(1)
        theta, eta = new, eta_c
        free = theta[:, :n_ramp] > 0
        stop = moved <= NEWTON_TOL * (1.0 + np.abs(theta).max(1))
        if stop.any():  # converged on its free set: a KKT point unless a fixed ramp has a descent direction
            grad = b - np.matmul(H, theta[:, :, None])[:, :, 0]
            viol = ~free & (grad[:, :n_ramp] > 1e-9 * (np.abs(b).max(1, keepdims=True) + 1e-300))
            again = stop & viol.any(1)
            free |= viol & again[:, None]
            conv = stop & ~again
            if conv.any():  # final: out of the stack
                out[act[conv]] = theta[conv]
                if conv.all():
                    return out
                keep = np.flatnonzero(~conv)
                act, W, WT, pen, theta, eta = act[keep], W[keep], WT[keep], pen[keep], theta[keep], eta[keep]
                free, fmax, mask = free[keep], fmax[keep], mask[keep]
                parts = _parts(designs, np.bincount(group[act], minlength=len(designs)))
        mu = np.tanh(0.5 * eta)  # expit(eta) = (1 + tanh(eta / 2)) / 2, without overflow, faster than expit
        mu += 1.0
        mu *= 0.5
        mask[:, :n_ramp] = free
    out[act] = theta
    return out


def _objective(W: np.ndarray, WT: np.ndarray, eta: np.ndarray, theta: np.ndarray, pen: np.ndarray) -> np.ndarray:
    return (W * np.logaddexp(0.0, eta) - WT * eta).sum(1) + 0.5 * (pen * theta * theta).sum(1)


def _halve(parts: list, levels: tuple, W: np.ndarray, WT: np.ndarray, pen: np.ndarray, theta: np.ndarray, eta: np.ndarray,
           step: np.ndarray, new: np.ndarray, eta_c: np.ndarray, big: np.ndarray):
    """Step halving for the fits ``big``: halve until the objective does not rise (or 1e-6).
    Returns the step lengths and the accepted coefficients and indices."""
    G = W.shape[1]
    s = np.ones(W.shape[0])
    q = _objective(W, WT, eta, theta, pen)
    q_c = _objective(W, WT, eta_c, new, pen)
    while True:
        bad = big & (q_c > q + 1e-12 * (1.0 + np.abs(q))) & (s >= 1e-6)
        if not bad.any():
            return s, new, eta_c
        s = np.where(bad, 0.5 * s, s)
        cand = theta + s[:, None] * step
        eta_c = np.where(bad[:, None], _apply(parts, levels, cand, G), eta_c)
        new = np.where(bad[:, None], cand, new)
        q_c = np.where(bad, _objective(W, WT, eta_c, new, pen), q_c)


def _qp_stack_pd(H: np.ndarray, b: np.ndarray, n_ramp: int, free: np.ndarray | None,
                 rounds: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The active set of `_ramp_lsq_stack` for positive definite systems (the ridge makes the logit
    stage's so): no rank checks, one batched solve of every masked system per round until every
    system is a KKT point (free ramps > 0, no fixed ramp with a descent direction); ``done`` False
    where ``rounds`` did not settle it (the caller then uses `qp_ramp`)."""
    N, P = b.shape
    if free is None or free.all():  # every ramp free: a KKT point unless a ramp comes out negative
        x = _lapack.solve1(H, b, signature="dd->d")
        neg = (x[:, :n_ramp] < 0).any(1)
        if not neg.any():
            return x, ~neg
    mask = np.ones((N, P), dtype=bool)
    if free is not None:
        mask[:, :n_ramp] = free
    tol = 1e-9 * (np.abs(b).max(1) + 1e-300)
    eye = eye_stack(P)
    for _ in range(rounds):
        x = _lapack.solve1(np.where(mask[:, :, None] & mask[:, None, :], H, eye), np.where(mask, b, 0.0),
                           signature="dd->d")
        x[~mask] = 0.0
        ramps, fr = x[:, :n_ramp], mask[:, :n_ramp]
        neg = (ramps < 0).any(1)
        grad = b - np.matmul(H, x[:, :, None])[:, :, 0]
        viol = ~fr & (grad[:, :n_ramp] > tol[:, None])
        settled = ~neg & ~viol.any(1)
        if settled.all():
            return x, settled
        mask[:, :n_ramp] = np.where(neg[:, None], fr & (ramps > 0), fr | viol)
    return x, settled


def _qp_rows(H: np.ndarray, b: np.ndarray, n_ramp: int, free: np.ndarray | None) -> np.ndarray:
    """`_qp_stack_pd`, with `qp_ramp` for the systems it did not settle."""
    x, done = _qp_stack_pd(H, b, n_ramp, free)
    for i in np.flatnonzero(~done):
        x[i] = qp_ramp(H[i], b[i], n_ramp, None)
    return x

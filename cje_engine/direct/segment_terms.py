"""Influence terms of many policies in a sparse Gram form (the segment x policy cells of `segment_by`).

`cje_engine.direct.estimators.influence` builds dense (prompts, 2K) arrays. With one virtual policy per
segment x policy cell (K ~ 100) and millions of prompts they are tens of GiB, and every variance, interval
and comparison of the finalize reads whole columns of them. Yet each column is sparse or low-rank:

* the evaluation part ``(f_i - theta_v) / n_v`` and the own-label and label-residual parts of cell ``v`` are
  non-zero only on the prompts with rows (labels) in that cell;
* the calibration part of cell ``v`` is ``sum_b rho_v(b) R[c, b]``: one per-prompt vector ``R[:, b]`` per
  level set ``b`` of the fitted calibrator (the calibration rows' residuals over ``m``), weighted by the
  cell's share ``rho_v`` of the level set (`estimators.calibration_term`); the audit's calibration part the
  same with the cell's labelled rows' shares.

So every prompt keeps one sparse basis row ``[e | r | own | R]`` (K + K + K + level sets) and each influence
column is that row times a column of a map (`cje_engine.inference.gram.GramTerms` on a
`cje_engine.inference.gram.SparseBasis`): the finalize's variances, accelerations, power-tuning weights and
paired differences come from the basis's cross-products (`GramTerms` answers them), never from a
(prompts, 4K) array. The same numbers as the dense terms up to the order of summation (pinned to 1e-12
relative in tests/unit/test_segment_terms.py).
"""
from __future__ import annotations

import numpy as np
from scipy import sparse

from cje_engine.direct.estimators import Design, level_set_shares
from cje_engine.inference.gram import GramTerms, Moments, SparseBasis


def _rho(ls, share: np.ndarray) -> np.ndarray:
    """(level sets, K) share of each policy's weight ``share`` (K, G) in each level set over the calibration
    rows' share (`estimators.calibration_term`'s ``rho``, one column per policy)."""
    K = share.shape[0]
    out = np.zeros((ls.n_blocks, K))
    for k in range(K):
        p_k = (np.bincount(ls.bj, weights=share[k] * (1 - ls.t), minlength=ls.n_blocks)
               + np.bincount(ls.bj1, weights=share[k] * ls.t, minlength=ls.n_blocks))
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:, k] = np.where(ls.q > 0, p_k / ls.q, 0.0)
    return out


def sparse_influence(design: Design, f: np.ndarray, full, stats: np.ndarray) -> dict[str, GramTerms]:
    """`estimators.influence` (``total``, ``calibration``, ``audit``) and the own-label terms (``own``,
    `cje_engine.direct.verified.own_label_influence`) of every policy of ``design`` as `GramTerms` on one
    `SparseBasis` (module docstring).

    Parameters
    ----------
    design : Design
        The (virtual-policy) design, with its cells.
    f : ndarray (n_rows,)
        Calibrated value of every row (out of fold on the calibration rows).
    full : fitted calibrator on all calibration rows.
    stats : ndarray (2K,)
        `estimators.policy_stats` of the fit (plug-in, then augmented values).

    Returns
    -------
    dict of str to GramTerms
        ``total`` and ``calibration`` (prompts, 2K), ``audit`` and ``own`` (prompts, K); a column NaN for
        lack of labels is NaN on every prompt, as in the dense terms.
    """
    d = design.data
    K, n_p = design.n_policies, d.n_prompts
    plug, aug = stats[:K], stats[K:]
    n_k = np.bincount(d.policy, minlength=K).astype(float)
    # evaluation part: every row of the cell, (f - theta) / n
    e_val = (f - plug[d.policy]) / n_k[d.policy]
    lab = design.lab_rows
    lw, lab_pol, lab_prompt = d.label_weight[lab], d.policy[lab], d.prompt[lab]
    den = np.bincount(lab_pol, weights=lw, minlength=K)
    with np.errstate(invalid="ignore", divide="ignore"):
        r_val = lw * ((d.label[lab] - f[lab]) - (aug - plug)[lab_pol]) / den[lab_pol]
        means = np.bincount(lab_pol, weights=lw * d.label[lab], minlength=K) / den
        own_val = lw * (d.label[lab] - means[lab_pol]) / den[lab_pol]
    has = den[lab_pol] > 0  # a policy without positively weighted labels: its columns are NaN (in the map)
    r_val, own_val = np.where(has, r_val, 0.0), np.where(has, own_val, 0.0)
    # calibration part: the calibration rows' residuals / m per (prompt, level set)
    cr = design.cal_rows
    ls = level_set_shares(design, full, f[cr])
    B = ls.n_blocks
    R_val = ls.resid_cal / ls.m
    rows = np.concatenate([d.prompt, lab_prompt, lab_prompt, d.prompt[cr]]).astype(np.int64)
    cols = np.concatenate([d.policy.astype(np.int64), K + lab_pol.astype(np.int64), 2 * K + lab_pol.astype(np.int64),
                           3 * K + ls.b_cal.astype(np.int64)])
    vals = np.concatenate([e_val, r_val, own_val, R_val])
    basis = SparseBasis(sparse.coo_matrix((vals, (rows, cols)), shape=(n_p, 3 * K + B)).tocsc(), Moments.zero(0))

    counts = design.cells.counts
    rho_plug = _rho(ls, counts / n_k[:, None])
    G = counts.shape[1]
    lab_counts = np.bincount(lab_pol.astype(np.int64) * G + design.cells.row_cell[lab], weights=lw,
                             minlength=K * G).reshape(K, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_share = np.where(den[:, None] > 0, lab_counts / den[:, None], 0.0)
    rho_aud = _rho(ls, lab_share)

    D = 3 * K + B
    eye = np.eye(K)
    e_map, r_map, own_map, cal_map, aud_map = (np.zeros((D, K)) for _ in range(5))
    e_map[:K] = eye
    r_map[K:2 * K] = eye
    own_map[2 * K:3 * K] = eye
    cal_map[3 * K:] = rho_plug
    aud_map[K:2 * K] = eye
    aud_map[3 * K:] = -rho_aud
    gone = np.flatnonzero(~(den > 0))
    maps = {"total": np.hstack([e_map + cal_map, e_map + r_map]), "calibration": np.hstack([cal_map, r_map]),
            "audit": aud_map, "own": own_map}
    maps["total"][:, K + gone] = np.nan
    maps["calibration"][:, K + gone] = np.nan
    maps["audit"][:, gone] = np.nan
    maps["own"][:, gone] = np.nan
    return {name: GramTerms(basis, M) for name, M in maps.items()}


def prompts_per_column(design: Design, terms: dict[str, GramTerms] | None = None) -> np.ndarray:
    """Distinct prompts with a row of each policy of ``design`` (no pass over (policy, prompt) pairs'
    hashes: the structure of the sparse (prompt, policy) matrix). ``terms``: `sparse_influence` of the design,
    whose evaluation columns have exactly that structure (one stored entry per (prompt, policy) pair with
    rows, kept when its value is 0)."""
    d = design.data
    K = design.n_policies
    if terms is not None:
        return np.diff(terms["total"].basis.rows.indptr[:K + 1]).astype(np.int64)
    m = sparse.coo_matrix((np.ones(d.n_rows, dtype=np.int8), (d.prompt.astype(np.int64), d.policy.astype(np.int64))),
                          shape=(d.n_prompts, K)).tocsc()
    return np.diff(m.indptr)

"""The verified level: the power-tuned residual correction (PPI++), one policy at a time.

With ``O`` the policy's own-label mean (Hajek, weighted by 1 / P(labelled)) and ``A`` its augmented
level (calibrated plug-in over all its rows plus the mean residual on its own labels),

    theta_lambda = O + lambda (A - O) = lambda * plug_in + mean over own labels of (Y - lambda f).

``A - O = plug_in - mean over own labels of f`` has mean zero whatever the calibration does (the own
labels are a random sample of the policy's rows), so ``theta_lambda`` is unbiased for every fixed
``lambda`` without assuming that the calibration transports: ``lambda = 0`` is the oracle-only mean,
``lambda = 1`` the augmented level. ``lambda`` is chosen to minimise the variance,

    lambda* = Cov(O, O - A) / Var(A - O)   (clipped to [0, 1]),

estimated from the bootstrap replicates of ``O`` and ``A`` (each refits the calibrator, so the
calibrator's error is carried) or, on the analytic route, from their per-prompt influence terms.
Angelopoulos, Duchi & Zrnic (2023), "PPI++: efficient prediction-powered inference", with the
prompt as the cluster. Estimating ``lambda`` changes the estimate by ``(lambda_hat - lambda*)(A - O)``,
a product of two ``O_p(n^-1/2)`` terms; the intervals' coverage with 10-50 labels is measured in
``benchmarks/bench_verified.py`` and pinned in ``tests/stats/test_verified_claims.py``.
"""
from __future__ import annotations

import numpy as np

from cje_engine.inference.gram import GramTerms


def power_tuned_lambda(own: np.ndarray, aug: np.ndarray) -> float:
    """Variance-minimising weight of the augmented level against the own-label mean.

    Parameters
    ----------
    own, aug : ndarray, shape (B,)
        Paired draws of the own-label mean and the augmented level (bootstrap replicates), or their
        per-prompt influence terms. Non-finite pairs are left out.

    Returns
    -------
    float
        ``lambda`` in [0, 1]; 1 (the augmented level) when ``A - O`` does not vary.
    """
    if isinstance(own, GramTerms):  # the sharded path's Gram form: from the moments
        return own.power_tuned_lambda(aug)
    ok = np.isfinite(own) & np.isfinite(aug)
    o, a = own[ok], aug[ok]
    if o.size < 3:
        return 1.0
    d = a - o
    var_d = float(np.var(d))
    if not var_d > 0:
        return 1.0
    lam = -float(np.mean((o - o.mean()) * (d - d.mean()))) / var_d
    return float(np.clip(lam, 0.0, 1.0))


def power_tuned(own: np.ndarray, aug: np.ndarray, lam: float | np.ndarray) -> np.ndarray:
    """``own + lam (aug - own)``: the level (or its replicates, or its influence terms) at ``lam``."""
    return own + lam * (aug - own)


def own_label_influence(prompt: np.ndarray, policy: np.ndarray, y: np.ndarray, weight: np.ndarray,
                        n_prompts: int, n_policies: int) -> tuple[np.ndarray, np.ndarray]:
    """Own-label means and their per-prompt influence terms.

    Parameters
    ----------
    prompt, policy, y, weight : ndarray, shape (m,)
        The labelled rows' prompt and policy codes, labels and label weights (1 / P(labelled)).

    Returns
    -------
    means : ndarray (K,)
        Hajek means per policy (NaN without labels).
    psi : ndarray (n_prompts, K)
        ``sum over the prompt's labelled rows of w (y - mean) / sum(w)`` (NaN column without labels).
    """
    K = n_policies
    den = np.bincount(policy, weights=weight, minlength=K)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.bincount(policy, weights=weight * y, minlength=K) / den
        contrib = weight * (y - means[policy]) / den[policy]
    psi = np.bincount(prompt.astype(np.int64) * K + policy, weights=contrib,
                      minlength=n_prompts * K).reshape(n_prompts, K)
    psi[:, den <= 0] = np.nan
    return means, psi

"""Off-policy estimators with prompt-clustered influence functions, and IF stacking.

Each returns an `Estimate` (value, clustered SE, per-prompt influence sums):

- ``ips``: mean of w R with raw weights (log-space, may be astronomically noisy);
- ``snips``: sum W R / sum W (self-normalised);
- ``calibrated_ips``: mean of W~ R with SIMCal-stabilised weights W~ (`cje_engine.offpolicy.weights.SIMCal`);
- ``dr``: mean over fresh draws of q + mean over logged rows of W~ (R - q) (hybrid);
- ``direct``: mean of the fresh draws' calibrated rewards;
- ``stacked``: influence-function stacking of the candidates (simplex weights minimising the
  clustered variance of the combined influence function).

Diagnostics are in `cje_engine.offpolicy.diagnostics`, gates in `cje_engine.offpolicy.gates`, the
per-target evaluation in `cje_engine.offpolicy.target`. Formulas and choices: docs/offpolicy.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_ppf
from cje_engine.inference.variance import cluster_cov, cluster_sums, clustered_se
from cje_engine.offpolicy.weights import log_mean_weight, mean_one_weights, solve_simplex_qp

LOGS_ONLY = ("ips", "snips", "calibrated_ips")
ALL_ESTIMATORS = ("ips", "snips", "calibrated_ips", "dr", "direct")
DEFAULT_STACK = ("snips", "calibrated_ips", "dr", "direct")


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its prompt-clustered influence function.

    ``psi[c]`` is cluster c's contribution to ``value - truth`` (sum over the cluster's rows of
    the row influence divided by the sample size); ``se = sqrt(G/(G-1) * sum psi^2)``.
    """

    name: str
    value: float
    se: float
    clusters: np.ndarray = field(repr=False)
    psi: np.ndarray = field(repr=False)

    def ci(self, level: float = 0.95) -> tuple[float, float]:
        """Normal interval ``value +/- z * se`` at ``level``."""
        z = float(norm_ppf(0.5 + level / 2))
        return (self.value - z * self.se, self.value + z * self.se)


def _merge_psi(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    parts = list(parts)
    labels = np.unique(np.concatenate([p[0] for p in parts]))
    psi = np.zeros(labels.shape[0])
    for lab, val in parts:
        psi[np.searchsorted(labels, lab)] += val
    return labels, psi


def _make(name: str, value: float, parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> Estimate:
    labels, psi = _merge_psi(parts)
    return Estimate(name, float(value), clustered_se(psi), labels, psi)


def estimate_ips(log_w: np.ndarray, rewards: np.ndarray, clusters: np.ndarray) -> Estimate:
    """IPS, ``mean(w R)`` with raw weights, computed as ``mean(w) * mean(W R)`` in log space.

    The value is ``inf`` when the mean raw weight overflows double precision (the gates refuse it).
    """
    W = mean_one_weights(log_w)
    n = W.shape[0]
    lmw = log_mean_weight(log_w)
    scale = float(np.exp(lmw)) if lmw <= 709.0 else float("inf")
    if not np.isfinite(scale):
        nan_psi = np.full(np.unique(clusters).shape[0], np.nan)
        return Estimate("ips", float("inf"), float("inf"), np.unique(clusters), nan_psi)
    theta1 = float(np.mean(W * rewards))
    phi = scale * (W * rewards - theta1)
    return _make("ips", scale * theta1, [cluster_sums(phi / n, clusters)])


def estimate_snips(W: np.ndarray, rewards: np.ndarray, clusters: np.ndarray) -> Estimate:
    """SNIPS, ``sum W R / sum W``; influence ``W (R - theta) / mean(W)``."""
    n = W.shape[0]
    mw = float(W.mean())
    theta = float(np.sum(W * rewards) / np.sum(W))
    phi = W * (rewards - theta) / mw
    return _make("snips", theta, [cluster_sums(phi / n, clusters)])


def estimate_weighted(name: str, W_used: np.ndarray, W_if: np.ndarray, y: np.ndarray,
                      clusters: np.ndarray) -> Estimate:
    """``theta = mean(W_used * y)`` with mean-one (self-normalised) weights ``W_used``.

    Influence ``W_if * (y - theta)`` (centred), the self-normalised form; ``W_if`` are the
    weights standing in for W_used in the influence function (SIMCal's ``influence_weights_``).
    """
    n = W_used.shape[0]
    theta = float(np.mean(W_used * y))
    phi = W_if * (y - theta)
    phi = phi - phi.mean()
    return _make(name, theta, [cluster_sums(phi / n, clusters)])


def estimate_dr(W_used: np.ndarray, W_if: np.ndarray, rewards: np.ndarray, q_logged: np.ndarray,
                q_fresh: np.ndarray, clusters: np.ndarray, fresh_clusters: np.ndarray,
                name: str = "dr") -> Estimate:
    """Calibrated DR: ``mean_fresh(q) + mean_logged(W (R - q))``.

    The two samples are independent given the prompts; their influence contributions are added
    per prompt, so prompts shared by fresh and logged rows are handled as one cluster.
    """
    n, m = W_used.shape[0], q_fresh.shape[0]
    resid = rewards - q_logged
    corr = float(np.mean(W_used * resid))
    base = float(np.mean(q_fresh))
    phi_l = W_if * (resid - corr)
    phi_l = phi_l - phi_l.mean()
    phi_f = q_fresh - base
    return _make(name, base + corr, [cluster_sums(phi_l / n, clusters), cluster_sums(phi_f / m, fresh_clusters)])


def estimate_direct(fresh_rewards: np.ndarray, fresh_clusters: np.ndarray) -> Estimate:
    """Direct: mean calibrated reward of the target's fresh draws (treats the calibrator as fixed;
    the bootstrap adds the calibration uncertainty)."""
    m = fresh_rewards.shape[0]
    theta = float(np.mean(fresh_rewards))
    return _make("direct", theta, [cluster_sums((fresh_rewards - theta) / m, fresh_clusters)])


@dataclass(frozen=True)
class StackedEstimate(Estimate):
    """IF-stacked estimate; ``coef`` maps candidate name to its simplex weight."""

    coef: Mapping[str, float] = field(default_factory=dict)


def stack_estimates(candidates: Sequence[Estimate] | Mapping[str, Estimate], name: str = "stacked") -> StackedEstimate:
    """Influence-function stacking: simplex weights b minimising ``b' Cov(Psi) b``.

    ``Psi`` holds the candidates' clustered influence contributions aligned on the union of
    prompts; ``Cov = G/(G-1) Psi' Psi``. The stacked value is ``sum b_k theta_k`` and its SE
    ``sqrt(b' Cov b)``, never above the best single candidate's (every vertex is feasible).
    The weights are chosen on the same data, so the SE is slightly optimistic; the bootstrap
    re-stacks in every replicate.
    """
    cands = list(candidates.values()) if isinstance(candidates, Mapping) else list(candidates)
    if not cands:
        raise CJEInputError("no candidate estimators to stack; expected at least one")
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        raise CJEInputError(f"candidate names must be distinct, got {names}")
    for c in cands:
        if not (np.isfinite(c.value) and np.all(np.isfinite(c.psi))):
            raise CJEInputError(f"candidate {c.name!r} has no finite estimate or influence function; "
                                "drop it from the stack")
    labels = np.unique(np.concatenate([c.clusters for c in cands]))
    Psi = np.zeros((labels.shape[0], len(cands)))
    for k, c in enumerate(cands):
        Psi[np.searchsorted(labels, c.clusters), k] = c.psi
    cov = cluster_cov(Psi, center=False)
    b = solve_simplex_qp(cov)
    value = float(sum(bk * c.value for bk, c in zip(b, cands)))
    psi = Psi @ b
    return StackedEstimate(name, value, float(np.sqrt(max(b @ cov @ b, 0.0))), labels, psi,
                           coef={c.name: float(bk) for bk, c in zip(b, cands)})

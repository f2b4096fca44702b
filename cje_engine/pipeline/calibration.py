"""Choosing the calibration: the sources that train it (robust pooling) and its mode.

`fit_calibration` is the first step of every evaluation:

1. **Mode.** ``auto`` fits every eligible registered mode (`cje_engine.calibration.registry`: without
   covariates only monotone is) and keeps the one of highest preference (two-stage) unless another
   fits every labelled row significantly better: out of fold for the calibration rows, under the
   borrowed fit for the audit slices of the other policies, each policy's labelled rows weighted
   equally, so that a judge bias that depends on a covariate and matters only where the evaluated
   policies differ from the calibration source is seen (`choose_mode`).
2. **Robust pooling.** With two or more calibration sources, a source whose own (out-of-fold) audit
   fails after Holm adjustment over the sources leaves the calibrator; the calibrator is refitted
   (mode chosen anew) and the remaining sources re-audited, to a fixed point. One source leaves per
   round, the most significant; a source is kept when the rest could not be cross-fitted. An excluded
   policy is then audited like any policy whose labels did not train the calibration.

Audit statistics (`audit_statistics`): the mean label residual ``delta_k`` (= augmented - plug-in)
of each policy. Its standard error carries the borrowed calibrator's estimation error (influence
``estimators.influence(...)["audit"]``) for a policy that did not train the calibrator. For a
calibration source the residuals are out of fold and the first-order calibration term would nearly
cancel its own residual term (the fit is partly a fit to those rows), so its SE is the residual
term's alone, which over-states the true SE by about ``1 / sqrt(1 - share)``: a conservative test.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cje_engine.audit import satterthwaite_df
from cje_engine.data.frame import EvalData
from cje_engine.data.ints import at_rows, count_distinct, present_codes, unique_inverse
from cje_engine.calibration import registry
from cje_engine.direct.estimators import (Design, cell_fits, cell_policy_stats, calibration_plan, influence, make_design,
                                          row_cells)
from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_sf
from cje_engine.inference.gram import GramTerms
from cje_engine.inference.multiplicity import holm
from cje_engine.options import EvaluationOptions

log = logging.getLogger(__name__)

#: z of the one-sided test of ``auto``: the preferred mode (two-stage) is used unless its squared error on the
#: labelled rows is larger than another eligible mode's (monotone) by more than this many standard errors.
MODE_Z = 2.0


@dataclass
class Fit:
    """One cross-fitted calibration: design, fitted values per cell and out of fold, models.

    Everything over all rows (``f``, ``stats``, ``infl``) is computed on first use: mode selection
    and robust pooling need only the labelled rows, so the fits they discard never touch the rest.
    """

    design: Design
    F_all: np.ndarray  # full fit at every cell
    f_cal: np.ndarray  # out-of-fold value of every calibration row
    full: object
    models: list | None

    @cached_property
    def f(self) -> np.ndarray:
        """Calibrated value of every row: out of fold on calibration rows, the full fit elsewhere."""
        f = self.F_all[self.design.cells.row_cell]
        f[self.design.cal_rows] = self.f_cal
        return f

    @cached_property
    def stats(self) -> np.ndarray:
        """`estimators.policy_stats` of this fit, from the cells (`estimators.cell_policy_stats`: no row pass)."""
        return cell_policy_stats(self.design, self.F_all, self.f_cal, self.f_lab)

    @cached_property
    def infl(self) -> dict:
        """Influence terms (`estimators.influence`)."""
        return influence(self.design, self.f, self.full, self.stats)

    @cached_property
    def f_lab(self) -> np.ndarray:
        """Calibrated value of every labelled row (``design.lab_rows`` order), without ``f``; read only (where every
        labelled row trains the calibrator, ``f_cal`` itself)."""
        lab, cr = self.design.lab_rows, self.design.cal_rows
        if cr is lab or (cr.size == lab.size and np.array_equal(cr, lab)):  # every labelled row calibrates
            return self.f_cal  # the values the gather below would overwrite entirely
        row_cell = self.design.cells.row_cell
        rows = at_rows(row_cell, lab)
        f = self.F_all[rows]
        if rows is row_cell:  # the labelled rows are every row: a calibration row's place among them is its index
            f[cr] = self.f_cal
            return f
        pos = np.clip(np.searchsorted(cr, lab), 0, max(cr.size - 1, 0))
        is_cal = cr[pos] == lab
        f[is_cal] = self.f_cal[pos[is_cal]]
        return f

    @cached_property
    def residual_terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`_labelled_residual_terms` of this fit (mode selection and the source audits read them; read-only)."""
        return _labelled_residual_terms(self)

    @cached_property
    def labelled_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, weight) of every labelled row, the weights summing to 1 within each policy: a function of the
        data's labelled rows only, the same in every fit of one data (`_share_labelled_prompts` shares it)."""
        return _labelled_weights(self.design)

    @cached_property
    def labelled_prompts(self) -> tuple[int, np.ndarray]:
        """(distinct prompts of the labelled rows, each labelled row's index among them): per-prompt sums over the
        labelled rows without a (prompts,) array of every prompt (`_sparse_column_var`)."""
        return labelled_prompt_index(at_rows(self.design.data.prompt, self.design.lab_rows),
                                     self.design.data.n_prompts)

    def release(self) -> None:
        """Drop what is rebuilt, identical, on demand (the calibration plan cached on the design, the labelled
        residual terms and prompt index): before another fit is computed beside this one."""
        self.design.__dict__.pop("_calibration_plan", None)
        self.__dict__.pop("residual_terms", None)
        self.__dict__.pop("labelled_prompts", None)
        self.__dict__.pop("labelled_weights", None)

    @property
    def sources(self) -> np.ndarray:
        """Policy codes whose labels train the calibrator."""
        pol = self.design.data.policy
        # `numpy.unique`'s array (its dtype too), counted without a sort
        return present_codes(pol[self.design.cal_rows], self.design.n_policies).astype(pol.dtype, copy=False)


#: Labelled rows ranked at a time by `labelled_prompt_index` (its temporaries stay in the core's cache).
RANK_BLOCK = 1 << 16


def labelled_prompt_index(prompt: np.ndarray, n_prompts: int, reference: bool = False) -> tuple[int, np.ndarray]:
    """(distinct values of ``prompt``, each value's index among them, int32 when they are fewer than 2^31): the
    prompt codes (in ``[0, n_prompts)``) of the labelled rows (`Fit.labelled_prompts`). By counting when the
    prompts are at most 64 a row, else (and with ``reference``) by `unique_inverse`'s sort and scatter
    (O(rows log rows)): the same index.

    The count: a bit a prompt, set where a row has it; a value's index is the number of bits set below its own,
    the set bits of the 64-bit words before its word (a running count a word) plus those below it in its word (a
    population count). 1/8 B a prompt and 8 B a word of 64 prompts, where a running count of every prompt took
    4 B a prompt (80 MB of fresh pages at 20M prompts, ~0.35 s of the sharded driver's fit on this machine)."""
    prompt = np.asarray(prompt).reshape(-1)
    if reference or prompt.size == 0 or n_prompts > 64 * prompt.size:
        u, inv = unique_inverse(prompt)
        inv = inv.reshape(-1)
        return int(u.size), inv.astype(np.int32) if u.size < 2**31 else inv  # an index for bincount: 4 B a row
    seen = np.zeros(-(-n_prompts // 64) * 64, dtype=bool)
    seen[prompt] = True
    words = np.packbits(seen, bitorder="little").view("<u8")  # bit j of word w: prompt 64 w + j
    del seen
    before = np.zeros(words.size + 1, dtype=np.int64)  # set bits in the words before each word
    np.cumsum(np.bitwise_count(words), out=before[1:], dtype=np.int64)
    n = int(before[-1])
    inv = np.empty(prompt.size, dtype=np.int32 if n < 2**31 else np.int64)
    one = np.uint64(1)
    for i in range(0, prompt.size, RANK_BLOCK):
        p = prompt[i:i + RANK_BLOCK]
        w = p >> 6
        below = words[w] & ((one << (p & 63).astype(np.uint64)) - one)  # the set bits below the value's own
        np.add(before[w], np.bitwise_count(below), out=inv[i:i + RANK_BLOCK], casting="unsafe")
    return n, inv


def _share_labelled_prompts(data: EvalData, fits: dict, shared: dict, weights_only: bool = False) -> None:
    """Give every fit of ``fits`` the labelled rows' prompt index (`Fit.labelled_prompts`) and weights
    (`Fit.labelled_weights`) computed once for ``data``: they depend on its labelled rows only (every design's
    ``lab_rows``, `make_design`), the same in every mode and round of robust pooling. ``weights_only``: the weights
    alone (`choose_mode` shares them before the residual terms read them)."""
    for fit in fits.values():
        if fit.design.data is not data:
            continue
        if "weights" not in shared:
            shared["weights"] = fit.labelled_weights
        fit.__dict__["labelled_weights"] = shared["weights"]
        if weights_only:
            continue
        if "value" not in shared:
            shared["value"] = fit.labelled_prompts
        fit.__dict__["labelled_prompts"] = shared["value"]


def fit_mode(data: EvalData, mode: str, sources: tuple[str, ...] | None, rows: tuple | None = None) -> Fit:
    """Cross-fit the calibrator of ``mode`` on the labels of ``sources`` (None: every labelled row).

    ``rows``: `estimators.row_cells` of ``data`` in ``mode`` (shared by the fits of one mode).
    """
    design = make_design(data, mode, sources, rows)
    F_all, f_cal, full, models = cell_fits(calibration_plan(design), np.ones(design.cal_rows.size))
    return Fit(design, F_all, f_cal, full, models)


def _column_var(psi: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """Clustered variance of each column's statistic from per-prompt influence sums (G/(G-1)).

    ``overwrite``: ``psi`` is a float64 temporary of the caller's, centred and squared in place (no copy).
    """
    if isinstance(psi, GramTerms):  # the sharded path's Gram form: from the moments
        return psi.column_var()
    c = np.nan_to_num(psi, copy=False) if overwrite else np.nan_to_num(np.asarray(psi, dtype=float))
    g = c.shape[0]
    c -= c.mean(axis=0)
    c *= c
    return (g / (g - 1) if g > 1 else 1.0) * np.sum(c, axis=0)


def _sparse_column_var(values: np.ndarray, g: int) -> float:
    """`_column_var` of one column of ``g`` clusters of which all but ``values`` are 0 (G/(G-1)): the centred
    sum of squares of the given values plus the zeros', without a (g,) array."""
    mean = float(values.sum()) / g if g else 0.0
    c = values - mean
    c *= c
    return (g / (g - 1) if g > 1 else 1.0) * (float(np.sum(c)) + (g - values.size) * mean * mean)


def audit_statistics(design: Design, stats: np.ndarray, infl: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean label residual, its SE and whether the policy trains the calibrator, per policy.

    ``stats`` and ``infl``: `estimators.policy_stats` and `estimators.influence` of the design's fit.
    Returns ``(delta, se, is_source)``, each of shape (K,); NaN where a policy has no labels.
    """
    K = design.n_policies
    delta = stats[K:] - stats[:K]
    is_source = np.isin(np.arange(K), present_codes(design.data.policy[design.cal_rows], K))
    psi = np.where(is_source[None, :], infl["calibration"][:, K:], infl["audit"])  # a new array: overwritten
    se = np.sqrt(np.maximum(_column_var(psi, overwrite=True), 0.0))
    se[~np.isfinite(delta)] = np.nan
    return delta, se, is_source


def audit_degrees_of_freedom(design: Design, infl: dict, se: np.ndarray, is_source: np.ndarray,
                             n_own_prompts: np.ndarray) -> np.ndarray:
    """Degrees of freedom of each policy's audit statistic ``delta / se`` (inf: the normal reference).

    A borrowed calibrator's audit variance ``se^2`` has two parts: the audit slice's residual term
    (``infl["calibration"]``'s residual column, from the policy's ``G_k`` labelled prompts: ``G_k - 1``
    degrees of freedom) and the rest, the calibrator's estimation error on that slice (from the
    ``G_cal`` calibration prompts: ``G_cal - 1``), taken as ``max(se^2 - v_residual, 0)`` whatever the
    route (the bootstrap's SD refits both stages of a two-stage calibrator, whose first stage the
    influence term leaves out). With ~12 calibration labels that part dominates and is itself
    estimated from ~12 residuals: the Welch-Satterthwaite df of the sum
    (`cje_engine.audit.satterthwaite_df`) gives the statistic's t reference; with many labels it tends
    to the normal. A calibration source's SE is its residual term's alone (conservative, module
    docstring) and keeps the normal reference, as in robust pooling. NaN where a policy has no labels.
    ``n_own_prompts``: each policy's distinct labelled prompts (``G_k``).
    """
    d, K = design.data, design.n_policies
    v_res = _column_var(infl["calibration"][:, K:])
    v = np.stack([v_res, np.maximum(np.nan_to_num(np.asarray(se, dtype=float)) ** 2 - v_res, 0.0)], axis=-1)
    g_own = np.asarray(n_own_prompts, dtype=float)
    g_cal = float(count_distinct(d.prompt[design.cal_rows], d.n_prompts))
    nu = np.stack([np.maximum(g_own - 1, 1), np.full(K, max(g_cal - 1, 1))], axis=-1)
    df = satterthwaite_df(v, nu)
    df[is_source] = np.inf
    df[g_own == 0] = np.nan
    return df


def _labelled_weights(design: Design) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, weight) of every labelled row of ``design``, weights summing to 1 within each policy."""
    d, lab = design.data, design.lab_rows
    lw, pol = at_rows(d.label_weight, lab), at_rows(d.policy, lab)
    den = np.bincount(pol, weights=lw, minlength=design.n_policies)
    return at_rows(d.prompt, lab), lw / den[pol]


def _labelled_residual_terms(fit: Fit, reference: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, weight, residual) of every labelled row, weights summing to 1 within each policy (the prompt and
    weights `Fit.labelled_weights`, shared by the fits of one data; ``reference``: computed here)."""
    prompt, w = _labelled_weights(fit.design) if reference else fit.labelled_weights
    return prompt, w, at_rows(fit.design.data.label, fit.design.lab_rows) - fit.f_lab


def source_audits(fit: Fit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`audit_statistics` of the calibration sources from their labelled rows alone (O(labels)).

    The same numbers as `audit_statistics` for the sources (residual mean, residual-term SE);
    NaN for every other policy.
    """
    d = fit.design.data
    K = fit.design.n_policies
    is_source = np.isin(np.arange(K), fit.sources)
    _, w, r = fit.residual_terms
    n_lab_prompts, lab_prompt = fit.labelled_prompts
    pol = at_rows(d.policy, fit.design.lab_rows)
    delta = np.full(K, np.nan)
    se = np.full(K, np.nan)
    for k in np.flatnonzero(is_source):
        sel = pol == k
        if not sel.any():
            continue
        delta[k] = float(np.sum(w[sel] * r[sel]))
        # per prompt over the labelled prompts only: the others' terms are 0 (no array of every prompt)
        psi = np.bincount(lab_prompt[sel], weights=w[sel] * (r[sel] - delta[k]), minlength=n_lab_prompts)
        se[k] = float(np.sqrt(_sparse_column_var(psi, d.n_prompts)))
    return delta, se, is_source


def _candidates(data: EvalData, opts: EvaluationOptions, n_cal: int) -> tuple[list, list[str]]:
    """The registered modes ``auto`` fits (registration order) and why the others are left out.

    An explicit ``calibration_mode`` is the only candidate.
    """
    if opts.calibration_mode != registry.AUTO:
        return [registry.get(opts.calibration_mode)], []
    p = data.X.shape[1]
    chosen, left_out = [], []
    for entry in registry.entries():
        if not entry.in_auto:
            continue
        why = entry.auto_exclusion(n_cal, p)
        if why is None:
            chosen.append(entry)
        else:
            left_out.append(why)
    if not chosen:
        raise CJEInputError("calibration_mode='auto' has no eligible calibration mode: " + "; ".join(left_out),
                            option="calibration_mode")
    return chosen, left_out


def _paired(fits: dict, entry, other, n_prompts: int) -> tuple[float, float]:
    """Mean difference of squared labelled residuals, ``other`` minus ``entry`` (each policy weighing 1),
    and its prompt-clustered SE."""
    _, w, r_other = fits[other.name].residual_terms
    _, _, r_entry = fits[entry.name].residual_terms
    n_lab_prompts, lab_prompt = fits[other.name].labelled_prompts
    t = np.bincount(lab_prompt, weights=w * (r_other**2 - r_entry**2), minlength=n_lab_prompts)  # 0 elsewhere
    n_pol = float(np.sum(w))  # policies with labels (each weighs 1)
    diff = float(t.sum() / n_pol)
    t /= n_pol
    return diff, float(np.sqrt(_sparse_column_var(t, n_prompts)))


def _compare(fits: dict, candidates: list, labelled_rmse: dict, n_prompts: int) -> tuple[str, str, dict]:
    """``auto`` among several fitted candidates: the preferred one unless another is significantly better.

    Returns (chosen, reason, the paired record of the closest challenger).
    """
    pref = max(candidates, key=lambda e: e.preference)  # the first registered on ties
    tests = [(c, *_paired(fits, pref, c, n_prompts)) for c in candidates if c is not pref]
    best, diff, se = min(tests, key=lambda t: t[1] + MODE_Z * t[2])  # the furthest past its threshold
    record = {"paired_difference": diff, "paired_se": se}
    drops_cov = pref.uses_covariates and not best.uses_covariates
    if diff < -MODE_Z * se:
        reason = (f"{best.label} fits the labelled rows of the evaluated policies better: its mean squared "
                  f"error is smaller by {-diff:.5f} (SE {se:.5f}, more than {MODE_Z:g} SE), "
                  + ("so the covariates are not used" if drops_cov else f"so it is used instead of {pref.label}"))
        return best.name, reason, record
    reason = (("covariates declared and " if pref.uses_covariates else "")
              + f"{best.label} is not significantly better on the labelled rows "
              f"of the evaluated policies (squared-error difference {diff:+.5f}, SE {se:.5f}; "
              f"labelled RMSE {labelled_rmse[pref.name]:.4f} {pref.label} vs "
              f"{labelled_rmse[best.name]:.4f} {best.label})"
              + ("; a covariate-dependent judge bias left out would bias every plug-in level" if drops_cov else ""))
    return pref.name, reason, record


def choose_mode(data: EvalData, opts: EvaluationOptions, sources: tuple[str, ...] | None,
                rows: dict | None = None, shared: dict | None = None) -> tuple[dict, dict]:
    """The calibration mode and the fits of every mode tried (so the chosen one is not refitted).

    ``auto``: every eligible registered mode is fitted (`_candidates`); with one, it is chosen; with
    several (covariates declared: monotone and two-stage), the one of highest preference (two-stage)
    unless another has a significantly smaller squared error on the labelled rows of the evaluated
    policies (paired, prompt-clustered, each policy weighted equally; one-sided at ``MODE_Z``). The
    declared covariates are kept by default because a covariate-dependent judge bias left in the
    calibration biases every plug-in level, which no interval carries, while an unneeded covariate
    costs only variance, which the intervals do carry.
    """
    lab_pol = data.policy[data.labelled]
    n_cal = int(lab_pol.size if sources is None else np.isin(lab_pol, [data.policies.index(p) for p in sources
                                                                        if p in data.policies]).sum())
    candidates, left_out = _candidates(data, opts, n_cal)
    rows = {} if rows is None else rows
    fits = {}
    for entry in candidates:
        m = entry.name
        if m not in rows:
            rows[m] = row_cells(data, m)
        fits[m] = fit_mode(data, m, sources, rows[m])
        # its calibration plan (~80 B a calibration row) is rebuilt, identical, where a bootstrap replicate needs
        # it: not held beside the next mode's fit, the audits and the rounds of robust pooling
        fits[m].design.__dict__.pop("_calibration_plan", None)
    if shared is not None:  # the labelled rows' weights of an earlier round (the same arrays), not computed again
        _share_labelled_prompts(data, fits, shared, weights_only=True)
    rmse, labelled_rmse = {}, {}
    for m, fit in fits.items():
        cr = fit.design.cal_rows
        rmse[m] = float(np.sqrt(np.mean((data.label[cr] - fit.f_cal) ** 2)))  # f_cal = f[cr]: no row pass
        _, w, r = fit.residual_terms
        labelled_rmse[m] = float(np.sqrt(np.sum(w * r * r) / np.sum(w)))
    selection = {"requested": opts.calibration_mode, "oof_rmse": rmse, "labelled_rmse": labelled_rmse}
    for entry in candidates:
        selection.update(entry.selection_record(fits[entry.name].design.n_knots))
    if opts.calibration_mode != registry.AUTO:
        chosen, reason = opts.calibration_mode, "requested by the user"
    elif len(candidates) == 1:
        chosen, reason = candidates[0].name, "; ".join(left_out)
    else:
        chosen, reason, paired = _compare(fits, candidates, labelled_rmse, data.n_prompts)
        selection.update(paired)
    selection.update(chosen=chosen, reason=reason)
    return selection, fits


def failing_source(delta: np.ndarray, se: np.ndarray, is_source: np.ndarray,
                   alpha: float) -> tuple[int, float, int] | None:
    """(code, Holm-adjusted p, family size) of the most significant failing calibration source, or None.

    Sources with a finite, positive SE form the family (at least two); the two-sided p-values of
    ``delta / se`` are Holm-adjusted and, among the failing ones, the largest |z| leaves (by |z|:
    adjusted p-values underflow to 0 at 100k labels). Shared by the full data's robust pooling and its
    rerun in every bootstrap replicate (`cje_engine.pipeline.pooling_replay`).
    """
    cand = np.flatnonzero(is_source & np.isfinite(se) & (se > 0) & np.isfinite(delta))
    if cand.size < 2:
        return None
    z = np.abs(delta[cand] / se[cand])
    p_adj = holm(2 * norm_sf(z))
    if not (p_adj <= alpha).any():
        return None
    i = int(np.argmax(np.where(p_adj <= alpha, z, -np.inf)))
    return int(cand[i]), float(p_adj[i]), int(cand.size)


def _failing_source(fit: Fit, alpha: float) -> dict | None:
    """The most significant calibration source whose own audit fails (Holm over the sources)."""
    delta, se, is_source = source_audits(fit)
    bad = failing_source(delta, se, is_source, alpha)
    if bad is None:
        return None
    k, p_adj, family = bad
    return {"policy": fit.design.data.policies[k], "residual_mean": float(delta[k]), "se": float(se[k]),
            "p_adjusted": p_adj, "family_size": family}


def fit_calibration(data: EvalData, opts: EvaluationOptions, rows: dict | None = None) -> tuple[Fit, dict, list[dict]]:
    """Choose the mode and the calibration sources (robust pooling); see the module docstring.

    ``rows``: `estimators.row_cells` of ``data`` per mode when given (a sharded preparation: its ``data`` holds
    the labelled rows, the cells and counts come from every row), else computed here.

    Returns
    -------
    fit : the chosen `Fit`
    selection : the mode selection record (result ``calibration.selection``)
    excluded : one record per source removed from the calibrator, in order
    """
    labelled = present_codes(data.policy[data.labelled], len(data.policies))
    sources = opts.calibration_policies
    names = list(sources) if sources is not None else [data.policies[k] for k in labelled]
    excluded: list[dict] = []
    rows = {} if rows is None else rows  # row-level cell coding per mode, shared by every round
    shared: dict = {}  # the labelled rows' prompt index and weights, the same in every fit (`_share_labelled_prompts`)
    selection, fits = choose_mode(data, opts, sources, rows, shared)
    _share_labelled_prompts(data, fits, shared)
    fit = fits[selection["chosen"]]
    current = sources
    while True:
        bad = _failing_source(fit, opts.alpha)
        if bad is None:
            break
        rest = tuple(n for n in names if n != bad["policy"])
        fit = fits = None  # not held beside the next round's fits (refitted, identical, if they cannot be made)
        try:
            selection_new, fits_new = choose_mode(data, opts, rest, rows, shared)
        except CJEInputError as exc:
            log.warning("calibration source %s failed its audit but is kept: %s", bad["policy"], exc)
            selection, fits = choose_mode(data, opts, current, rows, shared)
            _share_labelled_prompts(data, fits, shared)
            fit = fits[selection["chosen"]]
            break
        current = rest
        bad["reason"] = (f"its own out-of-fold audit failed (mean residual {bad['residual_mean']:+.3f}, SE "
                         f"{bad['se']:.3f}, Holm-adjusted p {bad['p_adjusted']:.2g} over {bad['family_size']} "
                         "calibration sources): its labels disagree with the other sources' calibration, so "
                         "they no longer train it; it is audited against the calibration of the others")
        bad["round"] = len(excluded) + 1
        excluded.append(bad)
        log.info("robust pooling: %s leaves the calibrator (%s)", bad["policy"], bad["reason"])
        names = list(rest)
        selection, fits = selection_new, fits_new
        selection_new = fits_new = None
        _share_labelled_prompts(data, fits, shared)
        fit = fits[selection["chosen"]]
    return fit, selection, excluded

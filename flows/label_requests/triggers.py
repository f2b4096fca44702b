"""The trigger rules (pure): which policies (or segment x policy cells) need labels, how many, and why
(docs/label-requests.md)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cje_engine.errors import CJEInputError
from cje_engine.inference.distributions import norm_ppf
from cje_engine.planning.allocation import is_under_labelled, labels_to_request
from cje_engine.planning.components import policy_components
from cje_engine.planning.model import VarianceComponents

from flows.label_requests.config import DESIGN_OF, RequestConfig

log = logging.getLogger(__name__)


def unwrap_result(published: Mapping[str, Any]) -> tuple[dict, dict]:
    """(result dict, run info) from a result dict or the evaluate flow's return value.

    The run info carries ``undecided`` (policy -> labels that would decide a drop across windows)
    when the flow's monitoring found one (`flows.pipelines.regressions.monitor_evaluation`).
    """
    if not isinstance(published, Mapping):
        raise CJEInputError(f"expected a published result dict, got {type(published).__name__}")
    if "policies" in published:
        return dict(published), {}
    inner = published.get("result")
    if isinstance(inner, Mapping) and "policies" in inner:
        info = {k: published.get(k) for k in ("run_key", "path", "window", "evaluation", "published")}
        info["undecided"] = dict((published.get("monitoring") or {}).get("undecided") or {})
        return dict(inner), info
    raise CJEInputError("the published result has no 'policies' section (expected evaluate(...).to_dict() or the "
                        "evaluate flow's return value)", column="policies")


def as_arrow_table(logs: Any) -> pa.Table:
    """The evaluated logs (an Arrow table or a pandas DataFrame) as an Arrow table with the columns the triggers
    read (``response_id``, ``policy``, ``judge_score``); anything else is a `CJEInputError` naming what is missing."""
    if isinstance(logs, pa.Table):
        table = logs
    else:
        try:
            table = pa.Table.from_pandas(logs, preserve_index=False)
        except Exception:
            raise CJEInputError(f"logs must be a pyarrow Table, a pandas DataFrame or a URI, got "
                                f"{type(logs).__name__}") from None
    for col in ("response_id", "policy", "judge_score"):
        if col not in table.column_names:
            raise CJEInputError(f"the evaluated logs lack column {col!r} (found {table.column_names})",
                                source="<logs>", column=col)
    return table


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int codes per row, names as an object array) of a string-like column, nulls included
    (a null is a name of its own, ``None``): one hash pass, no Python object per row."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    col = col.cast(pa.string())
    names = pc.unique(col)
    codes = pc.index_in(col, value_set=names).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, np.asarray(names.to_pylist(), dtype=object)


#: The engine's naming of segments (`cje_engine.pipeline.segments`): several columns' values joined by
#: ``" / "``, a missing value named ``"(missing)"``.
SEGMENT_JOIN, SEGMENT_MISSING = " / ", "(missing)"


def segment_keys(table: pa.Table, columns: Sequence[str]) -> pa.ChunkedArray:
    """Each row's segment name by the engine's rule (`SEGMENT_JOIN`, `SEGMENT_MISSING`).

    Raises
    ------
    CJEInputError
        A segment column is not in the logs read.
    """
    parts = []
    for col in columns:
        if col not in table.column_names:
            raise CJEInputError(f"the evaluated logs lack the segment column {col!r} (found {table.column_names})",
                                source="<logs>", column=col)
        arr = table.column(col)
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        parts.append(pc.fill_null(arr.cast(pa.string()), SEGMENT_MISSING))
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(*parts, SEGMENT_JOIN)


@dataclass
class TriggerRows:
    """Columnar view of the evaluated logs (only what the triggers need).

    Strings are never turned into one Python object per row: ``response_id`` stays an Arrow
    array with its rank in the (stable) sort by id; policies and log dates are integer codes
    into a small table of names; prompt ids are read for the chosen rows only.
    """

    rid_arrow: pa.ChunkedArray
    rid_rank: np.ndarray
    policy_codes: np.ndarray
    policy_names: np.ndarray
    score: np.ndarray
    labelled: np.ndarray
    prob: np.ndarray
    prompt_arrow: pa.ChunkedArray | None
    dt_codes: np.ndarray | None
    dt_names: np.ndarray | None
    segment_codes: np.ndarray | None = None
    segment_names: np.ndarray | None = None

    @classmethod
    def from_table(cls, table: pa.Table, segment_columns: Sequence[str] = ()) -> "TriggerRows":
        """The trigger columns of a logs table (dictionary-encoded ids decoded); with ``segment_columns`` (the
        result's ``segments.columns``) each row's segment by the engine's rule (`segment_keys`)."""
        n = table.num_rows
        rid = table.column("response_id")
        if pa.types.is_dictionary(rid.type):
            rid = rid.cast(rid.type.value_type)
        rid = rid.cast(pa.string())
        rank = np.empty(n, dtype=np.int64)
        # Arrow's sort is stable and compares UTF-8 bytes, i.e. code points: the order of
        # sorting the ids as Python strings, so a pool sorted by rank is sorted by id.
        rank[pc.sort_indices(rid).to_numpy()] = np.arange(n, dtype=np.int64)
        pcodes, pnames = _codes(table.column("policy"))
        score = table.column("judge_score").cast(pa.float64()).to_numpy()
        if "oracle_label" in table.column_names:
            lab = table.column("oracle_label").cast(pa.float64()).to_numpy(zero_copy_only=False)
            labelled = ~np.isnan(lab)  # nulls arrive as NaN
        else:
            labelled = np.zeros(n, dtype=bool)
        if "label_probability" in table.column_names:
            prob = table.column("label_probability").cast(pa.float64()).to_numpy(zero_copy_only=False)
            prob = np.where(np.isnan(prob), 1.0, prob)
        else:
            prob = np.ones(n)
        prompt = None
        if "prompt_id" in table.column_names:
            prompt = table.column("prompt_id")
            if pa.types.is_dictionary(prompt.type):
                prompt = prompt.cast(prompt.type.value_type)
            prompt = prompt.cast(pa.string())
        dcodes, dnames = _codes(table.column("dt")) if "dt" in table.column_names else (None, None)
        scodes, snames = _codes(segment_keys(table, segment_columns)) if segment_columns else (None, None)
        return cls(rid_arrow=rid, rid_rank=rank, policy_codes=pcodes, policy_names=pnames, score=score,
                   labelled=labelled, prob=prob, prompt_arrow=prompt, dt_codes=dcodes, dt_names=dnames,
                   segment_codes=scodes, segment_names=snames)

    def segment_in(self, names: Sequence[str]) -> np.ndarray:
        """Boolean mask of the rows whose segment is one of ``names`` (none without segment columns)."""
        if self.segment_codes is None:
            return np.zeros(self.rid_rank.size, dtype=bool)
        wanted = set(names)
        hit = np.array([v in wanted for v in self.segment_names.tolist()], dtype=bool)
        return hit[self.segment_codes] if hit.size else np.zeros(self.rid_rank.size, dtype=bool)

    @cached_property
    def policy(self) -> np.ndarray:
        """Policy per row (object array; built on first use, the triggers use `policy_in`)."""
        return self.policy_names[self.policy_codes]

    @cached_property
    def rid(self) -> np.ndarray:
        """Response id per row (object array; built on first use)."""
        return np.asarray(self.rid_arrow.to_pylist(), dtype=object)

    def policy_in(self, names: Sequence[str] | str) -> np.ndarray:
        """Boolean mask of the rows whose policy is one of ``names``."""
        wanted = {names} if isinstance(names, str) else set(names)
        hit = np.array([v in wanted for v in self.policy_names.tolist()], dtype=bool)
        return hit[self.policy_codes] if hit.size else np.zeros(self.policy_codes.size, dtype=bool)

    def rid_in(self, ids: Sequence[str] | set[str]) -> np.ndarray:
        """Boolean mask of the rows whose response id is in ``ids`` (a hash lookup)."""
        if not ids:
            return np.zeros(self.rid_rank.size, dtype=bool)
        hit = pc.is_in(self.rid_arrow, value_set=pa.array(list(ids), pa.string()))
        return hit.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)

    def recent_dt(self, days: int) -> np.ndarray:
        """Boolean mask of the rows on the last ``days`` log dates (all rows without a ``dt``)."""
        if self.dt_codes is None:
            return np.ones(self.rid_rank.size, dtype=bool)
        present = np.bincount(self.dt_codes, minlength=self.dt_names.size) > 0
        names = sorted(v for v, ok in zip(self.dt_names.tolist(), present) if ok and v is not None)
        keep = set(names[-days:])
        hit = np.array([v in keep for v in self.dt_names.tolist()], dtype=bool)
        return hit[self.dt_codes]

    def take(self, chosen: np.ndarray) -> dict[str, list]:
        """Python values of the chosen rows: ``response_id``, ``policy``, ``prompt_id``, ``dt``."""
        idx = pa.array(np.asarray(chosen, dtype=np.int64))
        return {"response_id": self.rid_arrow.take(idx).to_pylist(),
                "policy": self.policy_names[self.policy_codes[chosen]].tolist(),
                "prompt_id": None if self.prompt_arrow is None else self.prompt_arrow.take(idx).to_pylist(),
                "dt": None if self.dt_codes is None else self.dt_names[self.dt_codes[chosen]].tolist()}


def label_prior_probability(rows: TriggerRows, policy: str) -> float:
    """Harmonic mean of the stored label probabilities of the policy's labels (1 if none)."""
    sel = rows.labelled & rows.policy_in(policy)
    if not sel.any():
        return 1.0
    return float(sel.sum() / np.sum(1.0 / rows.prob[sel]))


# --------------------------------------------------------------------------------------
# trigger rules (pure)


def _z(alpha: float) -> float:
    return float(norm_ppf(1 - alpha / 2))


def audit_margin(result: Mapping) -> float:
    """The transport audit's practical margin in label units, as the engine computed it
    (`cje_engine.options.EvaluationOptions.audit_margin_in`) and stored it in every policy's ``audit.margin``.

    Raises
    ------
    CJEInputError
        The result holds no policy with an audit margin (not a result of the engine).
    """
    for p in (result.get("policies") or {}).values():
        margin = (p.get("audit") or {}).get("margin") if isinstance(p, Mapping) else None
        if margin is not None:
            return float(margin)
    raise CJEInputError("the result has no audit margin (policies.<name>.audit.margin): expected a result.json "
                        "of the engine", column="policies")


def _target_se(result: Mapping, cfg: RequestConfig) -> float:
    if cfg.target_se is not None:
        return cfg.target_se
    conf = result.get("config") or {}
    return audit_margin(result) / _z(float(conf.get("alpha", 0.05)))


def _pooled_residual_sd(result: Mapping) -> float:
    """Residual SD per label pooled over audited policies (sqrt of the median se^2 * n)."""
    vals = []
    for p in result["policies"].values():
        a = p.get("audit") or {}
        if a.get("se") and a.get("n_labels"):
            vals.append(float(a["se"]) ** 2 * float(a["n_labels"]))
    if vals:
        return math.sqrt(float(np.median(vals)))
    lo, hi = ((result.get("config") or {}).get("label_scale") or [0.0, 1.0])[:2]
    return 0.25 * (float(hi) - float(lo))  # a label with a spread of a quarter of its scale


def _trigger(code: str, scope: str, labels: int, reason: str, **detail: Any) -> dict:
    return {"trigger": code, "scope": scope, "labels": int(max(0, labels)), "design": DESIGN_OF[code],
            "reason": reason, "detail": detail}


def _verify_sizing(policy: Mapping, n: int, how: str) -> tuple[int, str]:
    """The larger of ``n`` and the own labels the result says would verify the policy (``labels_to_verify``:
    a verified level and its closest comparison decided at 80% power), with the sizing text."""
    ltv = policy.get("labels_to_verify") or {}
    need = ltv.get("n_labels")
    if policy.get("level_claim") == "assumes_transport" and isinstance(need, int) and need > n:
        return need, (f"the result's labels_to_verify: {need} own labels give a verified level and decide its closest "
                      f"comparison at {ltv.get('power', 0.8):.0%} power (was: {how})")
    return n, how


def audit_triggers(result: Mapping, cfg: RequestConfig) -> list[dict]:
    """Triggers 1-3: no own labels, inconclusive audit, failed audit."""
    conf = result.get("config") or {}
    alpha = float(conf.get("alpha", 0.05))
    min_labels = int(conf.get("min_labels", 10))
    out = []
    for name, p in result["policies"].items():
        a = p.get("audit") or {}
        verdict = a.get("verdict")
        n_own = int(p.get("n_labelled") or 0)
        if verdict == "not_run" and "no_own_labels" in cfg.triggers:
            if cfg.new_policy_labels is not None:
                n, how = cfg.new_policy_labels, "configured new_policy_labels"
            else:
                z = _z(alpha)  # audits are not adjusted for the number of policies (cje_engine.audit)
                margin = audit_margin(result)  # the engine's, from the result: never recomputed here
                sd = _pooled_residual_sd(result)
                n = max(min_labels, math.ceil((z * sd / margin) ** 2))
                how = (f"n = max(min_labels={min_labels}, ceil((z * sd_r / margin)^2)) with z={z:.3f}, pooled "
                       f"residual SD sd_r={sd:.4f}, margin={margin:g}: the fewest labels whose CI fits inside the "
                       f"margin if the calibration transports")
                n, how = _verify_sizing(p, n, how)
            out.append(_trigger("no_own_labels", name, n - n_own,
                                f"policy {name!r} has {n_own} audit label(s) of its own: the calibration's transport "
                                f"to it is untested", sizing=how, n_labelled=n_own))
        elif verdict == "inconclusive" and "audit_inconclusive" in cfg.triggers:
            extra = a.get("extra_labels_needed")
            if extra is None:
                extra = max(min_labels - n_own, 1)
            extra, how = _verify_sizing(p, int(extra), "the audit's extra_labels_needed: n (se / target)^2 - n with "
                                                       "target = (margin - |delta|) / z (or |delta| / z past the margin)")
            out.append(_trigger("audit_inconclusive", name, int(extra),
                                f"the transport audit of {name!r} is inconclusive ({a.get('reason')})",
                                sizing=how,
                                residual_mean=a.get("residual_mean"), se=a.get("se"), n_labelled=n_own))
        elif verdict == "fail" and "audit_failed" in cfg.triggers:
            need_min = max(0, min_labels - n_own)
            target = _target_se(result, cfg)
            vc = p.get("variance_components") or {}
            n_prompts = float(vc.get("n_prompts") or p.get("n_rows") or 0)
            s2_res = float(a.get("se") or 0.0) ** 2 * max(n_own, 1)
            # Variance of a recalibrated (augmented) level: evaluation part of the estimate plus the
            # residual mean over own labels.  sigma2_eval from the result; sigma2 of the residual
            # term from the audit's clustered SE (se^2 * n_own).
            s2_eval = float(vc.get("sigma2_eval") or 0.0)
            plan = None
            need_se = 0
            if n_prompts >= 1 and (s2_eval > 0 or s2_res > 0):
                comps = VarianceComponents(s2_eval, s2_res, target=name, method="recalibration of a failed audit")
                plan = labels_to_request(comps, n_prompts, min(max(n_own, 1), n_prompts), cfg.c_S, cfg.c_Y,
                                         target_se=target, max_labels=cfg.max_labels_per_request)
                need_se = int(plan["labels"]) if (float(p.get("se") or 0) > target or need_min > 0
                                                  or p.get("basis_code") != "recalibrated") else 0
            n = max(need_min, need_se)
            if n > 0:
                out.append(_trigger(
                    "audit_failed", name, n,
                    f"the transport audit of {name!r} failed ({a.get('reason')}); labels for a policy-specific "
                    f"recalibration", level_claim=p.get("level_claim"), basis=p.get("basis_code"), n_labelled=n_own,
                    sizing=(f"max(min_labels - n_own = {need_min}, labels for SE <= {target:.4g} with Var = "
                            f"sigma2_eval/n + sigma2_res/m, sigma2_res = audit se^2 * n_own = {s2_res:.4g}, "
                            f"sigma2_eval = {s2_eval:.4g}, n = {n_prompts:g})"),
                    planner=plan))
    return out


def under_labelled_triggers(result: Mapping, cfg: RequestConfig) -> list[dict]:
    """Trigger 6: the square-root allocation law says the calibration is under-labelled."""
    if "under_labelled" not in cfg.triggers:
        return []
    out = []
    for name, p in result["policies"].items():
        try:
            comps = policy_components(result, name)
        except CJEInputError as exc:
            log.info("under_labelled: skipping %s (%s)", name, exc)
            continue
        n, m = comps.n_pilot, comps.m_pilot
        if m is None or n is None or m > n:
            continue
        if not is_under_labelled(comps, n, m, cfg.c_S, cfg.c_Y, margin=cfg.share_margin):
            continue
        cal, bud = comps.shares(n, m, cfg.c_S, cfg.c_Y)
        plan = labels_to_request(comps, n, m, cfg.c_S, cfg.c_Y, max_labels=cfg.max_labels_per_request)
        own = p.get("basis_code") in ("augmented", "recalibrated")
        scope = name if own else "calibration"
        out.append(_trigger(
            "under_labelled", scope, int(plan["labels"]),
            f"{name!r}: calibration share of the variance {cal:.0%} exceeds the oracle share of the budget {bud:.0%} "
            f"(+{cfg.share_margin:.0%} margin) at c_Y/c_S = {cfg.c_Y / cfg.c_S:g}: the "
            + ("policy's own labels are" if own else "shared calibration labels are") + " under-labelled",
            policy=name, calibration_share=cal, oracle_budget_share=bud,
            sizing="planner.labels_to_request(goal='balance'): raise m to ceil(r* n), r* = sqrt(sigma2_cal c_S / "
                   "(sigma2_eval c_Y)) (square-root law)", planner=plan))
    return out


def support_regions(rows: TriggerRows, result: Mapping, policy: str) -> tuple[list[dict], dict]:
    """Thinly supported judge-score values of a policy and the labels each needs.

    The engine's rule (result ``support.rule``): a score is thin when fewer than
    ``support_min_labels`` calibration labels lie within ``+/- h`` (``h = support_bandwidth *
    score range``) or it is outside the calibration labels' range.  Deficits are allocated
    greedily from low to high score: labels placed at a score also count for scores within
    ``h``.  Returns ``[{"score", "n_rows", "have", "labels"}]`` and the rule's parameters.
    """
    conf = result.get("config") or {}
    cal_pols = (result.get("calibration") or {}).get("calibration_policies") or conf.get("calibration_policies")
    k_min = int(conf.get("support_min_labels", 10))
    bw = float(conf.get("support_bandwidth", 0.05))
    scale = conf.get("score_scale")
    if scale:
        width = float(scale[1]) - float(scale[0])
    else:
        width = float(np.nanmax(rows.score) - np.nanmin(rows.score)) or 1.0
    h = bw * width
    tol = 1e-9 * width
    cal = rows.labelled & (rows.policy_in(cal_pols) if cal_pols else True)
    cs = np.sort(rows.score[cal])
    pol = rows.score[rows.policy_in(policy)]
    values, counts = np.unique(pol, return_counts=True)
    # labels of the store within reach of each distinct score, and whether it is outside their range
    base = np.searchsorted(cs, values + h + tol, side="right") - np.searchsorted(cs, values - h - tol, side="left")
    outside = np.ones(values.size, dtype=bool) if cs.size == 0 else (values < cs[0] - tol) | (values > cs[-1] + tol)
    # labels placed earlier only add to `have`: scores with enough labels inside the range never need any
    candidates = np.flatnonzero((base < k_min) | outside)
    placed_at: list[float] = []  # scores given labels so far (ascending), and how many each
    placed_n: list[int] = []
    first, in_reach = 0, 0  # placed_at[first:] are the ones within h of the current score
    regions = []
    for i in candidates.tolist():
        s, n_rows = values[i], counts[i]
        while first < len(placed_at) and not abs(placed_at[first] - s) <= h + tol:
            in_reach -= placed_n[first]
            first += 1
        have = int(base[i]) + in_reach
        need = max(0, k_min - have) if (have < k_min or outside[i]) else 0
        if outside[i] and need == 0:
            need = 1  # outside the labelled range: at least one label there extends it
        if need:
            placed_at.append(float(s))
            placed_n.append(int(need))
            in_reach += int(need)
            regions.append({"score": float(s), "n_rows": int(n_rows), "have": have, "labels": int(need)})
    return regions, {"support_min_labels": k_min, "bandwidth": h}


def support_triggers(rows: TriggerRows, result: Mapping, cfg: RequestConfig) -> list[dict]:
    """Trigger 5: limited calibration support where a policy's scores lie."""
    if "thin_support" not in cfg.triggers:
        return []
    out = []
    for name, p in result["policies"].items():
        sup = p.get("support") or {}
        if not sup.get("limited"):
            continue
        regions, rule = support_regions(rows, result, name)
        n = sum(r["labels"] for r in regions)
        if n == 0:
            continue
        total = math.ceil(n / (1 - cfg.background_share))
        trig = _trigger("thin_support", name, total,
                        f"limited calibration support for {name!r}: {float(sup.get('share_thin') or 0):.0%} of its "
                        f"judge scores lie where calibration labels are thin or absent; targeted labels in "
                        f"{len(regions)} score value(s)", regions=regions, rule=rule,
                        sizing=(f"sum of per-score deficits (support_min_labels - labels within +/-{rule['bandwidth']:g}"
                                f", greedy) = {n}, plus a background share {cfg.background_share:g} drawn outside "
                                f"the regions"))
        out.append(trig)
    return out


def drift_triggers(drift_look: Mapping | None, cfg: RequestConfig, anchor_ids: Sequence[str] | None) -> list[dict]:
    """Trigger 4: a drift alarm asks for fresh labels on anchors and recent traffic."""
    if not drift_look or "drift_alarm" not in cfg.triggers:
        return []
    if not isinstance(drift_look, Mapping):
        raise CJEInputError(f"drift look must be a dict (DriftLook.to_dict()), got {type(drift_look).__name__}")
    alarms = list(drift_look.get("alarms") or [])
    if not (drift_look.get("alarm") or alarms):
        return []
    meta = drift_look.get("meta") or {}
    first = drift_look.get("first_alarm") or {}
    new = [m for m in alarms if first.get(m) == drift_look.get("look")]
    where = ", ".join(f"{k} {meta[k2]}" for k, k2 in (("judge", "judge_id"), ("monitor", "monitor"),
                                                      ("anchor set", "set_name")) if meta.get(k2))
    return [_trigger("drift_alarm", "drift", cfg.drift_traffic_labels,
                     f"judge drift alarm at look {drift_look.get('look')}" + (f" ({where})" if where else "")
                     + f" on {', '.join(alarms) or 'a metric'}: fresh labels on recent traffic"
                     + (" and anchors" if anchor_ids else ""),
                     look=drift_look.get("look"), look_key=meta.get("look_key"), judge_id=meta.get("judge_id"),
                     monitor=meta.get("monitor"), set_name=meta.get("set_name"),
                     anchors_version=meta.get("anchors_version"), alarms=alarms, new_alarms=new,
                     first_alarm=drift_look.get("first_alarm"),
                     n_anchor_labels=min(cfg.drift_anchor_labels, len(anchor_ids or [])),
                     sizing=f"configured drift_traffic_labels={cfg.drift_traffic_labels}, "
                            f"drift_anchor_labels={cfg.drift_anchor_labels}")]


def regression_triggers(undecided: Mapping[str, Any] | None, cfg: RequestConfig) -> list[dict]:
    """Trigger 7: a drop across windows is not yet significant and more own labels in this window
    would decide it (``labels_needed`` of `cje_engine.inference.changes`)."""
    if not undecided or "regression_undecided" not in cfg.triggers:
        return []
    out = []
    for name, needed in sorted(undecided.items()):
        needed = int(needed or 0)
        if needed <= 0:
            continue
        out.append(_trigger(
            "regression_undecided", name, min(needed, cfg.max_labels_per_request),
            f"{name!r}: a drop against an earlier window is not yet significant; about {needed} more own labels "
            "in this window would decide it", policy=name, labels_needed=needed))
    return out


def _segment_block(result: Mapping) -> Mapping | None:
    seg = result.get("segments")
    return seg if isinstance(seg, Mapping) and seg.get("cells") is not None else None


def segment_columns_of(result: Mapping) -> list[str]:
    """The segment columns of a result (``segments.columns``; ``[]`` without segments)."""
    seg = _segment_block(result)
    return [str(c) for c in (seg.get("columns") or [])] if seg else []


def _segment_scope(policy: str, segment: str) -> str:
    """The scope of a segment request: ``policy @ segment``."""
    return f"{policy} @ {segment}"


def _members(seg: Mapping, segment: str) -> list[str]:
    """The segments whose rows make up ``segment`` (``other``: its pooled members)."""
    info = next((s for s in seg.get("segments") or [] if s.get("name") == segment), {})
    return list(info.get("members") or []) or [segment]


def _more_labels(n: int, se: float, target: float, floor: int) -> int:
    """Extra labels for a standard error ``se`` from ``n`` labels to reach ``target`` (SE ~ 1/sqrt(labels)),
    at least ``floor``."""
    if target <= 0 or not math.isfinite(se) or se <= 0:
        return max(floor, 0)
    return max(floor, math.ceil(max(n, 1) * (se / target) ** 2) - n, 1)


def segment_triggers(result: Mapping, cfg: RequestConfig) -> list[dict]:
    """Triggers 8-9 (segmented results, ``segments`` of the result): a segment x policy cell whose transport
    audit is inconclusive (``segment_audit_inconclusive``), and a comparison with the baseline in a segment
    that is undecided (``segment_undecided``): not significant after the family's adjustment while its interval
    still holds a loss (or gain) larger than the decision margin (the audit margin), or resting on an assumed
    (unverified) level, significant or not.

    Sizes: the audit as the policy audit's ``extra_labels_needed`` (n (se / target)^2 - n, target = (margin -
    |delta|) / z); a comparison: labels on the cell with the larger standard error (the policy's or the
    baseline's in that segment; the unverified one when a level is assumed) so that its SE reaches
    max(|diff|, margin) / (z_{1-alpha/2} + z_{0.8}), and at least the ``min_labels`` a verified level needs. The
    request's pool is that cell's unlabelled rows (``other``: the rows of its pooled segments)."""
    seg = _segment_block(result)
    wanted = {"segment_audit_inconclusive", "segment_undecided"} & set(cfg.triggers)
    if seg is None or not wanted:
        return []
    conf = result.get("config") or {}
    alpha = float(conf.get("alpha", 0.05))
    min_labels = int(conf.get("min_labels", 10))
    margin = audit_margin(result)
    z, z_pow = _z(alpha), float(norm_ppf(0.8))
    cells = {(c.get("segment"), c.get("policy")): c for c in seg.get("cells") or []}
    out = []
    if "segment_audit_inconclusive" in wanted:
        for (s, p), c in cells.items():
            a = c.get("audit") or {}
            if a.get("verdict") != "inconclusive" or c.get("claim_kind") == "too_few":
                continue
            n_own, se, delta = int(c.get("n_labels") or 0), float(a.get("se") or 0.0), abs(float(a.get("residual_mean")
                                                                                                 or 0.0))
            target = (margin - delta) / z if delta < margin else delta / z
            n = min(_more_labels(n_own, se, target, 1), cfg.max_labels_per_request)
            out.append(_trigger(
                "segment_audit_inconclusive", _segment_scope(p, s), n,
                f"segment {s!r}: the transport audit of {p!r} on its {n_own} own label(s) is inconclusive (mean "
                f"residual {float(a.get('residual_mean') or 0):+.3g}, SE {se:.3g}, margin {margin:g})",
                policy=p, segment=s, segments=_members(seg, s), n_labelled=n_own,
                residual_mean=a.get("residual_mean"), se=a.get("se"),
                sizing=f"n (se / target)^2 - n with target = (margin - |delta|) / z = {target:.4g} (z={z:.3f})"))
    if "segment_undecided" in wanted:
        base = seg.get("baseline")
        for comp in seg.get("comparisons") or []:
            s, p = comp.get("segment"), comp.get("policy")
            kind, diff, ci = comp.get("claim_kind"), comp.get("diff"), comp.get("ci") or []
            if kind == "too_few" or diff is None or len(ci) != 2 or (comp.get("significant") and kind == "verified"):
                continue
            open_loss, open_gain = float(ci[0]) < -margin, float(ci[1]) > margin
            if not (open_loss or open_gain or kind == "assumes_transport"):
                continue
            own, bc = cells.get((s, p)) or {}, cells.get((s, base)) or {}
            if own.get("claim_kind") == "assumes_transport" or bc.get("claim_kind") == "assumes_transport":
                target_cell = own if own.get("claim_kind") == "assumes_transport" else bc  # the unverified level
            else:
                target_cell = own if float(own.get("se") or 0) >= float(bc.get("se") or 0) else bc
            tp = target_cell.get("policy", p)
            n_have = int(target_cell.get("n_labels") or 0)
            target = max(abs(float(diff)), margin) / (z + z_pow)
            n = _more_labels(n_have, float(comp.get("se") or 0.0), target, max(min_labels - n_have, 0))
            n = min(n, cfg.max_labels_per_request)
            why = ("rests on an assumed (unverified) level" if kind == "assumes_transport" else
                   f"its interval [{float(ci[0]):.3g}, {float(ci[1]):.3g}] still holds a "
                   + ("loss" if open_loss else "gain") + f" beyond the margin {margin:g}")
            out.append(_trigger(
                "segment_undecided", _segment_scope(tp, s), n,
                f"segment {s!r}: {p!r} vs {base!r} is undecided (diff {float(diff):+.3g}, adjusted p "
                f"{comp.get('p_adjusted') if comp.get('p_adjusted') is not None else 'n/a'}; {why}); labels for "
                f"{tp!r} in the segment", policy=tp, segment=s, segments=_members(seg, s), compared=p, baseline=base,
                diff=diff, ci=list(ci), p_adjusted=comp.get("p_adjusted"), n_labelled=n_have,
                sizing=(f"SE of the comparison {float(comp.get('se') or 0):.4g} -> max(|diff|, margin) / (z + z_0.8) = "
                        f"{target:.4g} by labels on the cell with the larger SE ({tp!r}), SE ~ 1/sqrt(labels); at "
                        f"least min_labels={min_labels} own labels")))
    return out


def find_triggers(result: Mapping, logs: Any, config: Mapping | RequestConfig | None = None, *,
                  drift_look: Mapping | None = None, anchor_ids: Sequence[str] | None = None) -> list[dict]:
    """Every trigger that fires for a published result (pure; no storage)."""
    cfg = RequestConfig.from_dict(config)
    result, info = unwrap_result(result)
    rows = TriggerRows.from_table(as_arrow_table(logs), segment_columns_of(result))
    return triggers_of_rows(result, rows, cfg, drift_look, anchor_ids, info.get("undecided"))


def triggers_of_rows(result: Mapping, rows: TriggerRows, cfg: RequestConfig, drift_look: Mapping | None,
                     anchor_ids: Sequence[str] | None, undecided: Mapping[str, Any] | None = None) -> list[dict]:
    """`find_triggers` on logs already read into `TriggerRows`: the audit, support, under-labelled, drift and
    regression triggers that ask for at least one label."""
    anchor_ids = None if anchor_ids is None else [str(a) for a in anchor_ids]
    trig = audit_triggers(result, cfg) + support_triggers(rows, result, cfg) + under_labelled_triggers(result, cfg)
    trig += drift_triggers(drift_look, cfg, anchor_ids) + regression_triggers(undecided, cfg)
    trig += segment_triggers(result, cfg)
    return [t for t in trig if t["labels"] > 0 or t["detail"].get("n_anchor_labels", 0) > 0]

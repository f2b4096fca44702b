"""Oracle label requests raised automatically from a published result (docs/label-requests.md).

Six trigger rules, each computed from a published result dict, the evaluated logs (one row
per response: ``response_id``, ``policy``, ``judge_score``, ``prompt_id``, ``oracle_label``,
``label_probability``, ``dt``) and, optionally, a drift look (`cje_engine.drift.monitor.DriftLook.to_dict`):

=====================  ============================================================  ==========
trigger                fires when                                                    design
=====================  ============================================================  ==========
``audit_failed``       a policy's transport audit failed and its SE is above the     stratified
                       target or it has fewer than ``min_labels`` own labels
``no_own_labels``      a policy has no audit labels of its own (audit ``not_run``)   stratified
``audit_inconclusive`` an audit is inconclusive (``extra_labels_needed``)            stratified
``drift_alarm``        the drift look alarmed: recent traffic (+ anchors)            stratified
``thin_support``       the policy's calibration support is limited                   targeted
``under_labelled``     calibration share of variance > oracle share of budget        stratified
=====================  ============================================================  ==========

Triggers for the same *scope* (a policy; ``calibration`` for the shared calibration labels of
plug-in estimates; ``drift`` for recent traffic) are merged into one request whose size is the
largest of theirs, every reason recorded.  A request is a JSON manifest, created with
`Storage.put_if_absent` at ``label_requests/<request_id>.json`` and never rewritten; its later
status (fulfilled) is a separate create-only marker ``label_requests/_status/<request_id>.json``,
and ``expired`` is derived from the deadline.

Sampling is deterministic (seeded by the configured seed and the request id).  Each row records
``selection_probability`` ``p`` (probability that this request picks it, among the pool it was
drawn from) and ``inclusion_probability`` = ``p * pi_prev``, where ``pi_prev`` is the harmonic
mean of the stored ``label_probability`` of the policy's labels so far (1 when it has none).
The labels flow stores ``inclusion_probability`` as ``label_probability``, so that in the
engine's Hajek residual mean (weights ``1 / label_probability``) the earlier labels count as a
census of themselves and each new label for ``1 / p`` pool rows: unbiased for the policy mean
conditional on the earlier labels (exact when those had equal probabilities).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields
from datetime import date, datetime, timedelta, timezone
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
from scipy.stats import norm

from cje_engine.errors import CJEInputError

log = logging.getLogger(__name__)

PREFIX = "label_requests"
MANIFEST_VERSION = 1
TRIGGERS = ("audit_failed", "no_own_labels", "audit_inconclusive", "drift_alarm", "thin_support", "under_labelled")
#: Design chosen for each trigger; a merged request uses the most specific (targeted > stratified > random).
DESIGN_OF = {"audit_failed": "stratified", "no_own_labels": "stratified", "audit_inconclusive": "stratified",
             "drift_alarm": "stratified", "thin_support": "targeted", "under_labelled": "stratified"}
DESIGNS = ("random", "stratified", "targeted")
_DESIGN_RANK = {"random": 0, "stratified": 1, "targeted": 2}
_ID_RE = re.compile(r"^lr-\d{8}-[0-9a-f]{12}$")


# --------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class RequestConfig:
    """Settings of automatic label requests (all optional; JSON-ready via `to_dict`).

    Parameters
    ----------
    max_labels_per_period : int
        Budget: labels requested per ISO week (all requests created that week count).
    max_labels_per_request : int
        Cap of one request.
    deadline_days : float
        A request not fulfilled this many days after creation is ``expired``.
    c_S, c_Y : float
        Cost of one judged response and of one oracle label (square-root law).
    target_se : float, optional
        SE a recalibrated level should reach; default ``audit_margin / z_{1-alpha/2}``
        (95% CI half-width equal to the audit margin).
    share_margin : float
        ``under_labelled`` fires when calibration share > oracle budget share + this.
    new_policy_labels : int, optional
        Labels for a policy without own labels; default sized so that a pass is reachable
        (module docs).
    drift_traffic_labels, drift_anchor_labels : int
        Sizes of a drift request (recent traffic rows; anchors when anchor ids are given).
    recent_days : int
        "Recent traffic" = the last ``recent_days`` log dates present.
    background_share : float
        Share of a targeted request drawn from outside the targeted score regions (keeps
        every unlabelled row's probability positive, hence the estimates unbiased).
    n_strata : int
        Score strata of a stratified design.
    seed : int
    triggers : list of str
        Enabled trigger rules.
    labels_uri : str, optional
        Label store to join when the logs are given as a URI (default: the logs URI).
    requests_uri : str, optional
        Where requests live (default: the results URI).
    webhook_url : str, optional
        Notification receiver (default ``$CJE_WEBHOOK_URL``).
    notify : bool
        Send ``label_request`` notifications.
    """

    max_labels_per_period: int = 2000
    max_labels_per_request: int = 500
    deadline_days: float = 7.0
    c_S: float = 1.0
    c_Y: float = 16.0
    target_se: float | None = None
    share_margin: float = 0.05
    new_policy_labels: int | None = None
    drift_traffic_labels: int = 100
    drift_anchor_labels: int = 50
    recent_days: int = 1
    background_share: float = 0.2
    n_strata: int = 5
    seed: int = 0
    triggers: tuple[str, ...] = TRIGGERS
    labels_uri: str | None = None
    requests_uri: str | None = None
    webhook_url: str | None = None
    notify: bool = True

    def __post_init__(self) -> None:
        def whole(name: str, lo: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise CJEInputError(f"label request setting {name} must be a whole number >= {lo}, got {v!r}")
            object.__setattr__(self, name, int(v))

        def positive(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(float(v))
            if not ok or float(v) < 0 or (float(v) == 0 and not allow_zero):
                raise CJEInputError(f"label request setting {name} must be a number {'>=' if allow_zero else '>'} 0, "
                                    f"got {v!r}")
            object.__setattr__(self, name, float(v))

        for name in ("max_labels_per_period", "max_labels_per_request", "drift_traffic_labels",
                     "drift_anchor_labels", "seed"):
            whole(name, 0)
        whole("recent_days", 1)
        whole("n_strata", 1)
        for name in ("deadline_days", "c_S", "c_Y"):
            positive(name)
        positive("share_margin", allow_zero=True)
        if self.target_se is not None:
            positive("target_se")
        if self.new_policy_labels is not None:
            whole("new_policy_labels", 1)
        if not (isinstance(self.background_share, (int, float)) and 0 <= self.background_share < 1):
            raise CJEInputError(f"label request setting background_share must be in [0, 1), got "
                                f"{self.background_share!r}")
        trig = (self.triggers,) if isinstance(self.triggers, str) else tuple(self.triggers)
        bad = [t for t in trig if t not in TRIGGERS]
        if bad:
            raise CJEInputError(f"unknown label request trigger(s) {bad}; expected some of {list(TRIGGERS)}")
        object.__setattr__(self, "triggers", trig)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "RequestConfig" | None) -> "RequestConfig":
        """From a mapping (e.g. the ``label_requests`` entry of an evaluation); errors name the key."""
        if d is None:
            return cls()
        if isinstance(d, RequestConfig):
            return d
        if not isinstance(d, Mapping):
            raise CJEInputError(f"label request settings must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CJEInputError(f"unknown label request setting(s) {unknown}; expected some of {sorted(known)}")
        return cls(**dict(d))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["triggers"] = list(self.triggers)
        return out


# --------------------------------------------------------------------------------------
# small helpers


def iso_period(when: datetime) -> str:
    """ISO week of a UTC time, e.g. ``2025-W09`` (the budget period)."""
    y, w, _ = when.astimezone(timezone.utc).isocalendar()
    return f"{y}-W{w:02d}"


def _now(now: datetime | str | None) -> datetime:
    if now is None:
        return datetime.now(timezone.utc)
    if isinstance(now, str):
        now = datetime.fromisoformat(now)
    return now if now.tzinfo else now.replace(tzinfo=timezone.utc)


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _seed_for(seed: int, request_id: str) -> int:
    return int(_hash(seed, request_id)[:16], 16)


def _unwrap_result(published: Mapping[str, Any]) -> tuple[dict, dict]:
    """(result dict, run info) from a result dict or the evaluate flow's return value."""
    if not isinstance(published, Mapping):
        raise CJEInputError(f"expected a published result dict, got {type(published).__name__}")
    if "policies" in published:
        return dict(published), {}
    inner = published.get("result")
    if isinstance(inner, Mapping) and "policies" in inner:
        info = {k: published.get(k) for k in ("run_key", "path", "window", "evaluation", "published")}
        return dict(inner), info
    raise CJEInputError("the published result has no 'policies' section (expected evaluate(...).to_dict() or the "
                        "evaluate flow's return value)", column="policies")


def _as_table(logs: Any) -> pa.Table:
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


@dataclass
class _Rows:
    """Numpy view of the evaluated logs (only what the triggers need)."""

    rid: np.ndarray
    policy: np.ndarray
    score: np.ndarray
    labelled: np.ndarray
    prob: np.ndarray
    prompt: np.ndarray | None
    dt: np.ndarray | None

    @classmethod
    def from_table(cls, table: pa.Table) -> "_Rows":
        n = table.num_rows

        def strings(name: str) -> np.ndarray:
            col = table.column(name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            return np.asarray(col.cast(pa.string()).to_pylist(), dtype=object)

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
        return cls(rid=strings("response_id"), policy=strings("policy"), score=score, labelled=labelled,
                   prob=prob, prompt=strings("prompt_id") if "prompt_id" in table.column_names else None,
                   dt=strings("dt") if "dt" in table.column_names else None)


def _prior_probability(rows: _Rows, policy: str) -> float:
    """Harmonic mean of the stored label probabilities of the policy's labels (1 if none)."""
    sel = rows.labelled & (rows.policy == policy)
    if not sel.any():
        return 1.0
    return float(sel.sum() / np.sum(1.0 / rows.prob[sel]))


# --------------------------------------------------------------------------------------
# trigger rules (pure)


def _z(alpha: float) -> float:
    return float(norm.ppf(1 - alpha / 2))


def _target_se(result: Mapping, cfg: RequestConfig) -> float:
    if cfg.target_se is not None:
        return cfg.target_se
    conf = result.get("config") or {}
    lo, hi = (conf.get("label_scale") or [0.0, 1.0])[:2]
    margin = float(conf.get("audit_margin", 0.05)) * (float(hi) - float(lo))
    return margin / _z(float(conf.get("alpha", 0.05)))


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


def audit_triggers(result: Mapping, cfg: RequestConfig) -> list[dict]:
    """Triggers 1-3: no own labels, inconclusive audit, failed audit."""
    from cje_engine.planning.planner import VarianceComponents, labels_to_request

    conf = result.get("config") or {}
    alpha = float(conf.get("alpha", 0.05))
    min_labels = int(conf.get("min_labels", 10))
    lo, hi = (conf.get("label_scale") or [0.0, 1.0])[:2]
    margin = float(conf.get("audit_margin", 0.05)) * (float(hi) - float(lo))
    target = _target_se(result, cfg)
    out = []
    for name, p in result["policies"].items():
        a = p.get("audit") or {}
        verdict = a.get("verdict")
        n_own = int(p.get("n_labelled") or 0)
        if verdict == "not_run" and "no_own_labels" in cfg.triggers:
            if cfg.new_policy_labels is not None:
                n, how = cfg.new_policy_labels, "configured new_policy_labels"
            else:
                m = int(a.get("family_size") or 0) + 1
                z_adj = float(norm.ppf(1 - alpha / (2 * m)))
                sd = _pooled_residual_sd(result)
                n = max(min_labels, math.ceil((z_adj * sd / margin) ** 2))
                how = (f"n = max(min_labels={min_labels}, ceil((z_adj * sd_r / margin)^2)) with z_adj={z_adj:.3f} "
                       f"(Bonferroni over {m} audits), pooled residual SD sd_r={sd:.4f}, margin={margin:g}: the "
                       f"fewest labels whose adjusted CI fits inside the margin if the calibration transports")
            out.append(_trigger("no_own_labels", name, n - n_own,
                                f"policy {name!r} has {n_own} audit label(s) of its own: the calibration's transport "
                                f"to it is untested", sizing=how, n_labelled=n_own))
        elif verdict == "inconclusive" and "audit_inconclusive" in cfg.triggers:
            extra = a.get("extra_labels_needed")
            if extra is None:
                extra = max(min_labels - n_own, 1)
            out.append(_trigger("audit_inconclusive", name, int(extra),
                                f"the transport audit of {name!r} is inconclusive ({a.get('reason')})",
                                sizing="the audit's extra_labels_needed: n (se / target)^2 - n with target = "
                                       "(margin - |delta|) / z_adj (or |delta| / z_adj past the margin)",
                                residual_mean=a.get("residual_mean"), se=a.get("se"), n_labelled=n_own))
        elif verdict == "fail" and "audit_failed" in cfg.triggers:
            need_min = max(0, min_labels - n_own)
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
    from cje_engine.planning.planner import is_under_labelled, labels_to_request, policy_components

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


def support_regions(rows: _Rows, result: Mapping, policy: str) -> tuple[list[dict], dict]:
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
    cal = rows.labelled & (np.isin(rows.policy, list(cal_pols)) if cal_pols else True)
    cs = np.sort(rows.score[cal])
    pol = rows.score[rows.policy == policy]
    values, counts = np.unique(pol, return_counts=True)
    placed: list[float] = []
    regions = []
    for s, n_rows in zip(values, counts):
        have = int(np.searchsorted(cs, s + h + tol, side="right") - np.searchsorted(cs, s - h - tol, side="left"))
        have += sum(1 for x in placed if abs(x - s) <= h + tol)
        outside = cs.size == 0 or s < cs[0] - tol or s > cs[-1] + tol
        need = max(0, k_min - have) if (have < k_min or outside) else 0
        if outside and need == 0:
            need = 1  # outside the labelled range: at least one label there extends it
        if need:
            placed.extend([float(s)] * need)
            regions.append({"score": float(s), "n_rows": int(n_rows), "have": have, "labels": int(need)})
    return regions, {"support_min_labels": k_min, "bandwidth": h}


def support_triggers(rows: _Rows, result: Mapping, cfg: RequestConfig) -> list[dict]:
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


def find_triggers(result: Mapping, logs: Any, config: Mapping | RequestConfig | None = None, *,
                  drift_look: Mapping | None = None, anchor_ids: Sequence[str] | None = None) -> list[dict]:
    """Every trigger that fires for a published result (pure; no storage)."""
    cfg = RequestConfig.from_dict(config)
    result, _ = _unwrap_result(result)
    return _find_triggers(result, _Rows.from_table(_as_table(logs)), cfg, drift_look, anchor_ids)


def _find_triggers(result: Mapping, rows: _Rows, cfg: RequestConfig, drift_look: Mapping | None,
                   anchor_ids: Sequence[str] | None) -> list[dict]:
    anchor_ids = None if anchor_ids is None else [str(a) for a in anchor_ids]
    trig = audit_triggers(result, cfg) + support_triggers(rows, result, cfg) + under_labelled_triggers(result, cfg)
    trig += drift_triggers(drift_look, cfg, anchor_ids)
    return [t for t in trig if t["labels"] > 0 or t["detail"].get("n_anchor_labels", 0) > 0]


# --------------------------------------------------------------------------------------
# sampling (pure, deterministic)


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


# --------------------------------------------------------------------------------------
# planning requests (pure)


def _merge(triggers: Sequence[dict]) -> dict[str, dict]:
    """Merge triggers by scope: size = the largest, design = the most specific, all reasons kept."""
    merged: dict[str, dict] = {}
    for t in triggers:
        m = merged.setdefault(t["scope"], {"scope": t["scope"], "labels": 0, "design": "random", "reasons": [],
                                           "regions": None, "rule": None})
        m["labels"] = max(m["labels"], t["labels"])
        if _DESIGN_RANK[t["design"]] > _DESIGN_RANK[m["design"]]:
            m["design"] = t["design"]
        if t["trigger"] == "thin_support":
            m["regions"], m["rule"] = t["detail"]["regions"], t["detail"]["rule"]
        m["reasons"].append({k: t[k] for k in ("trigger", "labels", "design", "reason", "detail")})
    return merged


def _pool(rows: _Rows, scope: str, result: Mapping, cfg: RequestConfig, exclude: set[str]) -> np.ndarray:
    """Row indices a request of this scope may draw from: unlabelled, not pending elsewhere."""
    ok = ~rows.labelled
    if exclude:
        ok &= ~np.isin(rows.rid, list(exclude))
    if scope == "calibration":
        cal = (result.get("calibration") or {}).get("calibration_policies") or \
              (result.get("config") or {}).get("calibration_policies")
        if cal:
            ok &= np.isin(rows.policy, list(cal))
    elif scope == "drift":
        if rows.dt is not None:
            days = sorted(set(rows.dt[rows.dt != None].tolist()))  # noqa: E711 - object array
            recent = days[-cfg.recent_days:]
            ok &= np.isin(rows.dt, recent)
    else:
        ok &= rows.policy == scope
    return np.flatnonzero(ok)


PRIORITY = {t: i for i, t in enumerate(TRIGGERS)}


def plan_requests(result: Mapping, logs: Any, config: Mapping | RequestConfig | None = None, *,
                  evaluation: str, window: str, run_key: str | None = None, logs_uri: str | None = None,
                  existing: Sequence[Mapping] = (), drift_look: Mapping | None = None,
                  anchor_ids: Sequence[str] | None = None, now: datetime | str | None = None) -> dict:
    """Turn a published result into label request manifests (pure: nothing is written).

    ``existing`` are the stored requests with their current status (`list_requests`): their
    pending rows are excluded from every pool, a trigger already pending for the same
    (evaluation, scope) is not raised again, and requests created in the current period count
    against ``max_labels_per_period``.

    Returns ``{"requests": [manifest, ...], "skipped": [{"scope", "reason", ...}], "triggers": [...]}``.
    """
    cfg = RequestConfig.from_dict(config)
    result, info = _unwrap_result(result)
    anchor_ids = None if anchor_ids is None else [str(a) for a in anchor_ids]
    run_key = run_key or info.get("run_key")
    now_ = _now(now)
    period = iso_period(now_)
    rows = _Rows.from_table(_as_table(logs))
    triggers = _find_triggers(result, rows, cfg, drift_look, anchor_ids)

    pending = [e for e in existing if e.get("status") == "pending"]
    pending_ids = {r["response_id"] for e in pending for r in e.get("rows", [])}
    # drift requests are deduplicated per drift monitor (one anchor set each), others per scope
    pending_codes = {(e.get("evaluation"), e.get("scope"), r["trigger"],
                      (e.get("drift") or {}).get("monitor") if e.get("scope") == "drift" else None)
                     for e in pending for r in e.get("reasons", [])}
    pending_anchors = {(str((e.get("drift") or {}).get("set_name")), str(a.get("anchor_id"))) for e in pending
                       for a in e.get("anchors") or []}
    # a drift look raises at most one request, whatever became of it (reruns and repairs of a look)
    done_looks = {((e.get("drift") or {}).get("monitor"), (e.get("drift") or {}).get("look")): e
                  for e in existing if e.get("scope") == "drift" and (e.get("drift") or {}).get("monitor")}
    used = sum(int(e.get("n_labels", 0)) for e in existing if e.get("period") == period)
    left = max(0, cfg.max_labels_per_period - used)

    skipped = []
    fresh = []
    for t in triggers:
        mon = t["detail"].get("monitor") if t["scope"] == "drift" else None
        prior = done_looks.get((mon, t["detail"].get("look"))) if mon else None
        if prior is not None:
            skipped.append({"scope": t["scope"], "trigger": t["trigger"],
                            "reason": f"drift look {t['detail'].get('look')} of monitor {mon!r} already raised "
                                      f"request {prior.get('request_id')} ({prior.get('status')})"})
        elif (evaluation, t["scope"], t["trigger"], mon) in pending_codes:
            skipped.append({"scope": t["scope"], "trigger": t["trigger"],
                            "reason": "a request for this trigger and scope is still pending"
                                      + (f" (drift monitor {mon!r})" if mon else "")})
        else:
            fresh.append(t)
    merged = _merge(fresh)
    order = sorted(merged.values(), key=lambda m: min(PRIORITY[r["trigger"]] for r in m["reasons"]))
    conf = result.get("config") or {}
    requests = []
    taken: set[str] = set()
    for m in order:
        codes = sorted(r["trigger"] for r in m["reasons"])
        id_parts: list[Any] = [evaluation, window, run_key, m["scope"], codes]
        n_anchor = 0
        anchor_pool: list[str] = []
        drift_detail: dict = {}
        if m["scope"] == "drift":
            drift_detail = next((r["detail"] for r in m["reasons"] if r["trigger"] == "drift_alarm"), {})
            n_anchor = max(r["detail"].get("n_anchor_labels", 0) for r in m["reasons"])
            set_key = str(drift_detail.get("set_name"))
            anchor_pool = sorted({str(a) for a in anchor_ids or []} - {a for s, a in pending_anchors if s == set_key})
            if drift_detail.get("monitor"):
                id_parts += [drift_detail["monitor"], drift_detail.get("look")]  # one request per drift look
        request_id = f"lr-{now_:%Y%m%d}-{_hash(*id_parts)[:12]}"
        want = min(m["labels"], cfg.max_labels_per_request)
        n_target = min(want, left)
        if n_target <= 0 and not (n_anchor and anchor_pool and left > 0):
            skipped.append({"scope": m["scope"], "trigger": ",".join(codes), "labels": m["labels"],
                            "reason": f"label budget of period {period} exhausted ({used} of "
                                      f"{cfg.max_labels_per_period} already requested)"})
            continue
        pool = _pool(rows, m["scope"], result, cfg, pending_ids | taken)
        if pool.size == 0 and not (n_anchor and anchor_pool):
            skipped.append({"scope": m["scope"], "trigger": ",".join(codes),
                            "reason": "no unlabelled row left to request"
                                      + (" (and no anchor that is not pending already)" if n_anchor else "")})
            continue
        rule = m["rule"] or {}
        idx, p, strata = sample(rows.rid[pool], rows.score[pool], n_target, m["design"],
                                _seed_for(cfg.seed, request_id), n_strata=cfg.n_strata, regions=m["regions"],
                                bandwidth=float(rule.get("bandwidth", 0.0)), background_share=cfg.background_share)
        chosen = pool[idx]
        prior = {pol: _prior_probability(rows, pol) for pol in set(rows.policy[chosen].tolist())}
        req_rows = []
        for i, pi, s in zip(chosen, p, strata):
            pol = str(rows.policy[i])
            req_rows.append({
                "response_id": str(rows.rid[i]), "policy": pol,
                "prompt_id": None if rows.prompt is None else str(rows.prompt[i]),
                "judge_score": float(rows.score[i]),
                "dt": None if rows.dt is None or rows.dt[i] is None else str(rows.dt[i]),
                "stratum": int(s), "selection_probability": float(pi),
                "prior_probability": prior[pol], "inclusion_probability": float(pi * prior[pol]),
            })
        anchors = []
        # anchors take what the traffic rows leave of the request cap and of the period budget
        k = min(n_anchor, len(anchor_pool), max(0, cfg.max_labels_per_request - len(req_rows)),
                max(0, left - len(req_rows)))
        if k > 0:
            ids = np.array(anchor_pool, dtype=object)
            pick = np.random.default_rng(_seed_for(cfg.seed + 1, request_id)).choice(ids.size, size=k, replace=False)
            anchors = [{"anchor_id": str(ids[j]), "selection_probability": k / ids.size} for j in np.sort(pick)]
        taken |= {r["response_id"] for r in req_rows}
        n_labels = len(req_rows) + len(anchors)
        caps = []
        if len(anchors) < n_anchor:
            caps.append(f"anchors: {len(anchors)} of {n_anchor} ({len(anchor_pool)} anchor(s) not pending "
                        f"elsewhere, request cap and period budget)")
        if m["labels"] > cfg.max_labels_per_request:
            caps.append(f"max_labels_per_request={cfg.max_labels_per_request}")
        if left < want:
            caps.append(f"the period budget ({left} label(s) left of {cfg.max_labels_per_period})")
        if len(req_rows) < n_target:
            caps.append(f"the pool ({pool.size} unlabelled row(s) not pending elsewhere)")
        note = f"requested {len(req_rows)} of {m['labels']} label(s); limited by " + ", ".join(caps) if caps else None
        left -= n_labels
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "request_id": request_id,
            "status": "pending",
            "evaluation": evaluation, "window": window, "run_key": run_key, "result_path": info.get("path"),
            "logs_uri": logs_uri, "scope": m["scope"],
            "design": m["design"],
            "design_detail": _design_text(m["design"], cfg, m["regions"], rule),
            "reasons": m["reasons"],
            "n_labels": n_labels, "labels_wanted": m["labels"], "note": note,
            "budget": {"period": period, "max_labels_per_period": cfg.max_labels_per_period,
                       "used_before": used, "this_request": n_labels,
                       "max_labels_per_request": cfg.max_labels_per_request,
                       "cost": n_labels * cfg.c_Y, "c_Y": cfg.c_Y},
            "label_scale": list(conf.get("label_scale") or [0.0, 1.0]),
            "seed": _seed_for(cfg.seed, request_id),
            "pool_size": int(pool.size),
            "created_at": now_.isoformat(),
            "deadline": (now_ + timedelta(days=cfg.deadline_days)).isoformat(),
            "period": period,
            "rows": req_rows,
            "anchors": anchors,
        }
        if m["scope"] == "drift" and drift_detail:
            manifest["drift"] = {k: drift_detail.get(k) for k in (
                "monitor", "set_name", "anchors_version", "look", "look_key", "judge_id", "alarms", "new_alarms")}
            manifest["drift"]["n_anchors_in_set"] = len({str(a) for a in anchor_ids or []})
        used += n_labels
        requests.append(manifest)
    return {"requests": requests, "skipped": skipped, "triggers": triggers}


def _design_text(design: str, cfg: RequestConfig, regions: Any, rule: Mapping) -> str:
    if design == "random":
        return "simple random sample of the pool; selection_probability = n / N"
    if design == "stratified":
        return (f"stratified by judge score: {cfg.n_strata} quantile strata of the pool, proportional allocation "
                f"(at least one per stratum), simple random sample within; selection_probability = n_h / N_h")
    return (f"targeted: for each thin score value, its label deficit drawn from pool rows within "
            f"+/-{float(rule.get('bandwidth', 0)):g} of it (stratum = region index); {cfg.background_share:.0%} "
            f"drawn from the rest of the pool (stratum -1); selection_probability = n_h / N_h")


# --------------------------------------------------------------------------------------
# storage


def _storage(uri: str, cfg: Any):
    from flows.storage.objects import Storage, StorageConfig

    if isinstance(cfg, Mapping):
        cfg = StorageConfig.from_dict(cfg)
    elif cfg is None:
        cfg = StorageConfig.from_env()
    return Storage.for_uri(uri, cfg)


def request_key(request_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}/{request_id}.json"


def status_key(request_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}/_status/{request_id}.json"


def status_of(manifest: Mapping, marker: Mapping | None, now: datetime | str | None = None) -> str:
    """``fulfilled`` (a marker exists), ``expired`` (deadline passed) or ``pending``."""
    if marker is not None:
        return str(marker.get("status", "fulfilled"))
    if _now(now) > datetime.fromisoformat(str(manifest["deadline"])):
        return "expired"
    return "pending"


def list_requests(st: Any, *, status: str | None = None, now: datetime | str | None = None,
                  prefix: str = PREFIX) -> list[dict]:
    """Stored requests with their current ``status`` (and ``fulfilment`` marker), oldest first."""
    markers = {}
    for info in st.list(f"{prefix}/_status/"):
        rid = info.key.rsplit("/", 1)[-1][:-5]
        markers[rid] = json.loads(st.read_bytes(info.key))
    out = []
    for info in st.list(f"{prefix}/"):
        name = info.key[len(prefix) + 1:]
        if "/" in name or not name.endswith(".json"):
            continue
        try:
            m = json.loads(st.read_bytes(info.key))
        except ValueError:
            log.warning("label request %s is not valid JSON; ignored", st.url(info.key))
            continue
        m["status"] = status_of(m, markers.get(m.get("request_id")), now)
        if m.get("request_id") in markers:
            m["fulfilment"] = markers[m["request_id"]]
        out.append(m)
    if status is not None:
        out = [m for m in out if m["status"] == status]
    out.sort(key=lambda m: (str(m.get("created_at")), str(m.get("request_id"))))
    return out


def write_request(st: Any, manifest: Mapping, prefix: str = PREFIX) -> bool:
    """Create the manifest (create-only); False when a request with this id exists already."""
    if not _ID_RE.match(str(manifest.get("request_id", ""))):
        raise CJEInputError(f"bad request id {manifest.get('request_id')!r}")
    body = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
    return bool(st.put_if_absent(request_key(manifest["request_id"], prefix), body))


def mark_fulfilled(st: Any, request_id: str, detail: Mapping, prefix: str = PREFIX) -> bool:
    """Create the fulfilment marker (idempotent: False when it exists already)."""
    body = json.dumps({"status": "fulfilled", **dict(detail)}, indent=1, sort_keys=True, default=str).encode()
    return bool(st.put_if_absent(status_key(request_id, prefix), body))


def _window_dates(window: str) -> tuple[date, date]:
    if "_" in window:
        a, b = window.split("_", 1)
    elif ".." in window:
        a, b = window.split("..", 1)
    else:
        a = b = window
    try:
        return date.fromisoformat(a), date.fromisoformat(b)
    except ValueError:
        raise CJEInputError(f"window {window!r} is not 'YYYY-MM-DD_YYYY-MM-DD'") from None


def read_evaluated_logs(logs_uri: str, window: str, labels_uri: str | None, storage_cfg: Any) -> pa.Table:
    """The window's rows (ids, policy, prompt, score, dt) joined with the label store."""
    from flows.storage.labels import LabelStore, join_labels
    from flows.storage.logs import discover_partitions, read_window

    st = _storage(logs_uri, storage_cfg)
    start, end = _window_dates(window)
    files = discover_partitions(st, start, end)
    table = read_window(st, files, columns=["response_id", "policy", "prompt_id", "judge_score", "dt"],
                        check_unique=False)
    store = LabelStore(_storage(labels_uri or logs_uri, storage_cfg))
    if store.version() > 0:
        table = join_labels(table, store.read())
        if "label_conflict" in table.column_names:
            table = table.drop_columns(["label_conflict"])
    return table


def raise_requests_for_run(storage_cfg: Any, results_uri: str, evaluation: str, window: str,
                           published_result: Mapping, logs_table_or_uri: Any,
                           config: Mapping | RequestConfig | None = None, *, drift_look: Mapping | None = None,
                           anchor_ids: Sequence[str] | None = None, now: datetime | str | None = None) -> list[dict]:
    """Raise (write and notify) the label requests a published run calls for.

    Parameters
    ----------
    storage_cfg : StorageConfig, dict or None
        Storage settings (None: from the environment).
    results_uri : str
        Root where ``label_requests/`` lives (unless ``config.requests_uri``).
    evaluation, window : str
        The run (window as in result paths, ``YYYY-MM-DD_YYYY-MM-DD``).
    published_result : dict
        The result dict, or the evaluate flow's return value (adds run key and path).
    logs_table_or_uri : pyarrow.Table, DataFrame or str
        Evaluated rows, or the logs URI (the window is read, labels joined from
        ``config.labels_uri`` or the logs URI).
    config : dict or RequestConfig

    Returns
    -------
    list of dict
        The manifests created by this call (with ``uri``); existing or skipped ones are not listed.
    """
    cfg = RequestConfig.from_dict(config)
    logs_uri = logs_table_or_uri if isinstance(logs_table_or_uri, str) else None
    if logs_uri is not None:
        table = read_evaluated_logs(logs_uri, window, cfg.labels_uri, storage_cfg)
    else:
        table = _as_table(logs_table_or_uri)
    st = _storage(cfg.requests_uri or results_uri, storage_cfg)
    existing = list_requests(st, now=now)
    plan = plan_requests(published_result, table, cfg, evaluation=evaluation, window=window, logs_uri=logs_uri,
                         existing=existing, drift_look=drift_look, anchor_ids=anchor_ids, now=now)
    for s in plan["skipped"]:
        log.info("label request not raised for %s/%s: %s", evaluation, s.get("scope"), s.get("reason"))
    return _write_and_notify(st, plan["requests"], cfg, evaluation, window)


def _write_and_notify(st: Any, manifests: Sequence[dict], cfg: RequestConfig, evaluation: str | None,
                      window: str | None) -> list[dict]:
    """Create each manifest (create-only) and notify it; returns the ones this call created."""
    from flows.integrations.notify import notify

    created = []
    for m in manifests:
        if not write_request(st, m):
            log.info("label request %s exists already; not written again", m["request_id"])
            continue
        m = dict(m, uri=st.url(request_key(m["request_id"])))
        log.info("label request %s: %d label(s) for %s/%s (%s)", m["request_id"], m["n_labels"], evaluation,
                 m["scope"], ", ".join(r["trigger"] for r in m["reasons"]))
        if cfg.notify:
            payload = {
                "evaluation": evaluation, "window": window, "request_id": m["request_id"], "uri": m["uri"],
                "scope": m["scope"], "n_labels": m["n_labels"], "design": m["design"],
                "triggers": [r["trigger"] for r in m["reasons"]], "reasons": [r["reason"] for r in m["reasons"]],
                "deadline": m["deadline"]}
            if m.get("drift"):
                payload["drift"] = m["drift"]
                payload["n_anchors"] = len(m.get("anchors") or [])
            m["notification"] = notify("label_request", payload, webhook_url=cfg.webhook_url)
        created.append(m)
    return created


def _empty_logs() -> pa.Table:
    return pa.table({"response_id": pa.array([], pa.string()), "policy": pa.array([], pa.string()),
                     "judge_score": pa.array([], pa.float64())})


def raise_drift_requests(storage_cfg: Any, requests_uri: str, drift_look: Mapping, anchor_ids: Sequence[str], *,
                         evaluation: str | None = None, latest: Mapping | None = None, logs_uri: str | None = None,
                         config: Mapping | RequestConfig | None = None, no_traffic_reason: str | None = None,
                         now: datetime | str | None = None) -> dict:
    """Raise the label request of a drift alarm: fresh labels on anchors and on recent traffic.

    Only the ``drift_alarm`` trigger is evaluated here (the audit triggers belong to the
    evaluation's own runs, `evaluate_and_audit`).

    Parameters
    ----------
    storage_cfg : StorageConfig, dict or None
    requests_uri : str
        Root of ``label_requests/`` (``config.requests_uri`` takes precedence).
    drift_look : dict
        The alarming look (`DriftLook.to_dict()` with ``meta``: monitor, set_name, judge_id, ...).
    anchor_ids : list of str
        The anchor set's ids (anchor labels are drawn from them).
    evaluation : str, optional
        The monitor's linked evaluation.
    latest : dict, optional
        Its latest published run (`flows.storage.publish.read_latest`): window and result.
    logs_uri : str, optional
        The evaluation's logs; the recent traffic is read from the latest run's window and
        joined with the label store at ``config.labels_uri`` (default the logs URI).
    config : dict or RequestConfig
        The evaluation's ``label_requests`` settings (budget, sizes, deduplication scope).
    no_traffic_reason : str, optional
        Why recent traffic cannot be requested (recorded in the manifest); without ``latest``
        and ``logs_uri`` the request holds anchors only.

    Returns
    -------
    dict
        ``requests`` (manifests created by this call, with ``uri``), ``skipped`` (with reasons)
        and ``traffic`` (what "recent traffic" meant, or why there was none).
    """
    from dataclasses import replace

    cfg = RequestConfig.from_dict(config)
    if "drift_alarm" not in cfg.triggers:
        return {"requests": [], "traffic": None, "skipped": [{
            "scope": "drift", "trigger": "drift_alarm",
            "reason": f"the drift_alarm trigger is disabled in the label_requests settings of evaluation "
                      f"{evaluation!r}"}]}
    cfg_drift = replace(cfg, triggers=("drift_alarm",))
    has_result = isinstance(latest, Mapping) and isinstance(latest.get("result"), Mapping)
    table = None
    if has_result and logs_uri:
        window = str(latest["window"])
        try:
            table = read_evaluated_logs(logs_uri, window, cfg.labels_uri, storage_cfg)
        except CJEInputError as exc:  # the alarm still asks for anchor labels; the manifest says why
            log.warning("drift label request: recent traffic of %r not readable (%s); anchors only", evaluation, exc)
            no_traffic_reason = f"the logs of window {window} of evaluation {evaluation!r} are not readable ({exc})"
    if table is not None:
        published: Mapping = latest
        traffic = (f"the last {cfg.recent_days} log date(s) of window {window} of evaluation {evaluation!r} "
                   f"(latest published run {latest.get('run_key')}), unlabelled rows only, from {logs_uri}")
    else:
        window = None
        table = _empty_logs()
        published = {"policies": {}, "config": {}}
        traffic = "none requested: " + (no_traffic_reason or (
            "the drift monitor has no linked evaluation" if not evaluation else
            f"evaluation {evaluation!r} has no published result yet" if not has_result else
            f"the logs of evaluation {evaluation!r} are unknown to the drift flow"))
    st = _storage(cfg.requests_uri or requests_uri, storage_cfg)
    existing = list_requests(st, now=now)
    plan = plan_requests(published, table, cfg_drift, evaluation=evaluation, window=window, logs_uri=logs_uri,
                         existing=existing, drift_look=drift_look,
                         anchor_ids=[] if anchor_ids is None else list(anchor_ids), now=now)
    for m in plan["requests"]:
        m.setdefault("drift", {})["traffic"] = traffic
    for s in plan["skipped"]:
        log.info("drift label request not raised for look %s: %s", drift_look.get("look"), s.get("reason"))
    created = _write_and_notify(st, plan["requests"], cfg, evaluation, window)
    return {"requests": created, "skipped": plan["skipped"], "traffic": traffic}


# --------------------------------------------------------------------------------------
# the wrapper flow: evaluate, then audit


def _raise_task():
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    @task(name="raise_label_requests", retries=2, retry_delay_seconds=[1.0, 5.0], cache_policy=NO_CACHE)
    def raise_label_requests(results_uri: str, cfg: Any, evaluation: str, window: str, outcome: dict,
                             logs_uri: str, config: dict, drift_look: dict | None,
                             anchor_ids: list[str] | None) -> list[dict]:
        return raise_requests_for_run(cfg, results_uri, evaluation, window, outcome, logs_uri, config,
                                      drift_look=drift_look, anchor_ids=anchor_ids)

    return raise_label_requests


def _build_flow():
    from prefect import flow
    from prefect.logging import get_run_logger
    from prefect.utilities.annotations import quote

    from flows.pipelines.evaluate import evaluate

    raise_label_requests = _raise_task()

    @flow(name="evaluate_and_audit", log_prints=False, validate_parameters=True)
    def evaluate_and_audit(
        logs_uri: str,
        window: str = "last 7 days",
        evaluation: str = "default",
        results_uri: str | None = None,
        labels_uri: str | None = None,
        policies: list[str] | None = None,
        options: dict[str, Any] | None = None,
        as_of: str | None = None,
        n_chunks: int | None = None,
        retry_delays: list[float] | None = None,
        label_requests: dict[str, Any] | None = None,
        drift_look: dict[str, Any] | None = None,
        anchor_ids: list[str] | None = None,
        mode: str = "direct",
    ) -> dict:
        """The `evaluate` flow, then notifications and automatic label requests.

        Same parameters as `flows.pipelines.evaluate.evaluate` (``mode`` is passed on when that flow
        has it), plus ``label_requests`` (a
        `RequestConfig` mapping), ``drift_look`` (`DriftLook.to_dict()`) and ``anchor_ids``.
        A failure after publishing (notification or request step) never unpublishes the
        result: it is logged and returned as ``label_requests_error``.
        """
        from flows.integrations.notify import notify_result
        from flows.storage.objects import StorageConfig

        logger = get_run_logger()
        cfg_req = RequestConfig.from_dict(label_requests)  # bad settings fail before any work
        req_dict = cfg_req.to_dict()
        req_dict["labels_uri"] = req_dict["labels_uri"] or labels_uri or logs_uri
        extra = {"mode": mode} if (mode != "direct" or "mode" in evaluate.parameters.properties) else {}
        out = evaluate(logs_uri=logs_uri, window=window, evaluation=evaluation, results_uri=results_uri,
                       labels_uri=labels_uri, policies=policies, options=options, as_of=as_of, n_chunks=n_chunks,
                       retry_delays=retry_delays, **extra)
        out["notifications"] = []
        out["label_requests"] = []
        if out.get("published"):  # a rerun of a published run notifies nothing new
            out["notifications"] = notify_result(out["result"], evaluation=evaluation, window=out["window"],
                                                 path=out.get("path"), webhook_url=cfg_req.webhook_url)
        cfg = StorageConfig.from_env()
        try:
            out["label_requests"] = raise_label_requests(results_uri or logs_uri, quote(cfg), evaluation,
                                                         out["window"], quote(out), logs_uri, req_dict, drift_look,
                                                         anchor_ids)
        except Exception as exc:  # noqa: BLE001 - the result is published; report, do not unpublish
            logger.error("label requests for %s/%s failed: %s", evaluation, out["window"], exc)
            out["label_requests_error"] = f"{type(exc).__name__}: {exc}"
        logger.info("%d label request(s) raised", len(out["label_requests"]))
        return out

    return evaluate_and_audit


evaluate_and_audit = _build_flow()

__all__ = ["RequestConfig", "find_triggers", "plan_requests", "sample", "raise_requests_for_run", "list_requests",
           "write_request", "mark_fulfilled", "status_of", "iso_period", "evaluate_and_audit", "TRIGGERS",
           "raise_drift_requests"]

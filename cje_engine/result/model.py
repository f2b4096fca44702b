"""The typed result model: what `result.json` holds, field by field (pydantic v2).

The JSON Schema committed beside this module (``result.schema.json``) and the field tables of
``docs/result-schema.md`` are generated from these models (`cje_engine.result.schema`), so the
three cannot disagree. Fields are only ever added within a schema version: a field that older
results of the same version lack is optional here (``None`` default, not required in the schema).
Mode-specific fields (logs-only / hybrid) are optional too and absent from Direct results.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from cje_engine.calibration.registry import result_mode_type
from cje_engine.result.segments import SegmentsResult

SCHEMA_VERSION = 1

Num = Optional[float]
#: ``[low, high]``; an end may be null when it is not finite (raw IPS)
Pair = list[Optional[float]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------ policies


class StatSummary(_Strict):
    """One statistic by both inference routes (``se``/``ci`` = the reported route)."""

    estimate: Num = Field(description="point estimate")
    se: Num = Field(description="standard error by the reported route")
    ci: Optional[Pair] = Field(description="interval by the reported route, clipped to the label scale")
    se_analytic: Num = Field(None, description="influence-function standard error")
    ci_analytic: Optional[Pair] = Field(None, description="normal/t interval from the influence function")
    se_bootstrap: Num = Field(None, description="bootstrap standard error (bootstrap route only)")
    ci_bootstrap: Optional[Pair] = Field(None, description="percentile interval (bootstrap route only)")


class OracleOnly(_Strict):
    """Baseline: weighted mean of the policy's own labels with a prompt-clustered t interval."""

    estimate: float
    se: float
    ci: Pair
    n_labels: int


class VarianceComponents(_Strict):
    """``Var ~ sigma2_eval / n_prompts + sigma2_cal / m_labels`` (for the budget planner)."""

    sigma2_eval: float = Field(description="evaluation-sampling variance per prompt")
    sigma2_cal: float = Field(description="calibration (or label-residual) variance per label")
    n_prompts: int
    m_labels: int


class Support(_Strict):
    """Calibration support of the policy's judge scores."""

    share_outside_range: float
    share_thin: float
    limited: bool = Field(description="more than the material share of rows is thinly supported")
    rule: Optional[str] = None
    share_covariate_outside: Optional[float] = Field(
        None, description="two-stage calibration: share of the policy's rows with a covariate outside the range the "
                          "calibration labels cover (the index extrapolates there); flagged, not refused: verified "
                          "levels do not depend on it")
    covariate_extrapolation: Optional[bool] = Field(None, description="share_covariate_outside above the material share")


class Decile(_Strict):
    """One score decile of a transport audit: its range, rows and mean residual."""
    lo: float
    hi: float
    n: int
    mean_residual: float
    se: Num


class Audit(_Strict):
    """Transport audit of the calibration on the policy's own labels (see cje_engine.audit)."""

    verdict: Literal["pass", "fail", "inconclusive", "not_run"]
    reason: str
    n_labels: int
    residual_mean: Num = None
    se: Num = None
    ci: Optional[Pair] = None
    ci_adjusted: Optional[Pair] = None
    p_value: Num = None
    p_adjusted: Num = None
    margin: float = Field(description="practical margin in label units")
    family_size: Optional[int] = Field(None, description="audited policies in the Holm family")
    df: Num = Field(None, description="degrees of freedom of the t reference of residual_mean / se (Welch-"
                                      "Satterthwaite: audit slice and borrowed calibrator); null: normal")
    calibrator: Optional[Literal["cross_fitted", "borrowed", "excluded"]] = Field(
        None, description="cross_fitted: its labels train the calibrator (out-of-fold residuals); borrowed: they "
                          "do not; excluded: they were removed from it by robust pooling")
    deciles: Optional[list[Decile]] = None
    extra_labels_needed: Optional[int] = None
    se_route: Optional[str] = Field(
        None, description="how the SE was obtained: bootstrap (SD of the residual mean over replicates that refit "
                          "the calibrator), influence (residual and calibration terms) or influence (residual term) "
                          "for a calibration source")


class SelectiveInterval(_Strict):
    """A recalibrated level's interval conditional on its failed audit (docs/statistics.md, "Selective
    intervals after a failed audit")."""

    ci: Pair = Field(description="the conditional (selective) interval, clipped to the label scale: the reported ci")
    ci_unconditional: Pair = Field(description="the ordinary own-label interval (unconditional), clipped")
    unconditional_method: str = Field(description="the ordinary interval's method (bca_expanded or skew_t)")
    z: float = Field(description="the audit's residual mean over its SE")
    critical_z: float = Field(description="the selection threshold on |z|: the normal quantile of the policy's "
                                          "Holm threshold, the other policies' p-values held fixed")
    p_threshold: float = Field(description="the largest unadjusted p-value at which this audit still fails")
    regression_coef: float = Field(description="b = Cov(level, residual mean) / Var(level): the truncation "
                                               "conditions on residual mean - b level")
    truncation: list[Pair] = Field(description="the level's values consistent with the failure, given that "
                                               "statistic (a union of intervals)")
    log_selection_mass: Num = Field(description="log probability of the failure given that statistic at the "
                                                "estimate: near 0 when the conditioning changes little")


class DirectSummary(_Strict):
    """Direct's estimate of an off-policy candidate from its fresh draws (hybrid)."""

    estimate: Num
    se: Num
    ci: Optional[Pair]
    level_claim: Literal["ok", "assumes_transport", "refused"]
    refusal_reasons: list[str]
    basis_code: str


class OffPolicyEstimate(_Strict):
    """One off-policy estimator of a candidate: influence-function and bootstrap routes."""

    value: Num
    se_if: Num
    ci_if: Optional[Pair]
    se: Num
    ci: Optional[Pair]
    n_replicates_finite: int
    claim: Literal["level", "downgraded", "refused"]
    coef: Optional[dict[str, float]] = Field(None, description="stacking weights (stacked only)")


class GateCheck(_Strict):
    """One gate's value against its threshold."""
    gate: str
    value: Num
    threshold: float
    passed: bool
    applies_to: str


class Verdict(_Strict):
    """A gate verdict: the claim allowed, why, and what to do."""
    claim: Literal["level", "downgraded", "refused"]
    reasons: list[str]
    recommendation: Optional[str]


class OffPolicyBlock(_Strict):
    """Off-policy detail of a policy: the logger's role, or a candidate's estimators and gates."""

    role: Optional[Literal["logger"]] = None
    estimator: str = Field(description="headline estimator")
    estimates: Optional[dict[str, OffPolicyEstimate]] = None
    diagnostics: Optional[dict[str, Any]] = Field(
        None, description="ESS raw/stabilised, max-weight share, q99.5 weight, Hill index, TTC, affinity, CLE floor, "
                          "SIMCal fit, DR orthogonality (docs/offpolicy.md)")
    verdicts: Optional[dict[str, Verdict]] = None
    gate_checks: Optional[list[GateCheck]] = None
    stack_candidates: Optional[list[str]] = None


class VerifiedLevel(_Strict):
    """The policy's verified level: valid without assuming that the calibration transports to it."""

    method: Literal["power_tuned"] = Field(description="power_tuned: own-label mean + lambda (augmented - own-label "
                                                       "mean), lambda chosen to minimise the variance (PPI++)")
    lam: Num = Field(alias="lambda", description="the power-tuning weight in [0, 1] (1: augmented, 0: oracle-only)")
    n_labels: int
    estimate: Num
    se: Num
    ci: Optional[Pair]


class AssumedLevel(_Strict):
    """The policy's assumes-transport level (the paper's protocol: the calibrated plug-in where the audit did
    not fail, the own-label level where it failed; an off-policy candidate's gated headline estimate), kept
    beside the verified one."""

    estimate: Num
    se: Num
    ci: Optional[Pair]
    ci_method: Optional[str] = None
    basis_code: str
    basis: str
    level_claim: Literal["ok", "assumes_transport", "refused"]
    refusal_reasons: list[str]


class LabelsToVerify(_Strict):
    """Own labels that would verify an unverified policy (its level, and its closest comparison at 80% power)."""

    n_labels: int = Field(description="the larger of for_level and for_closest_comparison")
    for_level: int = Field(description="own labels still missing for a verified level (min_labels)")
    for_closest_comparison: Optional[int] = None
    closest: Optional[dict[str, Any]] = Field(None, description="the verified policy whose assumed level is closest, "
                                                                "and the assumed difference")
    power: float
    residual_sd: Num = Field(None, description="SD of the label residuals Y - f used for the projection")
    capped: Optional[bool] = Field(None, description="n_labels was capped at the policy's unlabelled rows")


class PolicyResult(_Strict):
    """One policy's level, how it was obtained, and whether it may be quoted."""

    estimate: Num = Field(description="the quotable level (verified, or trusted assumes-transport); null when the "
                                      "policy has none (level_claim assumes_transport); kept for ranking when refused")
    se: Num
    ci: Optional[Pair]
    ci_method: Optional[str] = Field(
        None, description="Direct levels: how ci was obtained: percentile or normal (plug-in), bca_expanded or "
                          "skew_t (own labels), selective (a recalibrated level, conditional on its failed audit)")
    selective: Optional[SelectiveInterval] = Field(
        None, description="recalibrated levels: the conditional interval's construction and the unconditional one")
    level_claim: Literal["ok", "assumes_transport", "refused"] = Field(
        description="ok: a verified level (own labels correct it; quotable); assumes_transport: the level rests on "
                    "the calibration transporting to this policy, which its labels did not verify (estimate null "
                    "unless the team trusts it: trust_transport); refused")
    refusal_reasons: list[str] = Field(description="plain-language reasons, non-empty exactly when refused")
    verified: Optional[VerifiedLevel] = Field(None, description="the verified level, when the policy has one (Direct; "
                                                                "hybrid: Direct's, from the fresh draws' own labels)")
    assumed: Optional[AssumedLevel] = Field(None, description="the assumes-transport level (paper's protocol; "
                                                              "off-policy candidates: the gated off-policy headline)")
    labels_to_verify: Optional[LabelsToVerify] = None
    n_prompts: Optional[int] = None
    claim: Optional[Literal["level", "downgraded", "refused"]] = Field(
        None, description="off-policy modes: the gate verdict (level, downgraded, refused)")
    recommendation: Optional[str] = Field(None, description="off-policy modes: what to do when not a level")
    basis: str
    basis_code: str = Field(description="augmented, recalibrated, plug_in, or logs-only/<estimator>, "
                                        "hybrid/<estimator> (a hybrid candidate whose audit failed and whose own "
                                        "labels allow it takes Direct's path: recalibrated)")
    transport: Literal["audited", "unaudited"]
    plug_in: Optional[StatSummary]
    augmented: Optional[StatSummary]
    raw_judge_mean: Num
    raw_judge_basis: Optional[str] = None
    oracle_mean: Num
    oracle_only: Optional[OracleOnly] = None
    n_rows: int
    n_logged: Optional[int] = None
    n_fresh: Optional[int] = None
    n_labelled: int
    variance_share_calibration: Num
    variance_components: Optional[VarianceComponents] = None
    se_analytic: Num = None
    se_bootstrap: Num = None
    var_cal_jackknife_plug_in: Num = None
    var_cal_influence_plug_in: Num = None
    support: Support
    audit: Audit
    direct: Optional[DirectSummary] = None
    offpolicy: Optional[OffPolicyBlock] = None
    relative_claim: Optional[Literal["ok", "rank_only", "not_estimable"]] = Field(
        None, description="may the policy appear in comparisons and the ranking: ok, rank_only (limited "
                          "calibration support: conservative intervals) or not_estimable (overlap or transport "
                          "refusal: dropped)")
    relative_reason: Optional[str] = Field(None, description="why the relative claim is limited")


# ------------------------------------------------------------------------------- comparisons


class Comparison(_Strict):
    """A paired difference ``a - b`` (every unordered pair once)."""

    a: str
    b: str
    diff: Num = Field(description="estimate a - estimate b")
    se: Num
    ci: Optional[Pair]
    se_analytic: Num = None
    p_value: Num
    p_adjusted: Num = Field(description="adjusted by multiplicity.method")
    significant: Optional[bool] = Field(description="p_adjusted <= alpha")
    prob_a_better: Num
    involves_refused: bool
    reported: Optional[bool] = Field(
        None, description="false when a policy of the pair is not estimable even relatively (then diff, ci, "
                          "p_value, p_adjusted, significant are null)")
    not_estimable: Optional[str] = Field(None, description="why the pair is not reported (policy: reason)")
    claim_kind: Optional[Literal["verified", "assumes_transport"]] = Field(
        None, description="verified when both levels are verified, else assumes_transport")
    bias_bound: Num = Field(None, description="rank-only pairs (limited calibration support): the bound on the levels' "
                                              "bias that ci carries and p_value tests against")


class BaselineComparison(_Strict):
    """``policy - baseline`` with a simultaneous interval over all policies (single-step max-T)."""

    policy: str
    baseline: str
    claim_kind: Literal["verified", "assumes_transport"]
    diff: Num
    se: Num
    ci: Optional[Pair] = Field(description="simultaneous 1 - alpha interval over the many-to-one family")
    critical_value: Num
    p_adjusted: Num = Field(description="single-step max-T adjusted p-value")
    better: Optional[bool]
    worse: Optional[bool]
    non_inferior: Optional[bool] = Field(description="the interval's lower end is above -margin")
    margin: float = Field(description="non-inferiority margin in label units")
    reported: bool
    not_estimable: Optional[str] = None


class AssumedClaims(_Strict):
    """Comparisons, ranking and best policy on the assumes-transport levels, named as such."""

    comparisons: list["Comparison"]
    ranking: list["RankEntry"]
    best_policy: Optional[str]
    best_policy_reason: str


class RankEntry(_Strict):
    """A policy's place in the ranking."""
    policy: str
    rank: int = Field(description="1 + number of policies significantly better")
    estimate: Num
    level_claim: Literal["ok", "assumes_transport", "refused"]
    tied_with: Optional[list[str]] = None


class WinMatrix(_Strict):
    """Pairwise significance and probability that the row policy is better."""
    policies: list[str]
    significant: list[list[int]] = Field(description="+1 row significantly better than column, -1 worse, 0 not")
    prob_row_better: list[list[Optional[float]]]


class Multiplicity(_Strict):
    """The adjustment of the pairwise comparisons' p-values."""
    method: Literal["bh", "holm"]
    alpha: float
    n_comparisons: int = Field(description="reported comparisons (the adjustment's family)")
    looks: Literal["one", "repeated"] = Field("one", description="one: the claims hold for this evaluation looked at "
                                              "once; repeated: at every look at once (confidence sequences, "
                                              "anytime p-values; docs/statistics.md, 'Repeated looks')")
    planned_labels: Optional[int] = Field(None, description="repeated looks: the own labels per policy at which the "
                                          "confidence sequence is tightest (fixed before the first look)")


class RankAgreement(_Strict):
    """How far the raw judge's order agrees with the calibrated order."""
    kendall_tau_b_raw_vs_calibrated: Num
    raw_order: list[str]
    calibrated_order: list[str]


# ------------------------------------------------------------------------------- run context


class DataSummary(_Strict):
    """Counts of the evaluated data."""
    n_rows: int
    n_prompts: int
    n_labelled: int
    n_calibration_labels: int
    policies: list[str]
    covariates: Optional[list[str]] = None
    logger: Optional[str] = None
    n_logged: Optional[int] = None
    n_fresh: Optional[dict[str, int]] = None
    source: Optional[str] = None
    logger_column: Optional[str] = None


class Selection(_Strict):
    """How the calibration mode was chosen."""
    requested: str
    oof_rmse: dict[str, float] = Field(description="out-of-fold RMSE on the calibration rows, per mode tried")
    labelled_rmse: Optional[dict[str, float]] = Field(
        None, description="RMSE on every labelled row (out of fold on calibration rows, borrowed fit on audit "
                          "slices), each policy weighted equally, per mode tried")
    paired_difference: Num = Field(None, description="auto with covariates: monotone minus two-stage mean "
                                                     "squared error on the labelled rows (positive: two-stage fits better)")
    paired_se: Num = Field(None, description="its prompt-clustered standard error")
    two_stage_knots: Optional[int] = Field(
        None, description="ramp segments of the two-stage index when it was fitted (six, fewer with few "
                          "calibration labels: two labels per stage-1 parameter)")
    chosen: str
    reason: str


class ExcludedSource(_Strict):
    """A calibration source removed from the calibrator by robust pooling."""

    policy: str
    residual_mean: float = Field(description="its out-of-fold mean label residual when it was removed")
    se: float
    p_adjusted: float = Field(description="Holm-adjusted over the calibration sources of that round")
    family_size: int
    round: int
    reason: str


class Curve(_Strict):
    """The fitted calibration curve on a grid of scores."""
    score: list[float]
    fitted: list[float]
    covariates_at: Optional[dict[str, float]] = None


class Points(_Strict):
    """The labelled points the calibration was fitted on."""
    score: list[float]
    label: list[float]


class ReliabilityBin(_Strict):
    """One bin of the calibration's reliability table."""
    lo: float
    hi: float
    n: int
    mean_predicted: float
    mean_label: float


class Calibration(_Strict):
    """The judge-to-oracle calibration: mode, selection, fit and diagnostics."""
    mode: result_mode_type()  # a registered calibration mode (cje_engine.calibration.registry)
    selection: Optional[Selection] = None
    n_train: int
    calibration_policies: Optional[list[str]] = None
    curve: Optional[Curve] = None
    points: Optional[Points] = None
    reliability: Optional[list[ReliabilityBin]] = None
    label_range: Optional[Pair] = None
    excluded_sources: list[ExcludedSource] = Field(
        default_factory=list, description="calibration sources whose labels left the calibrator (robust pooling)")


class RowPass(_Strict):
    """Where the rows were reduced and why: the evaluate flow records it on either path (absent: an evaluation
    run outside the flow, in one process)."""

    path: Literal["single", "sharded"]
    shards: int = Field(description="shards by prompt (stable hash of the prompt id); 1 on the single path")
    influence: Literal["per_prompt", "gram"] = Field(
        description="per_prompt: every prompt's influence terms were brought to the driver and are kept; gram: "
                    "the labelled prompts' terms plus the moments (orders 1-3) of the other prompts' (variances, "
                    "intervals and comparisons as per_prompt; per-prompt terms not available: save_terms refuses)")
    reason: str


class Inference(_Strict):
    """The inference route: bootstrap or analytic, and its settings."""
    method: Literal["bootstrap", "analytic"]
    n_bootstrap: int
    ci_method: str
    own_label_ci_method: Optional[str] = Field(
        None, description="interval method of own-label (augmented / recalibrated) levels; `ci_method` covers "
                          "the plug-in levels and comparisons (docs/statistics.md, 'Own-label intervals')")
    seed: int
    alpha: float
    cluster: Optional[str] = None
    offpolicy: Optional[str] = None
    row_pass: Optional[RowPass] = None


class OffPolicyRun(_Strict):
    """Off-policy settings of a logs-only or hybrid run."""

    mode: Literal["logs-only", "hybrid"]
    logger: str
    targets: list[str]
    estimator: dict[str, str]
    gates: dict[str, float]
    simcal: dict[str, Any]
    ttc_mass: float
    stack: list[str]
    downgraded: Literal["ok", "refused"]
    direct_from_fresh: dict[str, dict[str, Any]]


class EvaluationModel(_Strict):
    """The whole result (``EvaluationResult.to_dict()``, ``result.json``)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    engine_version: str
    mode: Optional[Literal["direct", "logs-only", "hybrid"]] = None
    config: dict[str, Any] = Field(description="every option that shaped the numbers")
    data: DataSummary
    calibration: Calibration
    inference: Inference
    policies: dict[str, PolicyResult] = Field(min_length=1)
    comparisons: list[Comparison]
    multiplicity: Multiplicity
    ranking: list[RankEntry]
    win_matrix: WinMatrix
    best_policy: Optional[str] = Field(description="never a refused policy")
    best_policy_reason: str
    rank_agreement: RankAgreement
    baseline_comparisons: Optional[list[BaselineComparison]] = None
    assumes_transport: Optional[AssumedClaims] = Field(
        None, description="Direct: claims on the assumes-transport levels (never the basis of best or a gate)")
    offpolicy: Optional[OffPolicyRun] = None
    segments: Optional[SegmentsResult] = Field(
        None, description="evaluate(..., segment_by=[...]): segment x policy levels, comparisons with the baseline, "
                          "calibration by segment and the error control of the family (docs/segments.md)")
    warnings: list[str]

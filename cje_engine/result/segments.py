"""The typed result of a segmented evaluation (``evaluate(..., segment_by=[...])`` -> ``result.segments``).

One block, `SegmentsResult`, beside the per-policy result: where each policy wins and loses against the
baseline segment by segment, whether the judge's calibration holds in each segment, and how the family of
segment x policy claims is controlled (docs/segments.md). Every number is in label units. A segment
is one value of the ``segment_by`` columns (several columns: their combination, joined by ``" / "``).

Claim kinds of a cell or a comparison:

- ``verified``: the level rests on the cell's own labels (power-tuned residual correction, valid whether or
  not the calibration transports to the segment); a comparison is verified when both levels are.
- ``assumes_transport``: the level is the calibrated plug-in on the segment's rows; it is right only if
  the calibration transports to the segment (too few own labels to verify it). Shown named as such.
- ``too_few``: the segment has too few rows or labels (options ``segment_min_rows``,
  ``segment_min_labels``) even after pooling the small segments into ``other``: no level is printed.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Num = Optional[float]
Pair = list[Optional[float]]

#: The name of the pooled segment of every segment too small to be shown on its own.
OTHER = "other"

ClaimKind = Literal["verified", "assumes_transport", "too_few"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SegmentInfo(_Strict):
    """One segment: its size and whether it is shown on its own, pooled into ``other``, or too small."""

    name: str = Field(description="the segment's value (several columns: joined by ' / '); 'other' for the pool")
    status: Literal["shown", "pooled", "too_few"] = Field(
        description="shown: its own cells; pooled: its rows are in the 'other' segment; too_few: 'other' itself "
                    "is below the minimums, so no level is printed")
    n_rows: int = Field(description="rows of every policy in the segment")
    n_labels: int = Field(description="labelled rows of every policy in the segment")
    members: Optional[list[str]] = Field(None, description="'other': the pooled segments' names")


class SegmentAudit(_Strict):
    """Transport audit of the calibration on one cell's own labels (mean out-of-fold residual Y - f)."""

    verdict: Literal["pass", "fail", "inconclusive", "not_run"] = Field(
        description="the product's audit rule on the cell's labels (docs/statistics.md): fail when the interval "
                    "excludes 0, pass when it lies within the margin, not_run without labels")
    n_labels: int
    residual_mean: Num = None
    se: Num = None
    p_value: Num = Field(None, description="two-sided, H0: mean residual 0")
    p_adjusted: Num = Field(None, description="Holm over every audited cell of the family (a segment claim 'the "
                                              "judge is off here' is made at p_adjusted <= alpha)")


class SegmentCell(_Strict):
    """One segment x policy: its level (when it may be printed), the kind of claim, its audit and sizes."""

    segment: str
    policy: str
    n_rows: int
    n_prompts: int
    n_labels: int = Field(description="the cell's own labelled rows")
    claim_kind: ClaimKind
    estimate: Num = Field(description="the printed level: verified, or the plug-in named assumes_transport; null "
                                      "for too_few")
    se: Num = None
    ci: Optional[Pair] = Field(None, description="the shown interval at error_control.level_interval_level "
                                                 "(false coverage rate control over the shown cells)")
    ci_marginal: Optional[Pair] = Field(None, description="the cell's own 1 - alpha interval")
    assumed_estimate: Num = Field(None, description="the assumes-transport level (the paper's protocol) beside a "
                                                    "verified level")
    plug_in: Num = Field(None, description="the calibrated plug-in on the cell's rows (assumes transport; with "
                                           "recalibration.applied, of the calibration with the segment covariate)")
    reason: Optional[str] = Field(None, description="why the claim is not verified, or why nothing is printed")
    audit: SegmentAudit
    pooled: Optional["PooledLevel"] = Field(None, description="segment_pooling='eb': the partially pooled level")


class PooledLevel(_Strict):
    """A verified cell's level partially pooled across the policy's segments (empirical Bayes)."""

    estimate: float = Field(description="mean + (1 - shrinkage) (level - mean)")
    ci: Pair = Field(description="robust EBCI (Armstrong, Kolesar & Plagborg-Moller 2022): average coverage "
                                 "1 - alpha across the policy's segments whatever the spread of the true levels")
    shrinkage: float = Field(description="se^2 / (mu2 + se^2): the weight on the policy's mean across segments")


class PartialPooling(_Strict):
    """Empirical-Bayes partial pooling of one policy's verified segment levels."""

    policy: str
    method: Literal["robust_ebci"] = "robust_ebci"
    n_segments: int
    mean: float = Field(description="precision-weighted mean of the policy's verified segment levels")
    mean_se: float
    mu2: float = Field(description="estimated variance of the true levels around the mean (floored)")


class SegmentComparison(_Strict):
    """``policy - baseline`` within one segment."""

    segment: str
    policy: str
    baseline: str
    claim_kind: ClaimKind = Field(description="verified when both levels are verified; too_few: not compared")
    diff: Num = None
    se: Num = None
    df: Num = Field(None, description="degrees of freedom of the t reference of diff / se (the smaller of the two "
                                      "levels'; null: normal)")
    ci: Optional[Pair] = Field(None, description="marginal 1 - alpha interval")
    ci_fcr: Optional[Pair] = Field(None, description="selected comparisons only (significant after adjustment): "
                                                     "the Benjamini-Yekutieli interval at level 1 - R alpha / m")
    p_value: Num = None
    p_adjusted: Num = Field(None, description="adjusted over the family of every segment x policy comparison "
                                              "(error_control.claims_method)")
    significant: Optional[bool] = None
    better: Optional[bool] = Field(None, description="significant and diff > 0")
    worse: Optional[bool] = Field(None, description="significant and diff < 0: the policy loses in this segment")


class ErrorControl(_Strict):
    """How the segment x policy family is controlled, stated with its sizes."""

    alpha: float
    claims_method: Literal["bh", "holm"] = Field(
        description="comparison claims: bh (false discovery rate) or holm (family-wise error rate)")
    n_comparisons: int = Field(description="m: the comparisons of the family (too_few cells excluded)")
    n_selected: int = Field(description="R: the comparisons claimed (p_adjusted <= alpha)")
    comparison_interval_method: Literal["by_fcr"] = Field(
        "by_fcr", description="selected comparisons get Benjamini-Yekutieli (2005) intervals at 1 - R alpha / m, "
                              "so the false coverage rate of the shown intervals is at most alpha")
    comparison_interval_level: Num = Field(description="1 - R alpha / m (null when nothing is selected)")
    n_cells: int = Field(description="segment x policy cells considered for a level (too_few included)")
    n_shown: int = Field(description="cells with a printed level")
    level_interval_level: float = Field(
        description="1 - n_shown alpha / n_cells: the shown levels are selected by size only (never by their "
                    "values), so this Benjamini-Yekutieli level controls their false coverage rate at alpha")
    audit_method: Literal["holm"] = Field("holm", description="per-cell audit claims: Holm over the audited cells")
    omnibus: str = Field(description="how the omnibus calibration test is formed (one test per policy and one "
                                     "over all labels, each at alpha)")


class OmnibusComponent(_Strict):
    """One entry of the omnibus test's vector: the mean residual of a segment or of a score decile."""

    kind: Literal["segment", "decile"]
    name: str = Field(description="the segment's name, or the decile's score range 'lo-hi'")
    n: int = Field(description="labelled rows")
    mean_residual: float
    se: Num = Field(description="cluster-robust (prompt) standard error")


class OmnibusTest(_Strict):
    """Clustered Wald (chi-square) test that every segment's and every score decile's mean residual is 0.

    Catches calibration errors that cancel in the pooled mean (the pooled audit cannot see them)."""

    policy: str = Field(description="a policy, or '*' for the labels of every policy together")
    statistic: Num = Field(description="d' V^+ d, d the vector of mean residuals, V its prompt-clustered covariance")
    df: int = Field(description="rank of V (the segment and decile means share one linear constraint)")
    p_value: Num
    reject: Optional[bool] = Field(description="p_value <= alpha: the calibration is off somewhere")
    n_labels: int
    n_clusters: int = Field(description="distinct labelled prompts")
    pooled_residual_mean: Num = Field(None, description="the plain pooled audit's mean residual, for comparison")
    pooled_se: Num = None
    pooled_p_value: Num = None
    components: list[OmnibusComponent]


class ReliabilityPoint(_Strict):
    """One bin of a reliability diagram: mean calibrated prediction against mean oracle label."""

    lo: float
    hi: float
    n: int
    mean_predicted: float
    mean_label: float
    se: Num = Field(None, description="cluster-robust SE of mean_label - mean_predicted")


class ReliabilityDiagram(_Strict):
    """Per policy: its labelled rows binned by decile of the calibrated prediction (out of fold)."""

    policy: str
    bins: list[ReliabilityPoint]


class Recalibration(_Strict):
    """Whether the segment levels use a calibration with the segment as a covariate."""

    applied: bool
    reason: str
    mode: str = Field(description="calibration mode of the segment levels")
    covariates: list[str] = Field(description="covariates of that calibration (one-hot segments: 'segment=NAME')")


class SegmentsResult(_Strict):
    """Segment x policy levels, comparisons with the baseline, calibration by segment, error control."""

    columns: list[str] = Field(description="the segment_by columns")
    baseline: str = Field(description="the policy every other is compared with, segment by segment")
    min_rows: int = Field(description="fewest rows of each policy for a segment to be shown on its own")
    min_labels: int = Field(description="fewest labels (all policies) for a segment to be shown on its own")
    segments: list[SegmentInfo]
    cells: list[SegmentCell]
    comparisons: list[SegmentComparison]
    error_control: ErrorControl
    omnibus: list[OmnibusTest]
    recalibration: Recalibration
    reliability: list[ReliabilityDiagram]
    partial_pooling: Optional[list[PartialPooling]] = Field(
        None, description="segment_pooling='eb': per policy with at least three verified segments")


SegmentCell.model_rebuild()

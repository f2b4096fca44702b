"""Judge-drift statistics on anchor sets and the monitor that spends alpha over looks.

The public names: the monitor (`DriftMonitor`, its `METRICS` and `DEFAULT_WEIGHTS`, `look_spending`),
one look's results (`DriftLook`, `MetricResult`), the statistics it reports (`kendall_tau_b`,
`TauResult`, `distribution_change`, `DistributionChange`, `rank_change`, `RankChange`) and the
score readers (`as_scores`, `scores_from_frame`).
"""
from cje_engine.drift.inputs import as_scores, scores_from_frame
from cje_engine.drift.kendall import TauResult, kendall_tau_b
from cje_engine.drift.metrics import (DistributionChange, DriftLook, MetricResult, RankChange, distribution_change,
                                      rank_change)
from cje_engine.drift.monitor import DEFAULT_WEIGHTS, METRICS, WINDOW_SHARE, DriftMonitor, look_spending

__all__ = ["DEFAULT_WEIGHTS", "METRICS", "WINDOW_SHARE", "DistributionChange", "DriftLook", "DriftMonitor",
           "MetricResult", "RankChange", "TauResult", "as_scores", "distribution_change", "kendall_tau_b",
           "look_spending", "rank_change", "scores_from_frame"]

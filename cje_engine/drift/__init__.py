"""Judge-drift statistics on anchor sets and the monitor that spends alpha over looks."""

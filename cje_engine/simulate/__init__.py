"""Simulators with exact known truth, shared by tests, examples, benchmarks and the planner."""
from cje_engine.simulate.direct import simulate

__all__ = ["simulate"]

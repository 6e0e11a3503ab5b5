"""Cost-model simulation of compiled instruction streams: makespan, bubbles, memory, timelines."""

from pipec.sim.costs import DEFAULT_COSTS, Costs, parse_costs
from pipec.sim.simulate import SimResult, TimedOp, simulate

__all__ = ["DEFAULT_COSTS", "Costs", "SimResult", "TimedOp", "parse_costs", "simulate"]

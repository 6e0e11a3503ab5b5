"""The cost grid on which DualPipe's and DualPipeV's published bubbles hold (docs/simulator.md), and the bubble as
tests/sim/test_pair_cost.py and test_dualpipe_form.py measure it."""

from __future__ import annotations

from pipec.ir import Program
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate

# (F, W, hidden): I = F (B = F + W, the papers' T_F = T_B), W <= F, and the pair F&B = B + hidden * F, so that
# B <= F&B <= F + B; messages free
MIXES = [(1, 1, 0.0), (1, 1, 0.5), (1, 0.5, 1.0), (2, 1, 0.0), (2, 1, 0.7), (3, 1.5, 0.3), (3, 3, 1.0)]


def mix_spec(forward: float, weight: float, hidden: float) -> tuple[str, float, float]:
    """The --cost text of one mix, with its B and F&B."""
    backward = forward + weight
    pair = backward + hidden * forward
    return f"F={forward},B={backward},W={weight},FB={pair}", backward, pair


def max_idle(program: Program, spec: str, p2p: str) -> float:
    """The bubble: the most any rank idles in the step (makespan - its busy time), as the papers count it."""
    result = simulate(program, parse_costs(spec), p2p=p2p)
    return max(result.makespan - busy for busy in result.busy)

"""The text report of a simulation: makespan, bubble and a row per rank (what `pipec simulate` prints)."""

from __future__ import annotations

from pipec.sim.simulate import SimResult


def render_text(result: SimResult, p2p: str = "nccl") -> str:
    p = result.program
    lines = [
        f"{p.name}: P={p.ranks} M={p.microbatches} V={p.chunks}, costs {result.costs.describe()}, p2p {p2p}",
        f"makespan {result.makespan:g}   ideal {result.ideal:g}   efficiency {result.efficiency:.1%}   "
        f"bubble {result.bubble_fraction:.1%}",
        "rank      busy      idle      comm  span_idle  peak_memory",
    ]
    idle, span_idle = result.idle, result.span_idle  # properties building a tuple of P: once, not once per rank
    for r in range(p.ranks):
        lines.append(
            f"{r:>4} {result.busy[r]:>9g} {idle[r]:>9g} {result.comm[r]:>9g} {span_idle[r]:>10g} "
            f"{result.peak_memory[r]:>12g}"
        )
    return "\n".join(lines) + "\n"

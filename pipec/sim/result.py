"""What a simulation reports: the result (makespan, per-rank busy/idle/comm, peak memory), its timed ops and
messages, and the peak activations from the one liveness function, ``pipec.verify.memory.peak_activations``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pipec.errors import PipecInputError
from pipec.ir import Action, Instruction, Program
from pipec.sim.costs import Costs, length_mismatch
from pipec.verify.memory import peak_activations


class TimedOp(NamedTuple):
    """One executed instruction (or one p2p batch, then ``instruction`` is a tuple of actions) on one rank."""

    rank: int
    start: float
    end: float
    instruction: Instruction | tuple[Action, ...]

    @property
    def is_comm(self) -> bool:
        return type(self.instruction) is tuple


class Message(NamedTuple):
    """One matched send -> receive: the transfer runs from ``start`` to ``end``."""

    send: Action
    recv: Action
    src: int
    dst: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    program: Program
    costs: Costs
    makespan: float
    busy: tuple[float, ...]  # compute time per rank
    comm: tuple[float, ...]  # time per rank waiting for its receives (rule 2) and, at the end, for its batches
    finish: tuple[float, ...]  # when each rank's last instruction ends
    start: tuple[float, ...]  # when each rank's first compute starts
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[TimedOp, ...], ...] = field(default=(), repr=False)  # per rank, when recorded
    messages: tuple[Message, ...] = field(default=(), repr=False)

    @property
    def ranks(self) -> int:
        return self.program.ranks

    @property
    def idle(self) -> tuple[float, ...]:
        """Time each rank does no compute within the step (waiting for p2p batches included)."""
        return tuple(_clean(self.makespan - b, self.makespan) for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """idle / (P x makespan)."""
        total = self.ranks * self.makespan
        return sum(self.idle) / total if total else 0.0

    @property
    def ideal(self) -> float:
        """Total compute / P: the makespan with no bubble at all."""
        return sum(self.busy) / self.ranks

    @property
    def efficiency(self) -> float:
        return self.ideal / self.makespan if self.makespan else 1.0

    @property
    def span_idle(self) -> tuple[float, ...]:
        """Idle time inside each rank's own span (its first compute to its last op): the bubble a rank would
        still see if steps overlapped (the Zero Bubble paper's post-validation removes the step boundary)."""
        return tuple(_clean(f - s - b, f) for f, s, b in zip(self.finish, self.start, self.busy, strict=True))

    def to_json(self) -> dict:
        p = self.program
        idle, span_idle = self.idle, self.span_idle  # properties building a tuple of P: once, not once per rank
        return {
            "schedule": p.name,
            "P": p.ranks,
            "M": p.microbatches,
            "V": p.chunks,
            "costs": self.costs.describe(),
            "makespan": self.makespan,
            "ideal": self.ideal,
            "efficiency": self.efficiency,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_max": max(self.peak_memory, default=0.0),
            "ranks": [
                {
                    "rank": r,
                    "busy": self.busy[r],
                    "idle": idle[r],
                    "comm": self.comm[r],
                    "span_idle": span_idle[r],
                    "finish": self.finish[r],
                    "peak_memory": self.peak_memory[r],
                }
                for r in range(p.ranks)
            ],
        }



def peaks_of(program: Program, costs: Costs, input_fraction: float | None) -> tuple[float, ...]:
    """Peak activations per rank from the one liveness function, with the cost model's memory settings."""
    fraction = costs.input_fraction if input_fraction is None else input_fraction
    sizes = None
    if costs.activation is not None:
        sizes = costs.activation if isinstance(costs.activation, tuple) else (costs.activation,) * program.num_stages
        if len(sizes) != program.num_stages:
            raise PipecInputError(length_mismatch("activation", len(sizes), program.num_stages))
    return peak_activations(program, fraction, sizes)


def _clean(difference: float, scale: float) -> float:
    """A difference of sums of float durations, with the rounding error that makes a zero -8.9e-16 set to 0."""
    return 0.0 if abs(difference) <= 1e-9 * max(1.0, abs(scale)) else difference

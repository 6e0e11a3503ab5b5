"""Verification passes: Program -> Report. `verify` runs them all and collects their verdicts.

    structure   every (stage, micro-batch) computed exactly once, in range, on its stage's rank; sends/receives
                pair up one to one and cover every edge between ranks          structure.check_structure
    p2p order   (nccl, torch) each channel's k-th send and k-th receive name the same message
                                                                                order.check_p2p_order
    deadlock    every rank's stream runs to its end under the p2p model         deadlock.check.check_deadlock
    memory      each rank's peak activations stay within the declared bound or --memory-limit
                                                                                memory.check_memory
Later passes run only on a structurally sound program (they index stages and pair messages by name). What the
models mean exactly is written down in docs/verification.md.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

from pipec.errors import PipecInputError, ScheduleError
from pipec.ir import Program
from pipec.verify.deadlock import IN_ORDER, MODELS, batched, run_compute_orders, run_streams, streams_finish
from pipec.verify.deadlock.check import check_deadlock
from pipec.verify.diagnose import placed_by_pipec
from pipec.verify.flat import flatten
from pipec.verify.memory import DEFAULT_INPUT_FRACTION, check_memory, peak_activations, validate_memory_model
from pipec.verify.order import check_p2p_order
from pipec.verify.structure import check_structure

DEFAULT_P2P = "nccl"


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool
    explanation: str = ""
    note: str = ""  # shown after "ok" (e.g. the model a pass assumed)


@dataclass(frozen=True)
class Report:
    program: Program  # the program as checked (with send/recv inserted for the nccl and torch models)
    verdicts: tuple[Verdict, ...]
    peak_memory: tuple[float, ...]
    p2p: str = DEFAULT_P2P
    memory_limit: float | None = None

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)

    def render(self) -> str:
        lines = []
        for v in self.verdicts:
            lines.append(f"{v.name:<10} {'ok' if v.ok else 'FAILED'}{'  ' + v.note if v.note else ''}")
            if not v.ok:
                lines.extend("  " + line if line else "" for line in v.explanation.splitlines())
        bounds = self._bounds()
        lines.append("rank   ops  peak_activations" + ("  bound" if bounds else ""))
        for rank, stream in enumerate(self.program.streams):
            row = f"{rank:>4} {len(stream):>5}  {self.peak_memory[rank]:>16g}"
            if bounds:
                row += f"  {float(bounds[rank]):>5g}"
            lines.append(row)
        return "\n".join(lines)

    def _bounds(self) -> tuple[float, ...] | None:
        if self.memory_limit is not None:
            return (self.memory_limit,) * self.program.ranks
        return self.program.memory_bound

    def raise_if_failed(self) -> None:
        if not self.ok:
            failed = [v for v in self.verdicts if not v.ok]
            raise ScheduleError("\n".join(f"{v.name}: {v.explanation or v.note}" for v in failed))


def verify(
    program: Program,
    p2p: str = DEFAULT_P2P,
    memory_limit: float | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
) -> Report:
    """Run the passes in order. A sound compute-only program is checked under nccl or torch as insert_p2p_ops
    lowers it (torch's runtime runs pipec's send/recv placement too: pipec.torch and --format torch-csv-comms)."""
    # The passes allocate millions of small tuples that form no cycles; the cyclic collector would scan them over
    # and over (the simulator measured it halving the speed at 800k instructions).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _verify(program, p2p, memory_limit, input_fraction, stage_sizes)
    finally:
        if enabled:
            gc.enable()


def _verify(
    program: Program,
    p2p: str,
    memory_limit: float | None,
    input_fraction: float,
    stage_sizes: Sequence[float] | None,
) -> Report:
    if p2p not in MODELS:
        raise PipecInputError(f"unknown p2p model {p2p!r}; expected one of: {', '.join(MODELS)}")
    if memory_limit is not None and memory_limit < 0:
        raise PipecInputError(f"the memory limit must not be negative, got {memory_limit:g}")
    routing = program.routing_problem()
    if routing:
        raise PipecInputError(routing)
    sizes = validate_memory_model(program, input_fraction, stage_sizes)
    flat = flatten(program, input_fraction, sizes, batched=batched(p2p))  # the int form every pass shares
    verdicts = [Verdict("structure", *_ok(check_structure(program, flat)))]
    if verdicts[0].ok:
        lowered_here = p2p in IN_ORDER and not program.has_comms
        if lowered_here:  # positions in the explanations are the lowered program's
            from pipec.passes.p2p import insert_p2p_ops
            from pipec.passes.sync import with_copy_syncs

            program = with_copy_syncs(insert_p2p_ops(program))
            flat = flatten(program, input_fraction, sizes, batched=batched(p2p))
        deadlock = check_deadlock(program, p2p, flat, placed=True if lowered_here else None)
        if p2p in IN_ORDER:
            order = check_p2p_order(program, flat)
            if order and deadlock and (lowered_here or placed_by_pipec(program)):
                # reported under the deadlock, after its explanation: what to fix comes first
                verdicts.append(Verdict("p2p order", False, note=_CONSEQUENCE_NOTE))
                deadlock = [*deadlock, "", _CONSEQUENCE, *(f"  {line}" for line in order)]
            else:
                verdicts.append(Verdict("p2p order", *_ok(order)))
        verdicts.append(Verdict("deadlock", *_ok(deadlock), note=f"({p2p} model)"))
    peaks = flat.peaks
    if verdicts[0].ok:
        verdicts.append(Verdict("memory", *_ok(check_memory(program, peaks, memory_limit, input_fraction, sizes))))
    return Report(program, tuple(verdicts), peaks, p2p, memory_limit)


def _ok(problems: list[str]) -> tuple[bool, str]:
    return (not problems, "\n".join(problems))


_CONSEQUENCE_NOTE = "(only a consequence of the deadlock below)"
_CONSEQUENCE = (
    "p2p order mismatches that follow from this deadlock (pipec places sends and receives by timing the compute "
    "orders; past the point where those cannot run it falls back to a placement that does not keep each channel "
    "in order, so these go away once the deadlock is fixed):"
)


__all__ = [
    "DEFAULT_P2P",
    "MODELS",
    "Report",
    "Verdict",
    "check_deadlock",
    "check_memory",
    "check_p2p_order",
    "check_structure",
    "peak_activations",
    "run_compute_orders",
    "run_streams",
    "streams_finish",
    "verify",
]

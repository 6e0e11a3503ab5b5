"""Verification passes: Program -> report. `verify` runs them all and collects their verdicts."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.errors import ScheduleError
from pipec.ir import Program
from pipec.verify.deadlock import check_deadlock
from pipec.verify.memory import check_memory, peak_activations
from pipec.verify.structure import check_structure


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool
    explanation: str = ""


@dataclass(frozen=True)
class Report:
    program: Program
    verdicts: tuple[Verdict, ...]
    peak_memory: tuple[float, ...]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def render(self) -> str:
        lines = []
        for v in self.verdicts:
            lines.append(f"{v.name:<10} {'ok' if v.ok else 'FAILED'}")
            if not v.ok:
                lines.extend("  " + line for line in v.explanation.splitlines())
        lines.append("rank  ops  peak_activations" + ("  bound" if self.program.memory_bound else ""))
        for rank, stream in enumerate(self.program.streams):
            row = f"{rank:>4} {len(stream):>4}  {self.peak_memory[rank]:>16g}"
            if self.program.memory_bound:
                row += f"  {self.program.memory_bound[rank]:>5}"
            lines.append(row)
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            failed = [v for v in self.verdicts if not v.ok]
            raise ScheduleError("\n".join(f"{v.name}: {v.explanation}" for v in failed))


def verify(program: Program, p2p: str = "tagged", memory_limit: int | None = None) -> Report:
    """Run the passes in order; later passes run only on a structurally sound program."""
    verdicts = [Verdict("structure", *_ok(check_structure(program)))]
    peaks = peak_activations(program)
    if verdicts[0].ok:
        verdicts.append(Verdict("deadlock", *_ok(check_deadlock(program, p2p))))
        verdicts.append(Verdict("memory", *_ok(check_memory(program, peaks, memory_limit))))
    return Report(program, tuple(verdicts), peaks)


def _ok(problems: list[str]) -> tuple[bool, str]:
    return (not problems, "\n".join(problems))

"""grid: a compact terminal picture of a simulated timeline, one row per rank.

Time is cut into slots of the shortest compute duration; each op fills the slots it covers, its first slot
labelled with kind and micro-batch (``F3``; with several chunks the chunk follows a dot, ``F3.1``), later slots
``--``. ``.`` is idle (a bubble), ``~`` idle while one of the rank's send/recv batches takes time. With uniform
costs this is exactly the step grid the papers draw. A legend line under the grid explains the symbols it uses.

Past ``max_columns`` slots a column covers more than the shortest op, and an op that starts in the column of a
later op is drawn over (only the later one's label shows); an op taking no time also shares its column with the
next. A note under the legend says so, with the resolution and how many ops are hidden (``pipec viz`` draws them
all).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipec.sim.costs import time_units

if TYPE_CHECKING:
    from pipec.sim.simulate import SimResult

_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def render_grid(result: SimResult, max_columns: int = 400) -> str:
    program = result.program
    chunked = program.chunks > 1
    chunk_of = program.stage_chunks()
    widths = [op.end - op.start for line in result.timeline for op in line if not op.is_comm and op.end > op.start]
    shortest = min(widths, default=1.0)
    slot = shortest
    columns = math.ceil(result.makespan / slot - 1e-9) if result.makespan else 0
    capped = columns > max_columns
    if capped:
        slot = result.makespan / max_columns
        columns = max_columns
    rows: list[list[str]] = []
    hidden = 0  # compute ops whose label a later op, starting in the same column, draws over
    for line in result.timeline:
        cells = ["."] * columns
        labelled = [False] * columns  # whether an op's label (not `--`) is in the column
        for op in line:
            first = int(op.start / slot + 1e-9)
            last = max(first + 1, math.ceil(op.end / slot - 1e-9))
            if op.is_comm:
                for c in range(first, min(last, columns)):
                    if op.end > op.start and cells[c] == ".":
                        cells[c] = "~"
                continue
            if first >= columns:  # an op taking no time at the very end: in the last column
                if not columns:
                    continue
                first, last = columns - 1, columns
            if labelled[first]:
                hidden += 1
            cells[first] = "+".join(_label(a, chunk_of, chunked) for a in op.instruction.parts)
            labelled[first] = True
            for c in range(first + 1, min(last, columns)):
                cells[c] = "--"
                labelled[c] = False
        rows.append(cells)
    width = max((len(c) for row in rows for c in row), default=1)
    head = (
        f"{program.name}: P={program.ranks} M={program.microbatches} V={program.chunks}, makespan "
        f"{result.makespan:g}, bubble {result.bubble_fraction:.1%}, one column = {time_units(slot)}"
    )
    lines = [head]
    for r, cells in enumerate(rows):
        lines.append(f"rank {r:<3}|" + " ".join(c.ljust(width) for c in cells).rstrip())
    if columns:
        lines.append(_legend({cell for row in rows for cell in row}))
    note = _note(capped, hidden, slot, shortest, max_columns)
    if note:
        lines.append(note)
    return "\n".join(lines) + "\n"


def _label(action, chunk_of, chunked: bool) -> str:
    text = f"{action.kind.value}{action.mb}"
    return f"{text}.{chunk_of[action.stage]}" if chunked else text


def _legend(cells: set[str]) -> str:
    """One line naming every symbol the grid shows (read from its cells), in the order a reader meets them."""
    labels = [part for cell in cells if cell[0] in _KIND_NAMES for part in cell.split("+")]
    kinds = [k for k in _KIND_NAMES if any(label[0] == k for label in labels)]
    parts = []
    if kinds:
        chunked = any("." in label for label in labels)
        example = f"{kinds[0]}0.1" if chunked else f"{kinds[0]}0"
        what = f"{_KIND_NAMES[kinds[0]]} of micro-batch 0" + (" on the rank's chunk 1" if chunked else "")
        parts.append(f"{example} {what}")
        parts.extend(f"{k} {_KIND_NAMES[k]}" for k in kinds[1:])
    if any("+" in cell for cell in cells):
        parts.append("+ joins the halves of an overlapped pair")
    if "--" in cells:
        parts.append("-- the op goes on")
    if "." in cells:
        parts.append(". idle")
    if "~" in cells:
        parts.append("~ idle while a send/recv batch of the rank runs")
    return "legend: " + ", ".join(parts)


def _note(capped: bool, hidden: int, slot: float, shortest: float, max_columns: int) -> str:
    """What the grid cannot show: ops merged into a coarser column (capped), or ops that take no time."""
    if capped:
        text = (
            f"note: one column = {time_units(slot)} ({max_columns} columns at most), coarser than the shortest op "
            f"({time_units(shortest)}): ops are drawn from the column they start in"
        )
        if hidden:
            text += f", and {_ops(hidden, 'is', 'are')} drawn over by a later op starting in the same column"
        return text + "; `pipec viz` draws every op"
    if hidden:
        return (
            f"note: {_ops(hidden, 'takes', 'take')} no time and {'is' if hidden == 1 else 'are'} drawn over by the "
            "next op; `pipec viz` draws every op"
        )
    return ""


def _ops(n: int, one: str, many: str) -> str:
    return f"1 op {one}" if n == 1 else f"{n} ops {many}"

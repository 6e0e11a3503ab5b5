"""grid: a compact terminal picture of a simulated timeline, one row per rank.

Time is cut into slots of the shortest compute duration; each op fills the slots it covers, its first slot
labelled with kind and micro-batch (``F3``; with several chunks the chunk follows a dot, ``F3.1``), later slots
``--``. ``.`` is idle (a bubble), ``~`` a send/recv batch that takes time. With uniform costs this is exactly
the step grid the papers draw.
"""

from __future__ import annotations

import math


def render_grid(result, max_columns: int = 400) -> str:
    program = result.program
    chunked = program.chunks > 1
    chunk_of = program.stage_chunks()
    widths = [op.end - op.start for line in result.timeline for op in line if not op.is_comm and op.end > op.start]
    slot = min(widths, default=1.0)
    columns = math.ceil(result.makespan / slot - 1e-9) if result.makespan else 0
    if columns > max_columns:
        slot = result.makespan / max_columns
        columns = max_columns
    rows: list[list[str]] = []
    for line in result.timeline:
        cells = ["."] * columns
        for op in line:
            first = int(op.start / slot + 1e-9)
            last = max(first + 1, math.ceil(op.end / slot - 1e-9))
            if op.is_comm:
                for c in range(first, min(last, columns)):
                    if op.end > op.start and cells[c] == ".":
                        cells[c] = "~"
                continue
            label = "+".join(_label(a, chunk_of, chunked) for a in op.instruction.parts)
            for c in range(first, min(last, columns)):
                cells[c] = label if c == first else "--"
        rows.append(cells)
    width = max((len(c) for row in rows for c in row), default=1)
    head = (
        f"{program.name}: P={program.ranks} M={program.microbatches} V={program.chunks}, makespan "
        f"{result.makespan:g}, bubble {result.bubble_fraction:.1%}, one column = {slot:g} time units"
    )
    lines = [head]
    for r, cells in enumerate(rows):
        lines.append(f"rank {r:<3}|" + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines) + "\n"


def _label(action, chunk_of, chunked: bool) -> str:
    text = f"{action.kind.value}{action.mb}"
    return f"{text}.{chunk_of[action.stage]}" if chunked else text


"""svg: the Gantt chart of a simulated timeline, drawn like the papers draw schedules.

One row per rank (rank 0 on top), time to the right. Each compute op is a box coloured by kind (F, B, I, W) and
labelled with its micro-batch; with several chunks per rank the chunk is shown by the shade (chunk 0 darkest)
and the box's tooltip names the full action (torch's text form, ``2F0``). White space in a row is a bubble.
Send/recv batches are thin grey bars under the row; ``arrows`` draws each message from its send to its receive.
The title line gives the schedule, P, M, V, makespan and bubble fraction; a legend sits under the chart.
Plain string building, no dependencies: the files stay small enough to commit (a few tens of KB at P=4, M=8).
"""

from __future__ import annotations

from html import escape

from pipec.ir import Action, Kind

# Base colours per kind (hue families as in the Zero Bubble paper's figures: F blue, B/I teal-green, W purple).
_BASE = {Kind.F: (0x3B, 0x6F, 0xC9), Kind.B: (0x2E, 0x9E, 0x6B), Kind.I: (0x4D, 0xB3, 0x9C), Kind.W: (0x8E, 0x63, 0xC7)}
_NAMES = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input grad", Kind.W: "W weight grad"}
_ROW, _GAP, _LEFT, _TOP = 26, 6, 58, 44
DETAIL_LIMIT = 5000  # instructions; above this boxes carry no label or tooltip


def colour(kind: Kind, chunk: int = 0, chunks: int = 1) -> str:
    """The fill for a kind; later chunks are lighter shades of the same hue."""
    r, g, b = _BASE[kind]
    mix = 0.0 if chunks <= 1 else 0.55 * chunk / (chunks - 1)
    r, g, b = (round(c + (255 - c) * mix) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def _text_colour(chunk: int, chunks: int) -> str:
    return "#ffffff" if chunks <= 1 or chunk < (chunks + 1) // 2 else "#1a1a1a"


def render_svg(result, arrows: bool = False, title: str | None = None, width: int = 1100) -> str:
    """An SVG document for ``result`` (a SimResult recorded with ``record=True``)."""
    program = result.program
    P, V = program.ranks, max(1, program.chunks)  # noqa: N806 - the papers' names
    chunk_of = program.stage_chunks()
    makespan = result.makespan or 1.0
    scale = (width - _LEFT - 20) / makespan
    height = _TOP + P * (_ROW + _GAP) + 70
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]
    if title is None:
        title = (
            f"{program.name}   P={P}  M={program.microbatches}  V={program.chunks}   makespan {result.makespan:g}   "
            f"bubble {result.bubble_fraction:.1%}   peak memory {max(result.peak_memory, default=0):g}"
        )
    out.append(f'<text x="{_LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>')
    out.append(f'<text x="{_LEFT}" y="36" font-size="11" fill="#555">costs {escape(result.costs.describe())}</text>')
    # rows: a thin frame per rank, so bubbles read as white gaps inside it
    for r in range(P):
        y = _TOP + r * (_ROW + _GAP)
        out.append(f'<text x="{_LEFT - 8}" y="{y + _ROW * 0.68:.1f}" font-size="12" text-anchor="end">rank {r}</text>')
        out.append(
            f'<rect x="{_LEFT}" y="{y}" width="{makespan * scale:.1f}" height="{_ROW}" fill="#ffffff" '
            'stroke="#c8c8c8" stroke-width="0.8"/>'
        )
    font = max(6.0, min(11.0, _min_width(result) * scale * 0.55))
    # past a few thousand boxes labels are unreadable anyway; dropping them and the tooltips keeps files small
    detailed = sum(len(line) for line in result.timeline) <= DETAIL_LIMIT
    for r, line in enumerate(result.timeline):
        y = _TOP + r * (_ROW + _GAP)
        for op in line:
            x, w = _LEFT + op.start * scale, (op.end - op.start) * scale
            if op.is_comm:
                if w > 0.3:
                    names = " ".join(map(str, op.instruction))
                    out.append(
                        f'<rect x="{x:.1f}" y="{y + _ROW - 3}" width="{w:.1f}" height="3" fill="#9a9a9a">'
                        f"<title>{escape(names)} {op.start:g}-{op.end:g}</title></rect>"
                    )
                continue
            parts = op.instruction.parts
            h = _ROW / len(parts)  # an overlapped pair: its two halves stacked in one box
            for k, action in enumerate(parts):
                out.append(_box(action, x, y + k * h, w, h, chunk_of, V, font, op.start, op.end, detailed))
    if arrows:
        out.append(_arrows(result, scale))
    out.extend(_axis(makespan, scale, _TOP + P * (_ROW + _GAP)))
    out.extend(_legend(result, _TOP + P * (_ROW + _GAP) + 30, V))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _box(action: Action, x, y, w, h, chunk_of, chunks, font, start, end, detailed: bool = True) -> str:
    chunk = chunk_of[action.stage]
    fill = colour(action.kind, chunk, chunks)
    if not detailed:
        return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"/>'
    label = ""
    if w >= font * 0.75 * len(str(action.mb)) and h >= font:
        label = (
            f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + font * 0.36:.1f}" font-size="{font:.1f}" '
            f'text-anchor="middle" fill="{_text_colour(chunk, chunks)}">{action.mb}</text>'
        )
    return (
        f'<g><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" stroke="#ffffff" '
        f'stroke-width="0.6"><title>{action} (chunk {chunk}) {start:g}-{end:g}</title></rect>{label}</g>'
    )



def _min_width(result) -> float:
    widths = [op.end - op.start for line in result.timeline for op in line if not op.is_comm and op.end > op.start]
    return min(widths, default=1.0)


def _arrows(result, scale: float) -> str:
    lines = [
        '<defs><marker id="head" markerWidth="6" markerHeight="6" refX="5" refY="3" orient="auto">'
        '<path d="M0,0 L6,3 L0,6 z" fill="#d04040"/></marker></defs>'
    ]
    for m in result.messages:
        y1 = _TOP + m.src * (_ROW + _GAP) + (_ROW if m.dst > m.src else 0)
        y2 = _TOP + m.dst * (_ROW + _GAP) + (0 if m.dst > m.src else _ROW)
        lines.append(
            f'<line x1="{_LEFT + m.start * scale:.1f}" y1="{y1}" x2="{_LEFT + m.end * scale:.1f}" y2="{y2}" '
            'stroke="#d04040" stroke-width="0.8" stroke-opacity="0.7" marker-end="url(#head)"/>'
        )
    return "\n".join(lines)


def _axis(makespan: float, scale: float, y: float) -> list[str]:
    step = _nice_step(makespan / 10)
    out = [f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + makespan * scale:.1f}" y2="{y}" stroke="#888"/>']
    # ticks up to the makespan, rounding forgiven relative to the step: an absolute slack (1e-9) would draw
    # thousands of ticks past a makespan of 1e-12
    t, end = 0.0, makespan + step * 1e-6
    while t <= end:
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#888"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 15}" font-size="10" text-anchor="middle" fill="#555">{t:g}</text>')
        t += step
    return out


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    magnitude = 10 ** int(f"{raw:e}".split("e")[1])
    for m in (1, 2, 5, 10):
        if raw <= m * magnitude:
            return m * magnitude
    return 10 * magnitude


def _legend(result, y: float, chunks: int) -> list[str]:
    kinds = sorted(
        {a.kind for line in result.timeline for op in line if not op.is_comm for a in op.instruction.parts},
        key=list(_BASE).index,
    )
    out, x = [], _LEFT
    for kind in kinds:
        for c in range(chunks):
            out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{colour(kind, c, chunks)}"/>')
            x += 15
        out.append(f'<text x="{x + 3}" y="{y + 11}" font-size="11">{_NAMES[kind]}</text>')
        x += 12 + 7 * len(_NAMES[kind])
    if chunks > 1:
        out.append(f'<text x="{x}" y="{y + 11}" font-size="11" fill="#555">shades: chunk 0 .. {chunks - 1}</text>')
        x += 150
    out.append(f'<rect x="{x}" y="{y + 5}" width="14" height="3" fill="#9a9a9a"/>')
    out.append(f'<text x="{x + 18}" y="{y + 11}" font-size="11">send/recv batch</text>')
    out.append(
        f'<text x="{_LEFT}" y="{y + 30}" font-size="10" fill="#777">white: idle (bubble); number: micro-batch; '
        "hover a box for its action</text>"
    )
    return out

"""`drop padded`: the ops of micro-batches at or beyond M left out of a compute order (a pair keeps its other half)."""

from __future__ import annotations

from pipec.errors import Span
from pipec.ir import Action, Instruction


def drop_padded_spans(stream: list[Instruction], spans: list[Span], microbatches: int) -> list[Span]:
    """The spans of the instructions drop_padded keeps (a pair keeps its span when one half is kept)."""
    kept = zip(stream, spans, strict=True)
    return [span for instruction, span in kept if any(a.mb < microbatches for a in instruction.parts)]


def drop_padded(stream: list[Instruction], microbatches: int) -> list[Instruction]:
    out: list[Instruction] = []
    for instruction in stream:
        if type(instruction) is Action:  # the common case, without building a list
            if instruction.mb < microbatches:
                out.append(instruction)
            continue
        kept = [a for a in instruction.parts if a.mb < microbatches]
        if len(kept) == 2:
            out.append(instruction)
        elif kept:
            out.append(kept[0])
    return out

"""Text streams: one line per rank, `rank R: ` then the instructions as torch action strings.

A line without send/recv instructions is also valid `.pipe` literal syntax for a hand-made schedule.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipec.emit.streams import program_from_streams
from pipec.errors import PipecSyntaxError, Span
from pipec.ir import Instruction, Program, parse_instruction


def dump_text(program: Program) -> str:
    return "".join(f"rank {rank}: {' '.join(map(str, stream))}\n" for rank, stream in enumerate(program.streams))


def load_text(text: str, where: str = "<text>", expected: Mapping[str, int | None] | None = None) -> Program:
    streams: dict[int, list[Instruction]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        head, sep, body = line.partition(":")
        words = head.split()
        if not sep or len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
            raise PipecSyntaxError(
                "expected 'rank N: ACTION ACTION ...'", Span(where, number, 1, number, len(line) + 1, text)
            )
        rank = int(words[1])
        column = len(head) + 2
        for word in body.split():
            column = line.index(word, column - 1) + 1
            try:
                streams.setdefault(rank, []).append(parse_instruction(word))
            except PipecSyntaxError as e:
                raise PipecSyntaxError(
                    e.message, Span(where, number, column, number, column + len(word), text)
                ) from None
            column += len(word)
        streams.setdefault(rank, [])
    if not streams:
        raise PipecSyntaxError(f"{where}: no 'rank N:' lines")
    ranks = max(streams) + 1
    return program_from_streams([streams.get(r, []) for r in range(ranks)], where, "text", expected or {})

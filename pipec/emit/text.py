"""Text streams: one line per rank, `rank R: ` then the instructions as torch action strings.

A line without send/recv instructions is also valid `.pipe` literal syntax for a hand-made schedule. A program
with sync groups (``Program.sync_groups``) adds one line per group after the ranks, `sync G: STAGE STAGE ...`. A
program of C > 1 pipelines (copies of the model, docs/design/replicated.md) starts with the line `pipelines C`;
each micro-batch's copy is read from the stages its ops name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pipec.emit.streams import parse_word, program_from_streams
from pipec.errors import PipecSyntaxError, Span
from pipec.ir import Instruction, Program

# `rank N` before the colon: ASCII digits only (str.isdigit() also takes '²', which int() refuses), and few
# enough that int() converts them; the number is then checked against the number of rank lines
_HEAD = re.compile(r"\s*rank\s+([0-9]{1,100})\s*")
_SYNC_HEAD = re.compile(r"\s*sync\s+([0-9]{1,100})\s*")
_PIPELINES = re.compile(r"\s*pipelines\s+([0-9]{1,9})\s*")


def dump_text(program: Program) -> str:
    head = f"pipelines {program.pipelines}\n" if program.pipelines > 1 else ""  # one copy: the file as it was
    ranks = head + rank_lines(program)
    return ranks + "".join(f"sync {g}: {' '.join(map(str, stages))}\n" for g, stages in enumerate(program.sync_groups))


def rank_lines(program: Program) -> str:
    """The `rank R: ...` lines alone (also `.pipe` literal lists when they hold compute ops only)."""
    return "".join(f"rank {r}: {' '.join(map(str, stream))}\n" for r, stream in enumerate(program.streams))


def load_text(text: str, where: str = "<text>", expected: Mapping[str, int | None] | None = None) -> Program:
    lines = text.splitlines()
    rank_lines: dict[int, int] = {}  # rank -> its line number (1-based)
    streams: dict[int, list[Instruction]] = {}
    group_lines: dict[int, int] = {}  # sync group -> its line number
    groups: dict[int, tuple[int, ...]] = {}
    pipelines, pipelines_line = 1, 0

    def span(number: int, column: int = 1, width: int = 0) -> Span:
        line = lines[number - 1]
        return Span(where, number, column, number, column + (width or len(line) - column + 1), text)

    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        copies = _PIPELINES.fullmatch(line)
        if copies is not None:
            if pipelines_line:
                raise PipecSyntaxError(f"'pipelines' is given twice (first on line {pipelines_line})", span(number))
            if rank_lines or group_lines:
                raise PipecSyntaxError("'pipelines C' must come before the 'rank' lines", span(number))
            pipelines, pipelines_line = int(copies[1]), number
            if pipelines < 1:
                raise PipecSyntaxError("'pipelines' must be at least 1", span(number))
            continue
        head, sep, body = line.partition(":")
        sync = _SYNC_HEAD.fullmatch(head)
        if sep and sync is not None:
            group = int(sync[1])
            if group in group_lines:
                previous = group_lines[group]
                raise PipecSyntaxError(f"sync group {group} already has a line (line {previous})", span(number))
            if not all(word.isascii() and word.isdigit() and len(word) <= 9 for word in body.split()):
                raise PipecSyntaxError("expected 'sync G: STAGE STAGE ...' (stage numbers)", span(number))
            group_lines[group] = number
            groups[group] = tuple(int(word) for word in body.split())
            continue
        match = _HEAD.fullmatch(head)
        if not sep or match is None:
            raise PipecSyntaxError("expected 'rank N: ACTION ACTION ...' or 'sync G: STAGE STAGE ...'", span(number))
        rank = int(match[1])
        if rank in rank_lines:
            raise PipecSyntaxError(
                f"rank {rank} already has a line (line {rank_lines[rank]}); give each rank one line", span(number)
            )
        rank_lines[rank] = number
        stream = streams[rank] = []
        column = len(head) + 2
        for word in body.split():
            column = line.index(word, column - 1) + 1
            try:
                stream.append(parse_word(word))
            except PipecSyntaxError as e:
                raise PipecSyntaxError(e.message, span(number, column, len(word))) from None
            column += len(word)
    if not rank_lines:
        raise PipecSyntaxError(f"{where}: no 'rank N:' lines")
    # P is the number of rank lines: a rank number past them would make empty ranks out of nothing (and a list
    # sized by a number the file merely mentions)
    ranks = len(rank_lines)
    for rank, number in rank_lines.items():
        if rank >= ranks:
            raise PipecSyntaxError(
                f"rank {rank} is out of range: the file has {ranks} 'rank' line(s), so ranks are 0..{ranks - 1}",
                span(number),
            )

    def error_at(rank: int, index: int, message: str) -> PipecSyntaxError:
        number = rank_lines[rank]
        line = lines[number - 1]
        column = len(line.partition(":")[0]) + 2
        for position, word in enumerate(line.partition(":")[2].split()):
            column = line.index(word, column - 1) + 1
            if position == index:
                return PipecSyntaxError(message, span(number, column, len(word)))
            column += len(word)
        return PipecSyntaxError(message, span(number))

    for group, number in group_lines.items():
        if group >= len(group_lines):
            raise PipecSyntaxError(
                f"sync group {group} is out of range: the file has {len(group_lines)} 'sync' line(s), so groups are "
                f"0..{len(group_lines) - 1}",
                span(number),
            )
    sync_groups = [groups[g] for g in range(len(groups))]
    return program_from_streams(
        [streams[r] for r in range(ranks)],
        where,
        "text",
        expected or {},
        error_at,
        sync_groups=sync_groups,
        pipelines=pipelines,
    )

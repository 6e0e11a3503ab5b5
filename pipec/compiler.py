"""The driver: a list of named phases from SCHEDULE text to instruction streams.

    load      SCHEDULE -> (kind, text)                 library.resolve
    parse     .pipe text -> AST                        frontend.parser.parse
    expand    AST + P, M, V -> per-rank compute orders frontend.expand.expand   (or a stream-file loader)
    lower     orders -> orders with SEND/RECV          passes.p2p.insert_p2p_ops
Verification and back ends take the resulting Program.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipec.emit import load_json, load_text, load_torch_csv
from pipec.errors import PipecInputError
from pipec.frontend.ast import Schedule
from pipec.frontend.expand import expand
from pipec.frontend.parser import parse
from pipec.gcpause import without_cyclic_gc
from pipec.ir import Program
from pipec.library import resolve
from pipec.passes.p2p import insert_p2p_ops


def parse_schedule(schedule: str) -> Schedule:
    """The AST of a .pipe schedule (name, path or source text)."""
    kind, text, filename = resolve(schedule)
    if kind != "pipe":
        raise PipecInputError(f"{filename} is a {kind} stream file, not a .pipe schedule")
    return parse(text, filename)


def compute_orders(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    params: Mapping[str, int] | None = None,
) -> Program:
    """Phases load, parse and expand: the per-rank compute orders (or a stream file as written)."""
    kind, text, filename = resolve(schedule)
    expected = {"P": ranks, "M": microbatches, "V": chunks}
    if kind != "pipe" and params:
        raise PipecInputError(f"{filename}: --set applies to .pipe schedules only")
    if kind == "csv":
        return load_torch_csv(text, filename, expected)
    if kind == "text":
        return load_text(text, filename, expected)
    if kind == "json":
        return load_json(text, filename, expected)
    try:
        return expand(parse(text, filename), ranks, microbatches, chunks, params, source=filename)
    except RecursionError:
        raise PipecInputError(f"{filename}: expressions or blocks are nested too deeply to compile") from None


def compile_program(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    params: Mapping[str, int] | None = None,
    comms: bool = True,
) -> Program:
    """Every phase: the instruction streams, with send/recv inserted unless the input already had them."""
    with without_cyclic_gc():
        program = compute_orders(schedule, ranks, microbatches, chunks, params)
        if comms and not program.has_comms:
            program = insert_p2p_ops(program)
    return program

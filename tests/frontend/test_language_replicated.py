"""The language of replicated pipelines (docs/language.md, "Replicated pipelines"): `pipelines`, `route` and the
routed counters, read off the expanded compute orders (the front end's own result, before any pass)."""

from __future__ import annotations

import pytest

import pipec
from pipec.errors import PipecInputError
from pipec.ir import Action, Kind
from pipec.library import bundled_names

TWO_COPIES = """\
schedule two_copies "two copies in opposite directions, every F before every B"
params P, M, V = 2
pipelines 2
placement v
{route}
per rank r:
    repeat count_0: F[0]
    repeat count_1: F[1]
    repeat count_0: B[0]
    repeat count_1: B[1]
"""


def _orders(source: str, ranks: int, microbatches: int, chunks: int = 2) -> tuple[pipec.Program, list[list[str]]]:
    program = pipec.compile(source, ranks, microbatches, chunks, comms=False)
    return program, [[str(op) for op in stream] for stream in program.compute_streams()]


def _two_copies(route: str, count_0: str, count_1: str) -> str:
    return TWO_COPIES.format(route=route).replace("count_0", count_0).replace("count_1", count_1)


def test_the_default_route_gives_each_copy_an_equal_contiguous_block() -> None:
    program, orders = _orders(_two_copies("", "M // 2", "M // 2"), 2, 6)
    assert program.pipelines == 2
    assert program.routes == (0, 0, 0, 1, 1, 1)
    # rank 0 holds copy 0's stage 0 (chunk 0) and copy 1's stage 1 = global stage 3 (chunk 1)
    assert orders[0] == ["0F0", "0F1", "0F2", "3F3", "3F4", "3F5", "0B0", "0B1", "0B2", "3B3", "3B4", "3B5"]
    assert orders[1] == ["1F0", "1F1", "1F2", "2F3", "2F4", "2F5", "1B0", "1B1", "1B2", "2B3", "2B4", "2B5"]


def test_a_route_line_chooses_each_micro_batchs_copy_and_the_counters_follow_it() -> None:
    program, orders = _orders(_two_copies("route m -> m % C", "M // 2", "M // 2"), 2, 6)
    assert program.routes == (0, 1, 0, 1, 0, 1)
    assert orders[0][:6] == ["0F0", "0F2", "0F4", "3F1", "3F3", "3F5"]
    assert [op for op in orders[0] if "B" in op] == ["0B0", "0B2", "0B4", "3B1", "3B3", "3B5"]


def test_an_uneven_route_hands_out_padded_micro_batches_past_a_copys_last() -> None:
    source = _two_copies("route m -> 1 if m == 0 else 0", "M // 2", "M // 2")
    program, orders = _orders(source, 2, 4)
    assert program.routes == (1, 0, 0, 0)
    # copy 0 has 3 micro-batches but takes 2; copy 1 has one, its second F[1] is the padded M + 0 = 4
    assert orders[0][:4] == ["0F1", "0F2", "3F0", "3F4"]
    dropped = source.replace("pipelines 2", "pipelines 2\ndrop padded microbatches")
    _, orders = _orders(dropped, 2, 4)
    assert orders[0][:3] == ["0F1", "0F2", "3F0"] and "3F4" not in orders[0]


def test_an_explicit_micro_batch_is_global_and_count_counts_what_was_handed_out() -> None:
    source = """\
schedule at_global "explicit micro-batches name global ones"
params P, M, V = 2
pipelines 2
placement v
per rank r:
    F[1] @ (M - 1)
    F[1]
    x = count(F[1])
    F[0] @ x
"""
    _, orders = _orders(source, 2, 4)
    # @ names micro-batch 3 itself; the counter of chunk 1 then hands out copy 1's first, M/2 = 2; count is 1
    assert orders[0] == ["3F3", "3F2", "0F1"]


def test_the_name_c_holds_the_copies_for_the_header_and_the_programs() -> None:
    source = """\
schedule uses_c "C in a require, a let and a program"
params P, M, V = 2
pipelines V
require M % C == 0, "each copy takes M / C micro-batches"
let PER_COPY = M // C
placement v
per rank r:
    repeat PER_COPY: F[0]
    repeat PER_COPY: F[1]
    repeat C * PER_COPY // 2: B[0]
    repeat C * PER_COPY // 2: B[1]
"""
    program, orders = _orders(source, 2, 4)
    assert program.pipelines == 2 and len(orders[0]) == 8
    with pytest.raises(PipecInputError, match="each copy takes M / C"):
        pipec.compile(source, 2, 5, 2, comms=False)


def test_one_pipeline_is_todays_program_field_for_field() -> None:
    """No `pipelines` line: C = 1 and no routes, so every program, output and file is what it was."""
    compiled = 0
    for name in bundled_names():
        if name in ("dualpipe", "chimera"):
            continue
        program = pipec.compile(name, 4, 8, comms=False)  # each at its default V, which P = 4, M = 8 suit
        assert program.pipelines == 1 and program.routes == (), name
        compiled += 1
    assert compiled == len(bundled_names()) - 2


def test_the_route_line_is_checked_at_its_expression() -> None:
    source = _two_copies("route m -> m - 1", "M // 2", "M // 2")
    with pytest.raises(PipecInputError) as raised:
        pipec.compile(source, 2, 4, 2, comms=False)
    assert "micro-batch 0 to copy -1, outside 0..1" in raised.value.message
    assert (raised.value.span.line, raised.value.span.column) == (5, 12)


def test_a_route_may_not_hide_a_parameter_and_c_may_not_be_one() -> None:
    with pytest.raises(PipecInputError, match="route's variable 'M' hides"):
        pipec.compile(_two_copies("route M -> 0", "M // 2", "M // 2"), 2, 4, 2, comms=False)
    clash = "schedule clash\nparams P, M, C = 2\npipelines C\nper rank r:\n    repeat M: F\n    repeat M: B\n"
    with pytest.raises(PipecInputError, match="names the copies C, which is already a parameter"):
        pipec.compile(clash, 2, 4, comms=False)


def test_counters_of_each_kind_follow_the_route() -> None:
    source = """\
schedule split_copies "I and W on two copies"
params P, M, V = 2
pipelines 2
placement v
route m -> m % 2
per rank r:
    repeat M // 2: F[0]
    repeat M // 2: F[1]
    repeat M // 2: I[1]
    repeat M // 2: I[0]
    drain W
"""
    program, _ = _orders(source, 2, 4)
    rank_0 = program.compute_streams()[0]
    assert [op.mb for op in rank_0 if type(op) is Action and op.kind is Kind.I] == [1, 3, 0, 2]
    assert [op.mb for op in rank_0 if type(op) is Action and op.kind is Kind.W] == [1, 3, 0, 2]


def test_a_choose_section_schedules_each_copys_own_micro_batches() -> None:
    """The list scheduler takes a chunk's k-th routed micro-batch too: the result verifies (structure refuses an
    op of a micro-batch at another copy's stage) for the default route and an interleaved one."""
    source = """\
schedule bidirectional_auto "two copies in opposite directions, ordered by the list scheduler"
params P, M, V = 2
pipelines 2
placement v
{route}
choose per rank r:
    take B priority 1
    take F
"""
    for route in ("", "route m -> m % 2"):
        program = pipec.compile(source.format(route=route), 4, 8, 2)
        pipec.check(program)
        for stream in program.compute_streams():
            for op in stream:
                for part in op.parts:
                    assert part.stage in program.stages_of_microbatch(part.mb), (route, part)

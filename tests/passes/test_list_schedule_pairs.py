"""The list scheduler's overlapped pairs (Rules.overlap, issue #22 item 3): with the pair's own cost (FB) a rank
runs its chosen op together with the best ready op of the other side, as one instruction; the orders verify, stay
within the memory limit, and the scheduler's own timeline is the one the simulator's ideal model runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipec
from pipec.ir import Action, Kind, Program, loop_placement, v_placement
from pipec.passes.list_schedule import Candidate, Rules, list_schedule, schedule_timeline
from pipec.passes.p2p import insert_p2p_ops
from pipec.sim.costs import parse_costs
from pipec.sim.simulate import simulate
from pipec.verify.memory import peak_activations

P, M = 4, 8


def _template(chunks: int) -> Program:
    stages = P * chunks
    where = v_placement(P, stages) if chunks == 2 else loop_placement(P, stages)
    return Program(name="t", ranks=P, microbatches=M, chunks=chunks, stage_to_rank=where, streams=((),) * P)


def _priority(c: Candidate) -> tuple:
    return (c.kind is not Kind.W, c.kind is not Kind.F, c.chunk, -c.mb)  # backward first, later chunks first


def _pairs(program: Program) -> int:
    return sum(type(i) is not Action for stream in program.streams for i in stream)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("takes", [(Kind.F, Kind.B), (Kind.F, Kind.I, Kind.W)])
def test_pairs_verify_fit_and_shorten_the_step(chunks: int, takes: tuple[Kind, ...]) -> None:
    limit = 2 * P + 1
    costs = parse_costs("F=1,B=2,W=1,FB=2")
    plain = Rules(takes, priority=_priority, limit=lambda rank: limit)
    paired = Rules(takes, priority=_priority, limit=lambda rank: limit, overlap=True)
    alone = list_schedule(_template(chunks), plain, costs)
    timeline = schedule_timeline(_template(chunks), paired, costs)
    together = timeline.program
    assert _pairs(alone) == 0 and _pairs(together) > 0
    for instruction in (i for stream in together.streams for i in stream if type(i) is not Action):
        first, second = instruction.parts
        assert first.kind is Kind.F and second.kind in (Kind.B, Kind.I) and first.mb != second.mb
    pipec.check(insert_p2p_ops(together, costs), memory_limit=limit)
    assert max(peak_activations(together)) <= limit
    # the scheduler's times are the ideal model's: each op as soon as its rank is free and its inputs exist
    assert float(timeline.makespan) == pytest.approx(simulate(together, costs, p2p="ideal").makespan)
    assert simulate(together, costs, p2p="ideal").makespan < simulate(alone, costs, p2p="ideal").makespan


@pytest.mark.parametrize("spec", ["F=1,B=2,W=1", "F=1,B=2,W=1,FB=3", "F=1,B=2,W=1,FB=3.5"])
def test_no_pair_without_a_saving(spec: str) -> None:
    """No FB, or a pair no shorter than its halves: the orders are exactly those without overlap."""
    costs = parse_costs(spec)
    for chunks in (1, 2):
        plain = list_schedule(_template(chunks), Rules((Kind.F, Kind.B), priority=_priority), costs)
        paired = list_schedule(_template(chunks), Rules((Kind.F, Kind.B), priority=_priority, overlap=True), costs)
        assert paired.streams == plain.streams


def test_memory_buys_time_with_pairs() -> None:
    """A forward paired with a backward holds the forward's activations while the backward runs, so the limit
    decides which pairs fit: at 1F1B's memory (P units) the step is longer than with 2P, and both stay within."""
    costs = parse_costs("F=1,B=2,W=1,FB=2")
    makespans = []
    for limit in (P, 2 * P):
        rules = Rules((Kind.F, Kind.B), priority=_priority, limit=lambda rank, limit=limit: limit, overlap=True)
        program = list_schedule(_template(1), rules, costs)
        assert _pairs(program) > 0 and max(peak_activations(program)) <= limit
        makespans.append(simulate(program, costs, p2p="ideal").makespan)
    assert makespans == [31, 26]


PAIRED_SECTION = """schedule paired "1F1B-like choice with overlapped pairs"
params P, M, V = 1
stages P
memory 2 * P

choose per rank r:
    take B priority 2
    take F priority 1
    overlap
"""


def test_a_choose_section_pairs_with_its_overlap_line(tmp_path: Path) -> None:
    path = tmp_path / "paired.pipe"
    path.write_text(PAIRED_SECTION)
    with_fb = pipec.compile(str(path), P, M, 1, costs="F=1,B=2,W=1,FB=2", comms=False)
    without = pipec.compile(str(path), P, M, 1, costs="F=1,B=2,W=1", comms=False)
    assert _pairs(with_fb) > 0 and _pairs(without) == 0
    pipec.check(pipec.compile(str(path), P, M, 1, costs="F=1,B=2,W=1,FB=2"))
    unpaired = tmp_path / "unpaired.pipe"
    unpaired.write_text(PAIRED_SECTION.replace("    overlap\n", ""))
    assert _pairs(pipec.compile(str(unpaired), P, M, 1, costs="F=1,B=2,W=1,FB=2", comms=False)) == 0
    # the name stays free outside a choose section: a program may still call a variable `overlap`
    loop = tmp_path / "named.pipe"
    loop.write_text("schedule named\nper rank r:\n    overlap = 1\n    repeat M: F\n    repeat M: B\n")
    assert pipec.compile(str(loop), 2, 2, 1).ranks == 2

"""The verifier on SYNC collectives: insert_syncs' output is accepted across the library, broken placements are
refused with a counterexample, and the verdicts equal those of the independent executor (tests/support/executor.py)
on SYNCs placed at random."""

import random

import pytest
from executor import run as execute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sync_programs import random_syncs, sync_after_last_backward, without_syncs

import pipec
from pipec.compiler import parse_schedule
from pipec.errors import PipecError
from pipec.ir import Action, Kind, Program
from pipec.library import bundled_names
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import insert_syncs, member_ranks
from pipec.testing.orders import valid_programs
from pipec.verify import verify
from pipec.verify.deadlock.check import check_deadlock

MODELS = ("nccl", "tagged", "torch")
GRID = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p + 1) for v in (1, 2)]


def _library_with_ties() -> list[tuple[str, Program]]:
    """Every library schedule on the grid where it compiles, with the tied-embedding group (0, S-1)."""
    out = []
    for name in bundled_names():
        if parse_schedule(name).pipelines is not None:
            continue  # replicated copies come with their own groups, ties lifted to every copy (program_groups)
        for ranks, microbatches, chunks in GRID:
            try:
                program = pipec.compile(name, ranks, microbatches, chunks)
            except PipecError:
                continue  # parameters this schedule does not take (V, or M against P)
            tied = insert_syncs(program, [(0, program.num_stages - 1)])
            out.append((f"{name} P={ranks} M={microbatches} V={chunks}", tied))
    return out


def test_insert_syncs_output_verifies_for_every_library_schedule() -> None:
    cases = _library_with_ties()
    names = {label.split()[0] for label, _ in cases}
    assert len(names) == len(bundled_names()) - 2 and len(cases) > 60  # all but dualpipe and chimera
    synced = 0
    for label, program in cases:
        for model in MODELS:
            report = verify(program, p2p=model)
            assert report.ok, (label, model, report.render())
        issued = sum(isinstance(i, Action) and i.kind is Kind.SYNC for s in program.streams for i in s)
        expected = 0 if program.forward_only else len(member_ranks((0, program.num_stages - 1), program.stage_to_rank))
        assert issued == expected, label
        synced += issued > 0
    assert synced > 40  # most have stage 0 and S-1 on different ranks (V-shapes put both on rank 0)


def test_replicated_stage_groups_verify_too() -> None:
    # the copies of a stage on other ranks (#22's replicated stages) and several groups at once
    program = pipec.compile("interleaved_1f1b", 4, 8, 2)
    synced = insert_syncs(program, [(0, 7), (1, 5), (2, 3, 6)])
    for model in MODELS:
        assert verify(synced, p2p=model).ok


@pytest.mark.parametrize(
    ("model", "first"),
    [
        # in order, rank 0's send of stage 4's gradient waits for rank 3 to post its receive
        ("nccl", "rank 3's 7SYNC0 (op 68) comes before its 3RECV_B5 (op 69), which rank 0's 4SEND_B5 (op 65) needs"),
        ("torch", "rank 3's 7SYNC0 (op 68) comes before its 3RECV_B5 (op 69), which rank 0's 4SEND_B5 (op 65) needs"),
        # sends buffered: the receive is not waited on, but stage 7's last gradient never leaves rank 3
        ("tagged", "rank 3's 7SYNC0 (op 68) comes before its 7SEND_B7 (op 70), which rank 2's 6RECV_B7 (op 81) needs"),
    ],
)
def test_a_sync_before_a_p2p_another_member_waits_on_is_a_deadlock_with_its_cause(model: str, first: str) -> None:
    # the naive placement on interleaved 1F1B's last rank: right after stage 7's last backward, before its stage 3
    # backwards, which wait on rank 0, which syncs only after its stage 0
    program = insert_syncs(pipec.compile("interleaved_1f1b", 4, 8, 2), [(0, 7)])
    broken = sync_after_last_backward(program, 3, 7)
    report = verify(broken, p2p=model)
    assert not report.ok
    text = report.render()
    assert "deadlock   FAILED" in text
    assert f"4 ranks cannot finish: {first}, while the SYNC waits for every member of group 0" in text, text
    assert "rank 3 at op 68 7SYNC0 waits for rank 0 op 80 0SYNC0 to be reached" in text
    assert "7SYNC0*" in text  # the grid marks where rank 3 is stuck


def test_a_missing_sync_is_refused_naming_both_ranks() -> None:
    program = insert_syncs(pipec.compile("1f1b", 4, 8), [(0, 3)])
    streams = list(program.streams)
    streams[3] = without_syncs(program, 3)
    report = verify(program.with_streams(tuple(streams), True))
    assert not report.ok
    assert (
        "sync group 0 (0, 3): rank 3 issues 0 SYNCs of it, rank 0 1: rank 0's 0SYNC0 (op 32) would wait forever for "
        "rank 3" in report.render()
    )


@pytest.mark.parametrize(
    ("sync", "message"),
    [
        (Action(0, Kind.SYNC, 4), "there is no sync group 4"),
        (Action(1, Kind.SYNC, 0), "holds no stage of it"),
    ],
)
def test_a_sync_of_no_group_or_of_a_rank_outside_it_is_refused(sync: Action, message: str) -> None:
    program = insert_syncs(pipec.compile("1f1b", 4, 4), [(0, 3)])
    rank = program.stage_to_rank[sync.stage]
    streams = list(program.streams)
    streams[rank] = (*streams[rank], sync)
    report = verify(program.with_streams(tuple(streams), True))
    assert not report.ok and message in report.render()


def test_verdicts_equal_the_independent_executor_on_random_sync_placements() -> None:
    rng = random.Random(21)
    seen = {True: 0, False: 0}
    for name, *sizes in [("1f1b", 3, 4, 1), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 3, 3, 1), ("zbv", 2, 3, 2)]:
        program = pipec.compile(name, *sizes)
        last = program.num_stages - 1
        for _ in range(25):
            groups = [(0, last), (1, last - 1)] if rng.random() < 0.5 else [(0, last)]
            placed = random_syncs(program, groups, rng)
            for model in MODELS:
                verdict = not check_deadlock(placed, model)
                oracle = execute(placed, model).completed
                assert verdict == oracle, (name, model, [str(i) for s in placed.streams for i in s])
                seen[verdict] += 1
    assert seen[True] > 30 and seen[False] > 30  # both verdicts are exercised


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_programs(), st.randoms(use_true_random=False))
def test_insert_syncs_keeps_any_valid_program_deadlock_free(program: Program, rng: random.Random) -> None:
    # the pass's claim: SYNCs after each member's last send/recv, groups in one order, never make a program that
    # runs (valid compute orders lowered by insert_p2p_ops) deadlock, whatever the groups
    lowered = insert_p2p_ops(program)
    stages = lowered.num_stages
    if stages < 2:
        return
    groups = [tuple(rng.sample(range(stages), rng.randint(2, min(stages, 4)))) for _ in range(rng.randint(1, 3))]
    synced = insert_syncs(lowered, groups)
    assert insert_syncs(synced, groups) == synced
    for model in MODELS:
        assert not check_deadlock(synced, model), (model, groups, synced.streams)
        assert execute(synced, model).completed


def test_mirrored_groups_verify_across_the_library() -> None:
    # DualPipe's pattern for replicated stages: stage s with stage S-1-s, every such pair a group at once
    checked = 0
    for label, tied in _library_with_ties():
        stages = tied.num_stages
        groups = [(s, stages - 1 - s) for s in range(stages // 2)]
        program = insert_syncs(tied, groups)
        for model in MODELS:
            assert not check_deadlock(program, model), (label, model)
        checked += any(isinstance(i, Action) and i.kind is Kind.SYNC for s in program.streams for i in s)
    assert checked > 40  # V shapes hold stage s and S-1-s on one rank: nothing to sum there

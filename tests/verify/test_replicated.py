"""Replicated pipelines (docs/design/replicated.md): DeepSeek's own DualPipe orders, read as text stream files of
two copies, verify under nccl with the copies' SYNCs and simulate; the routing rule of the structure pass; the
copies' sync groups."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from cli_capture import run_main
from deepseek_orders import dualpipe_cases, dualpipe_text

import pipec
from pipec.emit import dump_text, load_text
from pipec.errors import PipecInputError
from pipec.ir import Action, Kind
from pipec.passes.sync import insert_syncs, program_groups
from pipec.sim import simulate
from pipec.verify import check_structure


def test_every_deepseek_dualpipe_order_verifies_with_its_syncs_and_simulates(tmp_path: Path) -> None:
    cases = dualpipe_cases()
    assert len(cases) == 48
    for ranks, microbatches, orders in cases:
        path = tmp_path / f"dualpipe_{ranks}_{microbatches}.txt"
        path.write_text(dualpipe_text(orders))
        program = pipec.compile(str(path))
        assert program.pipelines == 2 and program.routes == (0,) * (microbatches // 2) + (1,) * (microbatches // 2)
        # one group per logical stage, its two copies (l, P + l); every rank issues one SYNC per stage it holds
        assert program.sync_groups == tuple((stage, ranks + stage) for stage in range(ranks))
        syncs = [[a for i in stream for a in i.parts if a.kind is Kind.SYNC] for stream in program.streams]
        assert all(len(rank_syncs) == 2 for rank_syncs in syncs)
        report = program.check(p2p="nccl")
        assert report.ok, (ranks, microbatches, report.render())
        sim = simulate(program)
        assert sim.makespan > 0
    code, out, _ = run_main(["check", str(path)])
    assert code == 0 and "deadlock   ok  (nccl model)" in out
    code, out, _ = run_main(["simulate", str(path)])
    assert code == 0 and "makespan" in out


def _dualpipe(ranks: int = 4, microbatches: int = 8) -> pipec.Program:
    orders = next(o for p, m, o in dualpipe_cases() if (p, m) == (ranks, microbatches))
    return load_text(dualpipe_text(orders))


def test_an_op_at_another_copys_stage_is_refused_naming_both_copies() -> None:
    program = _dualpipe()
    # micro-batch 5 goes through copy 1 (stages 4..7); say copy 0 instead
    routes = list(program.routes)
    routes[5] = 0
    problems = check_structure(replace(program, routes=tuple(routes)))
    assert "rank 0 op 6 7F5: micro-batch 5 goes through copy 0 (stages 0..3); stage 7 is copy 1's" in problems


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pipelines": 3}, "8 stages do not split into 3 pipelines"),
        ({"routes": (0, 1)}, "routes give 2 micro-batches a copy; the program has 8 micro-batches"),
        ({"routes": (0, 0, 0, 0, 1, 1, 1, 2)}, "the route of micro-batch 7 is 2: the copies are 0..1"),
    ],
)
def test_pipelines_and_routes_are_checked_with_clear_errors(change: dict, message: str) -> None:
    program = replace(_dualpipe(), **change)
    assert message in check_structure(program)[0]
    with pytest.raises(PipecInputError, match=message):
        program.check()
    with pytest.raises(PipecInputError, match=message):
        simulate(program)


def test_the_copies_groups_partition_the_parameters_with_ties() -> None:
    """A tied embedding on a copy's first and last stage is one group over both copies; each stage's other
    parameters are the group of its copies; one copy: the ties alone."""
    assert program_groups(8, 2) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert program_groups(8, 2, [(0, 3)]) == ((0, 3, 4, 7), (0, 4), (1, 5), (2, 6), (3, 7))
    assert program_groups(6, 3) == ((0, 2, 4), (1, 3, 5))
    assert program_groups(4, 1, [(0, 3)]) == ((0, 3),)


def test_a_single_chain_is_what_it_was() -> None:
    """C = 1: no SYNCs appear, the chain ends where it did."""
    program = pipec.compile("1f1b", 4, 8)
    assert program.pipelines == 1 and not program.sync_groups
    assert not any(a.kind is Kind.SYNC for stream in program.streams for i in stream for a in i.parts)
    assert Action(3, Kind.SEND_F, 0) not in program.streams[3]


def test_copies_that_no_group_sums_are_refused_once_the_send_recv_are_placed(tmp_path: Path) -> None:
    """A stream file of two copies with its send/recv but no SYNCs would train two drifting models."""
    path = tmp_path / "dualpipe.txt"
    path.write_text(dualpipe_text(next(o for p, m, o in dualpipe_cases() if (p, m) == (4, 8))))
    synced = pipec.compile(str(path))
    unsynced = replace(
        synced,
        streams=tuple(tuple(i for i in s if i.parts[0].kind is not Kind.SYNC) for s in synced.streams),
        sync_groups=(),
    )
    problems = check_structure(unsynced)
    assert len(problems) == 4
    assert problems[0].startswith("the copies (0, 4) of stage 0 are summed by no sync group")
    # the compute orders alone: the verifier lowers them with the copies' SYNCs, as the compiler does
    orders = pipec.load(str(path))
    assert not orders.has_comms and orders.check().ok


def test_a_message_across_two_copies_chains_is_refused_naming_the_chain_end(tmp_path: Path) -> None:
    """Copy 0's last stage hands nothing on: a send from it to copy 1's first stage is named as such."""
    path = tmp_path / "dualpipe.txt"
    path.write_text(dualpipe_text(next(o for p, m, o in dualpipe_cases() if (p, m) == (4, 8))))
    program = pipec.compile(str(path))
    # rank 3 holds stage 3 (copy 0's last) and stage 4 (copy 1's first): a send of stage 3's output as if to 4
    streams = list(program.streams)
    streams[3] = (*streams[3], Action(3, Kind.SEND_F, 0))
    problems = check_structure(replace(program, streams=tuple(streams)))
    assert "3SEND_F0: stage 3 is the last of copy 0's chain, which hands nothing to stage 4 (copy 1's)" in problems


def _without_syncs(program: pipec.Program) -> pipec.Program:
    return replace(
        program, streams=tuple(tuple(i for i in s if i.parts[0].kind is not Kind.SYNC) for s in program.streams)
    )


@pytest.mark.parametrize("schedule", ["dualpipe", "chimera"])
def test_declared_groups_whose_syncs_are_all_missing_are_refused_from_the_file(schedule: str, tmp_path: Path) -> None:
    """Every member rank issuing no SYNC of a group is as balanced as one each, but the copies never meet: a file
    that declares the groups and lost every SYNC would train C drifting models. Exit 1, naming the group."""
    unsynced = _without_syncs(pipec.compile(schedule, ranks=4, microbatches=8))
    assert unsynced.sync_groups and unsynced.has_comms
    path = tmp_path / "unsynced.txt"
    path.write_text(dump_text(unsynced))
    code, out, err = run_main(["check", str(path)])
    assert code == 1, out + err
    assert f"sync group 0 {unsynced.sync_groups[0]}: its member ranks issue no SYNC of it" in out + err


def test_a_group_summed_twice_is_refused_and_a_tie_alike() -> None:
    """A second SYNC of a group on every member rank is balanced (no deadlock) but sums the summed gradients
    again: refused. The same rule holds for a tie's group in one pipeline (stages 0 and 3 of 1f1b)."""
    program = pipec.compile("dualpipe", ranks=4, microbatches=8)
    doubled = replace(
        program, streams=tuple(s + tuple(i for i in s if i.parts[0].kind is Kind.SYNC) for s in program.streams)
    )
    assert any("SYNCs of it: one per step" in p for p in check_structure(doubled))
    tied = insert_syncs(pipec.compile("1f1b", ranks=4, microbatches=4), [(0, 3)])
    assert check_structure(tied) == []
    assert any("issue no SYNC of it" in p for p in check_structure(_without_syncs(tied)))

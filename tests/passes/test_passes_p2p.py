"""passes/p2p.py directly: which messages insert_p2p_ops adds, where (the timed replay), the plain rule for what a
deadlocking compute order leaves, and the timed replay against the integer one. The expected streams below are
worked out by hand from the module docstring's rule; the random programs are checked against the rule restated
here edge by edge (brute force), not against the pass's own helpers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipec.errors import PipecInputError, ScheduleError
from pipec.ir import Action, Instruction, Kind, Program
from pipec.passes.p2p import insert_p2p_ops
from pipec.sim import Costs, simulate
from pipec.testing.orders import random_program

SENDS, RECVS = (Kind.SEND_F, Kind.SEND_B), (Kind.RECV_F, Kind.RECV_B)


def two_stage(streams: tuple[tuple[Instruction, ...], ...], microbatches: int = 2) -> Program:
    return Program(
        name="hand", ranks=2, microbatches=microbatches, chunks=1, stage_to_rank=(0, 1), streams=streams
    )


def text(program: Program) -> list[str]:
    return [" ".join(map(str, stream)) for stream in program.streams]


def a(spec: str) -> Action:
    """`0F1` -> Action(0, F, 1) (single-digit stage and micro-batch)."""
    return Action(int(spec[0]), Kind(spec[1:-1]), int(spec[-1]))


def test_the_timed_replay_places_each_message_when_its_data_exist() -> None:
    # default costs F=1, B=2: rank 1 runs 1F0 [1,2], 1B0 [2,4], 1F1 [4,5], 1B1 [5,7]; rank 0's 0B0 waits for 1B0's
    # gradient (4), 0B1 for 1B1's (7). 0F1 ends at 2, so 1RECV_F1 sits before 1B0 (a message before a compute at
    # the same time), not just before 1F1 where the naive rule would put it; 1SEND_B0 (4) comes before 1F1 (4).
    program = two_stage(
        (tuple(map(a, ["0F0", "0F1", "0B0", "0B1"])), tuple(map(a, ["1F0", "1B0", "1F1", "1B1"])))
    )
    assert text(insert_p2p_ops(program)) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


def test_a_compute_order_that_cannot_run_keeps_the_plain_rule_for_the_rest() -> None:
    # rank 0 starts with 0B0, whose gradient needs 0F0 first: nothing of rank 0 runs, nor anything of rank 1
    program = two_stage((tuple(map(a, ["0B0", "0F0"])), tuple(map(a, ["1F0", "1B0"]))), microbatches=1)
    placed = insert_p2p_ops(program)
    assert text(placed) == ["0RECV_B0 0B0 0F0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    with pytest.raises(ScheduleError, match="deadlock"):  # the verifier then reports the deadlock
        placed.check()


def test_a_program_with_send_recv_is_refused() -> None:
    program = insert_p2p_ops(two_stage((tuple(map(a, ["0F0", "0B0"])), tuple(map(a, ["1F0", "1B0"]))), 1))
    with pytest.raises(PipecInputError, match="already has send/recv"):
        insert_p2p_ops(program)


def expected_messages(program: Program) -> Counter:
    """(rank, send/recv action) for every edge that crosses ranks, from the rule: F(s, m) feeds stage s+1, B or
    I(s, m) feeds stage s-1; W and same-rank edges carry nothing."""
    where, last = program.stage_to_rank, program.num_stages - 1
    out: Counter = Counter()
    for rank, stream in enumerate(program.streams):
        for instruction in stream:
            for stage, kind, mb in instruction.parts:
                if kind is Kind.F and stage < last and where[stage + 1] != rank:
                    out[rank, Action(stage, Kind.SEND_F, mb)] += 1
                    out[where[stage + 1], Action(stage + 1, Kind.RECV_F, mb)] += 1
                elif kind in (Kind.B, Kind.I) and stage > 0 and where[stage - 1] != rank:
                    out[rank, Action(stage, Kind.SEND_B, mb)] += 1
                    out[where[stage - 1], Action(stage - 1, Kind.RECV_B, mb)] += 1
    return out


def check_placement(program: Program, placed: Program) -> None:
    """What every placement of a valid compute order must satisfy (module docstring)."""
    assert placed.has_comms
    where = program.stage_to_rank
    found = Counter(
        (rank, x) for rank, stream in enumerate(placed.streams) for x in stream if type(x) is Action and x.kind.is_comm
    )
    assert found == expected_messages(program)
    # the relative order of compute instructions is unchanged
    assert placed.compute_streams() == program.streams
    for rank, stream in enumerate(placed.streams):
        for i, x in enumerate(stream):
            if type(x) is not Action or not x.kind.is_comm:
                continue
            stage, kind, mb = x
            if kind in SENDS:  # after the compute that produced it
                producers = [Action(stage, Kind.F, mb)] if kind is Kind.SEND_F else [
                    Action(stage, Kind.B, mb), Action(stage, Kind.I, mb)]
                made = [j for j, y in enumerate(stream) for part in y.parts if part in producers]
                assert made and made[0] < i, (rank, x)
            else:  # before the compute that consumes it
                readers = [Action(stage, Kind.F, mb)] if kind is Kind.RECV_F else [
                    Action(stage, Kind.B, mb), Action(stage, Kind.I, mb)]
                used = [j for j, y in enumerate(stream) for part in y.parts if part in readers]
                assert used and i < used[0], (rank, x)
    # each channel carries its messages in the same order on both sides (the nccl order rule)
    sent: dict[tuple[int, int], list[tuple[int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, stream in enumerate(placed.streams):
        for x in stream:
            if type(x) is Action and x.kind in SENDS:
                to = x.stage + (1 if x.kind is Kind.SEND_F else -1)
                sent.setdefault((rank, where[to]), []).append((x.stage, x.mb))
            elif type(x) is Action and x.kind in RECVS:
                source = x.stage + (-1 if x.kind is Kind.RECV_F else 1)
                received.setdefault((where[source], rank), []).append((source, x.mb))
    assert sent == received


@pytest.mark.parametrize("seed", range(60))
def test_random_compute_orders_get_every_message_in_channel_order(seed: int) -> None:
    program = random_program(random.Random(seed))
    placed = insert_p2p_ops(program)
    check_placement(program, placed)
    assert simulate(placed, p2p="nccl").makespan > 0  # runs to the end under the runtime's rule (no deadlock)


@pytest.mark.parametrize("seed", range(40))
def test_the_timed_replay_keeps_the_rule_under_other_costs(seed: int) -> None:
    rng = random.Random(seed)
    program = random_program(rng)
    costs = Costs(
        F=rng.choice((0.5, 1.0, 3.0)), B=4.0, W=rng.choice((0.0, 1.0)), comm=rng.choice((0.0, 0.25, 2.0)),
        overlap=rng.random() < 0.5,
    )
    placed = insert_p2p_ops(program, costs)
    check_placement(program, placed)
    simulate(placed, costs, p2p="nccl")  # raises on a deadlock or a p2p order mismatch


@pytest.mark.parametrize("seed", range(40))
def test_the_timed_replay_with_scaled_default_costs_places_as_the_integer_replay(seed: int) -> None:
    # doubling every duration changes no comparison of the replay, so the float replay (_replay_timed) must give
    # the integer one's streams (_replay_default): two implementations of one rule checked against each other
    program = random_program(random.Random(seed))
    doubled = Costs(F=2.0, B=4.0, I=2.0, W=2.0)
    assert insert_p2p_ops(program, doubled).streams == insert_p2p_ops(program).streams


def test_costs_equal_to_the_defaults_take_the_default_placement() -> None:
    program = two_stage((tuple(map(a, ["0F0", "0F1", "0B0", "0B1"])), tuple(map(a, ["1F0", "1B0", "1F1", "1B1"]))))
    default = insert_p2p_ops(program).streams
    assert insert_p2p_ops(program, Costs()).streams == default
    assert insert_p2p_ops(program, Costs(overlap=True, activation=3.0)).streams == default  # memory, overlap: no matter
    # a message keeps its producer's end, not its arrival: with comm=1, 0F0's output arrives at 2, when 0F1 ends,
    # so 1F0 starts at 2 and 1RECV_F1 (key 2, a message) sorts before it
    with_comm = insert_p2p_ops(program, Costs(comm=1.0, overlap=True))
    assert text(with_comm)[1] == "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"


def test_a_wrong_per_stage_cost_list_is_refused_naming_its_key() -> None:
    program = two_stage((tuple(map(a, ["0F0", "0B0"])), tuple(map(a, ["1F0", "1B0"]))), 1)
    with pytest.raises(PipecInputError, match="'F' has 3 entries"):
        insert_p2p_ops(program, Costs(F=(1.0, 1.0, 1.0)))

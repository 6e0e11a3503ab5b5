"""pipec/p2p_rule.py, the point-to-point rule's shared pieces, against the rule written out by hand."""

from __future__ import annotations

import pytest

from pipec.ir import Action, Kind, chain_links
from pipec.p2p_rule import (
    DEFAULT_DURATION,
    consumers,
    counterpart,
    is_default,
    message_id,
    output_message,
    peer_of,
    peer_stage,
    producers,
    receive_for,
    remote_input,
    remote_output,
    send_for,
)
from pipec.sim.costs import DEFAULT_COSTS, Costs

COMMS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


def test_a_send_and_its_receive_name_each_other_and_the_same_message() -> None:
    n_mb = 5
    for stage in range(1, 4):
        for kind in COMMS:
            for mb in range(n_mb):
                action = Action(stage, kind, mb)
                other = counterpart(action)
                assert counterpart(other) == action
                assert peer_stage(action) == other.stage and peer_stage(other) == stage
                assert message_id(action, n_mb) == message_id(other, n_mb)


def test_message_ids_are_the_documented_numbers_and_distinct() -> None:
    n_mb, stages = 3, 4
    assert message_id(Action(2, Kind.SEND_F, 1), n_mb) == (2 * n_mb + 1) * 2
    assert message_id(Action(3, Kind.RECV_F, 1), n_mb) == (2 * n_mb + 1) * 2
    assert message_id(Action(2, Kind.SEND_B, 1), n_mb) == (2 * n_mb + 1) * 2 + 1
    assert message_id(Action(1, Kind.RECV_B, 1), n_mb) == (2 * n_mb + 1) * 2 + 1
    sends = [Action(s, k, m) for s in range(stages) for k in (Kind.SEND_F, Kind.SEND_B) for m in range(n_mb)]
    ids = [message_id(a, n_mb) for a in sends]
    assert sorted(ids) == list(range(stages * n_mb * 2))
    assert output_message(2, True, 1, n_mb) == message_id(Action(2, Kind.SEND_F, 1), n_mb)
    assert output_message(2, False, 1, n_mb) == message_id(Action(2, Kind.SEND_B, 1), n_mb)


def test_peers_follow_the_placement() -> None:
    where = (0, 1, 1, 0)  # a V placement: stages 1 and 2 share rank 1
    assert peer_of(Action(0, Kind.SEND_F, 0), where) == 1
    assert peer_of(Action(3, Kind.RECV_F, 0), where) == 1
    assert peer_of(Action(3, Kind.SEND_B, 0), where) == 1
    assert peer_of(Action(1, Kind.RECV_B, 0), where) == 1
    assert peer_of(Action(1, Kind.SEND_B, 0), where) == 0


def test_which_receive_feeds_which_compute() -> None:
    assert receive_for(Action(2, Kind.F, 4)) == Action(2, Kind.RECV_F, 4)
    assert receive_for(Action(2, Kind.B, 4)) == Action(2, Kind.RECV_B, 4)
    assert receive_for(Action(2, Kind.I, 4)) == Action(2, Kind.RECV_B, 4)
    assert receive_for(Action(2, Kind.W, 4)) is None


@pytest.mark.parametrize(
    ("where", "pipelines"),
    [
        ((0, 1, 2, 3), 1),
        ((0, 1, 1, 0), 1),
        ((0, 0, 1, 1), 1),
        ((0, 1, 1, 0), 2),
        ((0, 1, 2, 2, 1, 0), 2),
        ((0, 1, 0, 1), 2),
    ],
)
def test_remote_inputs_and_outputs_are_exactly_the_rank_crossing_edges(where: tuple[int, ...], pipelines: int) -> None:
    """Within a copy (stages c*L .. c*L + L-1) neighbours exchange; never across two copies' chains."""
    length = len(where) // pipelines
    links = chain_links(len(where), pipelines)
    for stage in range(len(where)):
        rank, copy = where[stage], stage // length
        for kind in (Kind.F, Kind.B, Kind.I, Kind.W):
            action = Action(stage, kind, 0)
            source = stage - 1 if kind is Kind.F else stage + 1
            in_copy = 0 <= source < len(where) and source // length == copy
            crosses_in = kind is not Kind.W and in_copy and where[source] != rank
            recv = remote_input(action, rank, where, links)
            assert (recv is not None) == crosses_in
            target = stage + 1 if kind is Kind.F else stage - 1
            in_copy = 0 <= target < len(where) and target // length == copy
            crosses_out = kind is not Kind.W and in_copy and where[target] != rank
            out = remote_output(action, rank, where, links)
            assert (out is not None) == crosses_out
            if out is not None:
                send, to, receive = out
                assert to == where[target] and counterpart(send) == receive and receive.stage == target


def test_default_costs_are_the_simulators_defaults() -> None:
    table = DEFAULT_COSTS.per_stage(3)
    assert {kind: row[0] for kind, row in table.items()} == DEFAULT_DURATION
    assert is_default(DEFAULT_COSTS, 3)
    assert not is_default(Costs(comm=0.5), 3)
    assert not is_default(Costs(F=(1.0, 1.0, 2.0), B=(2.0, 2.0, 3.0)), 3)


def test_a_receive_feeds_exactly_the_computes_whose_receive_it_is_and_a_send_carries_its_producers() -> None:
    for kind in (Kind.RECV_F, Kind.RECV_B):
        receive = Action(2, kind, 3)
        assert consumers(receive) and all(receive_for(action) == receive for action in consumers(receive))
    assert consumers(Action(2, Kind.RECV_B, 3)) == (Action(2, Kind.B, 3), Action(2, Kind.I, 3))
    for kind in (Kind.SEND_F, Kind.SEND_B):
        send = Action(2, kind, 3)
        assert producers(send) and all(send_for(action) == send for action in producers(send))
    assert producers(Action(2, Kind.SEND_F, 3)) == (Action(2, Kind.F, 3),)


@pytest.mark.parametrize("model", ["nccl", "tagged"])
def test_the_simulators_inlined_message_ids_pair_exactly_the_rules_counterparts(model: str) -> None:
    """The host loop and the ideal model compute message ids inline (measured hot loops): every message they match
    must be a send and its p2p_rule counterpart, between the ranks peer_of names, with one id for both."""
    import random

    from pipec.passes.p2p import insert_p2p_ops
    from pipec.sim import simulate
    from pipec.testing.orders import random_program

    for seed in range(30):
        program = insert_p2p_ops(random_program(random.Random(seed)))
        where, n_mb = program.stage_to_rank, program.microbatches
        result = simulate(program, record=True, p2p=model)
        sends = sum(1 for s in program.streams for x in s if type(x) is Action and x.kind in (Kind.SEND_F, Kind.SEND_B))
        assert len(result.messages) == sends
        for m in result.messages:
            assert counterpart(m.send) == m.recv and message_id(m.send, n_mb) == message_id(m.recv, n_mb)
            assert peer_of(m.send, where) == m.dst and peer_of(m.recv, where) == m.src
        ideal = simulate(program, record=True, p2p="ideal")
        assert sorted(map(str, (m.send for m in ideal.messages))) == sorted(map(str, (m.send for m in result.messages)))

"""The verifier's copies of the point-to-point rule, on its integer keys, against pipec.p2p_rule.

flatten builds each rank's channels with the peer inlined in its loop; the deadlock engines and the p2p order
check find a message's other end and a compute's receive by adding a shift to a key (counterpart_shift,
receive_shift). Each must say what pipec.p2p_rule says on Actions, for every op of real and random programs.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from strategies import valid_programs

import pipec
from pipec.ir import Action, Program
from pipec.p2p_rule import counterpart, peer_of, receive_for
from pipec.passes.p2p import insert_p2p_ops
from pipec.verify.flat import RECV_B, RECV_F, SEND_B, SEND_F, W, code_of, counterpart_shift, flatten, receive_shift

RANDOM = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
LIBRARY = [("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2)]


def _actions(program: Program):
    for rank, stream in enumerate(program.streams):
        for index, instruction in enumerate(stream):
            for action in (instruction,) if type(instruction) is Action else instruction.parts:
                yield rank, index, action


def _assert_keys_follow_the_rule(program: Program) -> None:
    flat = flatten(program)
    on_channel = set()
    for (src, dst), (sends, recvs) in flat.channels.items():
        for index, key in sends:
            assert peer_of(flat.decode(key), program.stage_to_rank) == dst
            on_channel.add((src, index))
        for index, key in recvs:
            assert peer_of(flat.decode(key), program.stage_to_rank) == src
            on_channel.add((dst, index))
    comms = 0
    for rank, index, action in _actions(program):
        key = flat.key(action.stage, code_of(action.kind), action.mb)
        if action.kind.is_comm:
            comms += 1
            assert (rank, index) in on_channel, (rank, index, action)
            assert flat.decode(key + counterpart_shift(key & 7, flat.mbs)) == counterpart(action)
        elif key & 7 < W:
            assert flat.decode(key + receive_shift(key & 7)) == receive_for(action)
    assert len(on_channel) == comms  # every send/recv on exactly one channel (its peer's)


def test_the_library_keys_follow_the_rule() -> None:
    for name, p, m, v in LIBRARY:
        _assert_keys_follow_the_rule(pipec.compile(name, p, m, v))


@RANDOM
@given(valid_programs())
def test_random_lowered_keys_follow_the_rule(program: Program) -> None:
    _assert_keys_follow_the_rule(insert_p2p_ops(program))


def test_the_shifts_are_the_documented_numbers() -> None:
    for mbs in (1, 7, 1024):
        step = mbs * 8
        assert [counterpart_shift(code, mbs) for code in (SEND_F, RECV_F, SEND_B, RECV_B)] == [
            step + 1, -step - 1, -step + 1, step - 1,
        ]
    assert [receive_shift(code) for code in range(W)] == [RECV_F, RECV_B - 1, RECV_B - 2]

"""insert_syncs: one SYNC per member rank and group, after the rank's last weight gradient of the group."""

import pytest

import pipec
from pipec.errors import PipecInputError, PipecSyntaxError
from pipec.ir import Action, Kind, parse_instruction
from pipec.passes.sync import insert_syncs


def _syncs(program: pipec.Program) -> list[list[Action]]:
    return [[i for i in stream if isinstance(i, Action) and i.kind is Kind.SYNC] for stream in program.streams]


def test_sync_text_form_round_trips() -> None:
    action = Action(3, Kind.SYNC, 1)
    assert str(action) == "3SYNC1"
    assert parse_instruction("3SYNC1") == action
    assert Kind.SYNC.is_collective and Kind.SYNC.is_comm and not Kind.SYNC.is_p2p and not Kind.SYNC.is_compute
    with pytest.raises(PipecSyntaxError):
        parse_instruction("(0SYNC0;1B0)OVERLAP_F_B")  # a SYNC is not compute: it pairs with nothing


def test_1f1b_syncs_after_the_last_backward_and_its_send() -> None:
    program = pipec.compile("1f1b", 2, 3)
    synced = insert_syncs(program, [(0, 1)])
    assert synced.sync_groups == ((0, 1),)
    assert synced.streams[0][-1] == Action(0, Kind.SYNC, 0)
    # rank 1's last B sends its gradient first: the SYNC comes after that send
    assert [str(i) for i in synced.streams[1][-3:]] == ["1B2", "1SEND_B2", "1SYNC0"]
    assert synced.compute_streams() == program.compute_streams()


def test_a_rank_holding_two_stages_of_a_group_issues_one_sync_on_its_lowest() -> None:
    program = pipec.compile("zbv", 2, 4)
    last = program.num_stages - 1
    synced = insert_syncs(program, [(0, last)])
    assert program.stage_to_rank[0] == program.stage_to_rank[last] == 0
    assert _syncs(synced) == [[], []]  # the group is on one rank: nothing to sum across ranks
    synced = insert_syncs(program, [(0, 1, 2, last)])
    assert _syncs(synced) == [[Action(0, Kind.SYNC, 0)], [Action(1, Kind.SYNC, 0)]]


def test_idempotent_and_groups_in_order() -> None:
    program = pipec.compile("1f1b", 4, 8)
    groups = [(0, 3), (1, 3)]
    once = insert_syncs(program, groups)
    assert insert_syncs(once, groups) == once
    rank3 = [i.mb for i in _syncs(once)[3]]
    assert rank3 == [0, 1]


@pytest.mark.parametrize(
    ("groups", "message"), [([(0,)], "at least two"), ([(0, 0)], "twice"), ([(0, 9)], "not a stage")]
)
def test_bad_groups_are_refused_with_a_message(groups: list[tuple[int, ...]], message: str) -> None:
    with pytest.raises(PipecInputError, match=message):
        insert_syncs(pipec.compile("1f1b", 2, 2), groups)


def test_compute_only_programs_are_refused() -> None:
    with pytest.raises(PipecInputError, match="after insert_p2p_ops"):
        insert_syncs(pipec.load("1f1b", 2, 2), [(0, 1)])

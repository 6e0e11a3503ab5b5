"""The point-to-point rule's shared pieces: who talks to whom, which message feeds which op, and the default costs.

Every engine that applies the rule (passes/p2p.py's replays, passes/list_schedule.py, the simulator, the
verifier's deadlock engines, the runtime's interpreter and the test kit's lowering) reads these names from here, so
that the rule is stated once:

- messages: F(s, m) on stage s hands its output to stage s+1 (SEND_F(s, m) -> RECV_F(s+1, m)); B or I of (s, m)
  hands the input gradient to stage s-1 (SEND_B(s, m) -> RECV_B(s-1, m)). W never communicates, nor do two stages
  on the same rank.
- which message feeds which op: RECV_F(s, m) feeds F(s, m), RECV_B(s, m) feeds B(s, m) or I(s, m).
- the message id: one int per message, the same on both ranks, ``(sending stage * n_mb + mb) * 2`` plus 1 for a
  gradient. A receive's sending stage is its neighbour: ``((s - 1) * n_mb + mb) * 2`` for RECV_F(s, m),
  ``((s + 1) * n_mb + mb) * 2 + 1`` for RECV_B(s, m).
- the default costs (F=1, B=2, I=1, W=1, messages free) and the one protocol a cost model offers the passes, which
  sit below the simulator's ``pipec.sim.costs.Costs`` (it has this protocol).

Layer 2, beside pipec.ir: it imports only the IR. The hot loops of the simulator and the replays inline the message
id arithmetic (a call per op is measured there); tests/test_p2p_rule.py checks each inlined copy against these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pipec.ir import Action, ChainLinks, Kind, chain_links

# The default compute durations of pipec.sim (pipec.sim.costs.Costs' defaults) and the replay's integer timeline.
DEFAULT_DURATION: Mapping[Kind, int] = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}
DEFAULT_MESSAGE_TIME = 0  # messages are free by default


class CostModel(Protocol):
    """What the passes read of a cost model (pipec.sim.costs.Costs has it; the passes sit below the simulator)."""

    @property
    def message_time(self) -> float: ...

    @property
    def overlap(self) -> bool: ...

    def per_stage(self, stages: int) -> Mapping[Kind, Sequence[float]]: ...

    def pair_per_stage(self, stages: int) -> Sequence[float] | None: ...


def is_default(costs: CostModel, stages: int) -> bool:
    """Whether ``costs`` time compute and messages exactly as the defaults do (memory fields and overlap aside)."""
    if costs.message_time != DEFAULT_MESSAGE_TIME or costs.pair_per_stage(stages) is not None:
        return False
    table = costs.per_stage(stages)  # raises on a per-stage list of the wrong length, naming the key
    return all(all(v == DEFAULT_DURATION[kind] for v in row) for kind, row in table.items())


def pair_duration(
    parts: Sequence[Action], serial: float, table: Mapping[Kind, Sequence[float]], pair: Sequence[float] | None
) -> float:
    """An overlapped pair's duration, the one rule every timed engine applies: ``serial`` (the sum of its halves'
    durations) without a pair cost (``pair`` None, Costs.FB unset) or for a pair that is not one forward and one
    backward; ``pair[s]`` (s the forward half's stage) for F & B; for F & I or F & W the share of ``serial`` that
    F & B gets of F + B (an overlap hides the same fraction whichever backward runs beside the forward)."""
    if pair is None:
        return serial
    first, second = parts
    forward, backward = (first, second) if first.kind is Kind.F else (second, first)
    if forward.kind is not Kind.F or backward.kind is Kind.F:
        return serial
    if backward.kind is Kind.B:
        return pair[forward.stage]
    full = table[Kind.F][forward.stage] + table[Kind.B][backward.stage]
    return serial * pair[forward.stage] / full if full > 0 else serial


# per send/recv kind: the step from its stage to the peer's stage, and whether it carries a gradient
PEER_STEP: Mapping[Kind, int] = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}
CARRIES_GRADIENT: Mapping[Kind, int] = {Kind.SEND_F: 0, Kind.RECV_F: 0, Kind.SEND_B: 1, Kind.RECV_B: 1}
SENDS = (Kind.SEND_F, Kind.SEND_B)


def peer_stage(action: Action) -> int:
    """The stage a SEND goes to or a RECV comes from."""
    return action.stage + PEER_STEP[action.kind]


def peer_of(action: Action, stage_to_rank: Sequence[int]) -> int:
    """The rank a SEND goes to or a RECV comes from."""
    return stage_to_rank[peer_stage(action)]


def receiving_ranks(stage_to_rank: Sequence[int], pipelines: int = 1) -> tuple[list[int | None], list[int | None]]:
    """Per stage, the rank its forward output goes to (stage + 1's) and the rank its input gradient goes to
    (stage - 1's); None at a copy's ends (``pipelines`` copies, stages numbered over them: pipec.ir.chain_links).
    Whether a message crosses ranks is then a comparison with the sender's rank."""
    has_next, has_previous = chain_links(len(stage_to_rank), pipelines)
    forward_to = [stage_to_rank[s + 1] if has_next[s] else None for s in range(len(stage_to_rank))]
    backward_to = [stage_to_rank[s - 1] if has_previous[s] else None for s in range(len(stage_to_rank))]
    return forward_to, backward_to


def counterpart(action: Action) -> Action:
    """The op a send or receive pairs with by name: SEND_F(s, m) <-> RECV_F(s+1, m), SEND_B(s, m) <-> RECV_B(s-1, m)."""
    stage, kind, mb = action
    return {
        Kind.SEND_F: Action(stage + 1, Kind.RECV_F, mb),
        Kind.RECV_F: Action(stage - 1, Kind.SEND_F, mb),
        Kind.SEND_B: Action(stage - 1, Kind.RECV_B, mb),
        Kind.RECV_B: Action(stage + 1, Kind.SEND_B, mb),
    }[kind]


def message_id(action: Action, n_mb: int) -> int:
    """The message a SEND or RECV carries, the same number on both ranks: (sending stage * n_mb + mb) * 2, plus 1
    for a gradient."""
    stage, kind, mb = action
    sender = stage if kind in SENDS else stage + PEER_STEP[kind]
    return (sender * n_mb + mb) * 2 + CARRIES_GRADIENT[kind]


def output_message(stage: int, forward: bool, mb: int, n_mb: int) -> int:
    """The id of the message a compute op of (stage, mb) produces: its output (forward) or input gradient."""
    return (stage * n_mb + mb) * 2 + (0 if forward else 1)


def receive_for(action: Action) -> Action | None:
    """The receive that feeds a compute action if its input comes from another rank: RECV_F(s, m) feeds F(s, m),
    RECV_B(s, m) feeds B(s, m) and I(s, m); W and send/recv are fed by none."""
    stage, kind, mb = action
    if kind is Kind.F:
        return Action(stage, Kind.RECV_F, mb)
    if kind is Kind.B or kind is Kind.I:
        return Action(stage, Kind.RECV_B, mb)
    return None


def send_for(action: Action) -> Action | None:
    """The send that hands on what a compute action produces if its consumer lives on another rank: F(s, m) ->
    SEND_F(s, m), B/I(s, m) -> SEND_B(s, m); W produces no message."""
    stage, kind, mb = action
    if kind is Kind.F:
        return Action(stage, Kind.SEND_F, mb)
    if kind is Kind.B or kind is Kind.I:
        return Action(stage, Kind.SEND_B, mb)
    return None


def consumers(receive: Action) -> tuple[Action, ...]:
    """The compute actions a receive feeds: RECV_F(s, m) -> F(s, m); RECV_B(s, m) -> B(s, m) or I(s, m)."""
    stage, kind, mb = receive
    if kind is Kind.RECV_F:
        return (Action(stage, Kind.F, mb),)
    return (Action(stage, Kind.B, mb), Action(stage, Kind.I, mb))


def producers(send: Action) -> tuple[Action, ...]:
    """The compute actions whose result a send carries: SEND_F(s, m) <- F(s, m); SEND_B(s, m) <- B(s, m) or
    I(s, m)."""
    stage, kind, mb = send
    if kind is Kind.SEND_F:
        return (Action(stage, Kind.F, mb),)
    return (Action(stage, Kind.B, mb), Action(stage, Kind.I, mb))


def remote_input(action: Action, rank: int, stage_to_rank: Sequence[int], links: ChainLinks) -> Action | None:
    """The RECV this compute action (on ``rank``) needs, if its input comes from another rank. ``links``:
    pipec.ir.chain_links of the program (where each copy's chain ends)."""
    stage, kind, _ = action
    has_next, has_previous = links
    in_range = 0 <= stage < len(has_next)
    if kind is Kind.F:
        remote = in_range and has_previous[stage] and stage_to_rank[stage - 1] != rank
    elif kind is Kind.B or kind is Kind.I:
        remote = in_range and has_next[stage] and stage_to_rank[stage + 1] != rank
    else:
        remote = False
    return receive_for(action) if remote else None


def remote_output(
    action: Action, rank: int, stage_to_rank: Sequence[int], links: ChainLinks
) -> tuple[Action, int, Action] | None:
    """(SEND, receiving rank, RECV) for an output of this compute action (on ``rank``) that another rank consumes.
    ``links``: pipec.ir.chain_links of the program."""
    stage, kind, _ = action
    has_next, has_previous = links
    in_range = 0 <= stage < len(has_next)
    if kind is Kind.F:
        target = stage + 1 if in_range and has_next[stage] else -1
    elif kind is Kind.B or kind is Kind.I:
        target = stage - 1 if in_range and has_previous[stage] else -1
    else:
        target = -1
    if target < 0 or stage_to_rank[target] == rank:
        return None
    send = send_for(action)
    assert send is not None
    return send, stage_to_rank[target], counterpart(send)

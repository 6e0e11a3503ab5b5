"""check_deadlock: does every rank's stream run to the end?

Model `tagged` (buffered sends, receives matched by (stage, micro-batch)): an instruction may run once the
work it depends on is done anywhere: F(s, m) after F(s-1, m); B/I(s, m) after F(s, m) and the backward of
(s+1, m); W(s, m) after I(s, m); RECV after its SEND; SEND at any time after what precedes it on its rank.
A schedule is deadlock-free under this model iff program order plus these dependencies form no cycle; the
check finds that by running the streams with a worklist (linear in the number of instructions).
"""

from __future__ import annotations

from collections import defaultdict, deque

from pipec.ir import Action, Instruction, Kind, Program

# What a finished action makes available: (stage, tag, mb), tag F = forward done, G = input gradient done,
# W = weight gradient done, S_F / S_B = a message is in flight.
Key = tuple[int, str, int]
_DONE_TAG = {Kind.F: "F", Kind.B: "G", Kind.I: "G", Kind.W: "W", Kind.SEND_F: "S_F", Kind.SEND_B: "S_B"}


def _needs(action: Action, last_stage: int) -> list[Key]:
    stage, kind, mb = action
    if kind is Kind.F:
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if kind is Kind.B or kind is Kind.I:
        needs = [(stage, "F", mb)]
        if stage < last_stage:
            needs.append((stage + 1, "G", mb))
        return needs
    if kind is Kind.W:
        return [(stage, "G", mb)]
    if kind is Kind.RECV_F:
        return [(stage - 1, "S_F", mb)]
    if kind is Kind.RECV_B:
        return [(stage + 1, "S_B", mb)]
    return []


def run_streams(program: Program) -> tuple[list[int], dict[int, Key]]:
    """Run the streams under the tagged model. Returns each rank's stop position and what blocked ranks wait for."""
    last = program.num_stages - 1
    streams = program.streams
    done: set[Key] = set()
    position = [0] * len(streams)
    waiting: dict[Key, list[int]] = defaultdict(list)
    blocked_on: dict[int, Key] = {}
    ready = deque(range(len(streams)))
    while ready:
        rank = ready.popleft()
        stream = streams[rank]
        i = position[rank]
        while i < len(stream):
            missing = _first_missing(stream[i], done, last)
            if missing is not None:
                waiting[missing].append(rank)
                blocked_on[rank] = missing
                break
            blocked_on.pop(rank, None)
            for action in stream[i].parts:
                key = (action.stage, _DONE_TAG.get(action.kind, ""), action.mb)
                if key[1]:
                    done.add(key)
                    ready.extend(waiting.pop(key, ()))
            i += 1
        position[rank] = i
    return position, blocked_on


def _first_missing(instruction: Instruction, done: set[Key], last: int) -> Key | None:
    for action in instruction.parts:
        for key in _needs(action, last):
            if key not in done:
                return key
    return None


def check_deadlock(program: Program, p2p: str = "tagged") -> list[str]:
    position, blocked_on = run_streams(program)
    stuck = [r for r, stream in enumerate(program.streams) if position[r] < len(stream)]
    if not stuck:
        return []
    lines = [f"deadlock under the {p2p} model: {len(stuck)} rank(s) cannot finish"]
    for rank in stuck:
        stage, tag, mb = blocked_on[rank]
        what = {
            "F": "the forward",
            "G": "the backward",
            "W": "the weight gradient",
            "S_F": "a SEND_F",
            "S_B": "a SEND_B",
        }
        lines.append(
            f"rank {rank} is stuck at op {position[rank]} {program.streams[rank][position[rank]]}, "
            f"waiting for {what[tag]} of stage {stage}, micro-batch {mb}"
        )
    return lines

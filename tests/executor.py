"""An independent executor for per-rank instruction streams, used only by the tests as a cross-check.

It shares nothing with pipec.verify: no dependency graph, no int keys, no precomputed waits. It plays the
runtime's rule (docs/verification.md) literally, one lockstep round after another:
- each rank holds the tensors it has: `act s m` (output of F(s, m)), `grad s m` (input gradient from B/I(s, m)),
  `wgrad-ready s m` (I(s, m) ran, so W(s, m) may run); a compute instruction runs when what it reads is held;
- a maximal run of SEND/RECV instructions is one batch: a rank reaching it posts all of its ops at once, and
  moves past it when every op of the batch has completed and it holds every tensor the batch sends (a send of a
  tensor computed later on the rank leaves the rank stuck there);
- `nccl`: per ordered pair of ranks, the k-th posted send meets the k-th posted receive; both complete when both
  are posted; if they name different messages the receive still completes (NCCL would deliver the wrong tensor)
  and the mismatch is recorded;
- `tagged`: a posted send completes at once and leaves its message in the receiver's mailbox; a receive
  completes once its message is there;
- a program without send/recv instructions reads other ranks' tensors directly (one shared store).
The run ends when a round makes no progress: it completed if every rank reached the end of its stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipec.ir import Action, Kind, Program


@dataclass
class Outcome:
    completed: bool
    positions: tuple[int, ...]  # instruction index where each rank stopped (len(stream) when it finished)
    mismatches: list[str] = field(default_factory=list)
    rounds: int = 0


def _produces(action: Action) -> list[tuple]:
    stage, kind, mb = action
    if kind is Kind.F:
        return [("act", stage, mb)]
    if kind is Kind.B:
        return [("grad", stage, mb)]
    if kind is Kind.I:
        return [("grad", stage, mb), ("wgrad-ready", stage, mb)]
    return []


def _reads(action: Action, last: int) -> list[tuple]:
    stage, kind, mb = action
    if kind is Kind.F:
        return [("act", stage - 1, mb)] if stage > 0 else []
    if kind in (Kind.B, Kind.I):
        reads = [("act", stage, mb)]
        if stage < last:
            reads.append(("grad", stage + 1, mb))
        return reads
    if kind is Kind.W:
        return [("wgrad-ready", stage, mb)]
    if kind is Kind.SEND_F:
        return [("act", stage, mb)]
    if kind is Kind.SEND_B:
        return [("grad", stage, mb)]
    return []


def _message(action: Action) -> tuple:
    """What travels: named by the sender's tensor. A receive names the tensor it expects."""
    stage, kind, mb = action
    if kind is Kind.SEND_F:
        return ("act", stage, mb)
    if kind is Kind.SEND_B:
        return ("grad", stage, mb)
    if kind is Kind.RECV_F:
        return ("act", stage - 1, mb)
    return ("grad", stage + 1, mb)  # RECV_B


def run(program: Program, model: str) -> Outcome:
    assert model in ("nccl", "tagged")
    streams = [list(s) for s in program.streams]
    ranks = len(streams)
    last = program.num_stages - 1
    place = program.stage_to_rank
    shared = not program.has_comms
    common: set[tuple] = set()
    stores: list[set[tuple]] = [common if shared else set() for _ in range(ranks)]
    pc = [0] * ranks
    posted_at = [-1] * ranks  # the batch start this rank has posted, if any
    # nccl: channel -> list of posted sends / receives, as [message, rank, done-flag holder]
    send_q: dict[tuple[int, int], list[list]] = {}
    recv_q: dict[tuple[int, int], list[list]] = {}
    mailbox: list[Counter] = [Counter() for _ in range(ranks)]
    batch_ops: list[list[list]] = [[] for _ in range(ranks)]  # the posted entries of each rank's current batch
    mismatches: list[str] = []

    def is_comm(instruction) -> bool:
        return isinstance(instruction, Action) and instruction.kind.is_comm

    def batch_end(rank: int, start: int) -> int:
        end = start
        while end < len(streams[rank]) and is_comm(streams[rank][end]):
            end += 1
        return end

    def post(rank: int, start: int, end: int) -> bool:
        ops = streams[rank][start:end]
        entries = []
        for index, op in enumerate(ops, start):
            sending = op.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = place[op.stage + 1] if op.kind in (Kind.SEND_F, Kind.RECV_B) else place[op.stage - 1]
            entry = [op, rank, index, False, sending, peer]
            entries.append(entry)
            if model == "tagged":
                if sending:
                    mailbox[peer][_message(op)] += 1
                    entry[3] = True
            else:
                channel = (rank, peer) if sending else (peer, rank)
                (send_q if sending else recv_q).setdefault(channel, []).append(entry)
        batch_ops[rank] = entries
        return True

    matched: Counter = Counter()  # per channel, how many send/receive pairs have met

    def settle_nccl() -> None:
        for channel, sends in send_q.items():
            recvs = recv_q.get(channel, [])
            while matched[channel] < min(len(sends), len(recvs)):
                send, recv = sends[matched[channel]], recvs[matched[channel]]
                matched[channel] += 1
                send[3] = recv[3] = True
                if _message(send[0]) != _message(recv[0]):
                    mismatches.append(
                        f"rank {send[1]} op {send[2]} {send[0]} met rank {recv[1]} op {recv[2]} {recv[0]}"
                    )

    def try_complete(rank: int) -> bool:
        entries = batch_ops[rank]
        if model == "tagged":
            for entry in entries:
                if not entry[3]:
                    message = _message(entry[0])
                    if mailbox[rank][message] > 0:
                        mailbox[rank][message] -= 1
                        entry[3] = True
        if not all(entry[3] for entry in entries):
            return False
        if any(r not in stores[rank] for entry in entries for r in _reads(entry[0], last)):
            return False  # it sent a tensor it never held: this rank cannot get past the batch
        for entry in entries:
            if not entry[4]:
                stores[rank].add(_message(entry[0]))
        return True

    rounds = 0
    progress = True
    while progress:
        progress = False
        rounds += 1
        for rank in range(ranks):
            stream = streams[rank]
            if pc[rank] >= len(stream):
                continue
            instruction = stream[pc[rank]]
            if is_comm(instruction):
                start = pc[rank]
                end = batch_end(rank, start)
                if posted_at[rank] != start:
                    if not post(rank, start, end):
                        continue
                    posted_at[rank] = start
                    progress = True
                if model == "nccl":
                    settle_nccl()
                if try_complete(rank):
                    pc[rank] = end
                    progress = True
                continue
            parts = instruction.parts
            if all(r in stores[rank] for action in parts for r in _reads(action, last)):
                for action in parts:
                    stores[rank].update(_produces(action))
                pc[rank] += 1
                progress = True
    positions = tuple(pc)
    completed = all(pc[r] == len(streams[r]) for r in range(ranks))
    return Outcome(completed, positions, mismatches, rounds)

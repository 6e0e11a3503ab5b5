"""What a deadlock's explanation says first when the compute orders run but the streams do not: the send or
receive placed where it holds the cycle (a hand-written stream file), or a SYNC placed before a send/recv another
member of its group needs. verify/diagnose.py decides which case it is and explains the compute orders' cycles."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.ir import BACKWARD_KINDS, Action, Instruction, Kind, Program
from pipec.verify.deadlock import Blocked, StreamRun


@dataclass(frozen=True)
class Diagnosis:
    summary: str  # what follows "N ranks cannot finish: " in the first line
    start: int  # the rank the detailed chain of waits starts at
    details: tuple[str, ...] = ()  # lines after the first one (the cycle in the compute orders, other cycles)


def stream_diagnosis(program: Program, run: StreamRun) -> Diagnosis:
    """Compute orders that run but streams that do not: a send or receive placed where it holds the cycle."""
    streams = program.streams
    blocked = run.blocked
    synced = _sync_diagnosis(program, run)
    if synced is not None:
        return synced
    queued = []  # (rank, op queued, op it is queued behind): from both sides of each "queued" wait
    for why in blocked.values():
        if why.behind >= 0 and why.state != "local":
            queued.append((why.rank, _consumed(program, run, why), why.op))
        if why.peer_state == "queued" and why.peer in blocked:
            queued.append((why.peer, why.peer_op, blocked[why.peer].op))
    if queued:
        # the known shape first: a send queued behind a receive (its peer waits for the send to send back)
        queued.sort(key=lambda q: (not _is_send(streams[q[0]][q[1]]), q[0]))
        rank, late, early = queued[0]
        why = blocked[rank]
        peer_text = ""
        if why.peer >= 0 and why.peer_state in ("posted", "queued"):
            peer, peer_op = why.peer, why.peer_op
            peer_text = f", which needs rank {peer}'s {streams[peer][peer_op]} (op {peer_op}), "
            held = blocked.get(peer)
            if held is None:
                peer_text += "which never runs"
            elif why.peer_state == "posted" and held.at < peer_op:
                cycle = held.peer == rank and held.peer_op == late
                waits = f"which waits for {streams[rank][late]}" if cycle else "which is stuck"
                peer_text += f"posted only after its {streams[peer][held.at]} (op {held.at}), {waits}"
            elif why.peer_state == "posted":
                peer_text += "not posted yet"
            else:
                peer_text += f"itself queued behind rank {peer}'s {streams[peer][held.op]} (op {held.op})"
        text = (
            f"rank {rank}'s {streams[rank][late]} (op {late}) is queued behind its {streams[rank][early]} "
            f"(op {early}) on rank {rank}'s stream{peer_text}; post {streams[rank][late]} before "
            f"{streams[rank][early]}"
        )
        return Diagnosis(text, rank)
    for why in blocked.values():
        if why.peer_state == "later":  # an op waiting for one of its own rank's later ops
            op, later = streams[why.rank][why.op], streams[why.rank][why.peer_op]
            text = (
                f"rank {why.rank}'s {op} (op {why.op}) comes before {later} (op {why.peer_op}), "
                f"{_stream_role(op, later)}; move {later} before {op}"
            )
            return Diagnosis(text, why.rank)
    for why in blocked.values():
        if why.peer_state == "none":
            op = streams[why.rank][why.op]
            text = f"rank {why.rank}'s {op} (op {why.op}) meets no counterpart on its channel: no rank posts one"
            return Diagnosis(text, why.rank)
    # a send or receive placed after a compute of its rank that waits, while another rank waits for it
    late = []
    for why in blocked.values():
        held = blocked.get(why.peer)
        if why.peer_state == "posted" and held is not None and held.at < why.peer_op:
            producer = _producer(program, why.peer, why.peer_op)
            late.append((not (producer is not None and producer < held.at), why.peer, why))
    if late:
        late.sort(key=lambda item: item[:2])
        _, rank, why = late[0]
        held = blocked[rank]
        op, stuck_at = streams[rank][why.peer_op], streams[rank][held.at]
        waits = f"rank {held.peer}'s {streams[held.peer][held.peer_op]}" if held.peer >= 0 else "what never comes"
        text = (
            f"rank {rank}'s {op} (op {why.peer_op}) comes after its {stuck_at} (op {held.at}), which waits for "
            f"{waits}, while rank {why.rank}'s {streams[why.rank][why.op]} (op {why.op}) needs {op} first; post "
            f"{op} before {stuck_at}"
        )
        return Diagnosis(text, rank)
    why = blocked[min(blocked)]  # pragma: no cover - every stuck wait above has one of those shapes
    text = f"rank {why.rank} at op {why.at} waits for rank {why.peer}'s op {why.peer_op}, which never runs"
    return Diagnosis(text, why.rank)


def _sync_diagnosis(program: Program, run: StreamRun) -> Diagnosis | None:
    """A SYNC in the cycle: placed before a send/recv that another rank needs before it can reach its own SYNC of
    the group, or waiting for a member that issues no matching SYNC. None when no stuck rank waits at a SYNC."""
    streams, blocked = program.streams, run.blocked
    at_sync = {r: why for r, why in blocked.items() if why.state == "sync"}
    if not at_sync:
        return None
    for rank, why in sorted(at_sync.items()):
        sync = streams[rank][why.at]
        # a rank that waits for an op of this one that comes after its SYNC: the host never gets there
        for other in sorted(blocked.values(), key=lambda w: w.rank):
            if other.peer == rank and other.peer_op > why.at and other.peer_state in ("posted", "queued"):
                needed = streams[rank][other.peer_op]
                text = (
                    f"rank {rank}'s {sync} (op {why.at}) comes before its {needed} (op {other.peer_op}), which "
                    f"rank {other.rank}'s {streams[other.rank][other.op]} (op {other.op}) needs, while the SYNC "
                    f"waits for every member of group {sync.mb} to reach theirs; move {sync} after {needed}"
                )
                return Diagnosis(text, rank)
    for rank, why in sorted(at_sync.items()):
        if why.peer_state == "none":
            sync = streams[rank][why.at]
            text = (
                f"rank {rank}'s {sync} (op {why.at}) waits for rank {why.peer}'s SYNC of group {sync.mb}, which rank "
                f"{why.peer} never issues: every rank holding a stage of the group must issue as many SYNCs of it"
            )
            return Diagnosis(text, rank)
    rank, why = min(at_sync.items())
    sync = streams[rank][why.at]
    text = (
        f"rank {rank}'s {sync} (op {why.at}) waits for rank {why.peer}, which never reaches its SYNC of group "
        f"{sync.mb}"
    )
    return Diagnosis(text, rank)


def _producer(program: Program, rank: int, index: int) -> int | None:
    """For a send, the position on its rank of the compute that makes what it sends (None: not there, or not a
    send): a send can move up to just after it."""
    send = program.streams[rank][index]
    if not _is_send(send):
        return None
    made = (Kind.F,) if send.kind is Kind.SEND_F else BACKWARD_KINDS
    for position, instruction in enumerate(program.streams[rank][:index]):
        if any(a.stage == send.stage and a.mb == send.mb and a.kind in made for a in instruction.parts):
            return position
    return None


def _is_send(instruction: Instruction) -> bool:
    return type(instruction) is Action and instruction.kind in (Kind.SEND_F, Kind.SEND_B)


def _consumed(program: Program, run: StreamRun, why: Blocked) -> int:
    """The op of the batch a stuck compute waits for that it reads (the batch's first op at the end of a step)."""
    ops = run.units.ops(why.rank, run.batch_units[why.rank][why.batch])
    stream = program.streams[why.rank]
    if why.state == "compute":
        wanted = {
            (a.stage, Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.mb) for a in stream[why.at].parts
        }
        for index in ops:
            action = stream[index]
            if type(action) is Action and (action.stage, action.kind, action.mb) in wanted:
                return index
    return ops[0]


def _stream_role(op: Instruction, later: Instruction) -> str:
    if type(op) is Action and op.kind in (Kind.SEND_F, Kind.SEND_B):
        return "whose output it sends"
    if type(later) is Action and later.kind.is_recv:
        return "which receives its input" if later.kind is Kind.RECV_F else "which receives its gradient"
    return "which it needs"

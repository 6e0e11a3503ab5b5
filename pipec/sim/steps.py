"""The steps of the p2p rule that the host loop (sim/hosts.py) calls, as closures bound to a run's arrays: start a
batch and match its ops (``nccl``/``torch``: in issue order per pair of ranks; ``tagged``: by message), complete a
message, run a rank's posted batches in order, and run an overlapped pair.

The steps are closures over the run's arrays, not methods of Run: a method would load each array as an attribute on
every call. The host loop is a plain function, so that the arrays it reads for every instruction are fast locals
there; it posts batches and runs single compute ops itself (a call per batch measured 4-5% of the run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pipec.errors import ScheduleError
from pipec.ir import Action, Kind, Overlap
from pipec.p2p_rule import pair_duration
from pipec.sim.refusals import early, mismatch, misplaced, no_receive
from pipec.sim.result import Message
from pipec.sim.state import Run


class BatchSteps(NamedTuple):
    """The batch steps the host loop calls (see batch_steps)."""

    start_tagged: Callable[[int, float], None]
    start_in_order: Callable[[int, float], None]
    advance_stream: Callable[[int], None]


def batch_steps(run: Run, record: bool) -> BatchSteps:
    """The batch steps of the rule bound to ``run``'s arrays: start a batch, complete its messages, advance a rank's
    NCCL stream. ``record`` keeps every matched message."""
    program, streams = run.program, run.streams
    tagged, message_time = run.tagged, run.message_time
    b_rank, b_post, b_start, b_done, b_missing, b_ops = (
        run.b_rank, run.b_post, run.b_start, run.b_done, run.b_missing, run.b_ops
    )
    batches, head, stream_free = run.batches, run.head, run.stream_free
    sends, recvs, tagged_sends, tagged_recvs = run.sends, run.recvs, run.tagged_sends, run.tagged_recvs
    messages, ready = run.messages, run.ready

    def complete(send_entry: tuple, recv_entry: tuple) -> None:
        """Both ends of one message are running (nccl) or posted (tagged): fix its times and tell both batches
        (rule 3); a batch with nothing left to match wakes its rank."""
        if send_entry[1] != recv_entry[1]:
            raise ScheduleError(mismatch(program, send_entry, recv_entry))
        start = send_entry[0] if send_entry[0] > recv_entry[0] else recv_entry[0]
        end = start + message_time
        # tagged: the send was buffered and completed when posted (its batch was told then)
        for entry in (recv_entry,) if tagged else (send_entry, recv_entry):
            b = entry[4]
            if b_done[b] < end:
                b_done[b] = end
            b_missing[b] -= 1
            if b_missing[b] == 0:
                ready.append(b_rank[b])
        if record:
            s_rank, r_rank = send_entry[2], recv_entry[2]
            send, recv = streams[s_rank][send_entry[3]], streams[r_rank][recv_entry[3]]
            messages.append(Message(send, recv, s_rank, r_rank, start, end))

    def start_tagged(b: int, start: float) -> None:
        """Batch ``b`` starts running at ``start`` under ``tagged``: a send is buffered (complete at once) and meets
        the receive of its message if posted; a receive meets the send of its message if posted, else waits."""
        b_start[b] = start
        b_done[b] = start
        rank = b_rank[b]
        for is_send, _, message, pos in b_ops[b]:
            entry = (start, message, rank, pos, b)
            if is_send:
                if message in tagged_sends:
                    raise ScheduleError(f"rank {rank}: op {pos} {streams[rank][pos]} sends a message a second time")
                tagged_sends[message] = entry
                b_missing[b] -= 1  # buffered: complete when posted
                waiting = tagged_recvs.pop(message, None)
                if waiting is not None:
                    complete(entry, waiting)
            elif message in tagged_sends:
                complete(tagged_sends[message], entry)
            else:
                tagged_recvs[message] = entry

    def start_in_order(b: int, start: float) -> None:
        """Batch ``b`` starts running at ``start`` under ``nccl`` or ``torch``: each of its ops meets the k-th op
        of the other side on its pair of ranks (rule 3) if that one already runs, else waits in the pair's list."""
        b_start[b] = start
        b_done[b] = start
        rank = b_rank[b]
        for is_send, pair, message, pos in b_ops[b]:
            entry = (start, message, rank, pos, b)
            if is_send:
                mine, theirs = sends[pair], recvs[pair]
            else:
                mine, theirs = recvs[pair], sends[pair]
            k = len(mine)
            mine.append(entry)
            if k < len(theirs):
                other = theirs[k]
                if record or other[1] != message:
                    complete(entry, other) if is_send else complete(other, entry)
                    continue
                # complete(), inlined: the hot path of the nccl model
                end = (start if start > other[0] else other[0]) + message_time
                if b_done[b] < end:
                    b_done[b] = end
                b_missing[b] -= 1
                if b_missing[b] == 0:
                    ready.append(rank)
                peer = other[4]
                if b_done[peer] < end:
                    b_done[peer] = end
                b_missing[peer] -= 1
                if b_missing[peer] == 0:
                    ready.append(other[2])

    start_batch = start_tagged if tagged else start_in_order

    def advance_stream(rank: int) -> None:
        """Run the rank's posted batches in order (rule 4, one NCCL stream; tagged: each at once) as far as
        completions allow: a batch starts at max(posted, previous completed)."""
        mine = batches[rank]
        h = head[rank]
        while h < len(mine):
            b = mine[h]
            if b_start[b] < 0:
                free = stream_free[rank]
                start_batch(b, b_post[b] if b_post[b] > free else free)
            if b_missing[b]:
                break
            stream_free[rank] = b_done[b]
            h += 1
        head[rank] = h

    return BatchSteps(start_tagged, start_in_order, advance_stream)


def sync_runner(run: Run) -> Callable[[int, int, Action, float], float]:
    """The step running a SYNC, bound to ``run``'s arrays (a collective: see pipec.sim.costs, ``sync``)."""
    tagged, batches, head, stream_free, ready = run.tagged, run.batches, run.head, run.stream_free, run.ready
    members, passed, arrived_at, ends, d_sync = (
        run.sync_members, run.sync_passed, run.sync_arrived, run.sync_end, run.d_sync
    )

    def run_sync(rank: int, pos: int, instruction: Action, t: float) -> float:
        """When the rank's SYNC at ``pos`` ends, or -1.0 while it waits: in order, for the rank's earlier batches
        (woken when one completes); then for the other members (woken by the last to come)."""
        stage, _, group = instruction
        if not 0 <= group < len(members) or rank not in members[group]:
            raise ScheduleError(f"rank {rank}: op {pos} {instruction} is a SYNC of no sync group this rank is in")
        if tagged:
            ready_at = t
        elif head[rank] != len(batches[rank]):
            return -1.0
        else:
            ready_at = t if t > stream_free[rank] else stream_free[rank]
        key = (group, passed[rank].get(group, 0))
        there = arrived_at.setdefault(key, {})
        there.setdefault(rank, (ready_at, stage))
        end = ends.get(key)
        if end is None:
            if len(there) < len(members[group]):
                return -1.0
            end = ends[key] = max(at for at, _ in there.values()) + max(d_sync[s] for _, s in there.values())
            ready.extend(q for q in there if q != rank)
        passed[rank][group] = key[1] + 1
        run.sync_ops += 1
        return end

    return run_sync


def pair_runner(run: Run) -> Callable[[int, int, Overlap, float], tuple[float, float]]:
    """The step running an overlapped pair, bound to ``run``'s arrays."""
    program, where, n_mb = run.program, run.where, run.n_mb
    has_next, has_previous = run.has_next, run.has_previous  # where each copy's chain ends (pipec.ir.chain_links)
    d_f, d_b, d_i, d_w, d_fb, durations = run.d_f, run.d_b, run.d_i, run.d_w, run.d_fb, run.durations
    forward_done, grad_done, input_done, recv_batch = run.forward_done, run.grad_done, run.input_done, run.recv_batch
    b_rank, b_start, b_done, b_missing = run.b_rank, run.b_start, run.b_done, run.b_missing
    # Enum members hash through Python code, so the hot paths compare kinds by identity only.
    k_f, k_i, k_w = Kind.F, Kind.I, Kind.W
    comm_kinds = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)  # `in` compares by identity first

    def run_pair(rank: int, pos: int, instruction: Overlap, t: float) -> tuple[float, float]:
        """An overlapped pair (the general case of run_hosts' inlined single op): it waits for the batches of
        both halves' receives (rule 2) and takes pipec.p2p_rule.pair_duration (the sum of its halves' durations
        unless the costs give FB). Returns its start and end, or -1.0
        twice when a batch it waits for has not completed."""
        parts = instruction.parts
        for stage, kind, mb in parts:
            if kind in comm_kinds:
                raise ScheduleError(f"rank {rank}: op {pos} {instruction} pairs a send/recv with compute")
            if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                misplaced(program, rank, pos, instruction, Action(stage, kind, mb))
        start = t
        for stage, kind, mb in parts:  # the message feeding each half (pipec.p2p_rule's id, inlined), if remote
            if kind is k_f:
                message = ((stage - 1) * n_mb + mb) * 2 if has_previous[stage] and where[stage - 1] != rank else -1
            elif kind is k_w:
                message = -1
            else:
                message = ((stage + 1) * n_mb + mb) * 2 + 1 if has_next[stage] and where[stage + 1] != rank else -1
            if message >= 0:
                b = recv_batch[message]
                if b < 0 or b_rank[b] != rank:
                    no_receive(Action(stage, kind, mb), rank, pos)
                if b_start[b] < 0 or b_missing[b]:
                    return -1.0, -1.0
                if b_done[b] > start:
                    start = b_done[b]
        end_time = start
        for stage, kind, mb in parts:
            index = stage * n_mb + mb
            if kind is k_f:
                if has_previous[stage] and not 0 <= forward_done[index - n_mb] <= start:
                    early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                end_time += d_f[stage]
            elif kind is k_w:
                if not 0 <= input_done[index] <= start:
                    early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                end_time += d_w[stage]
            else:
                if not 0 <= forward_done[index] <= start:
                    early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                if has_next[stage] and not 0 <= grad_done[index + n_mb] <= start:
                    early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                end_time += d_i[stage] if kind is k_i else d_b[stage]
        if d_fb is not None:
            end_time = start + pair_duration(parts, end_time - start, durations, d_fb)
        for stage, kind, mb in parts:
            index = stage * n_mb + mb
            if kind is k_f:
                forward_done[index] = end_time
            elif kind is k_w:
                input_done[index] = -2.0
            else:
                grad_done[index] = end_time
                if kind is k_i:
                    input_done[index] = end_time
        run.pair_parts += len(parts) - 1
        # the shape the structure pass accepts today (one forward, one backward, two micro-batches): any other
        # leaves the verdict to it
        first_part, second = parts
        if (first_part.kind is k_f) == (second.kind is k_f) or first_part.mb == second.mb:
            run.odd_pairs = True
        return start, end_time

    return run_pair

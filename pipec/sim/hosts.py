"""The host loop of the simulator (``run_hosts``): the worklist over ranks that runs each rank's stream in order,
posting its batches and running its compute, under the p2p rule the module docstring of sim/simulate.py states.

A measured hot loop: it keeps every array it reads per instruction in a local, posts batches and runs single
compute ops inline (a call per batch measured 4-5% of the run), and computes the message ids of
pipec.p2p_rule.message_id inline. Its benchmark is bench/simulate.py (the nccl column).
"""

from __future__ import annotations

from pipec.errors import ScheduleError
from pipec.ir import Action, Kind
from pipec.sim.refusals import early, misplaced, no_receive
from pipec.sim.result import TimedOp
from pipec.sim.state import Run
from pipec.sim.steps import batch_steps, pair_runner, sync_runner


def run_hosts(run: Run, record: bool) -> None:
    """The worklist over ranks. The host of a rank runs its stream in order from where it stopped: it posts each
    batch (below: without waiting, rule 1) and runs compute (below: single ops; run_pair: overlapped pairs) until
    a compute needs a batch that has not completed (rule 2) or a batch cannot be posted; at the end of its stream
    it waits for its outstanding batches (the step's end). A batch completion puts its rank back on the worklist."""
    start_tagged, start_in_order, advance_stream = batch_steps(run, record)
    run_pair = pair_runner(run)
    run_sync = sync_runner(run)
    program, streams, where, n_mb = run.program, run.streams, run.where, run.n_mb
    has_next, has_previous = run.has_next, run.has_previous  # where each copy's chain ends (pipec.ir.chain_links)
    tagged, joined, post_cost = run.tagged, run.joined, run.post_cost
    d_f, d_b, d_i, d_w = run.d_f, run.d_b, run.d_i, run.d_w
    forward_done, grad_done, input_done, recv_batch = run.forward_done, run.grad_done, run.input_done, run.recv_batch
    b_rank, b_lo, b_hi, b_post = run.b_rank, run.b_lo, run.b_hi, run.b_post
    b_start, b_done, b_missing, b_ops = run.b_start, run.b_done, run.b_missing, run.b_ops
    batches, head, stream_free, fwd_pair, bwd_pair = run.batches, run.head, run.stream_free, run.fwd_pair, run.bwd_pair
    time, position, busy, waited, finish = run.time, run.position, run.busy, run.waited, run.finish
    done, first, premature, timeline, ready = run.done, run.first, run.premature, run.timeline, run.ready
    # Enum members hash through Python code, so the hot loop compares kinds by identity only.
    k_f, k_i, k_w, k_sync = Kind.F, Kind.I, Kind.W, Kind.SYNC
    k_sf, k_rf, k_sb, k_rb = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    comm_kinds = (k_sf, k_rf, k_sb, k_rb)  # `in` on a tuple compares by identity first: no Enum hashing
    while ready:
        rank = ready.popleft()
        if done[rank]:
            continue
        advance_stream(rank)
        stream = streams[rank]
        n = len(stream)
        pos = position[rank]
        t = time[rank]
        line = timeline[rank]
        work = 0.0  # compute time in this run of the rank, added to busy[rank] when it stops
        # the rank's waiting time and first start, in locals while it runs (the same additions in the same order)
        wait, first_start = waited[rank], first[rank]
        while pos < n:
            instruction = stream[pos]
            if type(instruction) is not Action:
                start, end_time = run_pair(rank, pos, instruction, t)
                if start < 0:
                    break  # blocked: woken when the batch completes
            else:
                stage, kind, mb = instruction
                if kind in comm_kinds:
                    # post a batch: the maximal run of send/recv from here (or this one alone when not joined),
                    # without waiting (rule 1); overlap=0 charges the host message_time per send
                    end = pos
                    sent = 0
                    unsent = -1  # the position of a send whose value this rank has not computed yet
                    ops = []
                    last_op = n if joined else pos + 1
                    while end < last_op:
                        action = stream[end]
                        if type(action) is not Action:
                            break
                        stage, kind, mb = action
                        # pair tables: the number of the ordered pair of ranks per stage, -1 where none exists
                        if kind is k_rf:
                            is_send, pair, message = False, fwd_pair[stage - 1], ((stage - 1) * n_mb + mb) * 2
                        elif kind is k_rb:
                            is_send, pair, message = False, bwd_pair[stage + 1], ((stage + 1) * n_mb + mb) * 2 + 1
                        elif kind is k_sf:
                            is_send, pair, message = True, fwd_pair[stage], (stage * n_mb + mb) * 2
                        elif kind is k_sb:
                            is_send, pair, message = True, bwd_pair[stage], (stage * n_mb + mb) * 2 + 1
                        else:
                            break
                        # a negative stage would index the tables from their end
                        if pair < 0 or stage < 0 or where[stage] != rank or mb < 0 or mb >= n_mb:
                            raise ScheduleError(
                                f"rank {rank}: op {end} {action} names a stage or micro-batch out of range, "
                                "or a stage this rank does not hold"
                            )
                        if is_send:
                            # the runtime posts a send with the tensor its rank has computed: a send ahead of its
                            # producer leaves the rank stuck here for good (its stream runs in order), as in the
                            # verifier
                            if (forward_done if kind is k_sf else grad_done)[stage * n_mb + mb] < 0:
                                unsent = end
                                break
                            sent += 1
                        else:
                            recv_batch[message] = len(b_rank)
                        ops.append((is_send, pair, message, end))
                        end += 1
                    if unsent >= 0:  # not posted: forget the receives noted above, the rank is stuck here for good
                        for is_send, _, message, _ in ops:
                            if not is_send:
                                recv_batch[message] = -1
                        premature[rank] = unsent
                        break
                    b = len(b_rank)
                    b_rank.append(rank)
                    b_ops.append(ops)
                    b_lo.append(pos)
                    b_hi.append(end)
                    b_post.append(t)
                    b_start.append(-1.0)
                    b_done.append(-1.0)
                    b_missing.append(end - pos)
                    batches[rank].append(b)
                    if tagged:  # no FIFO: every batch runs once posted
                        start_tagged(b, t)
                    # at the head of the rank's NCCL stream (its predecessors completed), it starts now:
                    # advance_stream for this one batch, inlined; else it starts when its predecessor completes
                    if head[rank] == len(batches[rank]) - 1:
                        if not tagged:
                            free = stream_free[rank]
                            start_in_order(b, t if t > free else free)
                        if not b_missing[b]:
                            stream_free[rank] = b_done[b]
                            head[rank] += 1
                    t += sent * post_cost
                    pos = end
                    continue
                if kind is k_sync:  # a collective: its time counts as waiting, not compute
                    end_time = run_sync(rank, pos, instruction, t)
                    if end_time < 0:
                        break  # woken when its batches complete or the last member comes
                    if record:
                        line.append(TimedOp(rank, t, end_time, (instruction,)))
                    wait += end_time - t
                    t = end_time
                    pos += 1
                    continue
                # compute: wait for the batch holding the receive it consumes (rule 2), then run
                if mb < 0 or mb >= n_mb or stage < 0 or where[stage] != rank:
                    misplaced(program, rank, pos, instruction, instruction)
                start = t
                index = stage * n_mb + mb
                if kind is k_f:
                    message = ((stage - 1) * n_mb + mb) * 2 if has_previous[stage] and where[stage - 1] != rank else -1
                elif kind is k_w:
                    message = -1
                else:
                    message = ((stage + 1) * n_mb + mb) * 2 + 1 if has_next[stage] and where[stage + 1] != rank else -1
                if message >= 0:
                    b = recv_batch[message]
                    if b < 0 or b_rank[b] != rank:
                        no_receive(instruction, rank, pos)
                    if b_start[b] < 0 or b_missing[b]:
                        break  # blocked: woken when the batch completes
                    if b_done[b] > start:
                        start = b_done[b]
                if kind is k_f:
                    if has_previous[stage] and not 0 <= forward_done[index - n_mb] <= start:
                        early(instruction, rank, pos, f"the forward of stage {stage - 1}")
                    end_time = start + d_f[stage]
                    forward_done[index] = end_time
                elif kind is k_w:
                    if not 0 <= input_done[index] <= start:  # after a B, or a second W: the structure pass says more
                        early(instruction, rank, pos, f"the input-gradient backward (I) of stage {stage}")
                    end_time = start + d_w[stage]
                    input_done[index] = -2.0  # consumed
                else:
                    if not 0 <= forward_done[index] <= start:
                        early(instruction, rank, pos, f"its forward {Action(stage, Kind.F, mb)}")
                    if has_next[stage] and not 0 <= grad_done[index + n_mb] <= start:
                        early(instruction, rank, pos, f"the backward of stage {stage + 1}")
                    if kind is k_i:
                        end_time = input_done[index] = start + d_i[stage]
                    else:
                        end_time = start + d_b[stage]
                    grad_done[index] = end_time
            if first_start < 0:
                first_start = first[rank] = start
            if record:
                line.append(TimedOp(rank, start, end_time, instruction))
            wait += start - t
            work += end_time - start
            t = end_time
            pos += 1
        position[rank] = pos
        time[rank] = t
        busy[rank] += work
        if pos == n and head[rank] == len(batches[rank]):  # end of step: every batch has completed
            done[rank] = True
            end_time = stream_free[rank] if stream_free[rank] > t else t
            wait += end_time - t
            finish[rank] = end_time
        waited[rank] = wait


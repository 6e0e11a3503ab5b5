"""An independent executor for per-rank instruction streams, used only by the tests as a cross-check.

It shares nothing with pipec.verify: no dependency graph, no int keys, no precomputed waits. It plays version 2
of the point-to-point rule (docs/verification.md) literally, one lockstep round after another:
- each rank holds the tensors it has: `act s m` (output of F(s, m)), `grad s m` (input gradient from B/I(s, m)),
  `wgrad-ready s m` (I(s, m) ran, so W(s, m) may run); a compute instruction runs when what it reads is held,
  and a received tensor is held only once the batch that received it has completed;
- a maximal run of SEND/RECV instructions is one batch: a rank reaching it posts all of its ops at once and moves
  on without waiting (it cannot post a send of a tensor it does not hold: it stays there);
- `nccl`: a rank's posted batches run one at a time in posting order (a batch starts once the one before it
  completed); per ordered pair of ranks, the k-th posted send meets the k-th posted receive; an op completes
  once its counterpart's batch is running too; a batch completes when all of its ops have. If the pair names
  different messages the receive still completes (NCCL would deliver the wrong tensor) and the mismatch is
  recorded;
- `tagged`: a posted send completes at once and leaves its message in the receiver's mailbox; a receive
  completes once its message is there; batches complete in any order;
- `torch` (torch's `_PipelineScheduleRuntime`, docs/torch.md): as `nccl`, except that every SEND/RECV instruction
  is posted as a batch of its own, never together with its neighbours;
- a SYNC (a collective of its sync group) is reached by a rank once its host stands at it and, under `nccl` and
  `torch`, every batch it posted has completed (the collective queues on the rank's one stream); the rank passes it
  once every member rank of the group (the ranks holding the group's stages, when more than one) has reached its
  SYNC of the same count: the k-th SYNC of a group on one member meets the k-th on the others;
- a rank is finished when it reached the end of its stream and every batch it posted completed;
- a program without send/recv instructions reads other ranks' tensors directly (one shared store).
The run ends when a round makes no progress: it completed if every rank finished.
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


def _reads(action: Action, length: int) -> list[tuple]:
    """What the op needs; ``length``: the stages of one copy of the model, whose chain ends at its first stage
    (where the input enters) and its last (where the loss is)."""
    stage, kind, mb = action
    if kind is Kind.F:
        return [("act", stage - 1, mb)] if stage % length else []
    if kind in (Kind.B, Kind.I):
        reads = [("act", stage, mb)]
        if (stage + 1) % length:
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


def _new_pairs(send_q: dict, recv_q: dict, matched: Counter) -> list[tuple]:
    """Per ordered pair of ranks, the k-th posted send meets the k-th posted receive: the pairs not made yet
    (`matched` counts those made, per channel)."""
    made = []
    for channel, sends in send_q.items():
        recvs = recv_q.get(channel, [])
        while matched[channel] < min(len(sends), len(recvs)):
            made.append((sends[matched[channel]], recvs[matched[channel]]))
            matched[channel] += 1
    return made


class Batch:
    """A posted batch: its ops as [action, rank, op index, completed, is a send, peer], running and completed."""

    def __init__(self, entries: list[list]) -> None:
        self.entries = entries
        self.running = False
        self.completed = False


def run(program: Program, model: str) -> Outcome:
    assert model in ("nccl", "tagged", "torch")
    in_order = model != "tagged"  # nccl and torch: one stream of batches per rank, channels matched in order
    streams = [list(s) for s in program.streams]
    ranks = len(streams)
    length = program.num_stages // program.pipelines  # one copy's stages
    place = program.stage_to_rank
    shared = not program.has_comms
    common: set[tuple] = set()
    stores: list[set[tuple]] = [common if shared else set() for _ in range(ranks)]
    pc = [0] * ranks
    batches: list[list[Batch]] = [[] for _ in range(ranks)]  # every batch each rank posted, in order
    first_open = [0] * ranks  # the first batch of each rank not known to be complete (a shortcut, no semantics)
    # nccl: channel -> posted sends / receives in posting order, each (entry, its batch)
    send_q: dict[tuple[int, int], list[tuple[list, Batch]]] = {}
    recv_q: dict[tuple[int, int], list[tuple[list, Batch]]] = {}
    mailbox: list[Counter] = [Counter() for _ in range(ranks)]
    mismatches: list[str] = []
    matched: Counter = Counter()
    pairs: list[tuple[tuple[list, Batch], tuple[list, Batch]]] = []
    # sync groups: the ranks that hold each group's stages (none when one rank holds them all)
    members = []
    for stages in program.sync_groups:
        holders = {place[s] for s in stages}
        members.append(holders if len(holders) > 1 else set())
    reached: dict[tuple[int, int], set[int]] = {}  # (group, k) -> the ranks that reached their k-th SYNC of it
    passed: list[Counter] = [Counter() for _ in range(ranks)]  # per rank, group -> SYNCs passed

    def is_comm(instruction) -> bool:
        return isinstance(instruction, Action) and instruction.kind.is_p2p

    def try_sync(rank: int, group: int) -> bool:
        if in_order and not all(b.completed for b in batches[rank]):
            return False
        if group >= len(members) or rank not in members[group]:
            return False  # a SYNC of no group, or of one this rank is no member of: nobody meets it
        count = (group, passed[rank][group])
        reached.setdefault(count, set()).add(rank)
        if not members[group] <= reached[count]:
            return False
        passed[rank][group] += 1
        return True

    def post(rank: int, start: int, end: int) -> bool:
        ops = streams[rank][start:end]
        for op in ops:  # a send needs its tensor on this rank
            if op.kind in (Kind.SEND_F, Kind.SEND_B) and any(r not in stores[rank] for r in _reads(op, length)):
                return False
        entries = []
        batch = Batch(entries)
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
                (send_q if sending else recv_q).setdefault(channel, []).append((entry, batch))
        batches[rank].append(batch)
        return True

    def settle(rank: int) -> bool:
        """Move this rank's batches along; True if anything changed."""
        changed = False
        rank_batches = batches[rank]
        while first_open[rank] < len(rank_batches) and rank_batches[first_open[rank]].completed:
            first_open[rank] += 1
        for k in range(first_open[rank], len(rank_batches)):
            batch = rank_batches[k]
            if batch.completed:
                continue
            if in_order:
                if not batch.running:
                    if k == 0 or batches[rank][k - 1].completed:
                        batch.running = True
                        changed = True
                    else:
                        break
            else:
                batch.running = True
                for entry in batch.entries:
                    if not entry[3] and mailbox[rank][_message(entry[0])] > 0:
                        mailbox[rank][_message(entry[0])] -= 1
                        entry[3] = True
                        changed = True
            if all(entry[3] for entry in batch.entries):
                batch.completed = True
                for entry in batch.entries:
                    if not entry[4]:
                        stores[rank].add(_message(entry[0]))
                changed = True
            elif in_order:
                break  # the next batch cannot start before this one completes
        return changed

    def match_nccl() -> bool:
        changed = False
        for pair in _new_pairs(send_q, recv_q, matched):
            pairs.append(pair)
            (send, _), (recv, _) = pair
            if _message(send[0]) != _message(recv[0]):
                mismatches.append(f"rank {send[1]} op {send[2]} {send[0]} met rank {recv[1]} op {recv[2]} {recv[0]}")
        waiting = []
        for pair in pairs:
            (send, send_batch), (recv, recv_batch) = pair
            if send_batch.running and recv_batch.running:
                send[3] = recv[3] = True
                changed = True
            else:
                waiting.append(pair)
        pairs[:] = waiting
        return changed

    rounds = 0
    progress = True
    while progress:
        progress = False
        rounds += 1
        for rank in range(ranks):
            stream = streams[rank]
            if pc[rank] < len(stream):
                instruction = stream[pc[rank]]
                if isinstance(instruction, Action) and instruction.kind is Kind.SYNC:
                    if try_sync(rank, instruction.mb):
                        pc[rank] += 1
                        progress = True
                elif is_comm(instruction):
                    end = pc[rank] + 1  # torch posts each send/recv by itself
                    while model != "torch" and end < len(stream) and is_comm(stream[end]):
                        end += 1
                    if post(rank, pc[rank], end):
                        pc[rank] = end
                        progress = True
                else:
                    parts = instruction.parts
                    if all(r in stores[rank] for action in parts for r in _reads(action, length)):
                        for action in parts:
                            stores[rank].update(_produces(action))
                        pc[rank] += 1
                        progress = True
            if in_order and match_nccl():
                progress = True
            if settle(rank):
                progress = True
    positions = tuple(pc)
    completed = all(pc[r] == len(streams[r]) and all(b.completed for b in batches[r]) for r in range(ranks))
    return Outcome(completed, positions, mismatches, rounds)


@dataclass
class PlanOutcome:
    completed: bool
    positions: tuple[int, ...]  # plan entry where each rank stopped (len(plan) when it reached the end)
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # a compute that ran without its input: a plan bug


def run_plans(program: Program, plans: list[list]) -> PlanOutcome:
    """The interpreter's plan entries (`pipec.runtime.interpreter.plan`, one list per rank) on gloo, literally:
    - a rank walks its entries in order; a p2p entry posts all of its ops and moves on (a send needs its tensor
      held, or the rank stays there);
    - gloo has no order between a rank's posted ops: per ordered pair of ranks the k-th posted send meets the
      k-th posted receive, and both complete once both are posted (a rendezvous; what travels is the send's);
    - a compute entry first waits for every entry in its `waits` to complete (all of its ops), which delivers
      those entries' receives; then it runs, reading only what its rank holds (anything missing is a plan
      error); a rank's receives are held only once delivered so;
    - at the end of its plan a rank waits for every entry still outstanding.
    The run ends when a round makes no progress: it completed if every rank reached its end with nothing
    outstanding."""
    ranks = len(plans)
    length = program.num_stages // program.pipelines  # one copy's stages
    place = program.stage_to_rank
    stores: list[set[tuple]] = [set() for _ in range(ranks)]
    pc = [0] * ranks
    posted: list[dict[int, list]] = [{} for _ in range(ranks)]  # entry index -> [action, done, is a send] per op
    send_q: dict[tuple[int, int], list[list]] = {}
    recv_q: dict[tuple[int, int], list[list]] = {}
    matched: Counter = Counter()
    out = PlanOutcome(False, ())

    def post(rank: int, index: int, actions: tuple) -> bool:
        sends = [a for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_B)]
        if any(r not in stores[rank] for a in sends for r in _reads(a, length)):
            return False
        records = []
        for action in actions:
            sending = action.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = place[action.stage + 1] if action.kind in (Kind.SEND_F, Kind.RECV_B) else place[action.stage - 1]
            record = [action, False, sending]
            records.append(record)
            (send_q if sending else recv_q).setdefault((rank, peer) if sending else (peer, rank), []).append(record)
        posted[rank][index] = records
        return True

    def match() -> bool:
        made = _new_pairs(send_q, recv_q, matched)
        for send, recv in made:
            if _message(send[0]) != _message(recv[0]):
                out.mismatches.append(f"{send[0]} met {recv[0]}")
            send[1] = recv[1] = True
        return bool(made)

    def deliver(rank: int, index: int) -> bool:
        """Whether entry `index` of `rank` has completed (its receives then held); delivered entries are gone."""
        records = posted[rank].get(index)
        if records is None:
            return True
        if not all(record[1] for record in records):
            return False
        stores[rank].update(_message(record[0]) for record in records if not record[2])
        del posted[rank][index]
        return True

    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            plan = plans[rank]
            if pc[rank] < len(plan):
                entry = plan[pc[rank]]
                if entry.run.__name__ == "communicate":
                    if post(rank, pc[rank], entry.actions):
                        pc[rank] += 1
                        progress = True
                elif all([deliver(rank, k) for k in entry.waits]):
                    for action in entry.actions:
                        missing = [r for r in _reads(action, length) if r not in stores[rank]]
                        if missing:
                            out.errors.append(f"rank {rank}: {action} ran without {missing}")
                        stores[rank].update(_produces(action))
                    pc[rank] += 1
                    progress = True
            else:
                for index in list(posted[rank]):
                    if deliver(rank, index):
                        progress = True
        if match():
            progress = True
    out.positions = tuple(pc)
    out.completed = all(pc[r] == len(plans[r]) and not posted[r] for r in range(ranks))
    return out

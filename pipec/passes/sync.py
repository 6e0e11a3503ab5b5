"""insert_syncs: place the gradient-sync collectives (SYNC) of a program's sync groups.

Contract (Program with send/recv in -> the same with SYNCs and ``sync_groups``):
- a sync group is a tuple of stages whose copies of one shared parameter set are summed before the optimizer step:
  tied embeddings (stage 0 and S-1), the copies of a replicated stage. A rank holding several stages of a group
  holds one parameter object, so it issues ONE SYNC for the group, named by its lowest stage of the group; a group
  whose stages are all on one rank needs none.
- where: on each member rank, after the instruction holding the rank's last backward-for-weights of the group's
  stages (a stage's last W, or its last B when it has no W), then past the sends that follow that instruction, so
  that the SYNC never waits on a peer that waits on this rank's message; and never before the rank's last
  send/recv (see _after_last_weight_gradient): then no SYNC can wait on a p2p that waits on it, and a program that
  runs without its SYNCs runs with them under every p2p model.
- groups keep group order on every rank (a later group's SYNC is never placed before an earlier one's), so the
  collectives cannot wait on each other in a cycle.
- the program's existing SYNCs are dropped first, so the pass is idempotent.
- a forward-only program has no gradients: it gets the groups but no SYNC.
SYNC changes no live activations (pipec/verify/memory.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipec.errors import PipecInputError
from pipec.ir import Action, Instruction, Kind, Program

SyncGroups = tuple[tuple[int, ...], ...]


def insert_syncs(program: Program, groups: Sequence[Sequence[int]]) -> Program:
    """The program with one SYNC per member rank of each group in ``groups`` (see the module's contract)."""
    checked = check_groups(groups, program.num_stages)
    if program.ranks > 1 and not program.has_comms:
        raise PipecInputError("insert_syncs runs after insert_p2p_ops: the program has no send/recv instructions")
    base = tuple(tuple(i for i in stream if not _is_sync(i)) for stream in program.streams)
    if program.forward_only:
        return _with_syncs(program, base, checked)
    # per rank: (insert after this index, group) pairs
    points: list[list[tuple[int, int]]] = [[] for _ in range(program.ranks)]
    for group, stages in enumerate(checked):
        for rank in member_ranks(stages, program.stage_to_rank):
            mine = {s for s in stages if program.stage_to_rank[s] == rank}
            after = _after_last_weight_gradient(base[rank], mine)
            if points[rank]:  # one order of groups on every rank: a group's SYNC never precedes an earlier group's
                after = max(after, points[rank][-1][0])
            points[rank].append((after, group))
    streams = []
    for rank, stream in enumerate(base):
        placed: list[Instruction] = []
        pending = sorted(points[rank])
        head = 0
        # from index -1: an empty stream (a copy no micro-batch is routed through) syncs at its start
        for index in range(-1, len(stream)):
            if index >= 0:
                placed.append(stream[index])
            while head < len(pending) and pending[head][0] == index:
                group = pending[head][1]
                placed.append(Action(sync_stage(checked[group], rank, program.stage_to_rank), Kind.SYNC, group))
                head += 1
        streams.append(tuple(placed))
    return _with_syncs(program, tuple(streams), checked)


def program_groups(num_stages: int, pipelines: int, ties: Sequence[Sequence[int]] = ()) -> SyncGroups:
    """The sync groups of a program of ``pipelines`` copies (docs/design/replicated.md section 3), one per shared
    parameter set: **a group is the set of stages that hold one parameter**, so that the groups partition the
    parameters and none is summed twice. ``ties``: groups of one copy's stages (0..L-1, L = num_stages //
    pipelines) sharing a parameter (tied embeddings: (0, L-1)); each is lifted to every copy (stage s of copy c is
    c*L + s). Each logical stage l then gets the group of its copies, (l, L+l, ..., (C-1)L+l), for its parameters
    that no tie shares. With one copy: the ties themselves. Sorted, so that every caller numbers them alike."""
    length = num_stages // pipelines
    lifted = [tuple(sorted(c * length + s for c in range(pipelines) for s in tie)) for tie in ties]
    copies = [tuple(c * length + s for c in range(pipelines)) for s in range(length)] if pipelines > 1 else []
    return tuple(sorted(set(lifted) | set(copies)))


def unsynced_copies(program: Program) -> tuple[tuple[int, ...], ...]:
    """The copies' groups (program_groups without ties: each logical stage's copies) that the program does not
    declare: a stage whose copies no group sums would train drifting copies. None for one pipeline, and none for
    a forward-only program (no gradients to sum)."""
    if program.pipelines == 1 or program.forward_only:
        return ()
    declared = set(program.sync_groups)
    return tuple(g for g in program_groups(program.num_stages, program.pipelines) if g not in declared)


def with_copy_syncs(program: Program) -> Program:
    """A program of C > 1 pipelines (copies of the model), its send/recv placed, with the SYNCs that sum each
    stage's gradients over its copies before the step (program_groups), unless it declares sync groups of its
    own; any other program as it is. The compile driver and the verifier's own lowering apply it alike."""
    if program.pipelines == 1 or program.sync_groups:
        return program
    return insert_syncs(program, program_groups(program.num_stages, program.pipelines))


def copy_orders(program: Program) -> Program:
    """The compute orders of a placed program (send/recv and SYNCs taken out) to change and place again: a program
    of several copies whose sync groups are with_copy_syncs' loses them too, so that placing the changed order
    (with_copy_syncs) puts its SYNCs where they now belong; kept, they would say the SYNCs are the program's own
    and none would be placed. Groups of its own stay."""
    orders = program.with_streams(program.compute_streams(), has_comms=False)
    if program.pipelines > 1 and program.sync_groups == program_groups(program.num_stages, program.pipelines):
        orders = replace(orders, sync_groups=())
    return orders


def check_groups(groups: Sequence[Sequence[int]], stages: int) -> SyncGroups:
    """The groups as tuples, or PipecInputError naming what is wrong with one."""
    out = []
    for g, group in enumerate(groups):
        members = tuple(group)
        if len(members) < 2:
            raise PipecInputError(f"sync group {g} {members} needs at least two stages")
        if len(set(members)) != len(members):
            raise PipecInputError(f"sync group {g} {members} names a stage twice")
        for stage in members:
            if type(stage) is not int or not 0 <= stage < stages:
                raise PipecInputError(f"sync group {g} {members}: {stage!r} is not a stage of 0..{stages - 1}")
        out.append(members)
    return tuple(out)


def member_ranks(stages: Sequence[int], stage_to_rank: Sequence[int]) -> tuple[int, ...]:
    """The ranks that issue a SYNC for a group: none when all its stages are on one rank."""
    ranks = sorted({stage_to_rank[s] for s in stages})
    return tuple(ranks) if len(ranks) > 1 else ()


def sync_stage(stages: Sequence[int], rank: int, stage_to_rank: Sequence[int]) -> int:
    """The stage a rank's SYNC of a group names: its lowest stage of the group."""
    return min(s for s in stages if stage_to_rank[s] == rank)


def _after_last_weight_gradient(stream: Sequence[Instruction], stages: set[int]) -> int:
    """The index after which the rank's SYNC of a group with these (local) stages goes."""
    last_w: dict[int, int] = {}
    last_b: dict[int, int] = {}
    for index, instruction in enumerate(stream):
        for stage, kind, _ in instruction.parts:
            if stage in stages:
                if kind is Kind.W:
                    last_w[stage] = index
                elif kind is Kind.B:
                    last_b[stage] = index
    ends = [last_w.get(s, last_b.get(s, -1)) for s in stages]
    index = max(ends)
    if index < 0:
        index = len(stream) - 1  # no backward of these stages at all: the step's end
    while index + 1 < len(stream) and _is_send(stream[index + 1]):
        index += 1
    # A SYNC blocks its rank until every member reaches it (and, on one NCCL stream, until the rank's earlier
    # batches complete). A send or receive after it could be one that another member needs before it can reach
    # its own SYNC: a cycle (interleaved 1F1B's last rank finishes stage S-1 before its stage P-1 backwards, which
    # wait on rank 0, which syncs only after its stage 0). After the rank's last send/recv nothing that follows
    # is waited on by another rank, so every member gets there as the program without SYNCs does.
    last_p2p = max((i for i, x in enumerate(stream) if type(x) is Action and x.kind.is_p2p), default=-1)
    return max(index, last_p2p)


def _is_sync(instruction: Instruction) -> bool:
    return type(instruction) is Action and instruction.kind is Kind.SYNC


def _is_send(instruction: Instruction) -> bool:
    return type(instruction) is Action and (instruction.kind is Kind.SEND_F or instruction.kind is Kind.SEND_B)


def _with_syncs(program: Program, streams: tuple[tuple[Instruction, ...], ...], groups: SyncGroups) -> Program:
    return replace(program, streams=streams, sync_groups=groups)

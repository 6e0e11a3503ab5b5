"""check_structure: every (stage, micro-batch) has exactly one F and one B, or one I and one W after it.

Also: ops name stages and micro-batches in range and run on the rank that holds their stage; no op appears twice;
supplied send/recv instructions pair up one to one, never stay on their own rank, and every edge between stages
on different ranks (F(s) -> F(s+1), backward(s+1) -> backward(s)) has its send and its receive. Returns a list of
problems (empty when sound), each naming the rank, the position in its stream and the op. Linear in the number
of instructions (int keys from verify.flat).
"""

from __future__ import annotations

from itertools import pairwise

from pipec.ir import Action, Instruction, Kind, Program
from pipec.passes.sync import member_ranks, sync_stage, unsynced_copies
from pipec.verify.flat import RECV_B, RECV_F, SEND_B, SEND_F, B, F, Flat, I, W, flatten

_MAX_REPORTED = 12


def check_structure(program: Program, flat: Flat | None = None) -> list[str]:
    routing = program.routing_problem()
    if routing:  # the stages of each micro-batch are not known: nothing below can be judged
        return [routing]
    flat = flat or flatten(program)
    found = _Found(program)
    placement, stages, mbs = program.stage_to_rank, program.num_stages, program.microbatches
    for rank in range(program.ranks):
        if rank not in flat.misplaced and flat.mbs <= mbs:
            continue
        # the actions as written, not decoded from their keys: a negative micro-batch's key is another op's
        for index, action in _actions(program.streams[rank]):
            stage, _kind, mb = action
            if not 0 <= stage < stages:
                found.other.append(f"rank {rank} op {index} {action}: stage {stage} is outside 0..{stages - 1}")
            elif not 0 <= mb < mbs:
                found.beyond.setdefault((stage, _class(action.kind)), []).append((rank, index, action))
            elif placement[stage] != rank:
                found.other.append(
                    f"rank {rank} op {index} {action}: stage {stage} lives on rank {placement[stage]}, not {rank}"
                )
    if program.pipelines > 1:
        found.other.extend(_off_route(program))
    for key, n in flat.duplicates.items():
        rank, index = flat.where[key]
        found.other.append(f"{flat.decode(key)} appears {n} times (first on rank {rank} at op {index})")
    for rank, index in flat.bad_pairs:  # stream files: the front end refuses these pairs at compile time
        pair = program.streams[rank][index]
        found.other.append(f"rank {rank} op {index} {pair}: {_pair_problem(pair)}")
    if found or not _complete_at_a_glance(program, flat):
        _completeness(program, flat, found)
    if program.has_comms and (found or not _comms_at_a_glance(program, flat)):
        found.comms.extend(_comms(program, flat))
    if program.sync_groups or any(flat.syncs):
        found.other.extend(_syncs(program, flat))
    if program.has_comms:
        found.other.extend(_unsynced_copies(program))
    return found.render()


def _unsynced_copies(program: Program) -> list[str]:
    """With the send/recv placed (and so the SYNCs: pipec.passes.sync places them after), each logical stage's
    copies must be summed by a sync group: the copies' weights would drift apart otherwise."""
    length = program.stages_per_pipeline
    return [
        f"the copies {copies} of stage {copies[0] % length} are summed by no sync group: their weights would drift "
        f"apart (declare `sync G: {' '.join(map(str, copies))}` with its SYNCs, or give pipec the compute orders "
        "alone: it places the SYNCs)"
        for copies in unsynced_copies(program)
    ]


def _off_route(program: Program) -> list[str]:
    """Each op of micro-batch m at a stage of copy routes[m]: an op elsewhere names both copies."""
    length, mbs, stages = program.stages_per_pipeline, program.microbatches, program.num_stages
    out = []
    for rank, stream in enumerate(program.streams):
        for index, action in _actions(stream):
            stage, _, mb = action
            if not (0 <= stage < stages and 0 <= mb < mbs):
                continue  # out of range: said above
            copy, route = stage // length, program.route_of(mb)
            if copy != route:
                first = route * length
                out.append(
                    f"rank {rank} op {index} {action}: micro-batch {mb} goes through copy {route} (stages "
                    f"{first}..{first + length - 1}); stage {stage} is copy {copy}'s"
                )
    return out


def _syncs(program: Program, flat: Flat) -> list[str]:
    """Each SYNC names a group that exists and, of the group's stages on its rank, the lowest; a rank holding no
    stage of a group (or a group all on one rank) issues none; the member ranks of a group issue as many of its
    SYNCs as each other (the k-th of each rank meets the k-th of the others)."""
    out: list[str] = []
    groups, placement = program.sync_groups, program.stage_to_rank
    counts: dict[int, dict[int, list[int]]] = {}  # group -> rank -> op indices
    for rank, rank_syncs in enumerate(flat.syncs):
        for index, stage, group in rank_syncs:
            action = program.streams[rank][index]
            if not 0 <= group < len(groups):
                out.append(f"rank {rank} op {index} {action}: there is no sync group {group} ({len(groups)} declared)")
            elif rank not in member_ranks(groups[group], placement):
                why = "holds no stage of it" if all(placement[s] != rank for s in groups[group]) else "is on one rank"
                out.append(f"rank {rank} op {index} {action}: sync group {group} {groups[group]} {why}: no SYNC")
            elif stage != sync_stage(groups[group], rank, placement):
                out.append(
                    f"rank {rank} op {index} {action}: rank {rank}'s SYNC of group {group} names its lowest stage of "
                    f"the group, {sync_stage(groups[group], rank, placement)}"
                )
            else:
                counts.setdefault(group, {}).setdefault(rank, []).append(index)
    for group, stages in enumerate(groups):
        members = member_ranks(stages, placement)
        issued = counts.get(group, {})
        numbers = {rank: len(issued.get(rank, ())) for rank in members}
        if len(set(numbers.values())) > 1:
            most = max(members, key=lambda r: numbers[r])
            for rank in members:
                if numbers[rank] < numbers[most]:
                    k = numbers[rank]
                    out.append(
                        f"sync group {group} {stages}: rank {rank} issues {_plural(numbers[rank], 'SYNC')} of it, "
                        f"rank {most} {numbers[most]}: rank {most}'s {program.streams[most][issued[most][k]]} "
                        f"(op {issued[most][k]}) would wait forever for rank {rank}"
                    )
        elif program.has_comms and members and numbers[members[0]] != (0 if program.forward_only else 1):
            out.append(_not_once(program, group, stages, numbers[members[0]]))
    return out


def _not_once(program: Program, group: int, stages: tuple[int, ...], issued: int) -> str:
    """A placed program sums each group's gradients exactly once per step on each member rank: with no SYNC the
    copies (or tied weights) drift apart silently, with two the second all-reduce multiplies the sum by the group's
    size. A forward-only program has no gradients: none."""
    count = _plural(issued, "SYNC") if issued else "no SYNC"
    where = f"sync group {group} {stages}: its member ranks issue {count} of it"
    if program.forward_only:
        return f"{where}: a forward-only program has no gradients to sum, so none"
    if issued == 0:
        return (
            f"{where}: the gradients of its stages would never be summed and their weights would drift apart "
            "(give pipec the compute orders alone and it places the SYNCs, pipec.passes.sync)"
        )
    return f"{where}: one per step; each further one would sum the already summed gradients again"


def _pair_problem(pair: Instruction) -> str:
    first, second = pair.parts
    if (first.kind is Kind.F) == (second.kind is Kind.F):
        return "an overlapped pair runs one forward (F) with one backward (B, I or W)"
    return "the halves of an overlapped pair take two different micro-batches (a backward needs its forward)"


_CLASS = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward", Kind.W: "weight gradient"}


def _class(kind: Kind) -> str:
    """What a structure problem is about: the forward, the backward (B or I) or the weight gradient of a pair, or
    a message (send/recv)."""
    return _CLASS.get(kind, "send/recv")


class _Found:
    """The problems found, grouped by cause so that the causes come first in the report: a stage that misses ops
    and another stage of the same rank that runs those ops beyond the last micro-batch (an op emitted on the wrong
    chunk), then the other missing ops, ops beyond the last micro-batch, per-op problems, and last the send/recv
    problems, which in a compiled `.pipe` only follow from the compute ops' (pipec placed them)."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.missing: dict[tuple[int, str], list[Action]] = {}  # (stage, class) -> missing ops
        self.beyond: dict[tuple[int, str], list[tuple[int, int, Action]]] = {}  # -> (rank, index, op) outside 0..M-1
        self.other: list[str] = []
        self.comms: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.missing or self.beyond or self.other or self.comms)

    def render(self) -> list[str]:
        program, last_mb = self.program, self.program.microbatches - 1
        placement, chunk_of = program.stage_to_rank, program.stage_chunks()
        lines: list[str] = []
        missing, beyond = dict(self.missing), dict(self.beyond)
        # a rank's stage missing ops of a class while another stage of that rank runs that class beyond M - 1
        for (stage, what), ops in sorted(self.missing.items(), key=lambda item: (placement[item[0][0]], item[0])):
            rank = placement[stage]
            extra = next(
                (key for key in beyond if key[1] == what and key[0] != stage and placement[key[0]] == rank), None
            )
            if extra is None or what == "send/recv":
                continue
            beyond_ops = beyond.pop(extra)
            del missing[(stage, what)]
            lines.append(
                f"rank {rank}: stage {stage} (its chunk {chunk_of[stage]}) never runs {_ops(ops)}, while stage "
                f"{extra[0]} (its chunk {chunk_of[extra[0]]}) runs {_ops([a for _, _, a in beyond_ops])}, beyond "
                f"micro-batch {last_mb}: {_plural(len(beyond_ops), what)} of chunk {chunk_of[stage]} emitted on "
                f"chunk {chunk_of[extra[0]]}?"
            )
        for (stage, what), ops in sorted(missing.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(self._missing_text(stage, what, ops))
        comm_beyond = [found for key, group in sorted(beyond.items()) if key[1] == "send/recv" for found in group]
        for (stage, what), group in sorted(beyond.items(), key=lambda item: item[1][0][:2]):  # stream order
            if what == "send/recv":
                continue
            if len(group) == 1:
                rank, index, action = group[0]
                lines.append(f"rank {rank} op {index} {action}: micro-batch {action.mb} is outside 0..{last_mb}")
            else:
                rank, index, _ = group[0]
                lines.append(
                    f"stage {stage} (rank {placement[stage]}) runs {_ops([a for _, _, a in group])}, micro-batches "
                    f"outside 0..{last_mb} (the first at rank {rank} op {index})"
                )
        lines.extend(self.other)
        if len(comm_beyond) == 1:
            rank, index, action = comm_beyond[0]
            lines.append(f"rank {rank} op {index} {action}: micro-batch {action.mb} is outside 0..{last_mb}")
        elif comm_beyond:
            lines.append(
                f"{len(comm_beyond)} send/recv ops name micro-batches outside 0..{last_mb}: "
                f"{_ops([a for _, _, a in comm_beyond])}"
            )
        lines.extend(self.comms)
        if len(lines) > _MAX_REPORTED:
            lines = [*lines[:_MAX_REPORTED], f"... and {len(lines) - _MAX_REPORTED} more problems"]
        return lines

    def _missing_text(self, stage: int, what: str, ops: list[Action]) -> str:
        rank, mbs = self.program.stage_to_rank[stage], self.program.microbatches
        if len(ops) == 1:
            (op,) = ops
            if what == "weight gradient":
                return f"{op} is missing: the weight gradient of stage {stage}, micro-batch {op.mb} is never computed"
            return f"{op} is missing: stage {stage} never runs the {what} of micro-batch {op.mb}"
        if len(ops) == mbs:
            return f"stage {stage} (rank {rank}) never runs a {what}: {_ops(ops)} are all missing"
        return f"stage {stage} (rank {rank}) never runs the {what} of {len(ops)} micro-batches: {_ops(ops)} are missing"


_LISTED = 4  # ops named in one grouped line


def _ops(ops: list[Action]) -> str:
    """A few ops by name: `7F0..7F7` for a run of consecutive micro-batches, else the first ones and a count."""
    if len(ops) > 2 and all(b.mb == a.mb + 1 and b[:2] == a[:2] for a, b in pairwise(ops)):
        return f"{ops[0]}..{ops[-1]}"
    shown = ", ".join(map(str, ops[:_LISTED]))
    return shown if len(ops) <= _LISTED else f"{shown} and {len(ops) - _LISTED} more"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _actions(stream: tuple[Instruction, ...]) -> list[tuple[int, Action]]:
    """The ops (a SYNC names a group, not a micro-batch: _syncs checks those)."""
    return [
        (index, action)
        for index, instruction in enumerate(stream)
        for action in instruction.parts
        if action.kind is not Kind.SYNC
    ]


def _complete_at_a_glance(program: Program, flat: Flat) -> bool:
    """Set arithmetic over the keys (fast); when it fails, _completeness says what is wrong, pair by pair."""
    # every stage and micro-batch is in range, each op at its micro-batch's copy and no key repeats (checked
    # before this): each micro-batch has one copy's stages
    where = flat.where
    pairs = program.stages_per_pipeline * program.microbatches
    by_kind: list[set[int]] = [set(), set(), set(), set()]
    for kind in (F, B, I, W):
        by_kind[kind] = {k >> 3 for k in where if k & 7 == kind}
    forwards, fulls, inputs, weights = by_kind
    if len(forwards) != pairs:
        return False
    if program.forward_only:
        return not (fulls or inputs or weights)
    if fulls & inputs or len(fulls) + len(inputs) != pairs or weights != inputs:
        return False
    return all(where[(pair << 3) + I] < where[(pair << 3) + W] for pair in inputs)


def _completeness(program: Program, flat: Flat, found: _Found) -> None:
    where, key, name = flat.where, flat.key, flat.decode
    missing = found.missing
    for stage in range(program.num_stages):
        copy = program.pipeline_of(stage)
        for mb in range(program.microbatches):
            if program.route_of(mb) != copy:
                continue  # micro-batch mb does not pass this stage (_off_route names any op of it here)
            f, b, i, w = (key(stage, code, mb) for code in (F, B, I, W))
            if f not in where:
                missing.setdefault((stage, "forward"), []).append(name(f))
            if program.forward_only:
                extra = [k for k in (b, i, w) if k in where]
                if extra:
                    found.other.append(f"{name(extra[0])}: a forward-only schedule runs no backward")
                continue
            has_b, has_i, has_w = b in where, i in where, w in where
            if has_b and (has_i or has_w):
                found.other.append(
                    f"stage {stage}, micro-batch {mb} has both a full backward {name(b)} and a split one "
                    f"({name(i)}/{name(w)})"
                )
            elif not has_b:
                if not has_i:
                    missing.setdefault((stage, "backward"), []).append(name(w if has_w else b))
                if has_i and not has_w:
                    missing.setdefault((stage, "weight gradient"), []).append(name(w))
                if has_i and has_w and where[w] < where[i]:
                    rank, index = where[w]
                    found.other.append(f"rank {rank} op {index} {name(w)} runs before its {name(i)} (op {where[i][1]})")


def _comms_at_a_glance(program: Program, flat: Flat) -> bool:
    """Every send meets a receive of its name and vice versa, none stays on its rank, all edges covered (fast)."""
    step = flat.mbs * 8
    keys = set(flat.comm_keys)
    if len(keys) != len(flat.comm_keys) or any(src == dst for src, dst in flat.channels):
        return False
    partners = {k + step + 1 if k & 7 == SEND_F else k - step + 1 for k in keys if k & 7 == SEND_F or k & 7 == SEND_B}
    if len(partners) * 2 != len(keys) or not partners <= keys:
        return False
    if program.forward_only and any(k & 7 >= SEND_B for k in keys):
        return False
    # each pair is a distinct edge between stages on different ranks; as many as there are such edges: all there
    return len(keys) == 2 * program.crossings() * (1 if program.forward_only else 2)


def _comms(program: Program, flat: Flat) -> list[str]:
    """Sends and receives pair one to one by name, cross ranks, and cover every edge between ranks."""
    out: list[str] = []
    where, count, name = flat.where, flat.duplicates, flat.decode
    placement, last, step = program.stage_to_rank, program.num_stages - 1, flat.mbs * 8
    length = program.stages_per_pipeline
    # SEND_F(s, m) <-> RECV_F(s+1, m): key + step + 1; SEND_B(s, m) <-> RECV_B(s-1, m): key - step + 1
    partner_offset = {SEND_F: step + 1, RECV_F: -step - 1, SEND_B: -step + 1, RECV_B: step - 1}
    stage_offset = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}
    for key in dict.fromkeys(flat.comm_keys):
        code = key & 7
        stage = (key >> 3) // flat.mbs
        peer_stage = stage + stage_offset[code]
        partner = key + partner_offset[code]
        if 0 <= peer_stage <= last and peer_stage // length != stage // length:  # past the end of a copy's chain
            end = "last" if peer_stage > stage else "first"
            out.append(
                f"{name(key)}: stage {stage} is the {end} of copy {stage // length}'s chain, which hands nothing to "
                f"stage {peer_stage} (copy {peer_stage // length}'s)"
            )
        elif not 0 <= peer_stage <= last or partner not in where or count.get(key, 1) != count.get(partner, 1):
            out.append(f"{name(key)} has no matching {_text(peer_stage, partner, flat)}")
        elif stage <= last and placement[stage] == placement[peer_stage]:
            out.append(
                f"{name(key)}: stages {stage} and {peer_stage} both live on rank {placement[stage]}, "
                "so nothing is sent between them"
            )
    messages = program.crossings() * (1 if program.forward_only else 2)
    if not out and not flat.duplicates and len(flat.comm_keys) == 2 * messages:
        return out  # every send/recv is paired and there are as many as edges between ranks: none is missing
    key = flat.key
    for stage in range(last):
        if placement[stage] == placement[stage + 1] or (stage + 1) % length == 0:
            continue
        for mb in range(program.microbatches):
            if program.route_of(mb) != stage // length:
                continue
            send, recv = key(stage, SEND_F, mb), key(stage + 1, RECV_F, mb)
            if key(stage + 1, F, mb) in where and send not in where and recv not in where:
                out.append(
                    f"{stage + 1}F{mb} needs the activation of {stage}F{mb} from rank {placement[stage]}, "
                    f"but no {name(send)}/{name(recv)} pair carries it"
                )
            if program.forward_only or not (key(stage, B, mb) in where or key(stage, I, mb) in where):
                continue
            send, recv = key(stage + 1, SEND_B, mb), key(stage, RECV_B, mb)
            if send not in where and recv not in where:
                out.append(
                    f"the backward of stage {stage}, micro-batch {mb} needs the gradient of stage {stage + 1} "
                    f"from rank {placement[stage + 1]}, but no {name(send)}/{name(recv)} pair carries it"
                )
    return out


def _text(peer_stage: int, partner: int, flat: Flat) -> str:
    action = flat.decode(partner) if peer_stage >= 0 else None
    if action is None:
        return "receive: there is no stage -1"
    return str(action)

"""check_structure: every (stage, micro-batch) has exactly one F and one B, or one I and one W after it.

Also: ops name stages and micro-batches in range and run on the rank that holds their stage; no op appears twice;
supplied send/recv instructions pair up one to one, never stay on their own rank, and every edge between stages
on different ranks (F(s) -> F(s+1), backward(s+1) -> backward(s)) has its send and its receive. Returns a list of
problems (empty when sound), each naming the rank, the position in its stream and the op. Linear in the number
of instructions (int keys from verify.flat).
"""

from __future__ import annotations

from pipec.ir import Program
from pipec.verify.flat import RECV_B, RECV_F, SEND_B, SEND_F, B, F, Flat, I, W, flatten

_MAX_REPORTED = 12


def check_structure(program: Program, flat: Flat | None = None) -> list[str]:
    flat = flat or flatten(program)
    problems: list[str] = []
    placement, stages, mbs = program.stage_to_rank, program.num_stages, program.microbatches
    for rank in range(program.ranks):
        if rank not in flat.misplaced and flat.mbs <= mbs:
            continue
        for index, key in flat.ops[rank]:
            stage, _kind, mb = action = flat.decode(key)
            if not 0 <= stage < stages:
                problems.append(f"rank {rank} op {index} {action}: stage {stage} is outside 0..{stages - 1}")
            elif not 0 <= mb < mbs:
                problems.append(f"rank {rank} op {index} {action}: micro-batch {mb} is outside 0..{mbs - 1}")
            elif placement[stage] != rank:
                problems.append(
                    f"rank {rank} op {index} {action}: stage {stage} lives on rank {placement[stage]}, not {rank}"
                )
    for key, n in flat.duplicates.items():
        rank, index = flat.where[key]
        problems.append(f"{flat.decode(key)} appears {n} times (first on rank {rank} at op {index})")
    if problems or not _complete_at_a_glance(program, flat):
        problems.extend(_completeness(program, flat))
    if program.has_comms and (problems or not _comms_at_a_glance(program, flat)):
        problems.extend(_comms(program, flat))
    if len(problems) > _MAX_REPORTED:
        problems = [*problems[:_MAX_REPORTED], f"... and {len(problems) - _MAX_REPORTED} more problems"]
    return problems


def _complete_at_a_glance(program: Program, flat: Flat) -> bool:
    """Set arithmetic over the keys (fast); when it fails, _completeness says what is wrong, pair by pair."""
    where = flat.where  # every stage and micro-batch is in range and no key repeats (checked before this)
    pairs = program.num_stages * program.microbatches
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


def _completeness(program: Program, flat: Flat) -> list[str]:
    out: list[str] = []
    where, key, name = flat.where, flat.key, flat.decode
    for stage in range(program.num_stages):
        for mb in range(program.microbatches):
            f, b, i, w = (key(stage, code, mb) for code in (F, B, I, W))
            if f not in where:
                out.append(f"{name(f)} is missing: stage {stage} never runs the forward of micro-batch {mb}")
            if program.forward_only:
                extra = [k for k in (b, i, w) if k in where]
                if extra:
                    out.append(f"{name(extra[0])}: a forward-only schedule runs no backward")
                continue
            has_b, has_i, has_w = b in where, i in where, w in where
            if has_b and (has_i or has_w):
                out.append(
                    f"stage {stage}, micro-batch {mb} has both a full backward {name(b)} and a split one "
                    f"({name(i)}/{name(w)})"
                )
            elif not has_b:
                if not has_i:
                    out.append(
                        f"{name(w if has_w else b)} is missing: stage {stage} never runs the backward of "
                        f"micro-batch {mb}"
                    )
                if has_i and not has_w:
                    out.append(
                        f"{name(w)} is missing: the weight gradient of stage {stage}, micro-batch {mb} is never "
                        "computed"
                    )
                if has_i and has_w and where[w] < where[i]:
                    rank, index = where[w]
                    out.append(f"rank {rank} op {index} {name(w)} runs before its {name(i)} (op {where[i][1]})")
    return out


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
    placement, last = program.stage_to_rank, program.num_stages - 1
    boundaries = sum(1 for stage in range(last) if placement[stage] != placement[stage + 1])
    return len(keys) == 2 * boundaries * program.microbatches * (1 if program.forward_only else 2)


def _comms(program: Program, flat: Flat) -> list[str]:
    """Sends and receives pair one to one by name, cross ranks, and cover every edge between ranks."""
    out: list[str] = []
    where, count, name = flat.where, flat.duplicates, flat.decode
    placement, last, step = program.stage_to_rank, program.num_stages - 1, flat.mbs * 8
    # SEND_F(s, m) <-> RECV_F(s+1, m): key + step + 1; SEND_B(s, m) <-> RECV_B(s-1, m): key - step + 1
    partner_offset = {SEND_F: step + 1, RECV_F: -step - 1, SEND_B: -step + 1, RECV_B: step - 1}
    stage_offset = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}
    for key in dict.fromkeys(flat.comm_keys):
        code = key & 7
        stage = (key >> 3) // flat.mbs
        peer_stage = stage + stage_offset[code]
        partner = key + partner_offset[code]
        if not 0 <= peer_stage <= last or partner not in where or count.get(key, 1) != count.get(partner, 1):
            out.append(f"{name(key)} has no matching {_text(peer_stage, partner, flat)}")
        elif stage <= last and placement[stage] == placement[peer_stage]:
            out.append(
                f"{name(key)}: stages {stage} and {peer_stage} both live on rank {placement[stage]}, "
                "so nothing is sent between them"
            )
    boundaries = sum(1 for stage in range(last) if placement[stage] != placement[stage + 1])
    messages = boundaries * program.microbatches * (1 if program.forward_only else 2)
    if not out and not flat.duplicates and len(flat.comm_keys) == 2 * messages:
        return out  # every send/recv is paired and there are as many as edges between ranks: none is missing
    key = flat.key
    for stage in range(last):
        if placement[stage] == placement[stage + 1]:
            continue
        for mb in range(program.microbatches):
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

"""check_structure: every (stage, micro-batch) has exactly one F and one B, or one I and one W after it.

Also: ops name stages and micro-batches in range and run on the rank that holds their stage; supplied
send/recv instructions pair up one to one. Returns a list of problems (empty when sound), each naming the
rank, the position in its stream and the op. Linear in the number of instructions.
"""

from __future__ import annotations

from collections import Counter

from pipec.ir import Action, Kind, Program

_MAX_REPORTED = 12


def check_structure(program: Program) -> list[str]:
    problems: list[str] = []
    where, stages, mbs = program.stage_to_rank, program.num_stages, program.microbatches
    seen: Counter[Action] = Counter()
    first_at: dict[Action, tuple[int, int]] = {}
    for rank, stream in enumerate(program.streams):
        for index, instruction in enumerate(stream):
            for action in instruction.parts:
                stage, _kind, mb = action
                if not 0 <= stage < stages:
                    problems.append(f"rank {rank} op {index} {action}: stage {stage} is outside 0..{stages - 1}")
                    continue
                if not 0 <= mb < mbs:
                    problems.append(f"rank {rank} op {index} {action}: micro-batch {mb} is outside 0..{mbs - 1}")
                    continue
                if where[stage] != rank:
                    problems.append(
                        f"rank {rank} op {index} {action}: stage {stage} lives on rank {where[stage]}, not {rank}"
                    )
                seen[action] += 1
                first_at.setdefault(action, (rank, index))
    for action, n in seen.items():
        if n > 1:
            rank, index = first_at[action]
            problems.append(f"{action} appears {n} times (first on rank {rank} at op {index})")
    for stage in range(stages):
        for mb in range(mbs):
            problems.extend(_missing(stage, mb, seen, first_at, program.forward_only))
    if program.has_comms:
        problems.extend(_unpaired_comms(program, seen))
    if len(problems) > _MAX_REPORTED:
        problems = [*problems[:_MAX_REPORTED], f"... and {len(problems) - _MAX_REPORTED} more problems"]
    return problems


def _missing(
    stage: int, mb: int, seen: Counter[Action], first_at: dict[Action, tuple[int, int]], forward_only: bool
) -> list[str]:
    f, b, i, w = (Action(stage, k, mb) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    out = []
    if not seen[f]:
        out.append(f"{f} is missing: stage {stage} never runs the forward of micro-batch {mb}")
    if forward_only:
        extra = [a for a in (b, i, w) if seen[a]]
        if extra:
            out.append(f"{extra[0]}: a forward-only schedule runs no backward")
        return out
    if seen[b] and (seen[i] or seen[w]):
        out.append(f"stage {stage}, micro-batch {mb} has both a full backward {b} and a split one ({i}/{w})")
    elif not seen[b]:
        if not seen[i]:
            out.append(f"{i if seen[w] else b} is missing: stage {stage} never runs the backward of micro-batch {mb}")
        if not seen[w] and seen[i]:
            out.append(f"{w} is missing: the weight gradient of stage {stage}, micro-batch {mb} is never computed")
        if seen[i] and seen[w] and first_at[w] < first_at[i]:
            rank, index = first_at[w]
            out.append(f"rank {rank} op {index} {w} runs before its {i} (op {first_at[i][1]})")
    return out


def _unpaired_comms(program: Program, seen: Counter[Action]) -> list[str]:
    out = []
    last = program.num_stages - 1
    for (stage, kind, mb), n in seen.items():
        if kind is Kind.SEND_F and (stage == last or seen[Action(stage + 1, Kind.RECV_F, mb)] != n):
            out.append(f"{stage}SEND_F{mb} has no matching {stage + 1}RECV_F{mb}")
        if kind is Kind.RECV_F and (stage == 0 or seen[Action(stage - 1, Kind.SEND_F, mb)] != n):
            out.append(f"{stage}RECV_F{mb} has no matching {stage - 1}SEND_F{mb}")
        if kind is Kind.SEND_B and (stage == 0 or seen[Action(stage - 1, Kind.RECV_B, mb)] != n):
            out.append(f"{stage}SEND_B{mb} has no matching {stage - 1}RECV_B{mb}")
        if kind is Kind.RECV_B and (stage == last or seen[Action(stage + 1, Kind.SEND_B, mb)] != n):
            out.append(f"{stage}RECV_B{mb} has no matching {stage + 1}SEND_B{mb}")
    return out

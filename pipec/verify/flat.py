"""The flat integer form of a program that the verification passes share.

Every action becomes an int key, ((stage * mbs) + mb) * 8 + code, so that the passes do their bookkeeping with
int dicts and sets: an Action key would hash its Kind enum through Python code on every lookup, which made the
checks several times slower on the 780k instructions of interleaved 1F1B at (P=32, M=1024, V=4). One pass over
the streams builds everything; the checks then stay linear in the number of instructions.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipec.ir import Action, Kind, Program

F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B = range(8)  # noqa: E741 - the op names used everywhere else
KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
SENDS = (SEND_F, SEND_B)


_CODE_BY_VALUE = {kind.value: code for code, kind in enumerate(KINDS)}


def code_of(kind: Kind) -> int:
    # identity tests: dict lookups keyed by the enum would call Enum.__hash__ in Python
    if kind is Kind.F:
        return F
    if kind is Kind.B:
        return B
    if kind is Kind.I:
        return I
    if kind is Kind.W:
        return W
    if kind is Kind.SEND_F:
        return SEND_F
    if kind is Kind.RECV_F:
        return RECV_F
    if kind is Kind.SEND_B:
        return SEND_B
    return RECV_B


@dataclass(frozen=True)
class Flat:
    """Per rank, every action as (op index, key); where each key first occurs; how often each occurs."""

    mbs: int  # the key multiplier: above every micro-batch named, so keys never collide
    stages: int  # above every stage named
    ops: tuple[list[tuple[int, int]], ...]
    comm: tuple[list[bool], ...]  # per rank, per instruction: a send/recv?
    where: dict[int, tuple[int, int]]
    duplicates: dict[int, int]  # key -> count, only for keys seen more than once
    stages_on: tuple[set[int], ...]  # stages named on each rank
    total: int

    def key(self, stage: int, code: int, mb: int) -> int:
        return ((stage * self.mbs) + mb) * 8 + code

    def decode(self, key: int) -> Action:
        stage, mb = divmod(key >> 3, self.mbs)
        return Action(stage, KINDS[key & 7], mb)


def flatten(program: Program) -> Flat:
    streams = program.streams
    big_mb = max(
        [program.microbatches - 1]
        + [a.mb for stream in streams for ins in stream for a in (ins.parts if type(ins) is not Action else (ins,))]
    )
    mbs = big_mb + 1
    ops: list[list[tuple[int, int]]] = []
    comm: list[list[bool]] = []
    where: dict[int, tuple[int, int]] = {}
    duplicates: dict[int, int] = {}
    stages_on: list[set[int]] = []
    top_stage = program.num_stages - 1
    total = 0
    code_by_value = _CODE_BY_VALUE
    for rank, stream in enumerate(streams):
        rank_ops: list[tuple[int, int]] = []
        rank_comm: list[bool] = []
        seen_stages: set[int] = set()
        for index, instruction in enumerate(stream):
            parts = (instruction,) if type(instruction) is Action else instruction.parts
            is_comm = False
            for stage, kind, mb in parts:
                code = code_by_value[kind._value_]  # a str key: hashed in C
                is_comm = code >= SEND_F
                key = ((stage * mbs) + mb) * 8 + code
                rank_ops.append((index, key))
                seen_stages.add(stage)
                if key in where:
                    duplicates[key] = duplicates.get(key, 1) + 1
                else:
                    where[key] = (rank, index)
            rank_comm.append(is_comm)
        total += len(rank_ops)
        ops.append(rank_ops)
        comm.append(rank_comm)
        stages_on.append(seen_stages)
        if seen_stages:
            top_stage = max(top_stage, max(seen_stages))
    return Flat(mbs, top_stage + 1, tuple(ops), tuple(comm), where, duplicates, tuple(stages_on), total)

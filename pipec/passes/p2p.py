"""insert_p2p_ops: add SEND/RECV instructions on every edge that crosses ranks.

Contract (Program -> Program, compute-only in, with comms out):
- before a compute instruction, one RECV for each of its inputs that comes from another rank:
  RECV_F(s, m) before F(s, m) when stage s-1 lives elsewhere; RECV_B(s, m) before B/I(s, m) when stage s+1
  lives elsewhere;
- after it, one SEND for each output another rank consumes: SEND_F(s, m) after F(s, m) when stage s+1
  lives elsewhere; SEND_B(s, m) after B/I(s, m) when stage s-1 lives elsewhere;
- W never communicates; an overlapped pair gets the receives of both halves before it and the sends of both
  after it, in the order of its halves.
The relative order of compute instructions is unchanged, so each rank posts its messages in the order its
compute needs them: this is the order the verifier's p2p models and the runtime assume.
"""

from __future__ import annotations

from pipec.errors import PipecInputError
from pipec.ir import Action, Instruction, Kind, Program


def insert_p2p_ops(program: Program) -> Program:
    if program.has_comms:
        raise PipecInputError("the program already has send/recv instructions")
    where = program.stage_to_rank
    last = program.num_stages - 1
    streams = []
    for rank, stream in enumerate(program.streams):
        out: list[Instruction] = []
        for instruction in stream:
            receives: list[Action] = []
            sends: list[Action] = []
            for stage, kind, mb in instruction.parts:
                if kind is Kind.F:
                    if stage > 0 and where[stage - 1] != rank:
                        receives.append(Action(stage, Kind.RECV_F, mb))
                    if stage < last and where[stage + 1] != rank:
                        sends.append(Action(stage, Kind.SEND_F, mb))
                elif kind is Kind.B or kind is Kind.I:
                    if stage < last and where[stage + 1] != rank:
                        receives.append(Action(stage, Kind.RECV_B, mb))
                    if stage > 0 and where[stage - 1] != rank:
                        sends.append(Action(stage, Kind.SEND_B, mb))
            out.extend(receives)
            out.append(instruction)
            out.extend(sends)
        streams.append(tuple(out))
    return program.with_streams(tuple(streams), has_comms=True)

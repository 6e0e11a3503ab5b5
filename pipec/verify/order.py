"""check_p2p_order: on every channel (ordered pair of ranks), sends and receives name the same messages in order.

NCCL (and gloo with the runtime's single tag) matches the k-th send from rank a to rank b with the k-th receive
on b from a, whatever they name. If those two name different (stage, kind, micro-batch), b receives the wrong
tensor (or hangs on a size mismatch): the schedule is invalid under the nccl model even when nothing deadlocks.
Linear in the number of instructions.
"""

from __future__ import annotations

from pipec.ir import Program
from pipec.verify.flat import RECV_B, RECV_F, SEND_B, SEND_F, Flat, counterpart_shift, flatten

_MAX_REPORTED = 6


def check_p2p_order(program: Program, flat: Flat | None = None) -> list[str]:
    if not program.has_comms:
        return []
    flat = flat or flatten(program)
    # the receive each send should meet (pipec.p2p_rule.counterpart): SEND_F(s, m) -> RECV_F(s+1, m),
    # SEND_B(s, m) -> RECV_B(s-1, m); and the send each receive should meet
    expects = {code: counterpart_shift(code, flat.mbs) for code in (SEND_F, SEND_B, RECV_F, RECV_B)}
    problems = []
    for (src, dst), (sends, recvs) in sorted(flat.channels.items()):
        for k, ((i, send), (j, recv)) in enumerate(zip(sends, recvs, strict=False)):
            if send + expects[send & 7] != recv:
                wanted = recv + expects[recv & 7]
                problems.append(
                    f"p2p order mismatch on channel rank {src} -> rank {dst}: message {k + 1} is sent as "
                    f"rank {src} op {i} {flat.decode(send)} but received as rank {dst} op {j} {flat.decode(recv)}, "
                    f"which expects {flat.decode(wanted)}; messages on a channel are matched in issue order"
                )
                break  # later pairs on this channel are shifted by the same mistake
    if len(problems) > _MAX_REPORTED:
        problems = [*problems[:_MAX_REPORTED], f"... and {len(problems) - _MAX_REPORTED} more channels"]
    return problems

"""The flat integer form of a program that the verification passes share.

Every action becomes an int key, ((stage * mbs) + mb) * 8 + code, so that the passes do their bookkeeping with
int dicts and sets: an Action key would hash its Kind enum through Python code on every lookup, which made the
checks several times slower on the 780k instructions of interleaved 1F1B at (P=32, M=1024, V=4). One pass over
the streams builds everything; the checks then stay linear in the number of instructions.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pipec.ir import Action, Kind, Program, chain_links
from pipec.p2p_rule import counterpart, receive_for

F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B = range(8)  # noqa: E741 - the op names used everywhere else
KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
SENDS = (SEND_F, SEND_B)


SYNC = 8  # not a key code (keys hold 3 bits): a SYNC gets no key, only a unit of its own and an entry in Flat.syncs
_CODE_BY_VALUE = {kind.value: code for code, kind in enumerate(KINDS)} | {Kind.SYNC.value: SYNC}


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


def counterpart_shift(code: int, mbs: int) -> int:
    """key(counterpart(a)) - key(a), the same for every send/recv `a` of kind `code` (keys with multiplier `mbs`):
    pipec.p2p_rule's pairing by name, on keys, for the engines to add inline (SEND_F +(mbs * 8 + 1), RECV_F
    -(mbs * 8 + 1), SEND_B -(mbs * 8 - 1), RECV_B +(mbs * 8 - 1))."""
    other = counterpart(Action(0, KINDS[code], 0))
    return other.stage * mbs * 8 + code_of(other.kind) - code


def receive_shift(code: int) -> int:
    """key(receive_for(a)) - key(a) for a compute `a` of kind `code` that reads a message (F, B or I): the
    receive that feeds it, on keys (pipec.p2p_rule.receive_for)."""
    receive = receive_for(Action(0, KINDS[code], 0))
    assert receive is not None, f"{KINDS[code]} reads no message"
    return code_of(receive.kind) - code


@dataclass(frozen=True)
class Flat:
    """Per rank, where each key first occurs, how often each occurs, the units, the channels, the memory peaks.

    A unit is a compute instruction or a batch: a maximal run of send/recv instructions when `batched` (pipec's
    runtime posts it with one batch_isend_irecv), else one send/recv instruction (torch's runtime posts each
    action on its own; the p2p model's name selects, see verify.deadlock.batched). `local` lists, for a
    program with send/recv, every op whose input should come from its own rank (the compute before it, or the
    receive that brought it) but is not there before the op's unit starts: (rank, op index, needed keys). Those
    are the only waits on a rank's own ops; everything else a program with send/recv waits for is a message.
    `channels` maps (src, dst) to the (op index, key) of src's sends to dst and of dst's receives from src, in
    stream order. `peaks` is each rank's peak activation memory under the memory model flatten was given.
    """

    program: Program
    mbs: int  # the key multiplier: above every micro-batch named, so keys never collide
    where: dict[int, tuple[int, int]]
    duplicates: dict[int, int]  # key -> count, only for keys seen more than once
    misplaced: frozenset[int]  # ranks with an op whose stage is out of range or elsewhere, or whose mb is negative
    starts: tuple[tuple[int, ...], ...]  # per rank, the op index where each unit starts, plus len(stream)
    unit_of: tuple[list[int], ...]  # per rank, op index -> unit
    local: list[tuple[int, int, tuple[int, ...]]]
    comm_keys: list[int]
    channels: dict[tuple[int, int], tuple[list[tuple[int, int]], list[tuple[int, int]]]]
    peaks: tuple[float, ...]
    cache: dict = field(default_factory=dict, compare=False)
    batched: bool = True  # how the units were cut (above)
    # (rank, op index) of each overlapped pair that is not one forward and one backward of two micro-batches (the
    # front end refuses those in a .pipe; a stream file may hold them): the structure check reports them
    bad_pairs: tuple[tuple[int, int], ...] = ()
    # per rank, its SYNC instructions as (op index, stage, group), in stream order; each is a unit of its own
    syncs: tuple[tuple[tuple[int, int, int], ...], ...] = ()

    @property
    def ops(self) -> tuple[list[tuple[int, int]], ...]:
        """Per rank, every action as (op index, key) in stream order (built on first use)."""
        if "ops" not in self.cache:
            mbs, code_by_value = self.mbs, _CODE_BY_VALUE
            self.cache["ops"] = tuple(
                [
                    (index, ((a.stage * mbs) + a.mb) * 8 + code_by_value[a.kind._value_])
                    for index, instruction in enumerate(stream)
                    for a in ((instruction,) if type(instruction) is Action else instruction.parts)
                if a.kind is not Kind.SYNC
                ]
                for stream in self.program.streams
            )
        return self.cache["ops"]

    def key(self, stage: int, code: int, mb: int) -> int:
        return ((stage * self.mbs) + mb) * 8 + code

    def decode(self, key: int) -> Action:
        stage, mb = divmod(key >> 3, self.mbs)
        return Action(stage, KINDS[key & 7], mb)


def flatten(
    program: Program,
    input_fraction: float = 0.5,
    stage_sizes: tuple[float, ...] | None = None,
    mbs: int | None = None,
    batched: bool = True,
) -> Flat:
    """One pass over the streams. Keys use `mbs` = M unless some op names a micro-batch >= M (then a second pass)."""
    streams = program.streams
    mbs = mbs or max(program.microbatches, 1)
    placement, last = program.stage_to_rank, program.num_stages - 1
    has_next, has_previous = chain_links(program.num_stages, program.pipelines)  # where each copy's chain ends
    check_local = program.has_comms
    step = mbs * 8
    deltas = (1.0, -1.0, -input_fraction, input_fraction - 1.0)  # F, B, I, W; see verify.memory
    where: dict[int, tuple[int, int]] = {}
    duplicates: dict[int, int] = {}
    misplaced: set[int] = set()
    all_starts: list[tuple[int, ...]] = []
    all_unit_of: list[list[int]] = []
    all_ops: list[list[tuple[int, int]]] = []
    local: list[tuple[int, int, tuple[int, ...]]] = []
    comm_keys: list[int] = []
    channels: dict[tuple[int, int], tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
    peaks: list[float] = []
    top_mb = 0
    bad_pairs: list[tuple[int, int]] = []
    forward = Kind.F
    code_by_value = _CODE_BY_VALUE
    all_syncs: list[tuple[tuple[int, int, int], ...]] = []
    for rank, stream in enumerate(streams):
        rank_syncs: list[tuple[int, int, int]] = []
        # by peer; a dict holding only the peers this rank talks to (a few), not a list of P: that made flatten
        # quadratic in P (P = 10,000 ranks allocated 10^8 empty lists)
        sends: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
        recvs: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
        starts: list[int] = []
        unit_of: list[int] = []
        rank_ops: list[tuple[int, int]] = []  # Flat.ops, filled here rather than in a second pass
        all_ops.append(rank_ops)
        in_batch = False
        live = peak = 0.0
        for index, instruction in enumerate(stream):
            if type(instruction) is Action:
                parts: tuple[Action, ...] = (instruction,)
            else:
                parts = instruction.parts
                first, second = parts
                if (first.kind is forward) is (second.kind is forward) or first.mb == second.mb:
                    bad_pairs.append((rank, index))
            lead = code_by_value[parts[0].kind._value_]
            if lead == SYNC:  # a collective: a unit of its own, ending any batch; it names a group, not an op
                starts.append(index)
                unit_of.append(len(starts) - 1)
                in_batch = False
                rank_syncs.append((index, instruction.stage, instruction.mb))
                continue
            is_comm = lead >= SEND_F
            if not (is_comm and in_batch):
                starts.append(index)
            in_batch = is_comm and batched  # not batched: the next send/recv starts a unit of its own
            unit_start = starts[-1]
            unit_of.append(len(starts) - 1)
            for stage, kind, mb in parts:
                code = code_by_value[kind._value_]  # a str key: hashed in C
                if mb > top_mb:
                    top_mb = mb
                key = ((stage * mbs) + mb) * 8 + code
                rank_ops.append((index, key))
                if key in where:
                    duplicates[key] = duplicates.get(key, 1) + 1
                else:
                    where[key] = (rank, index)
                in_range = 0 <= stage <= last
                if not in_range or placement[stage] != rank or mb < 0:  # a negative mb: its key is another op's
                    misplaced.add(rank)
                if code >= SEND_F:
                    comm_keys.append(key)
                    # the channel: pipec.p2p_rule.peer_of, inlined (tests/verify/test_verify_rule.py checks it)
                    if code == SEND_F:
                        if in_range and has_next[stage]:
                            sends[placement[stage + 1]].append((index, key))
                    elif code == RECV_F:
                        if in_range and has_previous[stage]:
                            recvs[placement[stage - 1]].append((index, key))
                        continue
                    elif code == SEND_B:
                        if in_range and has_previous[stage]:
                            sends[placement[stage - 1]].append((index, key))
                    else:
                        if in_range and has_next[stage]:
                            recvs[placement[stage + 1]].append((index, key))
                        continue
                elif stage_sizes is None:
                    live += deltas[code]
                elif in_range:
                    live += deltas[code] * stage_sizes[stage]
                if not check_local or not in_range:
                    continue
                # the keys (any one of them) this op reads from its own rank
                base = key - code
                if code == SEND_F:
                    need: tuple[int, ...] = (base + F,)
                elif code == SEND_B:
                    need = (base + B, base + I)
                elif code == F:
                    if not has_previous[stage]:
                        continue
                    need = (base - step + F,) if placement[stage - 1] == rank else (base + RECV_F,)
                elif code == W:
                    need = (base + I,)
                else:  # B or I
                    hit = where.get(base + F)
                    if hit is None or hit[0] != rank or hit[1] >= unit_start:
                        local.append((rank, index, (base + F,)))
                    if not has_next[stage]:
                        continue
                    need = (base + step + B, base + step + I) if placement[stage + 1] == rank else (base + RECV_B,)
                for wanted in need:
                    hit = where.get(wanted)
                    if hit is not None and hit[0] == rank and hit[1] < unit_start:
                        break
                else:
                    local.append((rank, index, need))
            if live > peak:  # live memory after the whole instruction, as memory_profile counts it
                peak = live
        starts.append(len(stream))
        for peer in sorted(sends.keys() | recvs.keys()):  # the order a loop over every peer would give
            if peer in sends:
                channels.setdefault((rank, peer), ([], []))[0].extend(sends[peer])
            if peer in recvs:
                channels.setdefault((peer, rank), ([], []))[1].extend(recvs[peer])
        all_syncs.append(tuple(rank_syncs))
        all_starts.append(tuple(starts))
        all_unit_of.append(unit_of)
        peaks.append(0.0 if program.forward_only else peak)
    if top_mb >= mbs:  # keys would collide: start again with room for every micro-batch named
        return flatten(program, input_fraction, stage_sizes, top_mb + 1, batched)
    return Flat(
        program, mbs, where, duplicates, frozenset(misplaced), tuple(all_starts),
        tuple(all_unit_of), local, comm_keys, channels, tuple(peaks), {"ops": tuple(all_ops)}, batched,
        tuple(bad_pairs), tuple(all_syncs),
    )

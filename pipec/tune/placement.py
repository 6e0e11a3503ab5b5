"""Send/recv placed for a solved compute order under nccl (`pipec tune`'s exact phase, issue #23 item 3).

pipec.passes.p2p's timed replay posts every receive at the moment its message is made (the producer's end). Under
nccl a receive is posted when its rank's host reaches it, that is after the compute it follows in the stream: a
message made while the receiver computes is posted only when that compute ends, and the consumer then waits
`message_time` more (measured at P=4, M=8, F=1, I=2, W=1, comm=0.5, limit 4: 47 against the solver's 45.5). Two
steps close most of that (45.5 there; tests/tune/test_tune_placement.py):

- `ahead`: each send where the solver posts it (`cpsat.SolverResult.timing`: without overlap a post holds the
  host, and the solver may post after a later compute); each receive before the first compute of its rank that
  ends after its send is posted, so its batch is already posted when the sender's starts (the pair completes at
  the later start plus message_time); then, while a receive shares its batch with the receive of the compute
  right after and its message comes later than that compute starts (a compute waits for its whole batch), it
  moves one compute later (`_spread`); each channel's receives keep its sends' order on both sides;
- `improve_placement`: local moves on where the sends and receives sit (one swapped with a neighbouring compute,
  which changes which batch it joins and when it is posted, never the order of the messages on a channel), kept
  when the nccl makespan, then the sum of the compute ends, decreases; the simulator is the judge, and the caller
  verifies what it keeps (a move can make a deadlock, which the simulator refuses);
- `solve_placement`: where the moves stop above the solver's makespan (no single move helps, since a compute
  waits for its whole batch), a CP-SAT model of nccl's rule for the fixed compute order chooses every send's and
  receive's gap at once: per rank, computes in order with their post holds; per gap, the batch there starts at
  max(posted: the end of the compute before it, the previous gap's batch completed) and completes after each of
  its pairs, a pair at max(both batches' starts) + message_time; a consumer starts after the whole batch holding
  its receive; a channel's messages keep their order on both sides (and, without message time, a pair takes a
  tick too short to add up to a unit, so that batches waiting on each other in a cycle, a deadlock, have no
  timing). Each rule is an inequality whose least solution is what the simulator computes, so the model's optimum
  is the least nccl makespan over the placements it allows, and the simulator reproduces it (measured at P=4,
  M=8, V=2, I=2F, comm=0.5, limit 4: 51 after the moves, 50.5 after the solve, which proves 50.5 the best within
  its window).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from itertools import pairwise

from pipec.errors import PipecError
from pipec.ir import Action, Instruction, Kind, Program
from pipec.p2p_rule import consumers, counterpart, message_id, producers, send_for
from pipec.sim.costs import Costs
from pipec.sim.simulate import simulate
from pipec.tune.clock import (
    PLACEMENT_DETERMINISTIC_PER_SECOND,
    PLACEMENT_SECONDS_PER_OP,
    Clock,
    compute_ops,
    simulation_seconds,
)
from pipec.tune.cpsat import model_times
from pipec.tune.instance import exact_times

_EPSILON = 1e-9
_DIGITS = 9  # times rounded to these decimals (far finer than any model's unit) before they order a stream
_PLACED_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B})


def ahead(
    orders: Program,
    costs: Costs,
    timing: Mapping[Action, tuple[float, float | None]] | None = None,
    transfers: Mapping[Action, float] | None = None,
) -> Program | None:
    """The compute-only `orders` with send/recv placed as the module docstring says (None: the order cannot run).
    `timing`: per compute op its start and when its send is posted, as the solver timed them (cpsat.SolverResult);
    None: every op and post as early as the order allows. A solver may post a send after a later compute (the
    post holds the host without overlap), and the stream must say so: the sim posts a send where it sits.
    `transfers`: when each message moves (cpsat's `executed` solves): its receive is posted by then, not by the
    send's post."""
    times = model_times(orders, costs)
    if times is None:
        return None
    if timing is not None:
        if set(timing) != set(times):
            return None
        times = {op: (at, at + times[op][1] - times[op][0]) for op, (at, _) in timing.items()}
    # the stream sorts by these times: an end summed in floats (13.4 + 0.35) must not fall after the start it
    # equals in the model (13.75), which would put a receive after the compute that consumes it
    times = {op: (round(start, _DIGITS), round(end, _DIGITS)) for op, (start, end) in times.items()}
    n_mb = orders.microbatches
    where = orders.stage_to_rank
    delay = costs.message_time
    # per rank, its computes by start: a receive sits in slot j, after compute j - 1 and before compute j
    computes = [sorted(stream, key=lambda op: times[op][0]) for stream in orders.streams]
    index_of = [{op: j for j, op in enumerate(mine)} for mine in computes]
    ends = [[times[op][1] for op in mine] for mine in computes]
    items: list[list[tuple[tuple[float, ...], Instruction]]] = [[] for _ in orders.streams]
    # per receiving rank, [slot, posted, ident, receive, consumer's slot]; per channel, its receives in send order
    receives: list[list[list]] = [[] for _ in orders.streams]
    channels: dict[tuple[int, int], list[list]] = {}
    for rank, stream in enumerate(orders.streams):
        for index, action in enumerate(stream):
            start, end = times[action]
            items[rank].append(((start, 1, index, 0), action))
            send = send_for(action)
            if send is None or not 0 <= send.stage + (1 if action.kind is Kind.F else -1) < orders.num_stages:
                continue
            receive = counterpart(send)
            peer = where[receive.stage]
            if peer == rank:
                continue
            ident = message_id(send, n_mb)
            if timing is not None and timing[action][1] is not None:
                end = round(timing[action][1], _DIGITS)  # type: ignore[arg-type]
            items[rank].append(((end, 0, end, ident), send))
            consumer = (
                Action(receive.stage, Kind.F, receive.mb)
                if receive.kind is Kind.RECV_F
                else Action(receive.stage, Kind.I, receive.mb)
            )
            # first, right after the receiver's last compute that ends by the time the send is posted: its batch
            # is posted before the sender's starts
            moves = end if transfers is None else transfers.get(action, end)
            entry = [bisect.bisect_right(ends[peer], moves + _EPSILON), moves, ident, receive, index_of[peer][consumer]]
            receives[peer].append(entry)
            channels.setdefault((rank, peer), []).append(entry)
    for _ in range(3):
        moved = _spread(receives, computes, times, delay)
        for chain in channels.values():  # a channel's receives keep its sends' order
            chain.sort(key=lambda entry: (entry[1], entry[2]))
            for earlier, later in pairwise(chain):
                if later[0] < earlier[0]:
                    later[0], moved = earlier[0], True
        if not moved:
            break
    for rank, mine in enumerate(receives):
        for slot, posted, ident, receive, _ in mine:
            after = ends[rank][slot - 1] if slot else 0.0
            items[rank].append(((after, 0, posted, ident), receive))
    streams = tuple(tuple(instruction for _, instruction in sorted(mine, key=lambda item: item[0])) for mine in items)
    return orders.with_streams(streams, has_comms=True)


def _spread(receives: list[list[list]], computes: list[list[Action]], times, delay: float) -> bool:
    """Move a receive one slot later while it shares its batch with the receive of the compute right after and
    its message would arrive after that compute's start (the batch completes with its last op: the compute would
    wait for a message it does not need). Returns whether any moved."""
    moved = False
    for rank, mine in enumerate(receives):
        by_slot: dict[int, list[list]] = {}
        for entry in mine:
            by_slot.setdefault(entry[0], []).append(entry)
        for slot in sorted(by_slot):
            if slot >= len(computes[rank]):
                continue
            members = by_slot[slot]
            if not any(entry[4] == slot for entry in members):
                continue  # the compute after the batch consumes none of it: it does not wait for it
            begins = times[computes[rank][slot]][0]
            for entry in members:
                if entry[4] > slot and entry[1] + delay > begins + _EPSILON:
                    entry[0] = slot + 1
                    by_slot.setdefault(slot + 1, []).append(entry)
                    moved = True
    return moved


def place(
    orders: Program,
    placed: Program,
    makespan: float,
    costs: Costs,
    clock: Clock,
    deadline: float,
    timing: Mapping[Action, tuple[float, float | None]] | None = None,
    target: float | None = None,
    transfers: Mapping[Action, float] | None = None,
) -> tuple[Program, bool] | None:
    """The compute-only `orders` placed as the module docstring says, from the fastest start of `placed` (its
    placement as tune judged it, at `makespan` under nccl) and `ahead`'s from `timing` (and from `transfers`),
    then the local moves until `clock` passes `deadline`; for a solver order, `target` (its makespan in the
    model) given, half of the time left for the moves and, while they stop above it, the placement solve. Returns
    the placed program and whether the moves ended before the deadline; None when `ahead` cannot place the
    order."""
    first = ahead(orders, costs, timing)
    if first is None:
        return None
    begin, fastest = placed, makespan
    for option in (first, None if transfers is None else ahead(orders, costs, timing, transfers)):
        score = None if option is None else nccl_score(option, costs)
        if score is not None and score[0] < fastest - _EPSILON:
            begin, fastest = option, score[0]
    # a solver order (`target`, so OR-tools is there) keeps half the time for the placement solve
    moves_until = deadline if target is None else clock.after(clock.left(deadline) / 2)
    better, finished = improve_placement(begin, costs, clock, moves_until)
    reached = nccl_score(better, costs)
    if target is not None and reached is not None and reached[0] > target + _EPSILON:
        # the moves stop where no single one helps; the solve looks at every placement near that one at once
        solved = solve_placement(better, costs, clock, clock.left(deadline), target=target)
        score = None if solved is None else nccl_score(solved, costs)
        if score is not None and score < reached:
            better = solved
    return better, finished


def nccl_score(program: Program, costs: Costs) -> tuple[float, float] | None:
    """(nccl makespan, the sum of the compute ends) of a placed program, or None when it does not run."""
    try:
        sim = simulate(program, costs, p2p="nccl", record=True)
    except PipecError:
        return None
    return sim.makespan, sum(op.end for line in sim.timeline for op in line if not op.is_comm)


def improve_placement(program: Program, costs: Costs, clock: Clock, deadline: float) -> tuple[Program, bool]:
    """First-improvement moves of single sends/receives past a neighbouring compute (module docstring), until none
    helps or `clock` passes `deadline`. Returns the placed program and whether no move helps (False:
    the deadline stopped it)."""
    best = nccl_score(program, costs)
    each = simulation_seconds(PLACEMENT_SECONDS_PER_OP, program)  # the clock's charge for one score
    clock.charge(each)
    if best is None:
        return program, True
    streams = [list(stream) for stream in program.streams]
    while True:
        improved = False
        for stream in streams:
            for i in range(len(stream) - 1):
                if clock.passed(deadline):
                    return program.with_streams(tuple(map(tuple, streams)), has_comms=True), False
                a, b = stream[i], stream[i + 1]
                if _is_comm(a) == _is_comm(b):
                    continue  # two computes, or two messages (their order on a channel is fixed)
                stream[i], stream[i + 1] = b, a
                score = nccl_score(program.with_streams(tuple(map(tuple, streams)), has_comms=True), costs)
                clock.charge(each)
                if score is not None and (
                    score[0] < best[0] - _EPSILON or (score[0] <= best[0] + _EPSILON and score[1] < best[1] - _EPSILON)
                ):
                    best, improved = score, True
                else:
                    stream[i], stream[i + 1] = a, b
        if not improved:
            return program.with_streams(tuple(map(tuple, streams)), has_comms=True), True


# how many computes each send/recv may move from the last placement in one placement solve: the narrow window
# first, the wide one when the narrow finds nothing faster
PLACEMENT_WINDOWS = (1, 3)


def solve_placement(
    program: Program,
    costs: Costs,
    clock: Clock,
    seconds: float,
    windows: tuple[int, ...] = PLACEMENT_WINDOWS,
    target: float | None = None,
) -> Program | None:
    """The send/recv of a placed `program` (it must run under nccl) placed again by CP-SAT models of nccl's
    batches for its compute order (module docstring): each solve takes every placement within a window of gaps
    around the last one's, and the next starts from its best; a solve that finds nothing faster widens the
    window, one that does narrows it again, until the widest finds nothing or `seconds` end (measured at P=4,
    M=8, V=2, comm=0.5: a window of 1 proves its best in a fifth of the time a window of 2 or 4 takes to find it;
    on small cases it stops half a unit short where 3 reaches the best of any window). None when the model
    cannot take the program or finds nothing faster. `clock`: the budget's, charged for the solves (in CP-SAT's
    deterministic time: the same result whatever the load) and the scores. `target`: a makespan no placement
    beats (the order's own in the solver's model, which never times an order later than nccl does): reaching it
    ends the solves."""
    deadline = clock.after(seconds)
    each = simulation_seconds(PLACEMENT_SECONDS_PER_OP, program)  # the clock's charge for one score
    best, score = None, nccl_score(program, costs)
    clock.charge(each)
    level = 0
    reached = -math.inf if target is None else target + _EPSILON
    while score is not None and score[0] > reached and level < len(windows) and not clock.passed(deadline):
        placed = _placement_solve(program, costs, clock, clock.left(deadline), windows[level])
        faster = None if placed is None else nccl_score(placed, costs)
        clock.charge(each)
        if faster is None or faster >= score:
            level += 1
            continue
        best, program, score, level = placed, placed, faster, 0
    return best


def _placement_solve(program: Program, costs: Costs, clock: Clock, seconds: float, window: int) -> Program | None:
    """One placement solve (`solve_placement`): each send and receive sits in one of the gaps between its rank's
    computes within `window` gaps of where `program` has it (program itself, solved with its placement fixed, is
    the hint); the model's makespan is the least nccl makespan of those placements, and the simulator reproduces
    it (each constraint is one of nccl's rules as an inequality, so the simulated times are never later)."""
    from ortools.sat.python import cp_model

    deadline = clock.after(seconds)
    split = _computes_and_comms(program)
    if split is None:
        return None
    try:
        horizon = simulate(program, costs, p2p="nccl").makespan
    except PipecError:
        return None
    batches = _Batches(program, costs, *split, horizon)
    batches.place(window)
    # a complete hint: the model with every send/recv where `program` has it, solved (propagation alone)
    fixed = batches.model.clone()
    for (rank, position), flags in batches.choice.items():
        gap = next(gap for gap, pos, _ in batches.comms[rank] if pos == position)
        for g, flag in flags.items():
            fixed.add(fixed.get_bool_var_from_proto_index(flag.index) == (g == gap))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    ops = compute_ops(program)  # the simulation and the model, charged by size
    solved = (cp_model.OPTIMAL, cp_model.FEASIBLE)
    rate = PLACEMENT_DETERMINISTIC_PER_SECOND  # its own: these solves do few deterministic units a second
    if clock.run_solver(solver, fixed, clock.left(deadline), ops, rate=rate)[0] not in solved:
        return None
    model = batches.model
    for index in range(len(model.proto.variables)):
        variable = model.get_int_var_from_proto_index(index)
        model.add_hint(variable, solver.value(variable))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    if clock.run_solver(solver, model, clock.left(deadline), ops, rate=rate)[0] not in solved:
        return None
    streams = []
    for rank, mine in enumerate(batches.computes):
        placed: list[tuple[tuple[int, int, int], Action]] = [((j, 1, 0), op) for j, op in enumerate(mine)]
        for _, position, op in batches.comms[rank]:
            g = next(g for g, flag in batches.choice[(rank, position)].items() if solver.boolean_value(flag))
            placed.append(((g, 0, position), op))  # within a gap, the reference's order (each channel's)
        streams.append(tuple(op for _, op in sorted(placed, key=lambda item: item[0])))
    return program.with_streams(tuple(streams), has_comms=True)


def _computes_and_comms(program: Program) -> tuple[list[list[Action]], list[list[tuple[int, int, Action]]]] | None:
    """Per rank its computes in order and its sends and receives as (the gap they sit in: the number of computes
    before them, their position in the stream, the op); None for what the placement model does not take."""
    computes: list[list[Action]] = [[] for _ in program.streams]
    comms: list[list[tuple[int, int, Action]]] = [[] for _ in program.streams]
    for rank, stream in enumerate(program.streams):
        for position, op in enumerate(stream):
            if type(op) is not Action or op.kind not in _PLACED_KINDS:
                return None  # an overlapped pair or a collective: not in this model
            if op.kind.is_comm:
                comms[rank].append((len(computes[rank]), position, op))
            else:
                computes[rank].append(op)
    return computes, comms


class _Batches:
    """The placement model of one compute order (`_placement_solve`), in integer time units: per rank its
    computes' starts, per gap between them the start and completion of the batch posted there, per send/recv a
    Boolean per gap it may sit in (`place`), and the makespan, minimised."""

    def __init__(
        self,
        program: Program,
        costs: Costs,
        computes: list[list[Action]],
        comms: list[list[tuple[int, int, Action]]],
        horizon: float,
    ) -> None:
        from ortools.sat.python import cp_model

        self.program, self.computes, self.comms = program, computes, comms
        scale, exact, message = exact_times(costs, program.num_stages, (Kind.F, Kind.B, Kind.I, Kind.W))
        # without message time a cycle of batches waiting on each other (a deadlock under nccl) is a cycle of
        # zero-length inequalities, which the model would satisfy; a pair then takes one tick, in time units
        # of ticks more than messages, so that no chain of ticks adds up to a unit (measured at P=4, M=8, V=2,
        # F=1, I=1.5, W=0.7, limit 4: every placement solved deadlocked, and the moves stopped at 28.1 of 27.85)
        ticks = 0 if message > 0 else 1 + sum(len(mine) for mine in comms)  # a unit's ticks (none: not needed)
        self.tick = 1 if ticks else 0
        scale *= ticks or 1
        self.delay = int(message * scale)
        self.post = 0 if costs.overlap else self.delay
        self.index_of = [{op: j for j, op in enumerate(mine)} for mine in computes]
        self.horizon = top = math.ceil(horizon * scale) + 1 + ticks
        self.model = model = cp_model.CpModel()
        self.start = [[model.new_int_var(0, top, f"c{r}_{j}") for j in range(len(m))] for r, m in enumerate(computes)]
        self.dur = [[int(exact[op.kind][op.stage] * scale) for op in mine] for mine in computes]
        self.gaps = gaps = [len(mine) + 1 for mine in computes]
        self.begins = [[model.new_int_var(0, top, f"b{r}_{g}") for g in range(n)] for r, n in enumerate(gaps)]
        self.completes = [[model.new_int_var(0, top, f"d{r}_{g}") for g in range(n)] for r, n in enumerate(gaps)]
        self.makespan = model.new_int_var(0, top, "makespan")
        self.choice: dict[tuple[int, int], dict[int, object]] = {}
        for rank, n in enumerate(gaps):
            for g in range(n):
                # a batch is posted when the host reaches its gap and starts when its predecessor completed
                if g:
                    model.add(self.begins[rank][g] >= self.end(rank, g - 1))
                    model.add(self.begins[rank][g] >= self.completes[rank][g - 1])
                model.add(self.completes[rank][g] >= self.begins[rank][g])
            model.add(self.makespan >= self.completes[rank][n - 1])
        model.minimize(self.makespan)

    def end(self, rank: int, j: int):
        return self.start[rank][j] + self.dur[rank][j]

    def place(self, window: int) -> None:
        """Each send/recv in one gap of its window (after its producer, by its consumer); the hosts, the pairs
        and the channels' order."""
        n_mb = self.program.microbatches
        sends: dict[int, tuple[int, int]] = {}
        receives: dict[int, tuple[int, int]] = {}
        holds: list[list[list]] = [[[] for _ in range(n)] for n in self.gaps]
        for rank, mine in enumerate(self.comms):
            for gap, position, op in mine:
                is_send = op.kind in (Kind.SEND_F, Kind.SEND_B)
                if is_send:
                    producer = next(p for p in producers(op) if p in self.index_of[rank])
                    low, high = self.index_of[rank][producer] + 1, self.gaps[rank] - 1
                    sends[message_id(op, n_mb)] = (rank, position)
                else:
                    low, high = 0, self._consumer(rank, op)
                    receives[message_id(op, n_mb)] = (rank, position)
                options = range(max(low, gap - window), min(high, gap + window) + 1)
                flags = {g: self.model.new_bool_var(f"g{rank}_{position}_{g}") for g in options}
                self.model.add_exactly_one(flags.values())
                for g, flag in flags.items():
                    if is_send:
                        holds[rank][g].append(flag)
                self.choice[(rank, position)] = flags
        self._hosts(holds)
        for ident, sender in sends.items():
            self._pair(sender, receives[ident], ident)
        self._channels(sends, receives)

    def _consumer(self, rank: int, receive: Action) -> int:
        return self.index_of[rank][next(c for c in consumers(receive) if c in self.index_of[rank])]

    def _hosts(self, holds: list[list[list]]) -> None:
        """A compute starts after the one before it and the post holds of the sends in the gap between."""
        model = self.model
        for rank, mine in enumerate(self.computes):
            for j in range(len(mine)):
                before = self.end(rank, j - 1) if j else 0
                model.add(self.start[rank][j] >= before + self.post * sum(holds[rank][j]))
            last = len(mine) - 1
            tail = self.end(rank, last) if last >= 0 else 0
            model.add(self.makespan >= tail + self.post * sum(holds[rank][last + 1]))

    def _pair(self, sender: tuple[int, int], receiver: tuple[int, int], ident: int) -> None:
        """A pair completes message_time after both its batches started, each batch after it, and the consumer
        starts after the whole batch holding its receive."""
        model = self.model
        done = model.new_int_var(0, self.horizon, f"m{ident}")
        for rank, position in (sender, receiver):
            for g, flag in self.choice[(rank, position)].items():
                model.add(done >= self.begins[rank][g] + self.delay + self.tick).only_enforce_if(flag)
                model.add(self.completes[rank][g] >= done).only_enforce_if(flag)
        rank, position = receiver
        consumer = self._consumer(rank, self.program.streams[rank][position])  # type: ignore[arg-type]
        for g, flag in self.choice[receiver].items():
            model.add(self.start[rank][consumer] >= self.completes[rank][g]).only_enforce_if(flag)

    def _channels(self, sends: dict[int, tuple[int, int]], receives: dict[int, tuple[int, int]]) -> None:
        """A channel's messages keep their order on both sides (the k-th send meets the k-th receive)."""
        n_mb = self.program.microbatches
        channels: dict[tuple[int, int], list[int]] = {}
        for rank, mine in enumerate(self.comms):
            for _, _, op in mine:
                if op.kind in (Kind.SEND_F, Kind.SEND_B):
                    peer = self.program.stage_to_rank[counterpart(op).stage]
                    channels.setdefault((rank, peer), []).append(message_id(op, n_mb))
        for chain in channels.values():
            for earlier, later in pairwise(chain):
                for side in (sends, receives):
                    self.model.add(_gap_of(self.choice[side[earlier]]) <= _gap_of(self.choice[side[later]]))


def _gap_of(flags: Mapping[int, object]):
    return sum(g * flag for g, flag in flags.items())


def _is_comm(instruction: Instruction) -> bool:
    return type(instruction) is Action and instruction.kind.is_comm


__all__ = ["PLACEMENT_WINDOWS", "ahead", "improve_placement", "nccl_score", "place", "solve_placement"]

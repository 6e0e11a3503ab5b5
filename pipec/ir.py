"""The intermediate representation: ops, instructions, programs, and the dependency DAG.

A ``Program`` is the compiled schedule: per-rank instruction streams plus the facts they were compiled
for (P, M, V, placement, memory bound). ``build_graph`` lowers it to a NetworkX DiGraph for inspection
and for passes that want a graph; the hot paths (expansion, verification, simulation) work on the flat
per-rank streams, which is what keeps them linear in the number of ops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pipec.errors import PipecSyntaxError, Span
from pipec.limits import MAX_MICROBATCHES, MAX_STAGES

if TYPE_CHECKING:
    from collections.abc import Sequence

    import networkx as nx


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (I and W at once)
    I = "I"  # noqa: E741 - backward for inputs, the paper's and torch's name
    W = "W"  # backward for weights
    SEND_F = "SEND_F"  # send F's output activation to the next stage
    RECV_F = "RECV_F"  # receive this F's input activation from the previous stage
    SEND_B = "SEND_B"  # send the input gradient to the previous stage
    RECV_B = "RECV_B"  # receive the output gradient from the next stage
    # all-reduce (SUM) of a sync group's shared-parameter gradients with the group's other member ranks; an
    # Action(stage, SYNC, group) names the group where other kinds name the micro-batch
    SYNC = "SYNC"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """Communication of either kind: point-to-point (SEND/RECV) or collective (SYNC)."""
        return not self.is_compute

    @property
    def is_p2p(self) -> bool:
        return self in P2P_KINDS

    @property
    def is_collective(self) -> bool:
        return self is Kind.SYNC

    @property
    def is_recv(self) -> bool:
        return self is Kind.RECV_F or self is Kind.RECV_B


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})
P2P_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


class Action(NamedTuple):
    """One op on one (stage, micro-batch). Its text form is torch's: `2F0`, `1SEND_B3`. A SYNC's third field is its
    sync group, not a micro-batch: `0SYNC1` is stage 0's all-reduce of group 1 (``Program.sync_groups``)."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        # `_value_` is a plain attribute; `.value` goes through enum's descriptor, ~40% of text emission
        return f"{self.stage}{self.kind._value_}{self.mb}"

    # The text form, which parse_instruction reads back: a stream (a tuple of instructions) then prints as
    # `(0F0, 0SEND_F0, 0F1, ...)` rather than `(Action(stage=0, kind=<Kind.F: 'F'>, mb=0), ...)`.
    __repr__ = __str__

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self,)


class Overlap(NamedTuple):
    """Two compute actions run as one instruction (DualPipe's overlapped F and B of two micro-batches)."""

    first: Action
    second: Action

    def __str__(self) -> str:
        return f"({self.first};{self.second})OVERLAP_F_B"

    __repr__ = __str__  # as Action's: the text form, which parse_instruction reads back

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self.first, self.second)


Instruction = Action | Overlap

_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SYNC|F|B|I|W)(\d+)")
_OVERLAP_RE = re.compile(r"\(([^;()]+);([^;()]+)\)OVERLAP_F_B")


def parse_instruction(text: str) -> Instruction:
    """The inverse of ``str(instruction)``; also accepts the .pipe literal pair form `0F1&1B2`."""
    text = text.strip()
    if m := _ACTION_RE.fullmatch(text):
        kind = Kind(m[2])
        third = "group" if kind is Kind.SYNC else "micro-batch"
        return Action(_number(m[1], "stage", text), kind, _number(m[3], third, text))
    m = _OVERLAP_RE.fullmatch(text)
    halves = (m[1], m[2]) if m else tuple(text.split("&")) if text.count("&") == 1 else None
    if halves:
        first, second = (parse_instruction(h) for h in halves)
        if (
            isinstance(first, Action)
            and isinstance(second, Action)
            and first.kind.is_compute
            and second.kind.is_compute
        ):
            return Overlap(first, second)
    raise PipecSyntaxError(
        f"{text!r} is not an action: expected STAGE KIND MICROBATCH such as 0F1, 2I0, 1SEND_F3, "
        "a sync STAGE SYNC GROUP such as 0SYNC0, or an overlapped pair (0F1;1B2)OVERLAP_F_B"
    )


def _number(digits: str, what: str, text: str) -> int:
    """A stage or micro-batch number of an action, refused beyond the limits before int() converts it: a stream
    file's actions decide its P, M and V, and a 5,000-digit number would also exceed Python's int-string limit."""
    limit = MAX_MICROBATCHES if what == "micro-batch" else MAX_STAGES  # a group lists stages: at most as many
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) >= limit:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise PipecSyntaxError(f"{shown!r}: the {what} number is over pipec's limit of {limit - 1:,}")
    return int(digits)


DEFAULT_INPUT_FRACTION = 0.5  # the share of a stage's activations that I frees (W frees the rest)
# Live memory is a float sum of fractions (0.1 + 0.2 must not exceed a bound of 0.3): the verifier and every pass
# that admits ops by memory compare against a limit with this one tolerance, so what they admit, it proves.
MEMORY_TOLERANCE = 1e-9


def activation_deltas(input_fraction: float = DEFAULT_INPUT_FRACTION) -> dict[Kind, float]:
    """Per-op change of live activations for a stage of size 1: the one liveness rule (pipec/verify/memory.py's
    model), kept in the IR so that the verifier and the passes that order by memory use the same numbers."""
    return {Kind.F: 1.0, Kind.B: -1.0, Kind.I: -input_fraction, Kind.W: input_fraction - 1.0}


def v_placement(ranks: int, stages: int) -> tuple[int, ...]:
    """Stage -> rank for the V (zig-zag) shape: rank r holds stages r, 2P-1-r, 2P+r, ..."""
    return tuple(s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks for s in range(stages))


def loop_placement(ranks: int, stages: int) -> tuple[int, ...]:
    """Stage -> rank for Megatron's looped placement: s -> s mod P."""
    return tuple(s % ranks for s in range(stages))


Spans = tuple[tuple[Span, ...], ...]  # per rank, the span of the text that emitted each instruction of its order


class Provenance(Protocol):
    """Where a program's ops were written. The front end gives each program it expands from a `.pipe` one
    (pipec.frontend.expand.PipeSource); explanations ask through ``Program.op_spans()``, so that the layers above
    need not import the front end."""

    def op_spans(self, program: Program) -> Spans | None: ...


@dataclass(frozen=True, repr=False)
class Program:
    """A compiled schedule: per-rank instruction streams and the parameters they were compiled for.

    ``program.check()`` (raise ScheduleError unless every verification pass holds) is ``pipec.check``, attached by
    ``pipec/__init__.py``: the verifier is a layer above the IR and imports it, so the IR must not import the
    verifier (docs/architecture.md, "Layers").
    """

    name: str
    ranks: int
    microbatches: int
    chunks: int
    stage_to_rank: tuple[int, ...]
    streams: tuple[tuple[Instruction, ...], ...]
    memory_bound: tuple[float, ...] | None = None
    params: dict[str, int] = field(default_factory=dict)
    description: str = ""
    source: str = ""
    has_comms: bool = False
    forward_only: bool = False  # inference: every stage runs F only
    expected: dict[str, Fraction] = field(default_factory=dict)  # `expect bubble ...` figures, for pipec.testing
    # group g: the stages whose copies of one shared parameter set are summed by SYNC g (tied embeddings: (0, S-1);
    # the copies of one replicated stage); the SYNCs themselves are placed by pipec.passes.sync.insert_syncs
    sync_groups: tuple[tuple[int, ...], ...] = ()
    # replicated pipelines (docs/design/replicated.md): C copies of the model over the same ranks, stages numbered
    # over the copies (copy c's stage l is stage c * L + l, L = num_stages // pipelines); routes[m] is the copy
    # micro-batch m goes through (empty: every micro-batch through copy 0, today's single chain)
    pipelines: int = 1
    routes: tuple[int, ...] = ()
    # the text it came from, if any; not part of what the program is: equal orders are equal programs
    provenance: Provenance | None = field(default=None, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_pipeline(self) -> int:
        """L: the stages of one copy of the model (all of them when the program has one pipeline)."""
        return self.num_stages // self.pipelines

    def pipeline_of(self, stage: int) -> int:
        return stage // self.stages_per_pipeline

    def is_first(self, stage: int) -> bool:
        """Whether ``stage`` is the first of its copy: where a micro-batch's input enters, and B/I send nothing."""
        return stage % self.stages_per_pipeline == 0

    def is_last(self, stage: int) -> bool:
        """Whether ``stage`` is the last of its copy: where the loss is, and F sends nothing."""
        return (stage + 1) % self.stages_per_pipeline == 0

    def route_of(self, mb: int) -> int:
        """The copy micro-batch ``mb`` goes through."""
        return self.routes[mb] if self.routes else 0

    def stages_of_microbatch(self, mb: int) -> range:
        """The stages micro-batch ``mb`` passes, first to last."""
        first = self.route_of(mb) * self.stages_per_pipeline
        return range(first, first + self.stages_per_pipeline)

    def routing_problem(self) -> str | None:
        """What is wrong with ``pipelines`` and ``routes``, if anything: C must divide the stages, and routes be
        empty or name one copy 0..C-1 per micro-batch. Every engine that reads them asks this first."""
        copies, stages, mbs = self.pipelines, self.num_stages, self.microbatches
        if type(copies) is not int or copies < 1:
            return f"pipelines must be a positive integer, got {copies!r}"
        if stages % copies:
            return f"{stages} stages do not split into {copies} pipelines (copies of the model) of equal length"
        if not self.routes:
            return None
        if len(self.routes) != mbs:
            return f"routes give {len(self.routes)} micro-batches a copy; the program has {mbs} micro-batches"
        for mb, copy in enumerate(self.routes):
            if type(copy) is not int or not 0 <= copy < copies:
                return f"the route of micro-batch {mb} is {copy!r}: the copies are 0..{copies - 1}"
        return None

    def crossings(self) -> int:
        """How many values cross ranks forward in one step (as many gradients cross back): per micro-batch, the rank
        boundaries of its copy's chain."""
        placement, length = self.stage_to_rank, self.stages_per_pipeline
        per_copy = [
            sum(1 for s in range(c * length, (c + 1) * length - 1) if placement[s] != placement[s + 1])
            for c in range(self.pipelines)
        ]
        if not self.routes:
            return per_copy[0] * self.microbatches
        return sum(per_copy[copy] for copy in self.routes)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def stage_chunks(self) -> tuple[int, ...]:
        """Stage -> its chunk number on its rank (0 for the rank's first stage), as `F[c]` counts them."""
        seen: dict[int, int] = {}
        out = []
        for rank in self.stage_to_rank:
            out.append(seen.get(rank, 0))
            seen[rank] = out[-1] + 1
        return tuple(out)

    def compute_streams(self) -> tuple[tuple[Instruction, ...], ...]:
        """The streams without send/recv (and SYNC) instructions."""
        return tuple(
            tuple(i for i in stream if not (isinstance(i, Action) and i.kind.is_comm)) for stream in self.streams
        )

    def op_spans(self) -> Spans | None:
        """Where each compute instruction was written: per rank, one span per instruction of its compute order
        (send/recv left out), or None when the program did not come from a `.pipe` or its orders were changed
        since."""
        return None if self.provenance is None else self.provenance.op_spans(self)

    def with_streams(self, streams: tuple[tuple[Instruction, ...], ...], has_comms: bool) -> Program:
        return replace(self, streams=streams, has_comms=has_comms)

    def graph(self) -> nx.DiGraph:
        return build_graph(self)

    if TYPE_CHECKING:  # the signature for type checkers and editors; the method itself is pipec.check

        def check(
            self,
            p2p: str = "nccl",
            memory_limit: float | None = None,
            input_fraction: float | None = None,
            stage_sizes: Sequence[float] | None = None,
        ) -> Any: ...

    def __repr__(self) -> str:
        # the generated repr printed every instruction of every rank: thousands of lines for one REPL echo
        named = "".join(f" {k}={v}" for k, v in self.params.items() if k not in ("P", "M", "V"))
        count = sum(map(len, self.streams))
        what = "instructions with send/recv" if self.has_comms else "compute instructions"
        return (
            f"<Program {self.name} P={self.ranks} M={self.microbatches} V={self.chunks}{named}: "
            f"{self.ranks} ranks, {self.num_stages} stages, {count:,} {what}>"
        )


# chain_links' tables: per stage, whether its forward hands on to stage + 1 and whether its backward to stage - 1
ChainLinks = tuple[list[bool], list[bool]]


def chain_links(num_stages: int, pipelines: int = 1) -> ChainLinks:
    """Per stage, whether its forward hands to stage + 1 (it is not its copy's last) and whether its backward hands
    to stage - 1 (it is not its copy's first). With stages numbered over the copies a stage's neighbours are always
    stage +- 1; only where a chain ends depends on the copies. The hot loops read these tables in place of the
    single chain's `stage < S - 1` and `stage > 0`."""
    length = num_stages // pipelines
    has_next = [(s + 1) % length != 0 for s in range(num_stages)]
    has_previous = [s % length != 0 for s in range(num_stages)]
    return has_next, has_previous


def build_graph(program: Program) -> nx.DiGraph:
    """Lower a program to its dependency DAG.

    Nodes are Actions (hashable NamedTuples) with attributes ``rank`` and ``index`` (position in the rank's
    stream; both halves of an overlapped pair share it). Edges carry ``kind``:
    ``data`` (F(s,m)->F(s+1,m), F(s,m)->B/I(s,m), B/I(s+1,m)->B/I(s,m), I(s,m)->W(s,m); none across the end of
    one copy's chain and the start of the next, ``chain_links``),
    ``program`` (consecutive instructions of one rank) and ``p2p`` (SEND -> its RECV).
    """
    import networkx as nx

    graph = nx.DiGraph(name=program.name, ranks=program.ranks, microbatches=program.microbatches)
    has_next, has_previous = chain_links(program.num_stages, program.pipelines)
    for rank, stream in enumerate(program.streams):
        previous: tuple[Action, ...] = ()
        for index, instruction in enumerate(stream):
            parts = instruction.parts
            for action in parts:
                graph.add_node(action, rank=rank, index=index)
                for before in previous:
                    graph.add_edge(before, action, kind="program")
            previous = parts
    for node in list(graph.nodes):
        stage, kind, mb = node
        if kind is Kind.F and has_next[stage]:
            _add_data_edge(graph, node, Action(stage + 1, Kind.F, mb))
        if kind is Kind.F:
            _add_data_edge(graph, node, Action(stage, Kind.B, mb))
            _add_data_edge(graph, node, Action(stage, Kind.I, mb))
        if kind in BACKWARD_KINDS and has_previous[stage]:
            _add_data_edge(graph, node, Action(stage - 1, Kind.B, mb))
            _add_data_edge(graph, node, Action(stage - 1, Kind.I, mb))
        if kind is Kind.I:
            _add_data_edge(graph, node, Action(stage, Kind.W, mb))
        if kind is Kind.SEND_F:
            _add_data_edge(graph, node, Action(stage + 1, Kind.RECV_F, mb), "p2p")
        if kind is Kind.SEND_B:
            _add_data_edge(graph, node, Action(stage - 1, Kind.RECV_B, mb), "p2p")
    return graph


def _add_data_edge(graph: nx.DiGraph, source: Action, target: Action, kind: str = "data") -> None:
    if target in graph:
        graph.add_edge(source, target, kind=kind)

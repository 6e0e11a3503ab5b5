"""The driver: a list of named phases from SCHEDULE text to instruction streams.

    load      SCHEDULE -> (kind, text)                 library.resolve
    parse     .pipe text -> AST                        frontend.parser.parse
    expand    AST + P, M, V -> per-rank compute orders frontend.expand.prepare  (or a stream-file loader; a
              `choose` section: frontend.choose.run_choose, list-scheduled under the costs given)
    lower     orders -> orders with SEND/RECV          passes.p2p.insert_p2p_ops
Verification and back ends take the resulting Program.

Every phase is bounded on hostile input (pipec.limits): load caps the bytes read, parse the nesting and
the integer literals, expand P, M, V, the steps, the ops and the wall time; a stream file's P, M and V are checked
here once loaded, before verification loops over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipec.emit import load_json, load_text, load_torch_csv
from pipec.errors import PipecInputError
from pipec.frontend.ast import Schedule
from pipec.frontend.choose import ChooseRules, ChooseSpec, ListScheduler, run_choose
from pipec.frontend.expand import prepare
from pipec.frontend.parser import parse
from pipec.gcpause import without_cyclic_gc
from pipec.ir import DEFAULT_INPUT_FRACTION, Program
from pipec.library import resolve
from pipec.limits import check_sizes
from pipec.passes.list_schedule import Rules, list_schedule
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import with_copy_syncs

if TYPE_CHECKING:  # for the hints only: compiling with the default costs need not load the cost model
    from pipec.sim.costs import Costs


def parse_schedule(schedule: str) -> Schedule:
    """The AST of a .pipe schedule (name, path or source text)."""
    kind, text, filename = resolve(schedule)
    if kind != "pipe":
        raise PipecInputError(f"{filename} is a {kind} stream file, not a .pipe schedule")
    try:
        return parse(text, filename)
    except RecursionError:  # the parser bounds the nesting; this is the last line of defence
        raise PipecInputError(f"{filename}: expressions or blocks are nested too deeply to compile") from None


def compute_orders(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    params: Mapping[str, int] | None = None,
    costs: Costs | None = None,
    input_fraction: float = DEFAULT_INPUT_FRACTION,
    stage_sizes: Sequence[float] | None = None,
    memory_limit: float | None = None,
    per_rank_share: bool = False,
) -> Program:
    """Phases load, parse and expand: the per-rank compute orders (or a stream file as written).

    The other arguments matter to a `choose` schedule only, whose orders are list-scheduled under ``costs`` (None:
    the default costs) with the verifier's memory model (``input_fraction``, ``stage_sizes``, ``memory_limit``).
    ``per_rank_share``: those are per rank share of the model (`--per-rank-share`), converted here once P and V
    are known, as `pipec simulate` converts them."""
    kind, text, filename = resolve(schedule)
    expected = {"P": ranks, "M": microbatches, "V": chunks}
    if kind != "pipe" and params:
        raise PipecInputError(f"{filename}: --set applies to .pipe schedules only")
    if kind != "pipe":
        loader = {"csv": load_torch_csv, "text": load_text, "json": load_json}[kind]
        program = loader(text, filename, expected)
        # the file decides P, M and V (M from its largest micro-batch, for instance): the verifier's loops over
        # stages and micro-batches must not meet an M of 10**12
        check_sizes(program.ranks, program.microbatches, program.chunks, filename)
        return program
    try:
        found = prepare(parse(text, filename), ranks, microbatches, chunks, params, source=filename)
    except RecursionError:
        raise PipecInputError(f"{filename}: expressions or blocks are nested too deeply to compile") from None
    if not isinstance(found, ChooseSpec):
        return found
    template, sizes = found.template, None if stage_sizes is None else tuple(stage_sizes)
    if per_rank_share:
        from pipec.sim.costs import Costs
        from pipec.sim.costs import per_rank_share as share_costs
        from pipec.verify.memory import share_stage_sizes

        copies = template.pipelines
        costs = share_costs(costs if costs is not None else Costs(), template.ranks, template.chunks, copies)
        sizes = share_stage_sizes(sizes, template.ranks, template.chunks, copies)
    scheduler = _list_scheduler(found.template, costs, input_fraction, sizes)
    return run_choose(found, scheduler, memory_limit, share=per_rank_share)


def _list_scheduler(
    template: Program, costs: Costs | None, input_fraction: float, stage_sizes: tuple[float, ...] | None
) -> ListScheduler:
    """A choose section's orders by the list scheduler under these costs and memory model (the front end sits below
    the passes, so the driver hands it the scheduler). Mistakes in the costs or sizes are reported as themselves,
    here, before the run."""
    if costs is not None:
        costs.per_stage(template.num_stages)
    if stage_sizes is not None and len(stage_sizes) != template.num_stages:
        raise PipecInputError(f"{len(stage_sizes)} stage sizes given for {template.num_stages} stages")

    def schedule(template: Program, rules: ChooseRules) -> Program:
        passes_rules = Rules(
            rules.takes, priority=rules.priority, admit=rules.admit, limit=rules.limit, overlap=rules.overlap
        )
        return list_schedule(template, passes_rules, costs, input_fraction, stage_sizes)

    return schedule


def compile_program(
    schedule: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    params: Mapping[str, int] | None = None,
    comms: bool = True,
    costs: Costs | None = None,
) -> Program:
    """Every phase: the instruction streams, with send/recv inserted unless the input already had them. ``costs``
    time the placement of the send/recv (None: the default costs), and order a `choose` schedule; a stream file
    that has send/recv keeps its own."""
    with without_cyclic_gc():
        program = compute_orders(schedule, ranks, microbatches, chunks, params, costs)
        if comms and not program.has_comms:
            program = place_p2p(program, costs)
    return program


def place_p2p(program: Program, costs: Costs | None = None) -> Program:
    """Send/recv placed for ``costs``: the default placement (None), else the replay timed with them unless the
    default placement simulates faster under them (pipec.sim.placement; the simulator is loaded only then). Either
    way a program of several pipelines gets the SYNCs of its copies (pipec.passes.sync.with_copy_syncs)."""
    if costs is None:
        return with_copy_syncs(insert_p2p_ops(program))
    from pipec.sim.placement import fastest_placement

    return fastest_placement(program, costs)


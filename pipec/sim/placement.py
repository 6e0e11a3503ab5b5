"""Send/recv placed for a cost model: passes/p2p.py's replay timed with the costs, unless the default placement
simulates faster under them (nccl, the runtime's rule). ``pipec.compiler.place_p2p`` and the simulator (for a
compute-only program) call it; it sits in the simulator's layer because choosing needs a simulation."""

from __future__ import annotations

from pipec.errors import PipecError
from pipec.ir import Program
from pipec.passes.p2p import insert_p2p_ops
from pipec.passes.sync import with_copy_syncs
from pipec.sim.costs import Costs
from pipec.sim.engine import checked, run_model


def fastest_placement(program: Program, costs: Costs) -> Program:
    """The timed placement for ``costs`` if it simulates faster than the default one, else the default one. A list
    schedule is a heuristic: timing it with the user's costs is faster more often than not, but not always
    (measured on random programs and costs: faster in about 59% of cases, slower in 18%), and the user should
    never get a slower schedule for having said what their costs are. A program of several pipelines gets the SYNCs
    of its copies (pipec.passes.sync.with_copy_syncs)."""
    # a program of several copies is timed with the SYNCs that sum them, as it will run
    default = with_copy_syncs(insert_p2p_ops(program))
    timed = with_copy_syncs(insert_p2p_ops(program, costs))
    if timed.streams == default.streams:
        return default
    try:
        faster = _nccl_makespan(timed, costs) < _nccl_makespan(default, costs)
    except PipecError:  # a structurally invalid program: the verifier, not the placement, will say why
        return default
    return timed if faster else default


def _nccl_makespan(program: Program, costs: Costs) -> float:
    """The makespan of a placed program under nccl, as ``pipec.sim.simulate`` finds it (raising what it raises)."""
    return checked(program, "nccl", lambda: run_model(program, costs, False, None, "nccl")).makespan

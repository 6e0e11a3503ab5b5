"""`pipec simulate`: run a schedule through the cost model; print makespan, bubble, busy/idle and memory."""

from __future__ import annotations

import argparse
import json

from pipec.cli.common import compile_schedule, given_costs, schedule_args, share_args, write
from pipec.sim.costs import DEFAULT_COSTS

HELP = "simulate a schedule with a cost model: makespan, bubble, memory"
EXAMPLES = """examples:
  pipec simulate zb_h1 -P 4 -M 8 --cost F=1,B=2,W=1
  pipec simulate zbv -P 4 -M 8 -V 2 --cost costs.json --why     # a JSON cost file; list the critical-path waits
  pipec simulate 1f1b -P 4 -M 8 --p2p ideal --format json -o sim.json
exit codes: 0 ok, 1 the schedule is invalid (it deadlocks or is incomplete), 2 bad input or usage
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    add_model_arguments(parser)
    parser.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    parser.add_argument(
        "--why",
        action="store_true",
        help="also list the waits on the critical path that the compute order alone does not have (batch, fifo, "
        "post; nccl and torch models): which rank waits for which batch",
    )
    parser.add_argument("-o", "--output", metavar="PATH", help="write here (atomically) instead of standard output")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--cost, --p2p and --per-rank-share, shared by `pipec simulate`, `pipec viz` and `pipec show`."""
    parser.add_argument(
        "--cost",
        metavar="F=1,B=2,W=1,comm=0",
        help=f"durations: F, B (full backward), I, W, comm, latency, bandwidth, size, overlap; or a JSON file "
        f"(per-stage lists allowed); send/recv are placed for them. Default {DEFAULT_COSTS.describe()}",
    )
    parser.add_argument(
        "--p2p",
        choices=("nccl", "tagged", "torch", "ideal"),
        default="nccl",
        help="point-to-point model: nccl (in-order matching, the runtime's rule; default), tagged (buffered sends), "
        "torch (torch's _PipelineScheduleRuntime: nccl with each send/recv posted on its own) "
        "or ideal (compute order only, asynchronous messages: the papers' timeline)",
    )
    share_args(parser)


def run_simulation(args: argparse.Namespace, record: bool = False):
    """Compile the schedule named by the common arguments and simulate it (shared with `pipec viz`)."""
    from pipec.sim.simulate import simulate

    # the send/recv are placed for the costs simulated (streams a file already holds stay as written); under
    # --per-rank-share those are the given costs in the program's stage units
    program, costs = compile_schedule(args, given_costs(args.cost))
    assert costs is not None  # parse_costs gives the defaults for no --cost
    return simulate(program, costs, record=record, p2p=args.p2p)


def run(args: argparse.Namespace) -> int:
    from pipec.sim.costs import time_units
    from pipec.sim.report import render_text

    why = getattr(args, "why", False)
    result = run_simulation(args, record=why)
    waits = []
    if why:
        from pipec.sim.waits import critical_waits

        waits = critical_waits(result)
    if args.format == "json":
        data = result.to_json()
        data["p2p"] = args.p2p
        if args.per_rank_share:  # `costs` is in stage units; say what the given ones meant
            data["units"] = "per-rank-share"
        if why:
            data["critical_waits"] = [w._asdict() for w in waits]
        write(json.dumps(data, indent=2) + "\n", args.output)
    else:
        text = render_text(result, args.p2p)
        if args.per_rank_share:  # the header's costs are per stage; say how they relate to the ones given
            text += "units: per rank share of the model (costs above per stage: 1/V of those given; peak_memory "
            text += "in micro-batches of one rank's share)\n"
        elif result.program.chunks > 1:
            from pipec.verify.memory import stage_units_note

            text += stage_units_note(result.program.chunks, max(result.peak_memory, default=0.0)) + "\n"
        if why:
            total = sum(w.until - w.time for w in waits)
            text += f"waits on the critical path: {f'{len(waits)}, {time_units(total)}' if waits else 'none'}\n"
            text += "".join(f"  {w.kind:<5} {w.text}\n" for w in waits)
        write(text, args.output)
    return 0



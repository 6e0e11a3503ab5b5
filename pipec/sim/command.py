"""`pipec simulate`: run a schedule through the cost model and print makespan, bubble, busy/idle and memory."""

from __future__ import annotations

import argparse
import json

from pipec.sim.costs import DEFAULT_COSTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--why",
        action="store_true",
        help="also list the waits on the critical path that the compute order alone does not have (batch, fifo, "
        "post; nccl model): which rank waits for which batch",
    )
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of standard output")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--cost and --p2p, shared by `pipec simulate`, `pipec viz` and `pipec show`."""
    parser.add_argument(
        "--cost",
        metavar="F=1,B=2,W=1,comm=0",
        help=f"durations: F, B (full backward), I, W, comm, latency, bandwidth, size, overlap; or a JSON file "
        f"(per-stage lists allowed). Default {DEFAULT_COSTS.describe()}",
    )
    parser.add_argument(
        "--p2p",
        choices=("nccl", "tagged", "ideal"),
        default="nccl",
        help="point-to-point model: nccl (in-order matching, the runtime's rule; default), tagged (buffered sends) "
        "or ideal (compute order only, asynchronous messages: the papers' timeline)",
    )


def run_simulation(args: argparse.Namespace, record: bool = False):
    """Compile the schedule named by the common arguments and simulate it (shared with `pipec viz`)."""
    from pipec.cli import _params
    from pipec.compiler import compile_program
    from pipec.sim.costs import parse_costs
    from pipec.sim.simulate import simulate

    costs = parse_costs(args.cost)
    program = compile_program(args.schedule, args.ranks, args.microbatches, args.chunks, _params(args))
    return simulate(program, costs, record=record, p2p=args.p2p)


def main(args: argparse.Namespace) -> int:
    from pipec.cli import _write

    why = getattr(args, "why", False)
    result = run_simulation(args, record=why)
    waits = []
    if why:
        from pipec.sim.waits import critical_waits

        waits = critical_waits(result)
    if args.format == "json":
        data = result.to_json()
        data["p2p"] = args.p2p
        if why:
            data["critical_waits"] = [w._asdict() for w in waits]
        _write(json.dumps(data, indent=2) + "\n", args.output)
    else:
        text = render_text(result, args.p2p)
        if why:
            total = sum(w.until - w.time for w in waits)
            text += f"waits on the critical path: {len(waits)}, {total:g} time units\n"
            text += "".join(f"  {w.kind:<5} {w.text}\n" for w in waits)
        _write(text, args.output)
    return 0


def render_text(result, p2p: str = "nccl") -> str:
    p = result.program
    lines = [
        f"{p.name}: P={p.ranks} M={p.microbatches} V={p.chunks}, costs {result.costs.describe()}, p2p {p2p}",
        f"makespan {result.makespan:g}   ideal {result.ideal:g}   efficiency {result.efficiency:.1%}   "
        f"bubble {result.bubble_fraction:.1%}",
        "rank      busy      idle      comm  span_idle  peak_memory",
    ]
    for r in range(p.ranks):
        lines.append(
            f"{r:>4} {result.busy[r]:>9g} {result.idle[r]:>9g} {result.comm[r]:>9g} {result.span_idle[r]:>10g} "
            f"{result.peak_memory[r]:>12g}"
        )
    return "\n".join(lines) + "\n"

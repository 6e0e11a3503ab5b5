"""`pipec simulate`: run a schedule through the cost model; print makespan, bubble, busy/idle and memory."""

from __future__ import annotations

import argparse
import json

from pipec.cli.common import EXIT_OK, amount, compile_schedule, given_costs, schedule_args, share_args, write
from pipec.errors import PipecInputError
from pipec.sim.costs import DEFAULT_COSTS

HELP = "simulate a schedule with a cost model: makespan, bubble, memory"
EXAMPLES = """examples:
  pipec simulate zb_h1 -P 4 -M 8 --cost F=1,B=2,W=1
  pipec simulate zbv -P 4 -M 8 -V 2 --cost costs.json --why     # a JSON cost file; list the critical-path waits
  pipec simulate 1f1b -P 4 -M 8 --p2p ideal --format json -o sim.json
  pipec simulate 1f1b zb_h1 zbv -P 4 -M 8 --activation-bytes 3e8   # side by side, same costs per rank share
exit codes: 0 ok, 1 the schedule is invalid (it deadlocks or is incomplete), 2 bad input or usage
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    schedule_args(parser)
    schedule = next(a for a in parser._actions if a.dest == "schedule")
    schedule.nargs = "+"  # several: compared side by side (compare_schedules)
    schedule.help += "; several are compared side by side in one table, at the same costs per rank share"
    add_model_arguments(parser)
    parser.add_argument(
        "--activation-bytes",
        type=amount,
        metavar="N",
        help="bytes of one micro-batch's activations on a rank's share of the model: the comparison table "
        "gives peak memory in bytes too",
    )
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


def run_simulation(args: argparse.Namespace, record: bool = False, costs=None):
    """Compile the schedule named by the common arguments and simulate it (shared with `pipec viz`) with `costs`
    (default: --cost's)."""
    from pipec.sim.simulate import simulate

    # the send/recv are placed for the costs simulated (streams a file already holds stay as written); under
    # --per-rank-share those are the given costs in the program's stage units
    program, costs = compile_schedule(args, given_costs(args.cost) if costs is None else costs)
    assert costs is not None  # parse_costs gives the defaults for no --cost
    return simulate(program, costs, record=record, p2p=args.p2p)


def run(args: argparse.Namespace) -> int:
    if len(args.schedule) > 1:
        return compare_schedules(args)
    args.schedule = args.schedule[0]
    if args.activation_bytes is not None:
        raise PipecInputError("--activation-bytes is for comparing schedules: give two or more")
    return simulate_one(args)


def compare_schedules(args: argparse.Namespace) -> int:
    """`pipec simulate A B C ...`: one row a schedule, at the same costs and memory units whatever its V (per rank
    share of the model, as pipec tune compares them): makespan, bubble, the worst rank's peak. A schedule that
    cannot be compiled for the sizes gets its reason in its row; the exit code is then the worst row's."""
    from pipec.errors import PipecError

    if args.why:
        raise PipecInputError("--why takes one schedule; compare first, then ask --why of the one you pick")
    costs = given_costs(args.cost)  # once: its note, if any, once
    rows, code = [], EXIT_OK
    for name in args.schedule:
        one = argparse.Namespace(**{**vars(args), "schedule": name, "per_rank_share": True})
        try:
            result = run_simulation(one, costs=costs)
        except PipecError as e:
            rows.append({"schedule": name, "error": e.message.splitlines()[0]})
            code = max(code, e.exit_code)
            continue
        peak = max(result.peak_memory, default=0.0)
        row = {
            "schedule": name,
            "V": result.program.chunks,
            "makespan": result.makespan,
            "bubble_fraction": result.bubble_fraction,
            "peak_memory": peak,
        }
        if args.activation_bytes is not None:
            row["peak_bytes"] = peak * args.activation_bytes
        rows.append(row)
    sizes = f"P={args.ranks} M={args.microbatches}" if args.ranks else ""
    if args.format == "json":
        data = {"costs": costs.describe(), "p2p": args.p2p, "units": "per-rank-share", "rows": rows}
        write(json.dumps(data, indent=2) + "\n", args.output)
        return code
    lines = [
        f"{len(rows)} schedules, {sizes + ', ' if sizes else ''}costs {costs.describe()} per rank share of the "
        f"model (a chunk of V takes 1/V, C/V with C copies), p2p {args.p2p}"
    ]
    in_bytes = args.activation_bytes is not None
    table = [("schedule", "V", "makespan", "bubble", "peak_memory", *(["peak_bytes"] if in_bytes else []))]
    for r in rows:
        if "error" in r:
            table.append((r["schedule"], "-", "-", "-", "-", *(["-"] if in_bytes else [])))
            continue
        cells = [r["schedule"], str(r["V"]), f"{r['makespan']:g}", f"{r['bubble_fraction']:.1%}"]
        cells.append(f"{r['peak_memory']:g}")
        table.append((*cells, *([_bytes(r["peak_bytes"])] if in_bytes else [])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        lines.append("  ".join(cells))
    lines.append("peak_memory: the worst rank's, in micro-batches of one rank's share of the model")
    for r in rows:  # why a row is empty; the message names the schedule, or is given its name
        if "error" in r:
            lines.append(r["error"] if r["error"].startswith(f"{r['schedule']}:") else f"{r['schedule']}: {r['error']}")
    write("\n".join(lines) + "\n", args.output)
    return code


def _bytes(amount: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def simulate_one(args: argparse.Namespace) -> int:
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
            copies = result.program.pipelines
            part = "1/V" if copies == 1 else f"C/V = {copies}/{result.program.chunks}"
            text += f"units: per rank share of the model (costs above per stage: {part} of those given; peak_memory "
            text += "in micro-batches of one rank's share)\n"
        elif result.program.chunks > 1 or result.program.pipelines > 1:
            from pipec.verify.memory import stage_units_note

            peak = max(result.peak_memory, default=0.0)
            text += stage_units_note(result.program.chunks, peak, result.program.pipelines) + "\n"
        if why:
            total = sum(w.until - w.time for w in waits)
            text += f"waits on the critical path: {f'{len(waits)}, {time_units(total)}' if waits else 'none'}\n"
            text += "".join(f"  {w.kind:<5} {w.text}\n" for w in waits)
        write(text, args.output)
    return 0



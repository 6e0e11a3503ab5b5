"""Simulation-time benchmark: pipec's simulator against torch.distributed.pipelining's _simulate_comms_compute.

    python bench/simulate.py                                 # interleaved_1f1b at (16,256,4) and (32,1024,4)
    python bench/simulate.py --sizes 4,8,2 32,1024,4 --schedules interleaved_1f1b zbv --repeat 3

For each schedule torch also has, at each (P, M, V), it prints the median wall time of
- torch: `_simulate_comms_compute(schedule.pipeline_order_with_comms, stage_to_rank, num_stages)` on the lowered
  schedule torch built for rank 0, less the UNSHARD/RESHARD/REDUCE_GRAD actions its simulator rejects (construction
  not timed). torch's simulator counts unit steps: no durations, no communication cost, no memory;
- pipec: `pipec.sim.simulate(program)` on the compiled streams (send/recv included; compile not timed) under the
  nccl rule with the default costs, reporting durations, per-rank busy/idle and peak memory; also under the
  `ideal` model (compute order only) and end to end (compile + simulate, what `pipec simulate` does).
`ratio` is torch / pipec (nccl). Times are CPU seconds of this process (`time.process_time`, single-threaded
code on both sides), medians over `--repeat` runs: on a shared machine wall time mostly measures the neighbours.
Never used by the tests; timing belongs here, not in assertions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import pipec
from pipec.errors import PipecError
from pipec.sim import simulate


def _median(fn, repeat: int, budget: float) -> tuple[float, int, object]:
    times, value, spent = [], None, 0.0
    while len(times) < repeat and (not times or spent < budget):
        gc.collect()
        start = time.process_time()  # CPU seconds of this process: the machine is shared, wall time is noisy
        value = fn()
        elapsed = time.process_time() - start
        times.append(elapsed)
        spent += elapsed
    return statistics.median(times), len(times), value




def _torch_simulate(name: str, ranks: int, microbatches: int, chunks: int):
    from torch_reference import torch_simulation

    return torch_simulation(name, ranks, microbatches, chunks)


def _end_to_end(name: str, ranks: int, microbatches: int, chunks: int) -> object:
    """What `pipec simulate` does: compile, then simulate under the nccl rule (an invalid schedule still counts)."""
    program = pipec.compile(name, ranks, microbatches, chunks)
    try:
        return simulate(program)
    except PipecError as e:
        return e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["16,256,4", "32,1024,4"], help="P,M,V triples")
    parser.add_argument("--schedules", nargs="+", default=["interleaved_1f1b"])
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median), within --budget")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per cell before it stops repeating")
    parser.add_argument("--no-torch", action="store_true", help="skip torch (pipec columns only)")
    args = parser.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split(",")) for s in args.sizes]
    header = (
        f"{'schedule':<18} {'P':>3} {'M':>5} {'V':>2} {'instrs':>8}  {'pipec nccl s':>12} {'ideal s':>8} "
        f"{'compile+sim s':>13}  {'torch s':>8} {'torch steps':>11}  {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in args.schedules:
        for P, M, V in sizes:  # noqa: N806 - the papers' names
            try:
                program = pipec.compile(name, P, M, V)
            except PipecError as e:
                print(f"{name:<18} {P:>3} {M:>5} {V:>2}  pipec: {e.message}")
                continue
            instructions = sum(len(s) for s in program.streams)
            try:
                sim_s, _, result = _median(lambda p=program: simulate(p), args.repeat, args.budget)
                note = f"bubble {result.bubble_fraction:.1%}"
            except PipecError as e:
                sim_s, note = float("nan"), f"nccl: {e.message.splitlines()[0][:40]}"
            ideal_s, _, ideal = _median(lambda p=program: simulate(p, p2p="ideal"), args.repeat, args.budget)
            e2e_s, _, _ = _median(lambda n=name, p=P, m=M, v=V: _end_to_end(n, p, m, v), 1, args.budget)
            torch_s, steps = float("nan"), "-"
            if not args.no_torch:
                run = _torch_simulate(name, P, M, V)
                torch_s, _, steps = _median(run, args.repeat, args.budget)
            ratio = torch_s / sim_s if sim_s == sim_s and torch_s == torch_s else float("nan")
            print(
                f"{name:<18} {P:>3} {M:>5} {V:>2} {instructions:>8}  {sim_s:>12.3f} {ideal_s:>8.3f} {e2e_s:>13.3f}  "
                f"{torch_s:>8.3f} {steps!s:>11}  {ratio:>6.1f}   {note}; ideal bubble {ideal.bubble_fraction:.2%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

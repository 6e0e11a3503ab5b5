"""Verification-time benchmark: `pipec check` against torch.distributed.pipelining's _simulate_comms_compute.

    python bench/check.py                                    # interleaved_1f1b at (16,256,4) and (32,1024,4)
    python bench/check.py --schedules interleaved_1f1b zbv interleaved_zb --sizes 8,64,2 16,256,2 --repeat 3

Per schedule and (P, M, V), the median wall time of
- `pipec check`: the command itself, in a subprocess (start-up, parse, expand, insert send/recv, every pass under
  the nccl model, the report), i.e. what a user waits for;
- verify: `pipec.verify.verify(program)` alone on the compiled program (structure, p2p order, nccl deadlock,
  memory), and the nccl deadlock pass alone;
- torch: `_simulate_comms_compute(pipeline_order_with_comms, stage_to_rank, num_stages)` on the lowered schedule
  torch built for rank 0, less the UNSHARD/RESHARD/REDUCE_GRAD actions its simulator rejects (construction not
  timed). It detects stalls (no p2p order check, no memory model) by stepping every rank once per round.
`ratio` = torch / `pipec check` (end to end against torch's simulation alone, so it favours torch).
Both run on this machine one after the other; the tests never time anything.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import pipec  # noqa: E402
from pipec.errors import PipecError  # noqa: E402
from pipec.verify import check_deadlock, verify  # noqa: E402


def _median(fn, repeat: int) -> tuple[float, object]:
    times, value = [], None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def _cli(name: str, p: int, m: int, v: int) -> int:
    command = [sys.executable, "-m", "pipec", "check", name, "-P", str(p), "-M", str(m), "-V", str(v)]
    return subprocess.run(command, capture_output=True, check=False).returncode


def _torch(name: str, ranks: int, microbatches: int, chunks: int):
    from torch_reference import torch_simulation

    return torch_simulation(name, ranks, microbatches, chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["16,256,4", "32,1024,4"], help="P,M,V triples")
    parser.add_argument("--schedules", nargs="+", default=["interleaved_1f1b"])
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    header = (
        f"{'schedule':<18} {'P':>3} {'M':>5} {'V':>2} {'instrs':>8}  {'pipec check s':>13} {'verify s':>9} "
        f"{'deadlock s':>10}  {'torch sim s':>11} {'torch steps':>11}  {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in args.schedules:
        for size in args.sizes:
            p, m, v = (int(x) for x in size.split(","))
            try:
                program = pipec.compile(name, p, m, v)
            except PipecError as e:  # e.g. a size the schedule's `require` refuses
                print(f"{name:<18} {p:>3} {m:>5} {v:>2}  skipped: {e.message}")
                continue
            instructions = sum(len(s) for s in program.streams)
            cli_s, code = _median(lambda n=name, p=p, m=m, v=v: _cli(n, p, m, v), args.repeat)
            verify_s, report = _median(lambda program=program: verify(program), args.repeat)
            deadlock_s, _ = _median(lambda program=program: check_deadlock(program, "nccl"), args.repeat)
            torch_s, steps = float("nan"), "-"
            if not args.no_torch:
                torch_s, steps = _median(_torch(name, p, m, v), args.repeat)
            verdict = "ok" if report.ok and code == 0 else f"exit {code}"
            print(
                f"{name:<18} {p:>3} {m:>5} {v:>2} {instructions:>8}  {cli_s:>13.3f} {verify_s:>9.3f} "
                f"{deadlock_s:>10.3f}  {torch_s:>11.3f} {steps!s:>11}  {torch_s / cli_s:>6.1f}   {verdict}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

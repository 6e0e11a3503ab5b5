"""pipec's runtime beside torch.distributed.pipelining's, on the same workload and processes.

    python bench/runtime.py                      # 4 gloo ranks, M=8, both sizes, all four schedules
    python bench/runtime.py --rounds 9 --steps 4 --sizes 16x1

Workload: 16 blocks of Linear(H, H) + ReLU, MSE loss, SGD; H=16 with micro-batches of 1 row and H=256 with
micro-batches of 32 rows. torch's GPipe, 1F1B, Interleaved1F1B and InterleavedZeroBubble run against pipec's
gpipe, 1f1b, interleaved_1f1b and interleaved_zb on the same stage split (V=2 for the interleaved ones), in
alternating rounds inside the same 4 processes (one thread each). A step is zero_grad + the schedule + the
optimizer step; its time is the slowest rank's. Printed: median step times, the pipec/torch ratio of those medians,
the median over rounds of each round's pipec/torch ratio ("paired": the two ran back to back), and pipec's
interpreter cost per instruction: "loop" is the loop's time outside torch's compute calls (freeing a
micro-batch's autograd graph included: torch's own runtime pays that in its backward too) and p2p calls (posting
batches, waiting for them, freeing their Work objects), what is left being the interpreter's own work: the plan
and dict bookkeeping, receive buffers, the handlers' Python; "dispatch" the bare loop with no-op handlers.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAIRS = [  # (label, torch class, pipec schedule, chunks)
    ("GPipe", "ScheduleGPipe", "gpipe", 1),
    ("1F1B", "Schedule1F1B", "1f1b", 1),
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", "interleaved_1f1b", 2),
    ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", "interleaved_zb", 2),
]
BLOCKS = 16


def model(hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers)


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


class TorchRun:
    def __init__(self, class_name: str, chunks: int, hidden: int, microbatches: int, ranks: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
        rank = dist.get_rank()
        layers = model(hidden)
        per_stage = len(layers) // (ranks * chunks)
        stage_ids = [rank + c * ranks for c in range(chunks)]
        self.modules = [torch.nn.Sequential(*layers[s * per_stage : (s + 1) * per_stage]) for s in stage_ids]
        stages = [
            PipelineStage(m, s, ranks * chunks, torch.device("cpu"))
            for m, s in zip(self.modules, stage_ids, strict=True)
        ]
        cls = getattr(torch_schedules, class_name)
        loss = torch.nn.MSELoss()
        self.schedule = cls(stages[0], microbatches, loss_fn=loss) if chunks == 1 else cls(stages, microbatches, loss)
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=1e-3)
        self.first, self.last = rank == 0, rank == ranks - 1

    def step(self, x, y) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        self.optimizer.step()
        return time.perf_counter() - start


class PipecRun:
    def __init__(self, schedule: str, chunks: int, hidden: int, microbatches: int, ranks: int, batch) -> None:
        import torch

        import pipec
        from pipec.runtime.runner import Runner
        from pipec.runtime.workload import Workload

        program = pipec.compile(schedule, ranks, microbatches, chunks)
        layers = model(hidden)
        sizes = ",".join([str(len(layers) // program.num_stages)] * program.num_stages)
        work = Workload(layers, torch.nn.functional.mse_loss, [batch], lambda p: torch.optim.SGD(p, lr=1e-3))
        self.runner = Runner.setup(program, work, partition=sizes)

        self.interp: list[float] = []  # per step: the loop's time outside compute and p2p, per instruction

    def step(self, x, y) -> float:
        stats = self.runner.step((x, y))
        own = stats.loop_s - stats.host_compute_s - stats.comm_s  # the host's own time, as the report counts it
        self.interp.append(own / len(self.runner.program.streams[self.runner.rank]))
        return stats.wall_s


def dispatch_cost(runner, repeats: int = 200) -> float:
    """Seconds per instruction of the bare loop and dispatch: the rank's compute stream with every handler
    replaced by a no-op (what the interpreter adds per instruction before any handler work)."""
    from pipec.runtime import interpreter

    entries = interpreter.plan(runner.program.compute_streams()[runner.rank])
    handlers = dict(interpreter.DISPATCH)
    interpreter.DISPATCH.update({kind: lambda ctx, action: None for kind in handlers})
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            interpreter.run(runner.ctx, entries, [], [])
        return (time.perf_counter() - start) / repeats / max(1, len(entries))
    finally:
        interpreter.DISPATCH.update(handlers)


def worker(sizes: list[tuple[int, int]], microbatches: int, rounds: int, steps: int, only: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size()
    out = {}
    for hidden, rows in sizes:
        torch.manual_seed(1)
        x, y = torch.randn(rows * microbatches, hidden), torch.randn(rows * microbatches, hidden)
        for label, torch_class, pipec_name, chunks in PAIRS:
            if only and label not in only and pipec_name not in only:
                continue
            runs = {
                "torch": TorchRun(torch_class, chunks, hidden, microbatches, ranks),
                "pipec": PipecRun(pipec_name, chunks, hidden, microbatches, ranks, (x, y)),
            }
            times: dict[str, list[float]] = {"torch": [], "pipec": []}
            paired: list[float] = []  # per round, pipec's median step over torch's in the same round
            for round_index in range(rounds + 1):  # round 0 warms up
                this_round: dict[str, list[float]] = {"torch": [], "pipec": []}
                for name, impl in runs.items():
                    for _ in range(steps):
                        dist.barrier()
                        this_round[name].append(slowest(impl.step(x, y)))
                if round_index:
                    for name, seconds in this_round.items():
                        times[name].extend(seconds)
                    paired.append(statistics.median(this_round["pipec"]) / statistics.median(this_round["torch"]))
            runner = runs["pipec"].runner
            interp = statistics.median(runs["pipec"].interp)
            dispatch = dispatch_cost(runner)
            out[(hidden, rows, label)] = {
                "torch": statistics.median(times["torch"]),
                "pipec": statistics.median(times["pipec"]),
                "paired": statistics.median(paired),
                "interp_us": slowest(interp) * 1e6,
                "dispatch_us": slowest(dispatch) * 1e6,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=4, help="steps per implementation per round")
    parser.add_argument("--sizes", nargs="+", default=["16x1", "256x32"], help="HIDDENxROWS per micro-batch")
    parser.add_argument("--schedules", nargs="+", default=[], help="only these (torch or pipec names)")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in text.split("x")) for text in args.sizes]

    from pipec.runtime import launch

    start = time.perf_counter()
    results = launch.spawn(
        worker, args.ranks, (sizes, args.microbatches, args.rounds, args.steps, args.schedules), timeout_s=120
    )[0]
    print(
        f"{args.ranks} gloo ranks, 1 thread each, {BLOCKS} x (Linear+ReLU), M={args.microbatches}, "
        f"{args.rounds} alternating rounds x {args.steps} steps, median step (slowest rank)"
    )
    print(
        f"{'H/mb':<8} {'schedule':<22} {'torch ms':>9} {'pipec ms':>9} {'pipec/torch':>12} {'paired':>7} "
        f"{'loop us/instr':>14} {'dispatch us/instr':>18}"
    )
    for (hidden, rows, label), row in results.items():
        ratio = row["pipec"] / row["torch"]
        print(
            f"{f'{hidden}/{rows}':<8} {label:<22} {row['torch'] * 1e3:9.2f} {row['pipec'] * 1e3:9.2f} "
            f"{ratio:12.2f} {row['paired']:7.2f} {row['interp_us']:14.1f} {row['dispatch_us']:18.2f}"
        )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

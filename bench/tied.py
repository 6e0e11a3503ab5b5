"""The step time of tied input/output embeddings on 4 gloo ranks next to the same model untied, beside what
`pipec simulate` predicts from the measured costs.

    python bench/tied.py                         # 1f1b, P=4, M=8, 7 paired rounds of 6 steps
    python bench/tied.py --schedule zb_h1 --rounds 9

Workload: a language model (embedding VOCAB x WIDTH, 6 residual blocks, an LM head) whose head reuses the
embedding's weight (tied) or a copy of it (untied: a parameter of its own, the same values and arithmetic). Tied, the
first and the last stage hold copies of the weight on ranks 0 and P-1, and each step ends there with one SYNC:
the all-reduce of the weight's gradient (VOCAB x WIDTH floats). Each round runs `pipec run`'s training loop
untied and tied back to back inside the same 4 processes (the order alternating between rounds); a run's time is
its median step (the slowest rank's), the first step left out. Printed: the median step times, the median over
rounds of each round's difference tied - untied ("paired"), the measured time of one SYNC (the smallest a member
saw: the member that arrives last waits only for the collective), and the simulator's prediction: the untied
program and the tied one (with its SYNCs, pipec.passes.sync) simulated under the untied run's measured F/I/W
costs, the tied one with `sync` = the measured SYNC.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB, WIDTH, SEQ, BATCH, BLOCKS = 8192, 64, 16, 16, 6
HERE = Path(__file__).resolve()


def language_model(tied: bool):
    import torch
    from torch import nn

    from pipec.runtime.workload import Workload

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = (
                nn.LayerNorm(WIDTH),
                nn.Linear(WIDTH, 2 * WIDTH),
                nn.Linear(2 * WIDTH, WIDTH),
            )

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    embed, head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
    nn.init.normal_(embed.weight, std=0.02)  # GPT-2's: N(0, 1) logits would make denormals, slow on a CPU
    # tied: one parameter; untied: a parameter of its own holding the same values (the same arithmetic)
    head.weight = embed.weight if tied else nn.Parameter(embed.weight.detach().clone())

    def loss_fn(logits, tokens):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    layers = nn.Sequential(embed, *[Block() for _ in range(BLOCKS)], head)
    batches = [(ids, ids) for ids in (torch.randint(VOCAB, (BATCH, SEQ)) for _ in range(4))]
    return Workload(layers, loss_fn, batches, lambda params: torch.optim.SGD(params, lr=0.01))


def tied():
    return language_model(True)


def untied():
    return language_model(False)


def _rounds(schedule: str, chunks: int, microbatches: int, rounds: int, steps: int) -> list[dict]:
    """In every worker: `rounds` x (untied, tied) runs; rank 0 returns each run's report."""
    import torch.distributed as dist

    import pipec
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    program = pipec.compile(schedule, dist.get_world_size(), microbatches, chunks)
    out = []
    for r in range(rounds):
        order = ("untied", "tied") if r % 2 == 0 else ("tied", "untied")
        for variant in order:
            result = train(program, Options(model=f"{HERE}:{variant}", steps=steps, quiet=True))
            out.append({"variant": variant, "round": r, "report": result["report"]})
    return out


def step_s(report: dict) -> float:
    times = report["step_times"][1:] or report["step_times"]  # the first step warms up
    return statistics.median(times)


def predict(schedule: str, chunks: int, microbatches: int, costs: dict, sync_ms: float, partition) -> tuple:
    """(untied, tied) makespans in ms: the simulator under the measured costs, the tied program with its SYNCs."""
    import pipec
    from pipec.runtime import ties, workload
    from pipec.sim.costs import parse_costs
    from pipec.sim.simulate import simulate

    program = pipec.compile(schedule, 4, microbatches, chunks)
    synced = ties.with_syncs(program, workload.build(f"{HERE}:tied", 0).layers, partition)
    base = {k: costs[k] for k in ("F", "I", "W")}
    untied_ms = simulate(program, parse_costs(base)).makespan
    tied_ms = simulate(synced, parse_costs({**base, "sync": sync_ms})).makespan
    return untied_ms, tied_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.chunks != 1:
        parser.error("the measured costs are per segment at V=1; run this bench with --chunks 1")

    from pipec.runtime import launch

    runs = launch.spawn(
        _rounds, 4, (args.schedule, args.chunks, args.microbatches, args.rounds, args.steps), timeout_s=120
    )[0]
    by = {(run["round"], run["variant"]): run["report"] for run in runs}
    untied_s = [step_s(by[r, "untied"]) for r in range(args.rounds)]
    tied_s = [step_s(by[r, "tied"]) for r in range(args.rounds)]
    paired = statistics.median(t - u for t, u in zip(tied_s, untied_s, strict=True))
    syncs = [run["report"]["costs"]["sync"] for run in runs if run["variant"] == "tied"]
    sync_ms = statistics.median(syncs)
    costs = {k: [statistics.median(run["report"]["costs"][k][i] for run in runs if run["variant"] == "untied")
                 for i in range(4)] for k in ("F", "I", "W")}  # fmt: skip
    partition = by[0, "tied"]["partition"]
    untied_ms, tied_ms = predict(args.schedule, args.chunks, args.microbatches, costs, sync_ms, partition)
    print(f"{args.schedule} P=4 M={args.microbatches}, {args.rounds} paired rounds of {args.steps} steps, gloo")
    print(f"tied weight: {VOCAB} x {WIDTH} floats ({VOCAB * WIDTH * 4 / 2**20:.1f} MiB), partition {partition}")
    print(
        f"median step: untied {1e3 * statistics.median(untied_s):.2f} ms, tied {1e3 * statistics.median(tied_s):.2f} ms"
    )
    print(f"paired difference tied - untied: {1e3 * paired:+.2f} ms (median over rounds)")
    print(f"one SYNC, measured: {sync_ms:.3f} ms (median over runs of the smallest member's)")
    print(
        f"simulated under the untied run's F/I/W: untied {untied_ms:.2f} ms, tied (sync={sync_ms:.3f}) "
        f"{tied_ms:.2f} ms: difference {tied_ms - untied_ms:+.2f} ms"
    )


if __name__ == "__main__":
    main()

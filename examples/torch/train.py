"""A torchtitan-style training loop on torch.distributed.pipelining, with its schedule written in .pipe.

    torchrun --nproc-per-node 2 examples/torch/train.py examples/torch/v_1f1b.pipe --microbatches 4 --chunks 2
    torchrun --nproc-per-node 4 examples/torch/train.py zb_h2 --microbatches 8

torch's own PipelineStage objects, loss, optimizer and step(); pipec only provides the schedule (docs/torch.md).
tests/runtime/test_torch_api.py runs `train` and checks its losses against ordinary training of the whole model.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import pipec
from pipec.torch import PipelineSchedule

HIDDEN, LAYERS, BATCH = 16, 16, 16


def whole_model() -> list[torch.nn.Module]:
    """The model as a list of layers, the same on every rank (same seed)."""
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()) for _ in range(LAYERS)]


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator))
        for _ in range(steps)
    ]


def train(schedule: str, microbatches: int, chunks: int = 1, steps: int = 3) -> list[float]:
    """Train for `steps` steps; returns the loss of each step on the rank holding the last stage, else []."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    # Compile once: the program says which stages this rank holds (its placement: loop, V, ...).
    program = pipec.compile(schedule, ranks=ranks, microbatches=microbatches, chunks=chunks)
    layers, num_stages = whole_model(), program.num_stages
    per_stage = LAYERS // num_stages
    modules = {s: torch.nn.Sequential(*layers[s * per_stage : (s + 1) * per_stage]) for s in program.stages_of(rank)}
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for s, m in modules.items()]
    pipe = PipelineSchedule(program, stages, microbatches, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
    first, last = 0 in modules, num_stages - 1 in modules
    losses: list[float] = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        pipe.step(*((x,) if first else ()), target=y if last else None, losses=step_losses if last else None)
        optimizer.step()
        if last:
            losses.append(torch.stack(step_losses).mean().item())  # the micro-batches' mean: the batch's loss
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", help="a bundled schedule name or a .pipe file")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1, help="stages per rank (V)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        for step, loss in enumerate(train(args.schedule, args.microbatches, args.chunks, args.steps)):
            print(f"rank {dist.get_rank()}: step {step}: loss {loss:.6f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

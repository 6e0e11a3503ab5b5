"""Small workloads for the runtime tests, following the protocol of `pipec run --model MODULE:FACTORY`."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from pipec.runtime.workload import Workload


def mlp(layers: int = 8, hidden: int = 8, batch: int = 8, steps: int = 2) -> Workload:
    """Linear+ReLU blocks (one module each, so partitions are free to cut anywhere) and an MSE loss."""
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(hidden, hidden), nn.ReLU()]
    batches = [(torch.randn(batch, hidden), torch.randn(batch, hidden)) for _ in range(steps)]
    return Workload(nn.Sequential(*modules), nn.functional.mse_loss, batches)


class Residual(nn.Module):
    """x + MLP(LayerNorm(x)), a transformer-style block."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def residual(blocks: int = 8, hidden: int = 8, batch: int = 8, steps: int = 2) -> Workload:
    """LayerNorm, GELU and residual blocks; a classification head and cross-entropy; SGD with momentum."""
    layers = nn.Sequential(*[Residual(hidden) for _ in range(blocks)], nn.LayerNorm(hidden), nn.Linear(hidden, 5))
    batches = [(torch.randn(batch, 3, hidden), torch.randint(0, 5, (batch, 3))) for _ in range(steps)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 5), target.reshape(-1))

    return Workload(layers, loss_fn, batches, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))


class DieOnce(nn.Module):
    """Kills its own process (SIGKILL) on its n-th forward: a worker dying mid-step, for the fault test."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.after:
            os.kill(os.getpid(), 9)
        return x


def dies() -> Workload:
    """4 stages of an MLP where the third stage's rank dies on its 6th forward (the second step, M=4)."""
    work = mlp(layers=4, hidden=8, batch=8, steps=4)
    modules = list(work.layers)
    modules.insert(5, DieOnce(after=6))  # inside stage 2 under the explicit partition 2,2,3,2
    work.layers = nn.Sequential(*modules)
    return work


class HangOnce(DieOnce):
    """Blocks (sleeps) forever on its n-th forward: a hung worker, for the watchdog test."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.after:
            time.sleep(10**6)
        return x


def hangs() -> Workload:
    """Like `dies`, but the third stage's rank hangs instead of dying."""
    work = dies()
    work.layers[5] = HangOnce(after=6)
    return work


class Sleep(nn.Module):
    """Sleeps on every forward: a stage much slower than its neighbours."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def slow_receiver() -> Workload:
    """Two stages (partition 2,2) whose second sleeps 0.25 s per forward: its receives are posted late."""
    work = mlp(layers=1, hidden=8, batch=8, steps=1)
    work.layers = nn.Sequential(*work.layers, Sleep(0.25), nn.Linear(8, 8))
    return work


def dies_receiving() -> Workload:
    """Two stages (partition 2,2) where the second's rank dies on its 6th forward: step 0's micro-batch 5 for
    M=12 (the last stage is not run at start-up), while rank 0's later sends are still outstanding."""
    work = mlp(layers=1, hidden=8, batch=12, steps=4)
    work.layers = nn.Sequential(*work.layers, DieOnce(after=6), nn.Linear(8, 8))
    return work


def tiny() -> Workload:
    """Two layers: too few for four stages."""
    return mlp(layers=1)


def train_many(configs: list[tuple]) -> dict:
    """Runs in every worker of one spawn: train each (key, schedule, P, M, model, steps[, partition]) config in
    turn, sharing the processes' start-up. Returns, per key, this rank's weights and the run's report (or the
    error text)."""
    import torch.distributed as dist

    import pipec
    from pipec.errors import PipecError
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    for key, schedule, ranks, microbatches, model, steps, *partition in configs:
        if isinstance(microbatches, tuple):  # one count per rank: ranks that disagree about the schedule
            microbatches = microbatches[dist.get_rank()]
        try:
            program = pipec.compile(schedule, ranks, microbatches)
            options = Options(model=model, steps=steps, quiet=True, partition=(partition or ["params"])[0])
            out[key] = train(program, options)
        except PipecError as e:  # the disagreement check raises on every rank at set-up, before any message
            out[key] = {"error": e.message}
    return out

"""Workloads that break the `pipec run --model MODULE:FACTORY` protocol, or train into NaN/inf, for the fault
tests (tests/runtime/test_runtime_faults.py) and the fault table (bench/faults.py). Each is small: a run is mostly the
time to import torch in each process."""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn

from pipec.runtime.workload import Workload


def good(steps: int = 2) -> Workload:
    """A healthy 4-layer MLP (batch 8, hidden 8)."""
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(steps)]
    return Workload(layers, nn.functional.mse_loss, batches)


def raises() -> Workload:
    """The factory itself fails (a typo in the user's model code)."""
    raise ValueError("the factory broke on purpose")


def needs_args(hidden: int) -> Workload:
    """A factory with a required argument: `pipec run` calls it with none."""
    return good()


def string_layers() -> Workload:
    work = good()
    work.layers = "not a model"
    return work


def int_layers() -> Workload:
    work = good()
    work.layers = [1, 2, 3, 4]
    return work


def tensor_batches() -> Workload:
    """`batches` is one tensor, not a list of (input, target) pairs."""
    work = good()
    work.batches = torch.randn(2, 8, 8)
    return work


def unpaired_batches() -> Workload:
    """Each batch is a bare input tensor."""
    work = good()
    work.batches = [torch.randn(8, 8) for _ in range(2)]
    return work


def mismatched_batches() -> Workload:
    """Inputs of 8 rows with targets of 6: the targets cannot be cut into 4 micro-batches (another dim 0 than the
    inputs' is fine when it divides, as for flattened tokens)."""
    work = good()
    work.batches = [(torch.randn(8, 8), torch.randn(6, 8))]
    return work


def wrong_width() -> Workload:
    """Inputs of width 5 for a model that takes 8: the first layer fails."""
    work = good()
    work.batches = [(torch.randn(8, 5), torch.randn(8, 8))]
    return work


def number_batches() -> Workload:
    work = good()
    work.batches = 3
    return work


class Poison(nn.Module):
    """Multiplies by `value` (NaN or inf) from its `after`-th forward on (counting per process)."""

    def __init__(self, value: float, after: int = 1) -> None:
        super().__init__()
        self.value, self.after, self.calls = value, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.value if self.calls >= self.after else x


def nan_layers() -> Workload:
    """Stage 1 of 2 (partition 2,2) produces NaN from its 4th forward (step 0, micro-batch 3 for M=4: the last
    stage is not run at start-up). A few steps, so that training on would be visible."""
    work = good(steps=4)
    work.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Poison(math.nan, after=4), nn.Linear(8, 8))
    return work


def inf_loss() -> Workload:
    """A healthy model whose loss is inf from the second step's first micro-batch on (M=4): the loss of the
    last stage is inf, every gradient is NaN or inf."""
    work = good(steps=4)
    calls = [0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = nn.functional.mse_loss(out, target)
        return loss * math.inf if calls[0] > 4 else loss

    work.loss_fn = loss_fn
    return work


def nan_gradient() -> Workload:
    """A finite loss with NaN gradients: sqrt at 0 in stage 0 (its backward is inf * 0 = NaN), from step 1."""

    class SqrtAtZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls <= 5:  # the start-up shape pass and step 0 (M=4) stay healthy
                return x
            return x + (x * 0).sqrt()  # forward: x + 0; backward: inf * 0 = NaN

    work = good(steps=3)
    work.layers = nn.Sequential(nn.Linear(8, 8), SqrtAtZero(), nn.Linear(8, 8), nn.ReLU())
    return work


def slow(steps: int = 200) -> Workload:
    """Many slow steps (a 0.05 s sleep per forward of stage 0): a run long enough to be interrupted."""

    class Sleep(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x

    work = good(steps=steps)
    work.layers = nn.Sequential(Sleep(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    return work


def kills_worker() -> Workload:
    """Rank 1 (stage 1 under partition 2,2) SIGKILLs itself on its 6th forward."""

    class Die(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 6:
                os.kill(os.getpid(), 9)
            return x

    work = good(steps=4)
    work.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Die(), nn.Linear(8, 8))
    return work


def wide() -> Workload:
    """Like `good`, with 32-wide layers: its saved weights (about 10 KB) are much larger than its report."""
    layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    batches = [(torch.randn(8, 32), torch.randn(8, 32)) for _ in range(2)]
    return Workload(layers, nn.functional.mse_loss, batches)


class KeepPositive(nn.Linear):
    """Keeps the rows whose first input is positive: an output shape that depends on the data."""

    def forward(self, x):
        return super().forward(x)[x[:, 0] > 0]


class Pool(nn.Linear):
    def forward(self, h):
        return super().forward(h).mean(0, keepdim=True).expand(2, 8)


def varying_shapes() -> Workload:
    """Micro-batch 0 keeps 2 rows, micro-batch 1 keeps 1: what crosses the boundary changes shape."""
    x = torch.randn(8, 8)
    x[:, 0] = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    return Workload(nn.Sequential(KeepPositive(8, 8), Pool(8, 8)), nn.functional.mse_loss, [(x, torch.randn(8, 8))])

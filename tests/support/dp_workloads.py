"""Workloads and a multi-config worker for the data-parallel and checkpoint tests (tests/runtime/test_runtime_dp.py,
tests/runtime/test_checkpoint.py). Small models: a run is mostly the time to import torch in each process."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from pipec.runtime.workload import Workload

KILL_ENV = "PIPEC_TEST_KILL"  # "MARKER_PATH:N": the process running KillOnce's N-th training forward dies, once


class KillOnce(nn.Module):
    """Identity. When KILL_ENV is "MARKER:N", the first process to reach its N-th forward with gradients
    enabled (training, not the start-up shape pass) creates MARKER and SIGKILLs itself; every later process
    (another replica, a restarted or resumed run) finds MARKER and carries on. With M micro-batches per replica
    and this layer in one stage, forward N = k * M + 1 is the first micro-batch of step k."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        setting = os.environ.get(KILL_ENV)
        if setting and torch.is_grad_enabled():
            self.calls += 1
            marker, _, count = setting.rpartition(":")
            if self.calls == int(count):
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return x
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def dropout_mlp(steps: int = 8) -> Workload:
    """Linear+ReLU+Dropout blocks (dropout: the resumed run must draw the same masks), a KillOnce in the
    middle, Adam (per-parameter state to reshard: step, exp_avg, exp_avg_sq); batch 8, hidden 8."""
    modules: list[nn.Module] = []
    for block in range(4):
        modules += [nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.25)]
        if block == 1:
            modules.append(KillOnce())
    modules.append(nn.Linear(8, 8))
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(steps)]
    return Workload(nn.Sequential(*modules), nn.functional.mse_loss, batches, lambda ps: torch.optim.Adam(ps, lr=0.01))


def wider_mlp() -> Workload:
    """A different model (16 wide): a checkpoint of dropout_mlp is foreign to it."""
    layers = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(8)]
    return Workload(layers, nn.functional.mse_loss, batches, lambda ps: torch.optim.Adam(ps, lr=0.01))


def sgd_dropout_mlp() -> Workload:
    """dropout_mlp with SGD: the same keys and shapes, another optimizer."""
    work = dropout_mlp()
    work.optimizer = lambda ps: torch.optim.SGD(ps, lr=0.1)
    return work


def sparse_embedding() -> Workload:
    """A sparse-gradient Embedding (each replica's gradient is a sparse tensor: all-reduced on its own), then
    Linear layers; SGD (which takes sparse gradients). Batch 8 of 3 tokens."""
    layers = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    batches = [(torch.randint(0, 20, (8, 3)), torch.randn(8, 3, 8)) for _ in range(2)]
    return Workload(layers, nn.functional.mse_loss, batches)


def nan_in_replica_1() -> Workload:
    """An MLP whose second batch has a NaN in row 5: with --dp 2 and M = 2, replica 1's micro-batch 0."""
    modules: list[nn.Module] = []
    for _ in range(2):
        modules += [nn.Linear(8, 8), nn.ReLU()]
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    batches[1][0][5, 2] = float("nan")
    return Workload(nn.Sequential(*modules), nn.functional.mse_loss, batches)


def train_configs(configs: list[tuple]) -> dict:
    """Runs in every worker of one spawn: for each (key, schedule, P, M, options) train in turn, sharing the
    processes' start-up. Returns, per key, this rank's weights and the run's report, or the error text."""
    import pipec
    from pipec.errors import PipecError
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    for key, schedule, ranks, microbatches, fields in configs:
        try:
            program = pipec.compile(schedule, ranks, microbatches)
            out[key] = train(program, Options(quiet=True, **fields))
        except PipecError as e:  # the non-finite stop raises on every rank in the same step
            out[key] = {"error": e.message}
    return out

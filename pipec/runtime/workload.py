"""The workload protocol of `pipec run --model MODULE:FACTORY`.

FACTORY() returns an object with `layers` (an nn.Sequential or a list of modules), `loss_fn(output, target)`
(a mean over the batch), `batches` (a list of full `(input, target)` batches, one per step) and optionally
`optimizer(params)` (default SGD with lr 0.1). `Workload` below is a ready-made such object.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipec.errors import PipecInputError


@dataclass
class Workload:
    layers: Any
    loss_fn: Callable
    batches: list
    optimizer: Callable | None = None


def resolve(spec: str) -> Callable[[], Any]:
    """The FACTORY function named by MODULE:FACTORY (the current directory is importable, as with python -m)."""
    import sys

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PipecInputError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. examples.mlp:workload")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PipecInputError(f"--model {spec}: cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PipecInputError(f"--model {spec}: {module_name} has no function {attr}")
    return factory


def build(spec: str, seed: int) -> Workload:
    """Seed torch, call the factory and check what it returned. Every rank does this with the same seed, so
    every rank holds the same initial weights and data."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    made = resolve(spec)()
    missing = [name for name in ("layers", "loss_fn", "batches") if not hasattr(made, name)]
    if missing:
        raise PipecInputError(f"--model {spec}: the workload has no {', '.join(missing)} (see docs/runtime.md)")
    layers = made.layers
    if not isinstance(layers, nn.Sequential):
        layers = nn.Sequential(*layers)
    batches = list(made.batches)
    if not batches:
        raise PipecInputError(f"--model {spec}: the workload has no batches")
    return Workload(layers, made.loss_fn, batches, getattr(made, "optimizer", None))


def make_optimizer(workload: Workload, params: list):
    import torch

    if not params:
        return None
    if workload.optimizer is None:
        return torch.optim.SGD(params, lr=0.1)
    return workload.optimizer(params)


def split(batch, microbatches: int) -> tuple[list, list]:
    """A full (input, target) batch as M equal micro-batches along dim 0."""
    inputs, targets = batch
    size = inputs.shape[0]
    if size % microbatches:
        raise PipecInputError(f"the batch size {size} is not divisible by the {microbatches} micro-batches")
    return list(inputs.chunk(microbatches)), list(targets.chunk(microbatches))

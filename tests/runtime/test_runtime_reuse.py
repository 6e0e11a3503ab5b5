"""The interpreter's host-cost savings change nothing a run computes.

Receive buffers are reused only when nothing else holds them (pipec/runtime/buffers.py, `_recycle`).

The model passes one of its two boundary tensors through two stages unchanged, so the buffer stage 1 (and 2)
receives it into is the very tensor it sends on: reusing it for the next micro-batch while the send is in
flight, or while the next stage's graph saves it, would train on another micro-batch's values. The pipelined
runs (B; I and W; inference) must train like one process, and the pool must have served the buffers that were
free (so reuse is not silently off) and never the passed-through ones.

Layers that draw no random numbers are not reseeded (pipec/runtime/stages.py, `draws_nothing`): every draw, the
dropout masks and whatever runs after the stage (a sampling loss), is the same as with every layer reseeded.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipec
from pipec.runtime import buffers, interpreter, launch
from pipec.runtime.stages import Stage, draws_nothing, microbatch_seed
from pipec.runtime.workload import Workload

MODEL = "test_runtime_reuse:passthrough"
PARTITION = "2,2,2,2"  # 4 stages (V=2 on 2 ranks): stages 1 and 2 pass `aux` on as they received it
STEPS = 3
MICROBATCHES = 4
# (schedule, training): the full backward (B), the split one (I, then W) and a forward-only run.
RUNS = (("interleaved_1f1b", True), ("interleaved_zb", True), ("forward_only", False))


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), torch.tanh(x)


class Pass(nn.Module):
    """Transforms the first tensor and hands the second on as it came (the same tensor object)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.linear(h)), aux


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.linear(h * aux)


def passthrough() -> Workload:
    torch.manual_seed(0)
    layers = nn.Sequential(Split(), Pass(), Pass(), Pass(), Pass(), Pass(), Merge(), nn.Tanh())
    batches = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(STEPS)]
    return Workload(layers, nn.functional.mse_loss, batches, lambda params: torch.optim.SGD(params, lr=0.1))


def train_all() -> dict:
    """In each worker: every run of RUNS; per run, this rank's weights, losses and pool hits per
    (kind, stage, tensor index) ("F": activations, "B": gradients)."""
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    original = interpreter._buffers
    for schedule, _ in RUNS:
        hits: dict = {}

        def counting(ctx, key, boundary, hits=hits):
            before = [len(free) for _, _, free in ctx.pool.get(key, ())]
            parts = original(ctx, key, boundary)
            for i, n in enumerate(before):
                taken = n - len(ctx.pool[key][i][2])
                hits[(*key, i)] = hits.get((*key, i), 0) + taken
            return parts

        interpreter._buffers = counting
        try:
            program = pipec.compile(schedule, 2, MICROBATCHES, 2)
            result = train(program, Options(model=MODEL, steps=STEPS, quiet=True, partition=PARTITION))
        finally:
            interpreter._buffers = original
        out[schedule] = {"weights": result["weights"], "report": result["report"], "hits": hits}
    return out


@functools.cache
def runs() -> list[dict]:
    return launch.spawn(train_all, 2, (), timeout_s=60)


def reference(training: bool) -> tuple[dict, list[float]]:
    """One process, the same micro-batches: each loss / M, gradients accumulated, one SGD step per batch."""
    work = passthrough()
    params = list(work.layers.parameters())
    optimizer = work.optimizer(params)
    losses = []
    for x, y in work.batches:
        optimizer.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            with torch.set_grad_enabled(training):
                h = xm
                for layer in work.layers:
                    h = layer(*h) if isinstance(h, tuple) else layer(h)
                loss = work.loss_fn(h, ym) / MICROBATCHES
            total += float(loss.detach())
            if training:
                loss.backward()
        if training:
            optimizer.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in work.layers.state_dict().items()}, losses


def test_recycle_keeps_only_what_nothing_else_holds() -> None:
    pool = ((None, None, []),)
    fresh = (torch.empty(3),)
    buffers._recycle(pool, fresh)
    assert pool[0][2] == [fresh[0]]
    for hold in (lambda t: t, lambda t: t.detach(), lambda t: t[1:]):  # a reference, an alias, a view
        pool[0][2].clear()
        parts = (torch.empty(3),)
        held = hold(parts[0])
        buffers._recycle(pool, parts)
        assert pool[0][2] == []
        del held
        buffers._recycle(pool, parts)
        assert len(pool[0][2]) == 1
    pool[0][2].clear()
    parts = (torch.empty(3).requires_grad_(),)
    loss = (parts[0] * torch.ones(3, requires_grad=True)).sum()  # the graph saves the buffer
    buffers._recycle(pool, parts)
    assert pool[0][2] == []
    loss.backward()
    del loss
    buffers._recycle(pool, parts)
    assert len(pool[0][2]) == 1


@pytest.mark.parametrize(("schedule", "training"), RUNS)
def test_reused_buffers_train_like_one_process(schedule: str, training: bool) -> None:
    per_rank = runs()
    weights = {}
    for result in per_rank:
        weights.update(result[schedule]["weights"])
    expected, losses = reference(training)
    assert sorted(weights) == sorted(expected)
    worst = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-6, f"max abs weight difference {worst:g}"
    assert per_rank[0][schedule]["report"]["losses"] == pytest.approx(losses, abs=1e-6)

    hits = {key: n for result in per_rank for key, n in result[schedule]["hits"].items()}
    # What nothing else holds is free after the backward (after W, for what I's graph keeps), or after the
    # forward without training, so from the second step on every such receive reuses a buffer: the `h` (index
    # 0) of stages 1 and 2, both of stage 3's inputs and the gradients but the passed-through `aux`'s.
    reusable = [("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 3, 1)]
    if training:
        reusable += [("B", 0, 0), ("B", 0, 1), ("B", 1, 0), ("B", 2, 0)]
    for key in reusable:
        assert hits[key] >= (STEPS - 1) * MICROBATCHES, (key, hits)
    if not training:
        # Without a backward, the stage's output (holding `aux`) is still waiting to be sent when F gives its
        # input back: those buffers are never reused. (When training, they are given back after B, once the
        # send has completed, and may be.)
        assert hits[("F", 1, 1)] == hits[("F", 2, 1)] == 0


class Noisy(nn.Linear):
    """A Linear subclass that draws: not exactly nn.Linear, so it is reseeded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * torch.randn_like(x)


def test_only_layers_that_cannot_draw_skip_the_reseed() -> None:
    assert draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.LayerNorm(2)))
    assert not draws_nothing(nn.Dropout(0.5))
    assert not draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))
    assert not draws_nothing(Noisy(2, 2))
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda module, args, out: out + torch.rand_like(out))
    assert not draws_nothing(hooked)


def test_skipping_reseeds_draws_what_reseeding_every_layer_draws() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.5), Noisy(4, 4), nn.Linear(4, 4), nn.Dropout(0.3), nn.Tanh()]
    skipping = Stage.build(1, 3, layers)
    assert skipping.seeded == (False, False, True, True, False, True, True)  # the stage's last layer always
    every = Stage(*[getattr(skipping, f) for f in ("index", "first_layer", "layers", "param_layers")],
                  skipping.params_by_layer)  # fmt: skip
    generators = (torch.default_generator,)
    x = torch.randn(3, 4)
    for m in range(3):
        seed = microbatch_seed(7, 2, m)
        got, after = skipping.forward(x, seed, generators), torch.rand(2)  # after: a loss that samples
        expected, expected_after = every.forward(x, seed, generators), torch.rand(2)
        assert torch.equal(got, expected) and torch.equal(after, expected_after)
        (got, _), after = skipping.forward_recording(x, seed, generators), torch.rand(2)
        assert torch.equal(got, expected) and torch.equal(after, expected_after)

"""Partitioning a model's layers into the S pipeline stages, and the stage modules built from them.

`partition` returns the number of layers of each stage (contiguous, in order, none empty):
- `params`  (default): an optimal contiguous partition by parameter count, minimising the largest stage
  (ties broken towards fewer layers in the largest stage, so parameter-free layers spread out too);
- `profile`: the same optimum over measured per-layer forward+backward times (on the rank's device);
- `4,4,4,4`: explicit layer counts.

What flows between layers, and between stages: a layer returns a tensor or a tuple of tensors; the next layer
receives a tuple as positional arguments (`call`), as torch.distributed.pipelining passes a stage's outputs to
the next stage. `Boundary` describes what one stage sends to the next (learnt once at start-up); under
`--dtype bf16|fp16` its floating-point tensors travel in that dtype (`to_boundary`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipec.errors import PipecInputError


def optimal_partition(weights: Sequence[float], parts: int) -> tuple[int, ...]:
    """Split `weights` into `parts` contiguous non-empty runs minimising the largest run's sum (exact DP)."""
    n = len(weights)
    if parts > n:
        raise PipecInputError(f"the model has {n} layers but the schedule has {parts} stages; give it more layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest possible largest run when the first i layers form k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def parse_partition(text: str, layers: int, stages: int, copies: int = 1) -> tuple[int, ...]:
    """Explicit layer counts, one per stage of one copy of the model (`copies`: a replicated schedule's)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PipecInputError(f"--partition {text!r}: expected params, profile or layer counts like 4,4,4,4") from None
    if len(sizes) != stages or any(s < 1 for s in sizes) or sum(sizes) != layers:
        counted = f" (one per stage of one of the schedule's {copies} copies of the model)" if copies > 1 else ""
        raise PipecInputError(
            f"--partition {text}: expected {stages} positive layer counts{counted} summing to {layers} (the model's "
            "layers)"
        )
    return sizes


def layer_weights_by_params(layers) -> list[float]:
    # The parameter count dominates; the +1 per layer only breaks ties between equally heavy partitions
    # (every module count is below n + 1, so it never outweighs one parameter).
    n = len(layers)
    return [sum(p.numel() for p in layer.parameters()) * (n + 1) + 1.0 for layer in layers]


def layer_weights_by_profile(layers, sample, repeats: int = 5, device=None) -> list[float]:
    """Median forward+backward time of each layer on one micro-batch, feeding each layer its real input, on
    `device` (None: the CPU, where the layers are built). On a GPU each layer goes there for its own measurement
    and back (one rank need not hold the whole model), and the clock is read after a synchronize: a CUDA call
    returns once its kernels are queued, so the host clock alone would time the launches."""
    import time

    import torch

    gpu = device is not None and device.type == "cuda"

    def now() -> float:
        if gpu:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    weights = []
    x = detached(sample)
    if gpu:
        x = tuple(t.to(device) for t in x) if type(x) is tuple else x.to(device)
    for layer in layers:
        if gpu:
            layer.to(device)
        times = []
        for _ in range(repeats):
            inp = detached(x, grad=True)
            start = now()
            out = [t for t in tensors(call(layer, inp)) if t.requires_grad]
            if out:
                sum(t.float().sum() for t in out).backward()
            times.append(now() - start)
        with torch.no_grad():
            x = call(layer, x)
        layer.zero_grad(set_to_none=True)
        if gpu:
            layer.to("cpu")
        weights.append(sorted(times)[len(times) // 2])
    return weights


def partition(layers, stages: int, how: str = "params", sample=None, device=None, copies: int = 1) -> tuple[int, ...]:
    """Layers per stage: by parameter count, by profile (on `device`, see `layer_weights_by_profile`) or as
    given. `stages`: those of one copy of the model (a replicated schedule has `copies` of it)."""
    if how == "params":
        return optimal_partition(layer_weights_by_params(layers), stages)
    if how == "profile":
        return optimal_partition(layer_weights_by_profile(layers, sample, device=device), stages)
    return parse_partition(how, len(layers), stages, copies)


@dataclass
class Stage:
    """One stage's layers. `forward` records the output of every layer that has trainable parameters:
    the split backward's I captures gradients there and W continues from them, layer by layer."""

    index: int
    first_layer: int  # index of its first layer in the unsplit model
    layers: list
    param_layers: tuple[int, ...]  # positions (in `layers`) of layers with trainable parameters
    params_by_layer: dict[int, list]  # position -> that layer's trainable parameters
    seeded: tuple[bool, ...] = ()  # per layer: reseed the generators before it (`draws_nothing`); () all
    # A trainable parameter used by two of its layers (tied weights): W, which goes from each layer's outputs to
    # that layer's parameters, would reach the shared one through the earlier layer too, so the split backward
    # runs whole in I there (the interpreter's backward_input) and W has nothing left to do.
    tied: bool = False

    @classmethod
    def build(cls, index: int, first_layer: int, layers: list) -> Stage:
        params = {i: [p for p in layer.parameters() if p.requires_grad] for i, layer in enumerate(layers)}
        with_params = tuple(i for i in range(len(layers)) if params[i])
        # The stage's last layer is always reseeded: what runs after it (the loss, on the last stage) then draws
        # from the same state as if every layer were.
        seeded = tuple(i == len(layers) - 1 or not draws_nothing(layer) for i, layer in enumerate(layers))
        stage = cls(index, first_layer, layers, with_params, {i: params[i] for i in with_params}, seeded)
        stage.tied = len(stage.parameters()) != sum(len(params[i]) for i in with_params)
        return stage

    def parameters(self) -> list:
        """The stage's trainable parameters, each once: a parameter that several of its layers share (tied
        weights) is one parameter to the optimizer, whatever `layer_parameters` lists per layer for W."""
        return list(dict.fromkeys(p for i in self.param_layers for p in self.params_by_layer[i]))

    def named_parameters(self) -> list[tuple[str, Any]]:
        """(name in the unsplit model, parameter), each parameter once under its first name: the names
        checkpoints use, so that optimizer state is keyed the same way whatever the partition."""
        out, seen = [], set()
        for i in self.param_layers:
            for n, p in self.layers[i].named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{self.first_layer + i}.{n}", p))
        return out

    def layer_parameters(self, position: int) -> list:
        return self.params_by_layer[position]

    def to(self, device) -> Stage:
        for layer in self.layers:
            layer.to(device)
        return self

    def forward(self, x, seed: int | None = None, generators: Sequence = ()):
        """The stage's output. With `seed` (a micro-batch's seed, see `layer_seed`), each layer first reseeds
        `generators` from (seed, its index in the unsplit model): dropout masks then depend on the layer and the
        micro-batch only, not on the schedule, the partition or what ran before on this rank. A layer that draws
        no random numbers (`draws_nothing`) is not reseeded: that changes no draw."""
        seeded = self.seeded or (True,) * len(self.layers)
        for i, layer in enumerate(self.layers):
            if seed is not None and seeded[i]:
                reseed(generators, layer_seed(seed, self.first_layer + i))
            x = layer(*x) if type(x) is tuple else layer(x)
        return x

    def forward_recording(self, x, seed: int | None = None, generators: Sequence = ()):
        """The output, and, for each layer with parameters (in order), the tuple of its output tensors that
        require grad. `seed` as in `forward`."""
        recorded = []
        marks = set(self.param_layers)
        seeded = self.seeded or (True,) * len(self.layers)
        for i, layer in enumerate(self.layers):
            if seed is not None and seeded[i]:
                reseed(generators, layer_seed(seed, self.first_layer + i))
            x = layer(*x) if type(x) is tuple else layer(x)
            if i in marks:  # per layer, its outputs that carry a gradient (W starts from them)
                if type(x) is tuple:
                    x = _own_nodes(x)
                    recorded.append(tuple(t for t in x if t.requires_grad))
                else:  # none if it needs no gradient (parameters used under no_grad, or not at all)
                    recorded.append((x,) if x.requires_grad else ())
        return x, recorded

    def state_dict(self) -> dict:
        """Entries keyed as in the unsplit nn.Sequential (`{layer index}.{name}`)."""
        out = {}
        for i, layer in enumerate(self.layers):
            for key, value in layer.state_dict().items():
                out[f"{self.first_layer + i}.{key}"] = value.detach().cpu().clone()
        return out


# --- what flows between layers and stages -----------------------------------------------------------------------


def call(layer, x):
    """`layer` on `x`: a tuple's tensors are passed as positional arguments (torch.distributed.pipelining's rule
    between stages, here between any two layers), anything else as the one argument."""
    return layer(*x) if type(x) is tuple else layer(x)


def run_layers(layers, x):
    """The unsplit model on `x`, layer after layer with `call`'s rule (nn.Sequential would pass a tuple as one
    argument)."""
    for layer in layers:
        x = call(layer, x)
    return x


def tensors(value) -> tuple:
    """The tensors of a layer's output: the tuple itself, or a one-tensor tuple."""
    return value if type(value) is tuple else (value,)


def _own_nodes(outputs: tuple) -> tuple:
    """A layer's outputs, each one that requires grad behind a graph node of its own (a view of itself) when
    there are several. I's gradient at each recorded output is then only what reaches it from the layers after:
    without the views, an output computed from another (or one tensor returned twice) would also hold the
    other's gradient, and W, which starts from all of them, would count that part twice."""
    if sum(1 for t in outputs if t.requires_grad) < 2:
        return outputs
    return tuple(t.view_as(t) if t.requires_grad else t for t in outputs)


def detached(value, grad: bool = False):
    """`value` (a tensor or a tuple of them) cut from its graph; with `grad`, its floating-point tensors become
    leaves that require grad (integer tensors, such as positions or masks, cannot carry a gradient)."""
    if not grad:  # a detached tensor requires no grad already
        return value.detach() if type(value) is not tuple else tuple(t.detach() for t in value)
    if type(value) is not tuple:
        return value.detach().requires_grad_(value.is_floating_point())
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in value)


DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch's name (None: no autocast)


def compute_dtype(name: str):
    """The torch dtype of `--dtype NAME`, or None for fp32 (ordinary float32 training, no autocast)."""
    import torch

    if name not in DTYPES:
        raise PipecInputError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    attr = DTYPES[name]
    return None if attr is None else getattr(torch, attr)


def to_boundary(value, dtype):
    """A stage's output as it is sent: floating-point tensors in the compute dtype (`dtype`, None: unchanged).
    The cast is part of the autograd graph, so the backward starts from the tensors that were sent."""
    if dtype is None:
        return value
    if type(value) is not tuple:
        return value.to(dtype) if value.is_floating_point() else value
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in value)


class Boundary(NamedTuple):
    """What stage s sends to stage s + 1 for each micro-batch, learnt at start-up: each tensor's shape and dtype
    (as sent), whether it is a tuple (the next stage receives its tensors as positional arguments) and which of
    them carry a gradient back (the floating-point ones; their gradients travel in the same dtype)."""

    specs: tuple[tuple[tuple[int, ...], Any], ...]  # (shape, dtype) of each tensor
    is_tuple: bool
    grads: tuple[int, ...]  # indices (into specs) of the tensors whose gradients travel back

    @classmethod
    def of(cls, value) -> Boundary:
        parts = tensors(value)
        specs = tuple((tuple(t.shape), t.dtype) for t in parts)
        return cls(specs, type(value) is tuple, tuple(i for i, t in enumerate(parts) if t.is_floating_point()))

    def zeros(self, device) -> Any:
        """A stand-in input of these shapes (zeros), for the start-up shape pass."""
        import torch

        parts = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in self.specs)
        return parts if self.is_tuple else parts[0]


def build_stages(layers, sizes: Sequence[int], wanted: Sequence[int]) -> dict[int, Stage]:
    """The Stage objects for the stage indices in `wanted` (this rank's), sharing the model's layer objects.
    `sizes` partitions one copy of the model into L stages: stage s holds the layers of logical stage s % L (a
    replicated program's stages are numbered over its copies; with one pipeline s % L = s), so two copies of a
    stage on one rank are one set of layers."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    length = len(sizes)
    return {s: Stage.build(s, starts[s % length], list(layers[starts[s % length] : starts[s % length + 1]]))
            for s in wanted}  # fmt: skip


def describe(layers, sizes: Sequence[int], stage_to_rank: Sequence[int]) -> str:
    """One line per stage of one copy: its rank, layers and parameters; a replicated program's line names the
    stages (and ranks) of the other copies too."""
    lines, start = [], 0
    length = len(sizes)
    for s, size in enumerate(sizes):
        params = sum(p.numel() for layer in layers[start : start + size] for p in layer.parameters())
        copies = range(s + length, len(stage_to_rank), length)
        also = "".join(f"; copy {c // length}: stage {c} on rank {stage_to_rank[c]}" for c in copies)
        lines.append(
            f"  stage {s} (rank {stage_to_rank[s]}{also}): layers {start}-{start + size - 1}, {params} parameters"
        )
        start += size
    return "\n".join(lines)


# --- randomness: derived, never saved --------------------------------------------------------------------------

_MASK = 2**64 - 1


def mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64's finaliser, chained): well spread, fast in Python (~1 us), and the
    same on every machine, unlike Python's hash()."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        z = (h + (value & _MASK) + 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        h = z ^ (z >> 31)
    return h


def microbatch_seed(seed: int, step: int, microbatch: int) -> int:
    """The seed of one micro-batch of one step. `microbatch` is its index in the whole batch (replica r's
    micro-batch m is r * M + m), so runs with the same D x M split a batch into the same micro-batches and draw
    the same random numbers for them, whatever D, the schedule, P, V or the partition."""
    return mix(seed, step, microbatch)


def layer_seed(microbatch_seed: int, layer: int) -> int:
    return mix(microbatch_seed, layer)


# Module types whose forward draws no random number: exactly these classes (a subclass may override forward).
_NO_RANDOMNESS = (
    "Linear", "Bilinear", "Identity", "Flatten", "Unflatten", "Sequential", "Embedding", "EmbeddingBag",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "GELU", "SiLU", "Mish", "ELU", "SELU", "CELU", "Tanh", "Sigmoid",
    "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid", "Softmax", "LogSoftmax",
)  # fmt: skip


def draws_nothing(layer) -> bool:
    """Whether `layer` provably draws no random numbers, so that reseeding before it (about 2 us) changes
    nothing: it and every module inside are exactly one of torch.nn's deterministic classes, with no hooks
    (a hook could draw). Anything else, a user's own module included, is reseeded."""
    from torch import nn
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        return False
    allowed = {getattr(nn, name) for name in _NO_RANDOMNESS if hasattr(nn, name)}
    return all(type(m) in allowed and not m._forward_hooks and not m._forward_pre_hooks for m in layer.modules())


def reseed(generators: Sequence, value: int) -> None:
    """Seed each generator (torch's CPU generator, and the CUDA generator of the device in use) with `value`.
    `Generator.manual_seed` costs about 1 us; `torch.manual_seed` would cost 50 us (it visits every backend)."""
    for generator in generators:
        generator.manual_seed(value)

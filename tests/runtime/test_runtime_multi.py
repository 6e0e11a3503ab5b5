"""Several tensors between stages: a layer returning a tuple feeds the next layer its tensors as positional
arguments, across stage boundaries too, and the pipelined run trains like one process.

The model is examples/workload.py's causal transformer, small (embedding, 6 attention blocks, head: 8 layers, so
that zbv on 4 ranks has one layer per stage): its layers pass (hidden float32, positions int64) to each other, so
every boundary sends two tensors and gets one gradient back. zb_h1 (split backward: I and W) and zbv (V=2; on
one rank its two stages hand over locally) run on 1, 2 and 4 gloo ranks, 1f1b on 1 and 2, 2 steps each, some in
float32 (checked here) and some in bf16 (checked in tests/runtime/test_runtime_dtype.py, with the fp16 run and a
one-tensor model): one spawn per rank count runs them all (`RUNS`), to share the workers' start-up.

The reference is one process running the same micro-batches with gradient accumulation (each micro-batch's loss
/ M, one optimizer step per batch), written here without pipec's code, on one thread as the workers run: float32
weights must agree to 1e-5, the bound tests/runtime/test_runtime.py uses (float32 sums of the M micro-batch gradients,
possibly accumulated in another order; measured here: equal to the last bit).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from pathlib import Path

import pytest
import torch
from paths import ROOT

import pipec
from pipec.errors import PipecInputError
from pipec.ir import Kind
from pipec.runtime import launch
from pipec.runtime.workload import build, make_optimizer, resolve

EXAMPLE = f"{ROOT / 'examples' / 'workload.py'}:causal_transformer"
MODEL = "test_runtime_multi:tiny"
STEPS = 2
MICROBATCHES = {1: 2, 2: 4, 4: 4}
# (schedule, --dtype) of the transformer runs, per rank count: each dtype on each rank count, each schedule in
# both dtypes somewhere, the split backward (zb_h1) and V=2 (zbv) on every rank count.
RUNS = {
    1: (("1f1b", "fp32"), ("zb_h1", "bf16"), ("zbv", "bf16")),
    2: (("1f1b", "bf16"), ("zb_h1", "fp32"), ("zbv", "bf16")),
    4: (("zb_h1", "bf16"), ("zbv", "fp32")),  # the slowest spawn (4 processes): 1f1b runs on 1 and 2
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 1024.0  # the static loss scale docs/runtime.md states for --dtype fp16


def tiny():
    """The example's causal transformer, 8 layers of width 8, trained with SGD: Adam's first step moves every
    weight by about lr whatever the size of its gradient, which would turn rounding noise into weight changes."""
    work = resolve(EXAMPLE)(hidden=8, heads=2, blocks=6, vocab=11, seq=4, batch=8)
    work.optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
    return work


def tiny_residual():
    """A one-tensor model (tests/support/workloads.py's residual blocks) for --dtype with a single boundary tensor."""
    import workloads

    return workloads.residual()


class Fork(torch.nn.Linear):
    """Returns its output twice (the same tensor object) and a tensor computed from it: outputs that depend on
    each other, which the split backward must not count twice."""

    def forward(self, x):
        h = torch.tanh(super().forward(x))
        return h, h, 2 * h + 1


class Join(torch.nn.Linear):
    def forward(self, a, b, c):
        return super().forward(a) * b + c


def dependent():
    from pipec.runtime.workload import Workload

    layers = torch.nn.Sequential(
        torch.nn.Linear(6, 6), Fork(6, 6), Join(6, 6), Fork(6, 6), Join(6, 6), torch.nn.Linear(6, 3)
    )
    batches = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(STEPS)]
    return Workload(layers, torch.nn.functional.mse_loss, batches, lambda p: torch.optim.SGD(p, lr=0.1))


def tied_ends():
    """The first and the last layer share their weight (tied embeddings' shape of problem): one parameter."""
    from pipec.runtime.workload import Workload

    first, last = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
    last.weight = first.weight
    layers = torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), last)
    batches = [(torch.randn(8, 6), torch.randn(8, 6)) for _ in range(STEPS)]
    return Workload(layers, torch.nn.functional.mse_loss, batches, lambda p: torch.optim.SGD(p, lr=0.1))


class Teacher(torch.nn.Linear):
    """Uses its parameters without gradients: trainable, yet its output needs none."""

    def forward(self, x):
        with torch.no_grad():
            return super().forward(x)


def frozen_first():
    from pipec.runtime.workload import Workload

    layers = torch.nn.Sequential(Teacher(6, 6), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    batches = [(torch.randn(8, 6), torch.randn(8, 6)) for _ in range(STEPS)]
    return Workload(layers, torch.nn.functional.mse_loss, batches, lambda p: torch.optim.SGD(p, lr=0.1))


# Runs of those models: (key, schedule, model) per rank count. On 2 ranks zbv puts stages 0 and 3 on rank 0, so
# the tied first and last layers share a rank (one parameter object; across ranks: tests/runtime/test_runtime_ties.py).
SHAPES = {
    1: (
        (("zb_h1", "dependent"), "zb_h1", "dependent"),
        (("zb_h1", "tied"), "zb_h1", "tied_ends"),
        (("zb_h1", "frozen"), "zb_h1", "frozen_first"),
    ),
    2: (
        (("zbv", "dependent"), "zbv", "dependent"),
        (("zb_h1", "dependent"), "zb_h1", "dependent"),
        (("zbv", "tied"), "zbv", "tied_ends"),
        (("zb_h1", "frozen"), "zb_h1", "frozen_first"),
    ),
}


def configs(ranks: int) -> list[tuple]:
    """(key, schedule, P, M, model, dtype) of every run one spawn of `ranks` workers makes."""
    m = MICROBATCHES[ranks]
    out = [((name, dtype), name, ranks, m, MODEL, dtype) for name, dtype in RUNS[ranks]]
    out += [(key, name, ranks, m, f"test_runtime_multi:{model}", "fp32") for key, name, model in SHAPES.get(ranks, ())]
    if ranks == 2:
        out.append((("1f1b", "fp16"), "1f1b", 2, m, MODEL, "fp16"))
        out.append((("1f1b", "bf16-residual"), "1f1b", 2, m, "test_runtime_multi:tiny_residual", "bf16"))
        out.append((("forward_only", "fp32"), "forward_only", 2, m, MODEL, "fp32"))
    return out


def train_configs(todo: list[tuple]) -> dict:
    """In every worker of one spawn: train each config in turn; per key, this rank's weights, the report and
    what each message this rank sent held: ("SEND_F" or "SEND_B", ((dtype, bytes) of each tensor, ...))."""
    from pipec.runtime import interpreter
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    originals = {kind: interpreter.DISPATCH[kind] for kind in (Kind.SEND_F, Kind.SEND_B)}
    for key, schedule, ranks, microbatches, model, dtype in todo:
        sent: list[tuple] = []
        for kind, original in originals.items():

            def recording(ctx, action, original=original, kind=kind, sent=sent):
                posted = original(ctx, action)  # (ops, box, key, the tensors sent)
                sent.append((kind.name, tuple((str(t.dtype), t.numel() * t.element_size()) for t in posted[3])))
                return posted

            interpreter.DISPATCH[kind] = recording
        try:
            program = pipec.compile(schedule, ranks, microbatches)
            result = train(program, Options(model=model, steps=STEPS, quiet=True, dtype=dtype))
        finally:
            interpreter.DISPATCH.update(originals)
        out[key] = {**result, "sent": sent}
    return out


@functools.cache
def runs(ranks: int) -> dict:
    """One spawn of `ranks` gloo workers running every config; per key: the merged weights, rank 0's report and
    every rank's forward messages."""
    per_rank = launch.spawn(train_configs, ranks, (configs(ranks),), timeout_s=60)
    merged = {}
    for key in per_rank[0]:
        weights = {}
        for result in per_rank:
            weights.update(result[key]["weights"])
        sent = [message for result in per_rank for message in result[key]["sent"]]
        merged[key] = {"weights": weights, "report": per_rank[0][key]["report"], "sent": sent}
    return merged


def cast(value, dtype):
    """What pipec sends across a boundary: floating-point tensors in the compute dtype."""
    parts = value if isinstance(value, tuple) else (value,)
    parts = tuple(t.to(dtype) if t.is_floating_point() else t for t in parts)
    return parts if isinstance(value, tuple) else parts[0]


@functools.cache
def reference(model: str, dtype: str, partition: tuple[int, ...], microbatches: int, train: bool = True):
    """One process: each batch's M micro-batches in turn, each loss / M, gradients accumulated, one optimizer step;
    with --dtype, under CPU autocast, the tensors crossing the run's stage boundaries cast as pipec sends them and
    fp16's loss scaled by 1024 (gradients unscaled before the step). Returns the weights and the losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: a matmul's float32 sums are blocked by thread, so results
    try:  # can differ in the last bit with the thread count, and in bf16 such a bit can flip a rounding
        return _reference(model, dtype, partition, microbatches, train)
    finally:
        torch.set_num_threads(threads)


def _reference(model: str, dtype: str, partition: tuple[int, ...], microbatches: int, train: bool):
    compute = DTYPES[dtype]
    work = build(model, seed=0)
    layers = list(work.layers)
    cuts = set(itertools.accumulate(partition[:-1]))
    params = [p for p in work.layers.parameters() if p.requires_grad]
    optimizer = make_optimizer(work, params)
    scale = FP16_SCALE if dtype == "fp16" else 1.0
    losses = []
    for k in range(STEPS):
        inputs, targets = work.batches[k % len(work.batches)]
        optimizer.zero_grad()
        total = 0.0
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True):
            precision = torch.autocast("cpu", dtype=compute) if compute else contextlib.nullcontext()
            with precision, torch.set_grad_enabled(train):
                h = x
                for i, layer in enumerate(layers):
                    if i in cuts and compute is not None:
                        h = cast(h, compute)
                    h = layer(*h) if isinstance(h, tuple) else layer(h)
                loss = work.loss_fn(h, y) / microbatches
            total += float(loss.detach())
            if train:
                (loss * scale).backward()
        if train:
            for p in params:
                if p.grad is not None:  # (a parameter used under no_grad gets none)
                    p.grad /= scale
            optimizer.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in work.layers.state_dict().items()}, losses


def messages(name: str, ranks: int) -> int:
    """Forward messages of a run: one per micro-batch and step at each boundary between stages of two ranks
    (stages of one rank, zbv's middle pair or everything on one rank, hand over without a message)."""
    owners = pipec.compile(name, ranks, MICROBATCHES[ranks]).stage_to_rank
    crossings = sum(1 for a, b in itertools.pairwise(owners) if a != b)
    return crossings * MICROBATCHES[ranks] * STEPS


def worst_difference(got: dict, expected: dict) -> float:
    assert sorted(got) == sorted(expected)
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


def runs_in(dtype: str) -> list:
    return [
        pytest.param(ranks, name, id=f"{name}-P{ranks}")
        for ranks, todo in RUNS.items()
        for name, d in todo
        if d == dtype
    ]


@pytest.mark.parametrize(("ranks", "name"), runs_in("fp32"))
def test_two_tensors_between_stages_train_like_one_process(ranks: int, name: str) -> None:
    run = runs(ranks)[name, "fp32"]
    report = run["report"]
    expected, losses = reference(MODEL, "fp32", tuple(report["partition"]), MICROBATCHES[ranks])
    worst = worst_difference(run["weights"], expected)
    assert worst < 1e-5, f"max abs weight difference {worst:g}"
    assert report["losses"] == pytest.approx(losses, abs=1e-6)
    # every forward message carried both tensors (the float32 activations, the int64 positions), every backward
    # message the activations' gradient only: positions travel forward only
    n = messages(name, ranks)
    assert sorted(kind for kind, _ in run["sent"]) == ["SEND_B"] * n + ["SEND_F"] * n
    for kind, tensors in run["sent"]:
        expected = ["torch.float32", "torch.int64"] if kind == "SEND_F" else ["torch.float32"]
        assert [dtype for dtype, _ in tensors] == expected


@pytest.mark.parametrize(
    ("ranks", "key", "model"), [(r, key, model) for r, shapes in SHAPES.items() for key, _, model in shapes]
)
def test_dependent_outputs_and_tied_weights_train_like_one_process(ranks: int, key: tuple, model: str) -> None:
    """A layer returning one tensor twice and another computed from it (the split backward's W starts from
    each output with only the gradient that reached it from downstream), a weight shared by two layers of one
    rank (one parameter to the optimizer, its gradient summed over both uses), and a layer whose parameters are
    used under no_grad (the split backward has nothing to record there)."""
    run = runs(ranks)[key]
    partition = tuple(run["report"]["partition"])
    expected, losses = reference(f"test_runtime_multi:{model}", "fp32", partition, MICROBATCHES[ranks])
    worst = worst_difference(run["weights"], expected)
    assert worst < 1e-5, f"max abs weight difference {worst:g}"
    assert run["report"]["losses"] == pytest.approx(losses, abs=1e-6)


def test_a_weight_tied_across_ranks_is_synced_and_a_program_syncing_other_stages_is_refused() -> None:
    """Across ranks a tied weight is one parameter whose copies' gradients SYNC sums (trained in
    tests/runtime/test_runtime_ties.py): checked before any worker starts, not refused. A program that already
    syncs other stage groups (a stream file) than the model's ties need is bad input, naming both."""
    from pipec.passes.sync import insert_syncs
    from pipec.runtime.options import Options
    from pipec.runtime.preflight import validate

    validate(pipec.compile("1f1b", 2, 4), Options(model="test_runtime_multi:tied_ends"))
    wrong = insert_syncs(pipec.compile("1f1b", 4, 4), [(0, 1)])
    with pytest.raises(PipecInputError) as caught:
        validate(wrong, Options(model="test_runtime_multi:tied_ends", partition="2,1,1,1"))
    message = caught.value.message
    assert "syncs the stage groups [(0, 1)]" in message and "need [(0, 3)]" in message, message


def test_forward_only_passes_tuples_between_stages() -> None:
    run = runs(2)["forward_only", "fp32"]
    report = run["report"]
    _, losses = reference(MODEL, "fp32", tuple(report["partition"]), MICROBATCHES[2], train=False)
    assert report["losses"] == pytest.approx(losses, abs=1e-6)
    initial, _ = reference(MODEL, "fp32", tuple(report["partition"]), MICROBATCHES[2], train=False)
    assert worst_difference(run["weights"], initial) == 0.0


def test_the_example_attention_is_causal() -> None:
    """Changing the last token changes only the last position's logits: the blocks attend to earlier tokens only
    (and to every earlier one: the first position's change reaches all later logits)."""
    work = build(MODEL, seed=0)
    tokens = work.batches[0][0][:2]
    changed_last, changed_first = tokens.clone(), tokens.clone()
    changed_last[:, -1] = (tokens[:, -1] + 1) % 11  # tiny's vocabulary
    changed_first[:, 0] = (tokens[:, 0] + 1) % 11

    def logits(x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in work.layers:
            h = layer(*h) if isinstance(h, tuple) else layer(h)
        return h

    with torch.no_grad():
        base, last, first = logits(tokens), logits(changed_last), logits(changed_first)
    assert torch.equal(base[:, :-1], last[:, :-1])
    assert not torch.equal(base[:, -1], last[:, -1])
    assert all(not torch.equal(base[:, t], first[:, t]) for t in range(tokens.shape[1]))


def test_what_crosses_a_boundary_is_checked_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    """A boundary of only integer tensors cannot carry a gradient, and a list is not a tensor tuple: exit 2 with a
    message naming the stage, before any process starts."""
    from pipec.runtime.options import Options
    from pipec.runtime.preflight import validate

    (tmp_path / "cuts.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from pipec.runtime.workload import Workload\n"
        "class Round(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x.long(), x.long()\n"
        "class Listed(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return [x, x]\n"
        "class Back(nn.Module):\n"
        "    def forward(self, a, b=None):\n"
        "        return a.float()\n"
        "def ints():\n"
        "    return Workload(nn.Sequential(nn.Linear(4, 4), Round(), Back(), nn.Linear(4, 4)),\n"
        "                    nn.functional.mse_loss, [(torch.randn(4, 4), torch.randn(4, 4))])\n"
        "def listed():\n"
        "    return Workload(nn.Sequential(nn.Linear(4, 4), Listed(), Back(), nn.Linear(4, 4)),\n"
        "                    nn.functional.mse_loss, [(torch.randn(4, 4), torch.randn(4, 4))])\n"
    )
    monkeypatch.chdir(tmp_path)
    program = pipec.compile("1f1b", 2, 2)
    with pytest.raises(PipecInputError) as ints:
        validate(program, Options(model="cuts:ints", partition="2,2"))
    assert "stage 1 starts at layer 2, whose input holds no floating-point tensor (torch.int64" in ints.value.message
    with pytest.raises(PipecInputError) as listed:
        validate(program, Options(model="cuts:listed", partition="2,2"))
    assert "must be a tensor or a tuple of tensors" in listed.value.message
    forward_only = pipec.compile("forward_only", 2, 2)
    validate(forward_only, Options(model="cuts:ints", partition="2,2"))  # no gradient, no need for a float


def test_the_loss_gets_a_tuple_output_as_it_is() -> None:
    """A last layer returning (logits, a float auxiliary term): loss_fn(output, target) receives the tuple, as
    torch.distributed.pipelining's schedules call it; the gradients reach both through it. One rank (no message),
    the interpreter run in this process."""
    from torch import nn

    from pipec.runtime import interpreter
    from pipec.runtime.stages import Stage

    class Split(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = super().forward(x)
            return y, y.pow(2).mean()

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), Split(4, 3)]
    x, target = torch.randn(4, 4), torch.randn(4, 3)
    seen = []

    def loss_fn(output, target):
        seen.append(type(output))
        logits, aux = output
        return nn.functional.mse_loss(logits, target) + 0.1 * aux

    program = pipec.compile("1f1b", 1, 2)
    stages = {0: Stage.build(0, 0, layers)}
    ctx = interpreter.Context(
        rank=0,
        stages=stages,
        stage_to_rank=(0,),
        shapes={},
        microbatches=2,
        loss_fn=loss_fn,
        device=torch.device("cpu"),
    )
    interpreter.run(ctx, interpreter.plan(program.streams[0]), list(x.chunk(2)), list(target.chunk(2)))
    got = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    for xm, tm in zip(x.chunk(2), target.chunk(2), strict=True):
        (loss_fn(layers[1](layers[0](xm)), tm) / 2).backward()
    assert seen[:2] == [tuple, tuple]
    expected = [p.grad for layer in layers for p in layer.parameters()]
    assert all(torch.allclose(g, e, atol=1e-7) for g, e in zip(got, expected, strict=True))


def test_inference_runs_tied_weights_across_ranks_and_saving_into_the_checkpoint_directory_is_refused(
    tmp_path: Path,
) -> None:
    """forward_only steps nothing, so copies of a tied weight on two ranks stay equal: no refusal there. And
    `--save` naming the `--checkpoint` directory (made only after the CLI's output checks) is bad input up front."""
    from pipec.runtime.options import Options
    from pipec.runtime.preflight import validate

    validate(pipec.compile("forward_only", 2, 4), Options(model="test_runtime_multi:tied_ends"))
    where = str(tmp_path / "ck")
    with pytest.raises(PipecInputError) as caught:
        validate(pipec.compile("1f1b", 1, 4), Options(model=MODEL, checkpoint=where, save=where))
    assert caught.value.message == f"--save {where} is the --checkpoint directory; give a file name"
    assert not (tmp_path / "ck").exists()

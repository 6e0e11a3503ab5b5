"""The `pipec run --model` workload contract: targets with another dim 0 than the inputs (flattened tokens), and
the failing-layer message naming what that layer received.

A language model's targets are often its tokens flattened, (B x T,) for inputs (B, T), with a loss that flattens
the logits; torch.distributed.pipelining cuts inputs and targets along dim 0 separately, and so does pipec: each
must divide into the D x M micro-batches. The flattened-token workload trains on 2 gloo ranks exactly as the same
steps in one process.
"""

from __future__ import annotations

import functools
import multiprocessing

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import pipec  # noqa: E402
from pipec.cli import main as cli_main  # noqa: E402
from pipec.errors import PipecInputError  # noqa: E402
from pipec.runtime import launch  # noqa: E402
from pipec.runtime.workload import Workload, split  # noqa: E402

VOCAB, WIDTH, SEQUENCE, BATCH, STEPS = 16, 8, 6, 8, 3
MODEL = "test_workload_contract:flat_tokens"


def flat_tokens() -> Workload:
    """Token inputs (8, 6), targets their flattened next tokens (48,), a loss that flattens the logits."""
    layers = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, VOCAB),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(VOCAB, (BATCH, SEQUENCE), generator=generator), torch.randint(VOCAB, (BATCH * SEQUENCE,)))
        for _ in range(STEPS)
    ]
    return Workload(layers, flat_loss, batches)


def flat_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target)


def second_layer_fails() -> Workload:
    """The second layer expects width 5 but receives the embedding's (2, 6, 8) float output."""
    work = flat_tokens()
    work.layers = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(5, VOCAB))
    return work


def _train_flat() -> dict:
    from pipec.runtime.worker import Options, train

    program = pipec.compile("1f1b", 2, 4)
    return train(program, Options(model=MODEL, steps=STEPS, quiet=True))["weights"]


@functools.cache
def _flat_run() -> dict:
    weights: dict = {}
    for part in launch.spawn(_train_flat, 2, timeout_s=60):
        weights.update(part)
    return weights


def test_split_cuts_inputs_and_targets_along_dim_0_separately() -> None:
    inputs, targets = torch.arange(8).reshape(8, 1), torch.arange(48)
    x, y = split((inputs, targets), 2, replica=1, replicas=2)  # D x M = 4 micro-batches; replica 1 takes 2 and 3
    assert [t.flatten().tolist() for t in x] == [[4, 5], [6, 7]]
    assert [t.tolist() for t in y] == [list(range(24, 36)), list(range(36, 48))]
    with pytest.raises(PipecInputError) as refused:
        split((torch.zeros(8, 2), torch.zeros(6)), 4)
    assert refused.value.message == "the targets' dim 0 (6) is not divisible by the 4 micro-batches"
    with pytest.raises(PipecInputError) as refused:
        split((torch.zeros(6, 2), torch.zeros(8)), 2, replicas=2)
    assert refused.value.message.startswith("the batch size 6 is not divisible by --dp 2 x 2 micro-batches = 4")


def test_flattened_targets_train_like_one_process() -> None:
    torch.manual_seed(0)  # as pipec run seeds before calling the factory (--seed 0)
    work = flat_tokens()
    optimizer = torch.optim.SGD(work.layers.parameters(), lr=0.1)  # pipec run's default optimizer
    for x, y in work.batches:
        optimizer.zero_grad()
        flat_loss(work.layers(x), y).backward()
        optimizer.step()
    expected = work.layers.state_dict()
    got = _flat_run()
    assert sorted(got) == sorted(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"\nflattened targets, 1f1b P=2 M=4, {STEPS} steps: worst |weight - one process| {worst:.1e}")
    assert worst < 1e-6


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        # what layer 1 received, the embedding's output, not the batch's (2, 6) int64 tokens
        (
            "second_layer_fails",
            "layer 1 (Linear) fails on a micro-batch of batches[0] (input (2, 6, 8) torch.float32, the output of "
            "layer 0): RuntimeError: mat1 and mat2 shapes cannot be multiplied (12x8 and 5x16)",
        ),
    ],
)
def test_a_failing_layer_is_told_what_it_received(factory: str, message: str, capsys) -> None:
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", f"test_workload_contract:{factory}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: --model test_workload_contract:{factory}: {message}" in err, err
    assert not multiprocessing.active_children()


def test_targets_that_do_not_divide_are_refused_before_any_worker(capsys) -> None:
    code = cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", "faulty_workloads:mismatched_batches"])
    err = capsys.readouterr().err
    assert code == 2 and "error: the targets' dim 0 (6) is not divisible by the 4 micro-batches" in err, err
    assert not multiprocessing.active_children()


def sized(width: int, depth: int = 2, name: str = "x", flag: bool = False) -> Workload:
    """A factory with arguments, for `MODULE:FACTORY?NAME=VALUE,...`."""
    raise AssertionError("resolve does not call the factory")


def test_model_spec_arguments_are_typed_and_checked() -> None:
    from pipec.runtime.workload import resolve

    factory = resolve("test_workload_contract:sized?width=8,name=gpt2,flag=true,depth=1e1")
    assert factory.keywords == {"width": 8, "name": "gpt2", "flag": True, "depth": 10.0}  # type: ignore[attr-defined]
    for spec, message in [
        ("test_workload_contract:sized", "the factory needs arguments (width) but pipec calls it with none"),
        ("test_workload_contract:sized?width=1,height=2", "the factory takes no argument height (it takes width, "),
        ("test_workload_contract:sized?width=1,width=2", "width is given twice"),
        ("test_workload_contract:sized?width", "'width' is not NAME=VALUE (after ?, separated by commas)"),
    ]:
        with pytest.raises(PipecInputError) as refused:
            resolve(spec)
        assert refused.value.message.startswith(f"--model {spec}: {message}"), refused.value.message

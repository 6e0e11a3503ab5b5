"""pipec.torch with tied parameters: a language model whose output layer reuses the input embedding's weight, cut
into stages on real 2- and 4-process gloo groups, trained 3 SGD steps with torch's own `PipelineStage`s.

The tie is one logical parameter: given the module the stages were cut from (`model=`), or declared (`tied=`, here
with separate copies of the weight), every copy ends bitwise equal to every other and within 1e-6 of the same
3 steps of ordinary training of the whole model in one process, on loop and V placements (on a V placement the
first and last stages share rank 0, where torch alone divides the shared gradient by M twice). A tie that
pipec.torch cannot see is refused on every rank, never trained apart.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import launch  # noqa: E402
from pipec.torch import PipelineSchedule  # noqa: E402

VOCAB, WIDTH, SEQUENCE, BATCH, BLOCKS, STEPS, LR = 24, 8, 5, 8, 8, 3, 0.5
TOLERANCE = 1e-6
# world -> (schedule, V, M); the 2-rank group also declares the tie (tied=) and is refused without either.
CASES = {
    2: [("1f1b", 1, 4), ("interleaved_1f1b", 2, 4), ("zb_h1", 1, 4), ("zbv", 2, 4)],
    4: [("1f1b", 1, 8)],  # the tie spans ranks 0 and 3; ranks 1 and 2 add zeros
}
MODES = {2: ("model", "tied"), 4: ("model",)}


class TiedLM(nn.Module):
    """Embedding, BLOCKS Linear+Tanh blocks, and a head whose weight is the embedding's (seeded: alike on every
    rank). `untied_copy` gives the head a parameter of its own holding the same values (declared with tied=)."""

    def __init__(self, untied_copy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = nn.Parameter(self.embed.weight.detach().clone()) if untied_copy else self.embed.weight

    def cut(self, num_stages: int) -> list[nn.Sequential]:
        """The stage modules, made of this model's own modules: the embedding in the first, the head in the last."""
        per = BLOCKS // num_stages
        parts = [list(self.blocks[s * per : (s + 1) * per]) for s in range(num_stages)]
        parts[0].insert(0, self.embed)
        parts[-1].append(self.head)
        return [nn.Sequential(*part) for part in parts]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randint(VOCAB, (BATCH, SEQUENCE), generator=generator), torch.randint(VOCAB, (BATCH, SEQUENCE)))
        for _ in range(STEPS)
    ]


@functools.cache
def reference() -> dict[str, torch.Tensor]:
    """3 steps of ordinary training of the whole model: every parameter under each of its names."""
    model = TiedLM()
    whole = nn.Sequential(*model.cut(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches():
        optimizer.zero_grad()
        loss_fn(whole(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def _train(name: str, chunks: int, microbatches: int, mode: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One case on this rank: the parameters of its stages after 3 steps (by their names in the model) and the
    ties the schedule syncs."""
    from torch.distributed.pipelining import PipelineStage

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    program = pipec.compile(name, world, microbatches, chunks)
    model = TiedLM(untied_copy=mode == "tied")
    modules = model.cut(program.num_stages)
    local = {s: modules[s] for s in program.stages_of(rank)}
    stages = [PipelineStage(m, s, program.num_stages, torch.device("cpu")) for s, m in local.items()]
    last = program.num_stages - 1
    ties = {"model": {"model": model}, "tied": {"tied": [{0: "0.weight", last: f"{len(modules[last]) - 1}.weight"}]}}
    schedule = PipelineSchedule(program, stages, microbatches, loss_fn=loss_fn, **ties[mode])
    params = list(dict.fromkeys(p for m in local.values() for p in m.parameters()))
    optimizer = torch.optim.SGD(params, lr=LR)
    for x, y in batches():
        optimizer.zero_grad()
        schedule.step(*((x,) if 0 in local else ()), target=y if last in local else None)
        optimizer.step()
    held = {id(p) for p in params}
    named = model.named_parameters(remove_duplicate=False)
    return {n: p.detach().clone() for n, p in named if id(p) in held}, schedule.tied_parameters


def _refusal() -> str:
    """The whole model cut into stages on every rank, its tie neither found (model=) nor declared (tied=)."""
    from torch.distributed.pipelining import PipelineStage

    rank = torch.distributed.get_rank()
    modules = TiedLM().cut(2)
    stage = PipelineStage(modules[rank], rank, 2, torch.device("cpu"))
    try:
        PipelineSchedule("1f1b", [stage], 4, loss_fn=loss_fn)
    except pipec.PipecInputError as e:
        return e.message
    return "no error"


def _different_copies() -> str:
    """tied= declares two copies that do not start equal (the head's weight initialised on its own)."""
    from torch.distributed.pipelining import PipelineStage

    rank = torch.distributed.get_rank()
    model = TiedLM(untied_copy=True)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    modules = model.cut(2)
    stage = PipelineStage(modules[rank], rank, 2, torch.device("cpu"))
    last = f"{len(modules[1]) - 1}.weight"
    try:
        PipelineSchedule("1f1b", [stage], 4, loss_fn=loss_fn, tied=[{0: "0.weight", 1: last}])
    except pipec.PipecInputError as e:
        return e.message
    return "no error"


def _worker(world: int) -> dict:
    results: dict = {}
    for name, chunks, microbatches in CASES[world]:
        for mode in MODES[world]:
            results[(name, mode)] = _train(name, chunks, microbatches, mode)
    if world == 2:
        results["refused"] = _refusal()
        results["different"] = _different_copies()
    return results


@functools.cache
def _group(world: int) -> list[dict]:
    return launch.spawn(_worker, world, (world,), timeout_s=90)


@pytest.mark.parametrize("world", [2, 4])
def test_tied_embeddings_train_as_one_parameter(world: int) -> None:
    expected = reference()
    per_rank = _group(world)
    for name, _, _ in CASES[world]:
        for mode in MODES[world]:
            copies = [(rank, n, t) for rank, r in enumerate(per_rank) for n, t in r[(name, mode)][0].items()]
            assert sorted({n for _, n, _ in copies}) == sorted(expected), (name, mode)
            worst = max((t - expected[n]).abs().max().item() for _, n, t in copies)
            assert worst < TOLERANCE, (name, mode, worst)
            tied = [t for _, n, t in copies if n in ("embed.weight", "head.weight")]
            assert len(tied) >= 2 and all(torch.equal(t, tied[0]) for t in tied), (name, mode)
            synced = {tuple(r[(name, mode)][1]) for r in per_rank}
            assert len(synced) == 1, synced  # every rank syncs the same ties, in one order
            # a V placement holds the first and the last stage on rank 0: one parameter there, nothing to sync
            if mode == "model":
                assert synced == {() if name == "zbv" else ("embed.weight",)}, (name, synced)
            else:  # two copies, on two ranks or (V) both on rank 0
                assert [t.split(" ")[0] for t in synced.pop()] == ["tied[0]"], (name, synced)
            print(f"world {world} {name:<17} {mode:<6} worst |weight - one process| {worst:.1e}")


def test_a_tie_it_cannot_see_is_refused_on_every_rank() -> None:
    """Each rank finds a stage parameter that a module outside its stages registers too (rank 0: the embedding's
    weight, which the head it does not hold shares); every rank raises rank 0's finding, so none waits alone."""
    messages = [result["refused"] for result in _group(2)]
    expected = "pipec.torch: stage 0's parameter 0.weight (24, 8) is also registered by a Linear (weight) outside"
    assert messages[0].startswith(expected), messages
    assert messages[1] == messages[0] + " (on rank 0)", messages
    assert "model=whole_model" in messages[0] and "tied=[{0: '0.weight', OTHER_STAGE: 'its.name'}]" in messages[0]


def test_tied_copies_that_start_apart_are_refused() -> None:
    expected = (
        "pipec.torch: the copies of the tie tied[0] (stage 0 0.weight, stage 1 4.weight) on ranks 0 and 1 start from "
        "different values"
    )
    assert all(result["different"].startswith(expected) for result in _group(2)), [r["different"] for r in _group(2)]

"""GPT-2 and Llama with tied input/output embeddings (tiny, from a config, no download) through `pipec run`
(#21 item 1's must-show): 1f1b, interleaved_1f1b (V=2), zb_h1 and zbv on 2 and 4 gloo ranks, and each on 2 ranks
x --dp 2, 3 SGD steps against the same 3 steps of the HF model's own forward (`labels=input_ids`) in one process:
every weight within 1e-6, and every copy of the tied weight (the embedding's on the first stage's rank, the LM
head's on the last stage's, on every replica) bitwise equal. 6 decoder blocks: 8 layers, one per stage of the V=2
schedules on 4 ranks. One spawn per world size runs every config in turn.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from hf_workloads import CONFIGS, EMBEDDING, HEAD, STEPS, spec, worst_difference  # noqa: E402

import pipec  # noqa: E402
from pipec.runtime import launch  # noqa: E402

TOLERANCE = 1e-6
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))
RUNS = {  # world size -> (architecture, schedule, P, V, D)
    2: [(arch, name, 2, chunks, 1) for arch in CONFIGS for name, chunks in SCHEDULES],
    4: [(arch, name, 4, chunks, 1) for arch in CONFIGS for name, chunks in SCHEDULES]
    + [(arch, name, 2, chunks, 2) for arch in CONFIGS for name, chunks in SCHEDULES],
}


def _train_all(runs: list[tuple]) -> dict:
    from pipec.runtime.options import Options
    from pipec.runtime.worker import train

    out = {}
    for key in runs:
        architecture, schedule, ranks, chunks, dp = key
        program = pipec.compile(schedule, ranks, 4, chunks)
        result = train(program, Options(model=spec(architecture), steps=STEPS, quiet=True, dp=dp))
        out[key] = result["weights"]
    return out


@functools.cache
def trained(world: int) -> list[dict]:
    return launch.spawn(_train_all, world, (RUNS[world],), timeout_s=180)


@pytest.mark.parametrize("world", [2, 4])
def test_tied_gpt2_and_llama_train_like_the_hf_model_in_one_process(world: int) -> None:
    per_rank = trained(world)
    for key in RUNS[world]:
        architecture, schedule, ranks, _, dp = key
        merged: dict = {}
        for weights in per_rank:
            merged.update(weights[key])
        worst = worst_difference(architecture, merged)  # the weights, back into the HF model
        print(f"\n{architecture} {schedule} P={ranks} --dp {dp}: worst |weight - HF one process| {worst:.1e}")
        assert worst < TOLERANCE, (key, worst)
        copies = [w[key][k] for w in per_rank for k in (EMBEDDING, HEAD) if k in w[key]]
        assert len(copies) >= 2 * dp and all(torch.equal(c, copies[0]) for c in copies), key

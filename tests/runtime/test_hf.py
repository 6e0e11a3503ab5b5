"""pipec.hf: transformers causal LMs (GPT-2, Llama, Qwen2, Mistral; tiny, from a config, no download) trained 3 SGD
steps on 2 gloo ranks, through `pipec run --model "pipec.hf:ARCH?..." --save` and through pipec.torch, against
the same 3 steps of the HF model's own forward (`labels=input_ids`) in one process. The weights saved by
`pipec run` load back into the HF model (`load_state_dict`); tied embeddings stay one parameter.

Here `pipec run`'s tied cases run under zbv, whose V placement holds the first and the last stage on rank 0 (one
parameter object); ties across ranks, synced by SYNC, are tests/runtime/test_hf_ties.py's. pipec.torch syncs ties
across ranks (1f1b, interleaved_1f1b).
"""

from __future__ import annotations

import functools
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ["HF_HUB_OFFLINE"] = "1"  # no test downloads anything

from hf_workloads import trained_alone  # noqa: E402

import pipec  # noqa: E402
import pipec.hf  # noqa: E402
from pipec.runtime import launch  # noqa: E402
from pipec.runtime import stages as pipec_stages  # noqa: E402

STEPS, LR, TOLERANCE = 3, 0.1, 1e-6
DATA = {"batch": 8, "seq": 12, "steps": STEPS}
LLAMA_LIKE = {
    "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
}  # fmt: skip
CONFIGS = {
    "gpt2": {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 32, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0},  # GPT-2 ties its embeddings by default
    "llama": {**LLAMA_LIKE, "tie_word_embeddings": True},
    "qwen2": {**LLAMA_LIKE, "tie_word_embeddings": True},
    "mistral": {**LLAMA_LIKE, "sliding_window": 4},  # untied; a window shorter than the sequence
}  # fmt: skip
# pipec run: (architecture, schedule, V); here ties only where the placement keeps them on one rank
RUNS = [("gpt2", "zbv", 2), ("llama", "zbv", 2), ("qwen2", "1f1b", 1, {"tie_word_embeddings": False}),
        ("mistral", "interleaved_1f1b", 2)]  # fmt: skip
# pipec.torch: (architecture, schedule, V), tied across ranks
TORCH_RUNS = [("gpt2", "1f1b", 1), ("llama", "interleaved_1f1b", 2)]


def spec(architecture: str, extra: dict | None = None) -> str:
    options = {**CONFIGS[architecture], **(extra or {}), **DATA}
    return f"pipec.hf:{architecture}?" + ",".join(f"{k}={v}" for k, v in options.items())


def build(architecture: str, extra: dict | None = None) -> pipec.hf.HFWorkload:
    torch.manual_seed(0)  # as pipec run seeds before calling the factory
    return pipec.hf.from_config(architecture, **{**CONFIGS[architecture], **(extra or {}), **DATA})


@functools.cache
def reference(architecture: str, extra: tuple = ()) -> dict[str, torch.Tensor]:
    """3 SGD steps of the HF model's own forward and loss, in one process: its state_dict."""
    return trained_alone(build(architecture, dict(extra)))


def _pipec_torch(architecture: str, schedule: str, chunks: int) -> dict:
    """examples/torch/hf_train.py's `train` (what docs/torch.md shows): the HF parameters this rank holds."""
    example = runpy.run_path(str(ROOT / "examples" / "torch" / "hf_train.py"))
    trained, ties = example["train"](schedule, 4, chunks, architecture, **CONFIGS[architecture], **DATA)
    return {"weights": trained, "ties": ties}


def _worker(folder: str) -> dict:
    from pipec.runtime.worker import Options, train

    results: dict = {}
    for architecture, schedule, chunks, *extra in RUNS:
        program = pipec.compile(schedule, torch.distributed.get_world_size(), 4, chunks)
        saved = str(Path(folder, f"{architecture}.pt"))
        train(program, Options(model=spec(architecture, *extra), steps=STEPS, quiet=True, save=saved))
    for architecture, schedule, chunks in TORCH_RUNS:
        results[architecture] = _pipec_torch(architecture, schedule, chunks)
    return results


@functools.cache
def _group(folder: str) -> list[dict]:
    return launch.spawn(_worker, 2, (folder,), timeout_s=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("hf")
    return folder, _group(str(folder))


@pytest.mark.parametrize("case", RUNS, ids=lambda case: f"{case[0]}-{case[1]}")
def test_pipec_run_trains_the_hf_model_and_its_weights_load_back(case: tuple, trained) -> None:
    architecture, _, _, *extra = case
    folder, _ = trained
    extra_options = extra[0] if extra else {}
    work = build(architecture, extra_options)
    saved = torch.load(folder / f"{architecture}.pt")
    work.model.load_state_dict(work.model_state_dict(saved))  # --save, then the model's own load_state_dict
    expected = reference(architecture, tuple(sorted(extra_options.items())))
    got = work.model.state_dict()
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"\n{architecture} {case[1]}: worst |weight - HF one process| {worst:.1e}")
    assert worst < TOLERANCE, worst
    if work.model.config.tie_word_embeddings:  # saved under both layers' keys, bitwise the same, one parameter
        assert torch.equal(saved["0.tokens.weight"], saved[f"{len(work.layers) - 1}.lm_head.weight"])
        assert work.model.lm_head.weight is work.model.get_input_embeddings().weight


@pytest.mark.parametrize("case", TORCH_RUNS, ids=lambda case: f"{case[0]}-{case[1]}")
def test_pipec_torch_trains_the_tied_hf_model_as_one_process(case: tuple, trained) -> None:
    architecture = case[0]
    _, per_rank = trained
    expected = dict(reference(architecture))
    embedding = "transformer.wte.weight" if architecture == "gpt2" else "model.embed_tokens.weight"
    expected.setdefault(embedding, expected["lm_head.weight"])
    copies = [(name, t) for result in per_rank for name, t in result[architecture]["weights"].items()]
    assert all(result[architecture]["ties"] == [embedding] for result in per_rank)  # synced, on every rank
    assert {name for name, _ in copies} >= {embedding, "lm_head.weight"}
    worst = max((t - expected[name]).abs().max().item() for name, t in copies)
    print(f"\n{architecture} {case[1]} (pipec.torch): worst |weight - HF one process| {worst:.1e}")
    assert worst < TOLERANCE, worst
    tied = [t for name, t in copies if name in (embedding, "lm_head.weight")]
    assert len(tied) >= 2 and all(torch.equal(t, tied[0]) for t in tied)  # on both ranks, bitwise


def test_the_layers_give_the_hf_models_own_logits() -> None:
    for architecture in CONFIGS:
        work = build(architecture)
        ids = work.batches[0][0]
        out = work.model(input_ids=ids, labels=ids)
        logits = pipec_stages.run_layers(work.layers, ids)
        assert torch.equal(logits, out.logits), architecture
        # transformers shifts the labels instead of the logits: the same mean, to the last bit or so
        assert abs(pipec.hf.loss_fn(logits, ids).item() - out.loss.item()) < 1e-6, architecture


def test_pretrained_loads_a_local_directory(tmp_path: Path) -> None:
    work = build("llama")
    work.model.save_pretrained(tmp_path)
    again = pipec.hf.pretrained(path=str(tmp_path), **DATA)
    assert again.model.training
    for (name, a), (_, b) in zip(work.model.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bad_specs_are_refused_with_a_message(capsys) -> None:
    from pipec.cli import main as cli_main

    for model, message in [
        ("pipec.hf:gpt2?n_layers=4", "n_layers is not a GPT2Config field"),
        ("pipec.hf:gpt2?n_layer", "'n_layer' is not NAME=VALUE"),
        ("pipec.hf:pretrained?path=/nonexistent", "path='/nonexistent' is not a directory holding a saved model"),
    ]:
        code = cli_main(["run", "1f1b", "-P", "2", "-M", "4", "--model", model])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


def test_transformers_is_imported_only_by_pipec_hf() -> None:
    code = (
        "import sys, pipec, pipec.torch, pipec.runtime.worker, pipec.runtime.workload\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "import pipec.hf\n"
        "assert 'transformers' not in sys.modules, 'import pipec.hf imports transformers before it is used'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

"""Tiny Hugging Face causal LMs built from a config (no download) as `pipec run --model` specs, and the reference
they are checked against: the HF model's own forward and loss (`labels=input_ids`) on the whole batch, SGD, in
one process. GPT-2 and Llama here tie their input and output embeddings."""

from __future__ import annotations

import functools
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # no test downloads anything (set before transformers is imported)

import torch

import pipec.hf

STEPS, LR = 3, 0.1
DATA = {"batch": 8, "seq": 12, "steps": STEPS, "lr": LR}
CONFIGS = {
    "gpt2": {"n_layer": 6, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 32, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0},  # GPT-2 ties its embeddings by default
    "llama": {"num_hidden_layers": 6, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
              "tie_word_embeddings": True},
}  # fmt: skip
EMBEDDING, HEAD = "0.tokens.weight", "7.lm_head.weight"  # the tied weight's keys among the 8 layers'


def spec(architecture: str) -> str:
    options = {**CONFIGS[architecture], **DATA}
    return f"pipec.hf:{architecture}?" + ",".join(f"{k}={v}" for k, v in options.items())


def build(architecture: str) -> pipec.hf.HFWorkload:
    torch.manual_seed(0)  # as pipec run seeds before calling the factory
    return pipec.hf.from_config(architecture, **CONFIGS[architecture], **DATA)


@functools.cache
def reference(architecture: str) -> dict[str, torch.Tensor]:
    """3 SGD steps of the HF model's own forward and loss on the whole batch, in one process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        return trained_alone(build(architecture))
    finally:
        torch.set_num_threads(threads)


def worst_difference(architecture: str, weights: dict) -> float:
    """The largest |weight - reference| once `weights` (a pipec run's, keyed by layer) are back in the HF model."""
    work = build(architecture)
    work.model.load_state_dict(work.model_state_dict(weights))
    got, expected = work.model.state_dict(), reference(architecture)
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


def trained_alone(work: pipec.hf.HFWorkload) -> dict[str, torch.Tensor]:
    """The workload's HF model trained by its own forward and loss, SGD over its batches, in one process."""
    optimizer = torch.optim.SGD(work.model.parameters(), lr=LR)
    for ids, _ in work.batches:
        optimizer.zero_grad()
        work.model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in work.model.state_dict().items()}

"""Hugging Face causal language models as pipec workloads (`pip install pipec[hf]`; docs/runtime.md, "Hugging Face
models").

    pipec run zbv -P 2 -M 4 --model "pipec.hf:gpt2?n_layer=4,n_embd=64,n_head=4,vocab_size=256,batch=8,seq=32"

    model = transformers.AutoModelForCausalLM.from_config(config)      # or from_pretrained of a local directory
    work = pipec.hf.workload(model, batches)                           # a pipec workload: layers, loss_fn, batches

`layers(model)` cuts a transformers causal LM (GPT-2, and the Llama family: Llama, Qwen2, Mistral and the models
built like them) into pipec layers made of the model's own modules: the embedding, each decoder block, and the final
norm with the LM head. What flows between them is one tensor, the hidden states; each block builds its own
position ids, rotary position embeddings and causal (or sliding-window) mask for the micro-batch it receives, as
the model's forward builds them for the whole batch. A tied LM head keeps the embedding's weight (one parameter).
`loss_fn` is the shifted next-token loss of the model's own `labels=input_ids`. `state_dict_for(model, layers,
saved)` maps what `pipec run --save` wrote (keys of the layers) back to the model's own keys.

This module imports transformers; nothing else in pipec does.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipec.errors import PipecInputError
from pipec.runtime.workload import Workload

ARCHITECTURES = ("gpt2", "llama", "qwen2", "mistral")
DATA_OPTIONS = {"batch": 8, "seq": 32, "steps": 3}  # the synthetic batches of the --model factories
IGNORE_INDEX = -100  # transformers' label for "no loss here"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise PipecInputError(
            "pipec.hf needs transformers: pip install 'pipec[hf]' (or pip install transformers)"
        ) from None
    return transformers


# --- the layers -------------------------------------------------------------------------------------------------


def _named_parameters(function: Callable) -> frozenset[str]:
    """The parameters `function` names: transformers renames them across versions (past_key_values/cache,
    input_embeds/inputs_embeds), so pipec.hf passes only those a function names (a bare **kwargs takes none)."""
    return frozenset(inspect.signature(function).parameters)


class _Positions:
    """Per micro-batch: position ids 0..T-1 and the attention mask of each kind, built as the model's forward
    builds them (with no padding and no cache)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        masking = _masking()
        self.makers = {"full_attention": masking.create_causal_mask}
        sliding = getattr(masking, "create_sliding_window_causal_mask", None)
        if sliding is not None:
            self.makers["sliding_attention"] = sliding
        self.takes = {kind: _named_parameters(make) for kind, make in self.makers.items()}

    def kind(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def mask(self, kind: str, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        if kind not in self.makers:
            raise PipecInputError(f"pipec.hf: attention of kind {kind!r} is not supported (known: {list(self.makers)})")
        make = self.makers[kind]
        offered = {
            "config": self.config,
            "inputs_embeds": hidden,
            "input_embeds": hidden,
            "attention_mask": None,
            "cache": None,
            "past_key_values": None,
            "position_ids": position_ids,
            "cache_position": position_ids[0],
        }
        return make(**{name: value for name, value in offered.items() if name in self.takes[kind]})


def _masking() -> Any:
    _transformers()
    from transformers import masking_utils

    return masking_utils


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, H): the token embedding, GPT-2's learnt positions and its dropout."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None = None, dropout: nn.Module | None = None):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device)).unsqueeze(0)
        return self.dropout(hidden) if self.dropout is not None else hidden


class Block(nn.Module):
    """One decoder block on hidden states (B, T, H), given the keyword arguments it needs for this micro-batch:
    position ids, the rotary position embeddings (the model's rotary module, shared by the blocks, has no
    trainable parameter) and the mask of its attention kind."""

    def __init__(self, layer: nn.Module, index: int, positions: _Positions, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self._positions = positions
        self._rotary = [rotary]  # not a submodule: one module shared by every block, with no state to save
        self._kind = positions.kind(index)
        self._takes = _named_parameters(layer.forward)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = self._positions.ids(hidden)
        rotary = self._rotary[0]
        offered = {
            "attention_mask": self._positions.mask(self._kind, hidden, position_ids),
            "position_ids": position_ids,
            "position_embeddings": rotary(hidden, position_ids) if rotary is not None else None,
            "cache": None,
            "past_key_values": None,
            "use_cache": False,
            "cache_position": position_ids[0],
        }
        out = self.layer(hidden, **{name: value for name, value in offered.items() if name in self._takes})
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Hidden states -> logits (B, T, V): the final norm and the LM head (its weight the embedding's if tied)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def layers(model: nn.Module) -> list[nn.Module]:
    """The model as pipec layers, made of its own modules (training them trains the model): embedding, each decoder
    block, final norm + LM head. Works for GPT-2 and for models built like Llama (`model.model.embed_tokens`,
    `.layers`, `.norm`, `.rotary_emb`: Llama, Qwen2, Mistral, ...); anything else is refused with what was found."""
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    if config is None or lm_head is None or base is None:
        raise PipecInputError(
            f"pipec.hf: {type(model).__name__} is not a transformers causal LM with an lm_head (such as "
            "AutoModelForCausalLM gives)"
        )
    positions = _Positions(config)
    if all(hasattr(base, name) for name in ("wte", "wpe", "h", "ln_f")):  # GPT-2
        embedding = Embedding(base.wte, base.wpe, getattr(base, "drop", None))
        blocks, norm, rotary = base.h, base.ln_f, None
    elif all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm")):  # Llama and its kin
        embedding = Embedding(base.embed_tokens)
        blocks, norm, rotary = base.layers, base.norm, getattr(base, "rotary_emb", None)
    else:
        found = ", ".join(name for name, _ in base.named_children())
        raise PipecInputError(
            f"pipec.hf: {type(model).__name__}'s layout is not one pipec.hf knows (GPT-2's wte, wpe, h, ln_f or "
            f"Llama's embed_tokens, layers, norm); it has {found}"
        )
    count = getattr(config, "num_hidden_layers", None) or len(blocks)
    return [embedding, *(Block(blocks[i], i, positions, rotary) for i in range(count)), Head(norm, lm_head)]


def loss_fn(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss transformers computes for `labels=input_ids`: token t predicts token t + 1, the mean
    over the micro-batch's B x (T - 1) predictions (labels equal to -100 are ignored, as there)."""
    predicted = logits[:, :-1].flatten(0, 1).float()
    return nn.functional.cross_entropy(predicted, input_ids[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


@dataclass
class HFWorkload(Workload):
    """A pipec workload that knows its transformers model: `model_state_dict(saved)` is what `pipec run --save`
    wrote, under the model's own keys (`work.model.load_state_dict(work.model_state_dict(torch.load(path)))`)."""

    model: Any = None

    def model_state_dict(self, saved: Mapping[str, torch.Tensor]) -> dict:
        return state_dict_for(self.model, list(self.layers), saved)


def workload(model: nn.Module, batches: Sequence[torch.Tensor], optimizer: Callable | None = None) -> HFWorkload:
    """A pipec workload of `model`: its `layers`, the shifted-token `loss_fn`, and `batches` of token ids (each
    (B, T), its own target)."""
    return HFWorkload(layers(model), loss_fn, [(ids, ids) for ids in batches], optimizer, model)


def state_dict_for(model: nn.Module, model_layers: Sequence[nn.Module], saved: Mapping[str, torch.Tensor]) -> dict:
    """`saved` (keys of the layers, `{layer index}.{name}`, what `pipec run --save` writes) under the model's own
    state_dict keys, for `model.load_state_dict`. A tied weight saved under two keys fills both of the model's."""
    own = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, tensor in own.items():
        names.setdefault(id(tensor), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model_layers):
        for name, tensor in layer.state_dict(keep_vars=True).items():
            key = f"{index}.{name}"
            if key not in saved:
                raise PipecInputError(f"pipec.hf: the saved weights have no {key} (saved from another model?)")
            for model_name in names.get(id(tensor), []):
                out[model_name] = saved[key]
    missing = sorted(set(own) - set(out))
    if missing:
        raise PipecInputError(f"pipec.hf: no saved weight for {', '.join(missing[:5])} of the model")
    return out


# --- --model factories ------------------------------------------------------------------------------------------


def _config(architecture: str, options: Mapping[str, Any]) -> Any:
    transformers = _transformers()
    classes = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
    config_class = getattr(transformers, classes[architecture])
    defaults = config_class().to_dict()
    known = set(defaults)
    unknown = sorted(set(options) - known)
    if unknown:
        raise PipecInputError(
            f"pipec.hf:{architecture}: {', '.join(unknown)} is not a {config_class.__name__} field nor one of "
            f"{', '.join(DATA_OPTIONS)}, lr"
        )
    options = dict(options)
    vocab = options.get("vocab_size", defaults.get("vocab_size"))
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256 in a smaller vocabulary
        if token not in options and isinstance(defaults.get(token), int) and vocab and defaults[token] >= vocab:
            options[token] = vocab - 1
    return config_class(**options)


def _data_options(options: dict[str, Any]) -> tuple[int, int, int, float | None]:
    batch, seq, steps = (int(options.pop(name, default)) for name, default in DATA_OPTIONS.items())
    lr = options.pop("lr", None)
    if batch < 1 or seq < 2 or steps < 1:
        what = f"batch={batch}, seq={seq}, steps={steps}"
        raise PipecInputError(f"pipec.hf: {what}: expected batch and steps of at least 1, seq of at least 2")
    return batch, seq, steps, None if lr is None else float(lr)


def _synthetic(model: nn.Module, batch: int, seq: int, steps: int, lr: float | None) -> HFWorkload:
    """Random token batches (from the seeded generator: every rank draws the same) for `model`."""
    vocab = model.config.vocab_size
    batches = [torch.randint(vocab, (batch, seq)) for _ in range(steps)]
    optimizer = None if lr is None else (lambda params: torch.optim.SGD(params, lr=lr))
    return workload(model, batches, optimizer)


def from_config(architecture: str, **options: Any) -> HFWorkload:
    """A randomly initialised `architecture` (gpt2, llama, qwen2, mistral) built from its config with `options`
    (config fields; `batch`, `seq`, `steps` size the synthetic token batches; `lr` the SGD learning rate)."""
    if architecture not in ARCHITECTURES:
        raise PipecInputError(f"pipec.hf: unknown architecture {architecture!r}; expected one of {ARCHITECTURES}")
    data = _data_options(options)
    config = _config(architecture, options)
    model = _transformers().AutoModelForCausalLM.from_config(config)
    return _synthetic(model, *data)


def gpt2(**options: Any) -> HFWorkload:
    """`--model "pipec.hf:gpt2?n_layer=4,n_embd=64,..."`: GPT-2 from its config (see `from_config`)."""
    return from_config("gpt2", **options)


def llama(**options: Any) -> HFWorkload:
    """`--model "pipec.hf:llama?num_hidden_layers=4,hidden_size=64,..."`: Llama from its config."""
    return from_config("llama", **options)


def qwen2(**options: Any) -> HFWorkload:
    """`--model "pipec.hf:qwen2?..."`: Qwen2 from its config."""
    return from_config("qwen2", **options)


def mistral(**options: Any) -> HFWorkload:
    """`--model "pipec.hf:mistral?..."`: Mistral from its config."""
    return from_config("mistral", **options)


def pretrained(path: str = "", **options: Any) -> HFWorkload:
    """`--model "pipec.hf:pretrained?path=DIR,batch=8,seq=32"`: the causal LM saved in the local directory DIR
    (`save_pretrained`), loaded without any download; `options` as in `from_config` (data and lr only)."""
    if not path or not os.path.isdir(path):
        raise PipecInputError(f"pipec.hf:pretrained: path={path!r} is not a directory holding a saved model")
    data = _data_options(options)
    if options:
        raise PipecInputError(f"pipec.hf:pretrained: unknown options {', '.join(sorted(options))}")
    model = _transformers().AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.train()  # from_pretrained returns it in eval mode
    return _synthetic(model, *data)


__all__ = [
    "Block",
    "Embedding",
    "HFWorkload",
    "Head",
    "from_config",
    "gpt2",
    "layers",
    "llama",
    "loss_fn",
    "mistral",
    "pretrained",
    "qwen2",
    "state_dict_for",
    "workload",
]

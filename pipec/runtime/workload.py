"""The workload protocol of `pipec run --model MODULE:FACTORY`.

FACTORY() (or FACTORY(**arguments) for `MODULE:FACTORY?NAME=VALUE,...`) returns an object with `layers` (an
nn.Sequential or a list of modules), `loss_fn(output, target)` (a mean over the batch), `batches` (a list of full
`(input, target)` batches, one per step; inputs and targets are each cut along dim 0 into the micro-batches) and
optionally `optimizer(params)` (default SGD with lr 0.1). `Workload` below is a ready-made such object.

`build` checks all of that and turns every way a workload can break the protocol (a factory that needs
arguments or raises, layers that are not modules, batches that are not pairs of tensors of one shape) into a
PipecInputError naming the problem: `pipec run` calls it once before any worker starts, so bad input exits 2
with a message, never a traceback from inside a worker.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipec.errors import PipecError, PipecInputError

SEED_MAX = 2**64 - 1  # torch.manual_seed takes an unsigned 64-bit seed


@dataclass
class Workload:
    layers: Any
    loss_fn: Callable
    batches: list
    optimizer: Callable | None = None


def resolve(spec: str) -> Callable[[], Any]:
    """The FACTORY function named by MODULE:FACTORY or path/to/file.py:FACTORY, with the keyword arguments of an
    optional `?NAME=VALUE,NAME=VALUE` (`pipec.hf:gpt2?n_layer=4,n_embd=64`; values are ints, floats, true/false/
    none or else strings). MODULE is imported as `python -m` would: from the current directory first, then the
    installed packages."""
    import functools
    import sys

    target, _, query = spec.partition("?")
    arguments = _arguments(spec, query)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise PipecInputError(
            f"--model {spec!r}: expected MODULE:FACTORY or FILE.py:FACTORY, e.g. examples.workload:mlp "
            "(MODULE is found from the current directory, as with python -m, or among the installed packages)"
        )
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = _load_file(module_name) if _is_file(module_name) else importlib.import_module(module_name)
    except ImportError as e:
        raise PipecInputError(
            f"--model {spec}: cannot import {module_name}: {e} (MODULE is looked up from the current directory "
            "and the installed packages; or give a file: path/to/model.py:FACTORY)"
        ) from None
    except PipecError:
        raise
    except Exception as e:  # the module's own code failed while it was imported (a typo, a missing file)
        raise PipecInputError(f"--model {spec}: importing {module_name} raised {_error_text(e)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PipecInputError(f"--model {spec}: {module_name} has no function {attr}")
    _check_no_arguments(spec, factory, arguments)
    return functools.partial(factory, **arguments) if arguments else factory


def _arguments(spec: str, query: str) -> dict[str, Any]:
    """The keyword arguments of `?a=1,b=x`: each value an int, a float, True/False/None, or else the string."""
    out: dict[str, Any] = {}
    for item in query.split(",") if query else ():
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise PipecInputError(f"--model {spec}: {item!r} is not NAME=VALUE (after ?, separated by commas)")
        if name in out:
            raise PipecInputError(f"--model {spec}: {name} is given twice")
        out[name] = _value(text.strip())
    return out


def _value(text: str) -> Any:
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _is_file(name: str) -> bool:
    return name.endswith(".py") or "/" in name or "\\" in name


def _load_file(path: str) -> Any:
    """Import a .py file by path under a name of its own (its folder need not be a package or on sys.path)."""
    import importlib.util
    import os
    import sys

    if not os.path.isfile(path):
        raise ImportError(f"no file {path}")
    name = "pipec_model_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered first, as import does: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _check_no_arguments(spec: str, factory: Callable, given: dict[str, Any]) -> None:
    """pipec calls FACTORY() with no arguments but those of `?...`: say so before calling it, rather than report a
    TypeError."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C function without a signature: calling it will tell
        return
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [name for name in given if name not in signature.parameters]
        if unknown:
            raise PipecInputError(
                f"--model {spec}: the factory takes no argument {', '.join(unknown)} "
                f"(it takes {', '.join(signature.parameters) or 'none'})"
            )
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in given
    ]
    if required:
        raise PipecInputError(
            f"--model {spec}: the factory needs arguments ({', '.join(required)}) but pipec calls it with none; "
            "give them defaults or name a function without arguments"
        )


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= 500 else text[:500] + " ..."


def describe(value: object) -> str:
    """A short description of a value of the wrong type, for messages."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (str, bytes)):
        return f"the {type(value).__name__} {value[:40]!r}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def build(spec: str, seed: int) -> Workload:
    """Seed torch, call the factory and check what it returned. Every rank does this with the same seed, so
    every rank holds the same initial weights and data."""
    import torch

    if not 0 <= seed <= SEED_MAX:
        raise PipecInputError(f"--seed {seed}: expected an integer from 0 to 2**64-1")
    torch.manual_seed(seed)
    factory = resolve(spec)
    try:
        made = factory()
    except PipecError:
        raise
    except Exception as e:
        raise PipecInputError(f"--model {spec}: the factory raised {_error_text(e)}") from None
    missing = [name for name in ("layers", "loss_fn", "batches") if not hasattr(made, name)]
    if missing:
        raise PipecInputError(f"--model {spec}: the workload has no {', '.join(missing)} (see docs/runtime.md)")
    layers = _layers(spec, made.layers)
    batches = _batches(spec, made.batches)
    if not callable(made.loss_fn):
        raise PipecInputError(f"--model {spec}: loss_fn is {describe(made.loss_fn)}, not a function")
    optimizer = getattr(made, "optimizer", None)
    if optimizer is not None and not callable(optimizer):
        raise PipecInputError(f"--model {spec}: optimizer is {describe(optimizer)}, not a function of the parameters")
    return Workload(layers, made.loss_fn, batches, optimizer)


def _layers(spec: str, layers: Any):
    from torch import nn

    if isinstance(layers, nn.Sequential):
        modules = list(layers)
    elif isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList):
        raise PipecInputError(
            f"--model {spec}: layers is one {type(layers).__name__}; pipec splits an nn.Sequential or a list of "
            "modules into stages"
        )
    elif isinstance(layers, (str, bytes)) or not _iterable(layers):
        expected = "expected an nn.Sequential or a list of modules"
        raise PipecInputError(f"--model {spec}: layers is {describe(layers)}; {expected}")
    else:
        modules = list(layers)
    for index, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise PipecInputError(f"--model {spec}: layers[{index}] is {describe(module)}, not an nn.Module")
    if not modules:
        raise PipecInputError(f"--model {spec}: the workload has no layers")
    return layers if isinstance(layers, nn.Sequential) else nn.Sequential(*modules)


def _iterable(value: object) -> bool:
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _batches(spec: str, raw: Any) -> list:
    """A list of (input, target) tensor pairs whose inputs all have one shape and dtype: the stages exchange
    tensors of the shapes learnt from the first batch, so a batch of another shape could not be sent."""
    import torch

    if isinstance(raw, (torch.Tensor, str, bytes)) or not _iterable(raw):
        raise PipecInputError(f"--model {spec}: batches is {describe(raw)}; expected a list of (input, target) pairs")
    batches = list(raw)
    if not batches:
        raise PipecInputError(f"--model {spec}: the workload has no batches")
    first = None
    for k, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            expected = "expected an (input, target) pair"
            raise PipecInputError(f"--model {spec}: batches[{k}] is {describe(batch)}; {expected}")
        for name, tensor in zip(("input", "target"), batch, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise PipecInputError(f"--model {spec}: the {name} of batches[{k}] is {describe(tensor)}, not a tensor")
            if tensor.dim() == 0:
                raise PipecInputError(
                    f"--model {spec}: the {name} of batches[{k}] is a scalar; dim 0 is the batch, split into "
                    "micro-batches"
                )
        # Inputs and targets are each cut along dim 0 (`split`), as torch.distributed.pipelining cuts them: targets
        # may have another dim 0 (flattened tokens, say), as long as each divides into the micro-batches.
        inputs, _ = batch
        if first is None:
            first = (tuple(inputs.shape), inputs.dtype)
        elif (tuple(inputs.shape), inputs.dtype) != first:
            raise PipecInputError(
                f"--model {spec}: the input of batches[{k}] is {tuple(inputs.shape)} {inputs.dtype} but batches[0]'s "
                f"is {first[0]} {first[1]}; every batch must have the same shape and dtype"
            )
    return batches


def make_optimizer(workload: Workload, params: list):
    import torch

    if not params:
        return None
    if workload.optimizer is None:
        return torch.optim.SGD(params, lr=0.1)
    return workload.optimizer(params)


def split(batch, microbatches: int, replica: int = 0, replicas: int = 1) -> tuple[list, list]:
    """Replica `replica`'s M micro-batches of a full (input, target) batch: the inputs and the targets are each cut
    along dim 0 into D x M equal micro-batches and replica r takes the r-th run of M (global micro-batch r * M + m).
    Their dim 0 may differ (targets of flattened tokens: B x T rows for B sequences)."""
    inputs, targets = batch
    mine = slice(replica * microbatches, (replica + 1) * microbatches)
    return (
        _cut(inputs, "the batch size {}", microbatches, replicas)[mine],
        _cut(targets, "the targets' dim 0 ({})", microbatches, replicas)[mine],
    )


def _cut(tensor, named: str, microbatches: int, replicas: int) -> list:
    """`tensor` cut along dim 0 into D x M equal pieces; `named` formats its dim 0 for messages."""
    size, parts = tensor.shape[0], microbatches * replicas
    what = named.format(size)
    if size % parts:
        if replicas == 1:
            raise PipecInputError(f"{what} is not divisible by the {microbatches} micro-batches")
        raise PipecInputError(
            f"{what} is not divisible by --dp {replicas} x {microbatches} micro-batches = {parts} "
            "(each replica takes an equal share of every batch, cut into equal micro-batches)"
        )
    if size < parts:  # chunk() would return fewer, empty-free pieces
        raise PipecInputError(f"{what} is smaller than {parts} micro-batches")
    return list(tensor.chunk(parts))


def received(value: object) -> str:
    """What a layer received, for messages: `(2, 16, 64) torch.float32`, or a tuple's tensors in brackets."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    if type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value):
        return "a tuple (" + ", ".join(received(t) for t in value) + ")"
    return describe(value)


def module_file(spec: str) -> str | None:
    """The file of --model's module, if it can be found without running it: an output must not replace it."""
    import contextlib
    import importlib.util
    import sys

    module_name = spec.partition("?")[0].rpartition(":")[0]
    if not module_name:
        return None
    if _is_file(module_name):
        return module_name
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as resolve does: the current directory is importable
    with contextlib.suppress(Exception):  # a package's __init__ may fail: validate() reports that later
        found = importlib.util.find_spec(module_name)
        if found is not None and found.has_location:
            return found.origin
    return None

"""Checkpoints of `pipec run --checkpoint DIR`: the format, the atomic write, and the checks made before resuming.

A checkpoint directory holds:

    DIR/latest                  "step-00000004\\n": the last complete checkpoint (the commit point)
    DIR/step-00000004/          one complete checkpoint: training has done 4 steps
        model.pt                the model's state_dict with the unsplit model's keys (what --save writes)
        optimizer.pt            the optimizer state keyed by unsplit parameter name (see `optimizer_state`)
        manifest.json           format, version, step, seed, the model's keys, shapes and dtypes, the optimizer's
                                class, the data position, what wrote it, and each file's size and SHA-256
    DIR/.tmp-step-00000006-*/   a checkpoint being written: ignored by readers, removed by the next writer

Nothing in a checkpoint depends on the schedule, P, V, D or the partition: the model and the optimizer state are
keyed by the unsplit model's names, and no random state is saved, because the runtime derives every random
number from (seed, step, layer, micro-batch) (`stages.microbatch_seed`). The data position is the step (step k
trains on batches[k % len(batches)]).

Writing (rank 0 only): every file goes into a fresh temporary directory inside DIR and is fsynced; the manifest,
holding the files' checksums, is written last; the directory is fsynced and renamed to `step-NNNNNNNN`; DIR is
fsynced; then `latest` is replaced atomically (a temporary file renamed over it, pipec.outputs.write_text). A crash
at any point leaves `latest` naming the previous complete checkpoint and no half file under a name a reader
uses. A `step-*` directory that `latest` does not name (one renamed into place just before a crash, or one beyond
a `latest` moved back by hand) is not committed: readers ignore it and a writer replaces it.

Reading (`find` and `check_compatible`, before any worker starts): `latest` must name a step directory, the
manifest must be this format and a version this code reads, every file it lists must exist with its size and
checksum, and the model's keys, shapes and dtypes, the optimizer's class, the seed and the number of batches must
match the run's; anything else is refused with a message naming what is wrong (exit 2), and nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from pipec.errors import PipecError, PipecInputError
from pipec.outputs import write_text

FORMAT = "pipec-checkpoint"
VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
FILES = (MODEL_FILE, OPTIMIZER_FILE)
TEMP_PREFIX = ".tmp-"
STEP_NAME = re.compile(r"step-([0-9]{8,})")
RNG_NOTE = "none saved: derived from (seed, step, layer, micro-batch)"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Found:
    """A complete checkpoint, checked against its manifest."""

    path: str  # DIR/step-NNNNNNNN
    step: int
    manifest: dict


class CheckpointWriteError(PipecError):
    """A checkpoint could not be written (exit 3, like any failure after the workers started); the previous one
    is intact."""

    exit_code = 3
    located = True


# --- reading -------------------------------------------------------------------------------------------------


def committed(directory: str) -> str | None:
    """The name in DIR/latest (stripped), or None when there is no `latest`: the directory holds no checkpoint."""
    path = os.path.join(directory, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read(256).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise PipecInputError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None


def find(directory: str, flag: str = "--resume") -> Found | None:
    """The checkpoint DIR/latest names, with its manifest and files checked; None when DIR holds no `latest`.
    Raises PipecInputError naming what is wrong with a corrupt checkpoint (nothing is written)."""
    where = f"{flag} {directory}"
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a directory"
        raise PipecInputError(f"{where}: the checkpoint directory {what}")
    name = committed(directory)
    if name is None:
        return None
    match = STEP_NAME.fullmatch(name)
    if not match:
        raise PipecInputError(f"{where}: {LATEST} holds {name[:60]!r}, not the name of a step directory")
    path = os.path.join(directory, name)
    if not os.path.isdir(path):
        raise PipecInputError(f"{where}: {LATEST} names {name}, which is missing")
    manifest = read_manifest(path, where)
    if manifest.get("step") != int(match[1]):
        said = manifest.get("step")
        raise PipecInputError(f"{where}: {name}/{MANIFEST} says step {said!r}, its directory says {int(match[1])}")
    check_files(path, manifest, where)
    return Found(path, int(match[1]), manifest)


def read_manifest(path: str, where: str) -> dict:
    name = os.path.basename(path)
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, encoding="utf-8") as stream:
            manifest = json.load(stream)
    except FileNotFoundError:
        raise PipecInputError(f"{where}: {name}/{MANIFEST} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PipecInputError(f"{where}: {name}/{MANIFEST} is not a readable JSON manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PipecInputError(f"{where}: {name}/{MANIFEST} is not a pipec checkpoint manifest (no format {FORMAT!r})")
    version = manifest.get("version")
    if version != VERSION:
        raise PipecInputError(
            f"{where}: {name} is checkpoint format version {version!r}; this pipec reads version {VERSION}"
        )
    for key, kind in (("step", int), ("seed", int), ("state", dict), ("optimizer", str), ("files", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise PipecInputError(f"{where}: {name}/{MANIFEST} has no valid {key!r} entry")
    return manifest


def check_files(path: str, manifest: dict, where: str) -> None:
    """Every file the format needs is listed, present, of the listed size and SHA-256."""
    name = os.path.basename(path)
    files = manifest["files"]
    for needed in FILES:
        if needed not in files:
            raise PipecInputError(f"{where}: {name}/{MANIFEST} does not list {needed}")
    for file, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or os.sep in file or file[:1] == ".":
            raise PipecInputError(f"{where}: {name}/{MANIFEST}: the entry of {file!r} is not valid")
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise PipecInputError(f"{where}: {name}/{file} is missing")
        size = os.path.getsize(full)
        if size != entry.get("bytes"):
            raise PipecInputError(
                f"{where}: {name}/{file} has {size} bytes but the manifest says {entry.get('bytes')} (truncated?)"
            )
        if sha256(full) != entry["sha256"]:
            raise PipecInputError(f"{where}: {name}/{file} does not match its checksum in the manifest (corrupt)")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_compatible(found: Found, state: dict, optimizer: str, seed: int, batches: int, where: str) -> None:
    """Refuse a checkpoint of another model (keys, shapes, dtypes), optimizer, seed or data.

    `state` maps each key of the run's model state_dict to (shape, dtype name), as `state_spec` gives it."""
    name = os.path.basename(found.path)
    saved = {k: (tuple(v["shape"]), v["dtype"]) for k, v in found.manifest["state"].items()}
    only_saved = sorted(set(saved) - set(state), key=_natural)
    only_model = sorted(set(state) - set(saved), key=_natural)
    problems = []
    if only_saved:
        problems.append(f"{len(only_saved)} key(s) only in the checkpoint ({', '.join(only_saved[:3])})")
    if only_model:
        problems.append(f"{len(only_model)} key(s) only in the model ({', '.join(only_model[:3])})")
    for key in sorted(set(saved) & set(state), key=_natural):
        if saved[key] != state[key]:
            (s_shape, s_dtype), (m_shape, m_dtype) = saved[key], state[key]
            problems.append(f"{key} is {list(s_shape)} {s_dtype} there but {list(m_shape)} {m_dtype} in the model")
            if len(problems) >= 4:
                break
    if problems:
        raise PipecInputError(f"{where}: {name} holds another model: " + "; ".join(problems))
    if found.manifest["optimizer"] != optimizer:
        raise PipecInputError(
            f"{where}: {name} was trained with the optimizer {found.manifest['optimizer']}; the workload makes "
            f"{optimizer}"
        )
    if found.manifest["seed"] != seed:
        raise PipecInputError(
            f"{where}: {name} was trained with --seed {found.manifest['seed']} (the data and the random numbers "
            f"derive from it); give --seed {found.manifest['seed']}"
        )
    saved_batches = found.manifest.get("data", {}).get("batches")
    if saved_batches != batches:
        raise PipecInputError(
            f"{where}: {name} was trained on a workload of {saved_batches} batches, this one has {batches} "
            "(the data position would mean another batch)"
        )


def _natural(key: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", key))


def state_spec(state: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each entry of a state_dict as (shape, dtype name): what a manifest records and a resume compares."""
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}


def optimizer_kind(optimizer: object) -> str:
    """The optimizer's class, as module.name ("none" for a model without trainable parameters)."""
    if optimizer is None:
        return "none"
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


# --- the optimizer state, keyed by parameter name ------------------------------------------------------------


def optimizer_state(optimizer, names: dict[int, str]) -> dict:
    """`optimizer.state_dict()` with parameter names for torch's indices: {"state": {name: {...}},
    "param_groups": [{hyperparameters..., "params": [names]}]}. `names` maps id(parameter) -> unsplit name.
    torch numbers the parameters of param_groups in order from 0, which is how the indices are mapped back."""
    saved = optimizer.state_dict()
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    index = {i: names[id(p)] for i, p in enumerate(flat)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[i] for i in g["params"]]}
              for g in saved["param_groups"]]  # fmt: skip
    # On the CPU: the state travels to rank 0 pickled, and a CUDA tensor would come back on the sender's device
    # index, which rank 0's node may not have. load_state_dict moves it back to each parameter's device.
    state = {index[i]: {k: _on_cpu(v) for k, v in value.items()} for i, value in saved["state"].items()}
    return {"state": state, "param_groups": groups}


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if hasattr(value, "detach") and hasattr(value, "cpu") else value


def merge_optimizer_states(parts: Iterable[dict | None]) -> dict:
    """One optimizer state from the ranks' parts (each holding its own parameters): the states side by side, and
    the groups merged by their hyperparameters (not by position: a rank holding only biases may have only the
    no-decay group of an optimizer that gives others a decay group first), each with every rank's names, each
    once (the copies of a parameter tied across ranks hold the same state under its first name)."""
    state: dict = {}
    groups: list[dict] = []
    keys: list[str] = []  # per merged group, its hyperparameters as text (values may be tensors or tuples)
    for part in parts:
        if not part:
            continue
        state.update(part["state"])
        for group in part["param_groups"]:
            key = repr(sorted((k, v) for k, v in group.items() if k != "params"))
            if key in keys:  # (a parameter tied across ranks: every copy's rank lists it, under one name)
                merged = groups[keys.index(key)]["params"]
                merged += [name for name in group["params"] if name not in merged]
            else:
                keys.append(key)
                groups.append({**group, "params": list(group["params"])})
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizer, names: dict[int, str], saved: dict) -> None:
    """Load a name-keyed optimizer state into this rank's optimizer, whatever partition wrote it: each of its
    groups takes the hyperparameters of the saved group holding its parameters, each parameter its own state."""
    group_of = {name: i for i, group in enumerate(saved["param_groups"]) for name in group["params"]}
    current = optimizer.state_dict()
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for mine, live in zip(current["param_groups"], optimizer.param_groups, strict=True):
        wanted = [names[id(p)] for p in live["params"]]
        missing = [n for n in wanted if n not in group_of]
        if missing:
            raise PipecError(f"the checkpoint's optimizer state has no parameter {missing[0]}")
        found = {group_of[n] for n in wanted}
        if len(found) > 1:
            raise PipecError(
                f"the optimizer's parameter groups differ from the checkpoint's: {wanted[0]} and the parameters "
                "grouped with it were in different groups"
            )
        hyper = {k: v for k, v in saved["param_groups"][found.pop()].items() if k != "params"} if found else {}
        groups.append({**mine, **hyper, "params": mine["params"]})
    state = {i: saved["state"][names[id(p)]] for i, p in enumerate(flat) if names[id(p)] in saved["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# --- writing -------------------------------------------------------------------------------------------------


class _Hashing:
    """A binary stream that hashes what passes through it (torch.save writes through it: no second read)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.digest, self.size = stream, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self.stream.write(view)

    def flush(self) -> None:
        self.stream.flush()


def fsync_directory(path: str) -> None:
    """Make a rename inside `path` durable (a crash after it cannot bring the old name back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    directory: str,
    step: int,
    files: dict[str, Callable[[Any], object]],
    manifest: dict,
    on_temporary: Callable[[str | None], None] = lambda path: None,
) -> str:
    """Write one checkpoint atomically and commit it (see the module's docstring); returns its path.

    `files` maps a file name to a function writing it to a binary stream; `manifest` is completed with the
    format, version, step and the files' sizes and checksums. `on_temporary(path)` is told the temporary
    directory while it exists (and None after), so that a stopped process can remove it.
    Raises CheckpointWriteError (the previous checkpoint and `latest` untouched)."""
    name = step_name(step)
    final = os.path.join(directory, name)
    if committed(directory) == name:
        raise CheckpointWriteError(f"{final} is the committed checkpoint; refusing to replace it")
    remove_temporaries(directory)
    try:
        temporary = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{name}-", dir=directory)
    except OSError as e:
        raise CheckpointWriteError(f"cannot write a checkpoint in {directory}: {e.strerror or e}") from None
    on_temporary(temporary)
    try:
        listed = {}
        for file, writer in files.items():
            with open(os.path.join(temporary, file), "wb") as stream:
                hashing = _Hashing(stream)
                writer(hashing)
                stream.flush()
                os.fsync(stream.fileno())
            listed[file] = {"bytes": hashing.size, "sha256": hashing.digest.hexdigest()}
        full = {"format": FORMAT, "version": VERSION, "step": step, **manifest, "files": listed}
        with open(os.path.join(temporary, MANIFEST), "w", encoding="utf-8") as stream:
            stream.write(manifest_text(full))
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o777 & ~_umask())  # mkdtemp's 0o700 would hide it from the user's group
        fsync_directory(temporary)
        if os.path.lexists(final):  # not committed (checked above): a leftover of an interrupted or rolled-back run
            aside = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}old-{name}-", dir=directory)
            os.rename(final, os.path.join(aside, name))
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(temporary, final)
        on_temporary(None)
        fsync_directory(directory)
        write_text(os.path.join(directory, LATEST), name + "\n")  # the commit: atomic replace, fsynced
        fsync_directory(directory)
    except PipecError as e:
        _discard(temporary, on_temporary)
        raise CheckpointWriteError(f"cannot commit the checkpoint {final}: {e.message}") from None
    except OSError as e:
        _discard(temporary, on_temporary)
        raise CheckpointWriteError(f"cannot write the checkpoint {final}: {e.strerror or e}") from None
    except BaseException:
        _discard(temporary, on_temporary)
        raise
    return final


def manifest_text(manifest: dict) -> str:
    """Indented JSON with lists of numbers (shapes) on one line: a manifest people can read."""
    text = json.dumps(manifest, indent=2)
    return re.sub(r"\[\s+([-0-9.,\s]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m[1]) + "]", text) + "\n"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _discard(temporary: str, on_temporary: Callable[[str | None], None]) -> None:
    shutil.rmtree(temporary, ignore_errors=True)
    on_temporary(None)


def remove_temporaries(directory: str) -> None:
    """Remove what interrupted writers left (.tmp-* entries): no reader looks at them."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if entry.startswith(TEMP_PREFIX):
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, entry))


def prepare_directory(directory: str) -> None:
    """Create DIR (not its parents: a typo in them should not create a tree) and check that files can be created
    in it, before any worker starts."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise PipecInputError(f"--checkpoint {directory} is not a directory")
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise PipecInputError(f"--checkpoint {directory}: the directory {parent} does not exist")
    try:
        os.makedirs(directory, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}probe-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise PipecInputError(f"--checkpoint {directory}: cannot create files there: {e.strerror or e}") from None

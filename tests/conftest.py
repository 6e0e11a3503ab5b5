import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "support"))


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA); torch imported only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip, saying why, unless `count` GPUs are visible (NCCL needs one per process)."""
    found = gpu_count()
    return pytest.mark.skipif(found < count, reason=f"needs {count} GPU(s) for NCCL, {found} visible")


def on_gloo(command: list[str]) -> list[str]:
    """A command line that starts `pipec run` (or `-m pipec.run`, torchrun's form), with `--backend gloo` unless
    it names a backend. The suite's runs compare with CPU references and read gloo's behaviour, whatever GPUs
    the machine has: without it, a machine with a GPU per process would run them on NCCL. The GPU paths are
    tests/runtime/test_runtime_devices.py's."""
    starts_run = "run" in command or "pipec.run" in command
    return [*command, "--backend", "gloo"] if starts_run and "--backend" not in command else list(command)

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA); torch imported only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip, saying why, unless `count` GPUs are visible (NCCL needs one per process)."""
    found = gpu_count()
    return pytest.mark.skipif(found < count, reason=f"needs {count} GPU(s) for NCCL, {found} visible")

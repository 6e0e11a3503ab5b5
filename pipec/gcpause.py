"""without_cyclic_gc: the passes build hundreds of thousands of small tuples and free none of them in cycles, so
Python's cyclic collector only burns time re-scanning them (25-50% of a large compile, check or simulation)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_cyclic_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

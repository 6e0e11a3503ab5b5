"""DeepSeek's recorded DualPipe / DualPipeV compute orders (tests/reference/deepseek_*_orders.json.gz, see
tests/emit/test_deepseek_conformance.py for how they were extracted) and DualPipe's as a text stream file."""

from __future__ import annotations

import gzip
import json

from paths import TESTS


def reference(name: str) -> dict[str, list[str]]:
    """'P,M' -> each rank's compute order as pipec's text writes it (a pair as `F&B`)."""
    with gzip.open(TESTS / "reference" / f"deepseek_{name}_orders.json.gz", "rt", encoding="utf-8") as file:
        return json.load(file)


def dualpipe_cases() -> list[tuple[int, int, list[str]]]:
    """(P, M, orders) of every recorded DualPipe case, in grid order."""
    cases = [(*map(int, key.split(",")), orders) for key, orders in reference("dualpipe").items()]
    return sorted(cases, key=lambda case: case[:2])


def dualpipe_text(orders: list[str]) -> str:
    """A text stream file of DualPipe's two copies (docs/format.md: `pipelines 2`, the routes read from the ops)."""
    return "pipelines 2\n" + "".join(f"rank {rank}: {order}\n" for rank, order in enumerate(orders))

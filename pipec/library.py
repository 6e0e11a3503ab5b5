"""Finding schedules: bundled names, .pipe paths, source text, torch CSV, text and JSON stream files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from pipec.errors import PipecInputError


def bundled_names() -> list[str]:
    folder = resources.files("pipec").joinpath("schedules")
    return sorted(entry.name[: -len(".pipe")] for entry in folder.iterdir() if entry.name.endswith(".pipe"))


def bundled_source(name: str) -> str:
    return resources.files("pipec").joinpath("schedules", f"{name}.pipe").read_text()


def resolve(schedule: str) -> tuple[str, str, str]:
    """Classify a SCHEDULE argument. Returns (kind, text, filename) where kind is pipe, csv, text or json."""
    if "\n" in schedule:
        return "pipe", schedule, "<string>"
    path = Path(schedule)
    suffix = path.suffix.lower()
    if suffix in (".pipe", ".csv", ".json", ".txt"):
        try:
            text = path.read_text()
        except OSError as e:
            raise PipecInputError(f"cannot read {schedule}: {e.strerror or e}") from None
        kind = {".pipe": "pipe", ".csv": "csv", ".json": "json", ".txt": "text"}[suffix]
        return kind, text, schedule
    if schedule in bundled_names():
        return "pipe", bundled_source(schedule), f"{schedule}.pipe"
    if path.exists():
        raise PipecInputError(f"{schedule}: unknown file type; expected .pipe, .csv (torch), .txt or .json")
    raise PipecInputError(
        f"unknown schedule {schedule!r}; bundled schedules: {', '.join(bundled_names())} "
        "(or give a path to a .pipe, torch .csv, .txt or .json file)"
    )

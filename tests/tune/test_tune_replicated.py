"""tune and replicated pipelines: its costs and memory are per rank share with each stage 1/V of it, which a
schedule of C copies (each stage C/V of a share) does not fit, so the library's dualpipe and chimera are skipped,
saying why, rather than ranked C times too cheap."""

from __future__ import annotations

from pipec.tune.space import draws, library_sources


def test_replicated_library_schedules_are_skipped_with_the_reason() -> None:
    sources = [source for source in library_sources() if source[0] in ("dualpipe", "chimera", "dualpipev")]
    found = {draw.name: draw for draw in draws(sources, 4, 8, (2,), 6.0, seed=0)}
    for name in ("dualpipe", "chimera"):
        assert found[name].skipped and "replicated pipelines" in (found[name].problem or ""), name
    assert not found["dualpipev"].skipped  # one copy: tuned as before

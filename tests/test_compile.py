"""Compiling the library: golden streams, properties over random (P, M, V), round trips, malformed inputs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from golden_files import assert_matches_golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipec
from pipec.emit import dump_json, dump_text, dump_torch_csv, load_json, load_text, load_torch_csv
from pipec.errors import PipecInputError
from pipec.library import bundled_names, bundled_source
from pipec.testing import schedule_params

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CASES = [("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2)]
LIBRARY = bundled_names()


@pytest.mark.parametrize(("name", "ranks", "microbatches", "chunks"), GOLDEN_CASES)
def test_golden_text_streams(name: str, ranks: int, microbatches: int, chunks: int) -> None:
    program = pipec.compile(name, ranks, microbatches, chunks)
    assert_matches_golden(dump_text(program), GOLDEN / f"{name}_P{ranks}_M{microbatches}_V{chunks}.txt")


def library_params() -> st.SearchStrategy[tuple[str, int, int, int]]:
    """A library schedule and valid parameters for it, drawn with pipec's own testing kit (no rejections)."""
    return st.sampled_from(LIBRARY).flatmap(
        lambda name: schedule_params(name, max_ranks=6, max_microbatches=16).map(
            lambda p: (name, p["P"], p["M"], p["V"])
        )
    )


def _independent_run(program: pipec.Program) -> bool:
    """Run the compute orders with no graph: an op may run when its producers ran. True if every rank finishes."""
    streams = [[a for i in s for a in i.parts if a.kind.is_compute] for s in program.compute_streams()]
    done: set[tuple[int, str, int]] = set()
    position = [0] * len(streams)
    progress = True
    while progress:
        progress = False
        for rank, stream in enumerate(streams):
            while position[rank] < len(stream):
                stage, kind, mb = stream[position[rank]]
                needs = {
                    # a chain ends at its copy's first and last stage (one copy: stage 0 and S - 1)
                    "F": [] if program.is_first(stage) else [(stage - 1, "F", mb)],
                    "B": [(stage, "F", mb)] + ([] if program.is_last(stage) else [(stage + 1, "G", mb)]),
                    "I": [(stage, "F", mb)] + ([] if program.is_last(stage) else [(stage + 1, "G", mb)]),
                    "W": [(stage, "G", mb)],
                }[kind.value]
                if not all(n in done for n in needs):
                    break
                done.add((stage, "G" if kind.value in "BI" else kind.value, mb))
                position[rank] += 1
                progress = True
    return all(position[r] == len(s) for r, s in enumerate(streams))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(library_params())
def test_every_library_schedule_compiles_completely(params: tuple[str, int, int, int]) -> None:
    name, ranks, microbatches, chunks = params
    program = pipec.compile(name, ranks, microbatches, chunks)
    counts = Counter((a.stage, a.kind.value, a.mb) for s in program.streams for i in s for a in i.parts)
    for stage in range(ranks * chunks):
        assert program.stage_to_rank[stage] in range(ranks)
        for mb in range(microbatches):
            if stage not in program.stages_of_microbatch(mb):  # another copy's (replicated pipelines)
                assert not any(counts[(stage, kind, mb)] for kind in "FBIW"), (name, stage, mb)
                continue
            assert counts[(stage, "F", mb)] == 1, (name, stage, mb)
            if program.forward_only:
                continue
            full, split_input, split_weight = (counts[(stage, k, mb)] for k in "BIW")
            assert (full, split_input, split_weight) in ((1, 0, 0), (0, 1, 1)), (name, stage, mb)
    assert _independent_run(program), f"{name} P={ranks} M={microbatches} V={chunks} cannot run to the end"
    for rank, stream in enumerate(program.streams):
        for instruction in stream:
            for action in instruction.parts:
                assert program.stage_to_rank[action.stage] == rank


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(library_params())
def test_streams_round_trip_through_every_format(params: tuple[str, int, int, int]) -> None:
    program = pipec.compile(*params)
    via_json = load_json(dump_json(program))
    assert via_json.streams == program.streams
    assert via_json.stage_to_rank == program.stage_to_rank
    assert via_json.memory_bound == program.memory_bound
    assert load_text(dump_text(program)).streams == program.streams
    if program.pipelines > 1:  # torch's runtime holds one copy of each stage: a replicated schedule is refused
        with pytest.raises(PipecInputError, match=r"pipelines \(copies of the model\)"):
            dump_torch_csv(program, with_comms=True)
        return
    assert load_torch_csv(dump_torch_csv(program, with_comms=True)).streams == program.streams
    compute_only = load_torch_csv(dump_torch_csv(program, with_comms=False))
    assert compute_only.streams == program.compute_streams()
    assert not compute_only.has_comms


def test_a_compute_only_csv_gets_sends_and_receives(tmp_path: Path) -> None:
    path = tmp_path / "one.csv"
    path.write_text(dump_torch_csv(pipec.compile("1f1b", 4, 8), with_comms=False))
    from_csv = pipec.compile(str(path))
    assert from_csv.streams == pipec.compile("1f1b", 4, 8).streams
    assert (from_csv.ranks, from_csv.microbatches, from_csv.chunks) == (4, 8, 1)


_MUTATIONS = st.sampled_from(["delete", "insert", "duplicate_line", "drop_line", "swap_lines", "indent", "dedent"])


@settings(max_examples=int(__import__("os").environ.get("PIPEC_FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.sampled_from(LIBRARY), st.data())
def test_mutated_library_files_never_crash(name: str, data: st.DataObject) -> None:
    text = bundled_source(name)
    for _ in range(data.draw(st.integers(1, 3))):
        lines = text.splitlines(keepends=True)
        mutation = data.draw(_MUTATIONS)
        if mutation in ("delete", "insert"):
            at = data.draw(st.integers(0, len(text) - 1))
            if mutation == "delete":
                text = text[:at] + text[at + 1 :]
            else:
                text = text[:at] + data.draw(st.sampled_from(list('FBIW[]()&?@:=-+*/%#"0123 \n\tPMVrk.'))) + text[at:]
            continue
        i = data.draw(st.integers(0, len(lines) - 1))
        j = data.draw(st.integers(0, len(lines) - 1))
        if mutation == "duplicate_line":
            lines.insert(i, lines[i])
        elif mutation == "drop_line":
            del lines[i]
        elif mutation == "swap_lines":
            lines[i], lines[j] = lines[j], lines[i]
        elif mutation == "indent":
            lines[i] = "    " + lines[i]
        else:
            lines[i] = lines[i].lstrip(" ")
        text = "".join(lines)
    ranks, microbatches, chunks = (
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 9)),
        data.draw(st.integers(1, 3)),
    )
    try:
        program = pipec.compile(text, ranks, microbatches, chunks)
        program.check(p2p="tagged")
    except pipec.PipecError as e:
        rendered = e.render()
        assert rendered and "Traceback" not in rendered
        if isinstance(e, pipec.PipecSyntaxError) and e.span is not None:
            assert rendered.startswith("<string>:")


def test_compile_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pipec.cli; pipec.cli.main(['compile', 'zbv', '-P', '4', '-M', '8', '-V', '2', '-o', '/dev/null']);"
        "pipec.cli.main(['check', 'zbv', '-P', '4', '-M', '8', '-V', '2']); assert 'torch' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_emit_phases_print_each_phase(capsys: pytest.CaptureFixture[str]) -> None:
    from pipec.cli import main

    assert main(["compile", "1f1b", "-P", "2", "-M", "2", "--emit", "ast"]) == 0
    ast_text = capsys.readouterr().out
    assert "Schedule" in ast_text and "Repeat" in ast_text and "rank_var: 'r'" in ast_text
    assert main(["compile", "1f1b", "-P", "2", "-M", "2", "--emit", "orders"]) == 0
    assert capsys.readouterr().out == "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n"
    assert main(["compile", "1f1b", "-P", "2", "-M", "2", "--emit", "ir"]) == 0
    ir_text = capsys.readouterr().out
    assert "1F0(data)" not in ir_text.split("1RECV_F0")[0]
    assert "0SEND_F0(p2p)" in ir_text and "0F0(data)" in ir_text and "(program)" in ir_text

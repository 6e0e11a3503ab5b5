"""What a new user meets in the first minutes (issue 24): a missing torch, typos, help, unit names, messages that
name the flag that fixes them. Each test runs the command as the user typed it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from cli_capture import run_main
from paths import ROOT


def _run_without_torch(tmp_path: Path) -> subprocess.CompletedProcess:
    """`pipec run` as after `pip install -e .`: a `torch` package on the path that fails to import."""
    blocker = tmp_path / "blocked" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), str(ROOT)]))
    command = [sys.executable, "-m", "pipec", "run", "1f1b", "-P", "2", "-M", "4", "--model", "examples.workload:mlp"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_run_without_torch_names_the_extra_not_a_bug(tmp_path: Path) -> None:
    """`pip install -e .` has no torch: `pipec run` says how to get it (exit 2), not 'internal error'."""
    result = _run_without_torch(tmp_path)
    assert result.returncode == 2, result.stderr
    assert "'.[torch]'" in result.stderr and "internal error" not in result.stderr
    assert result.stderr.startswith("error: pipec run needs PyTorch")


def test_readme_names_the_torch_extra_and_the_suite_time() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "'.[torch]'" in readme
    assert re.search(r"The whole suite \(about [0-9,]+ tests\) took [0-9]+ minutes", readme.replace("\n", " "))


def test_typos_get_a_suggestion() -> None:
    cases = [
        (["check", "1f1b", "-P", "4", "-M", "8", "--memory-limt", "4"], "(--memory-limt: did you mean --memory-limit?"),
        (["run", "1f1b", "-P", "2", "-M", "4", "--modle", "examples.workload:mlp"], "did you mean --model?"),
        (["simulte", "1f1b", "-P", "2", "-M", "4"], "(did you mean simulate?)"),
        (["simulate", "1f1b", "-P", "2", "-M", "4", "--p2p", "ncl"], "(did you mean nccl?)"),
        (["check", "1F1B", "-P", "4", "-M", "8"], "unknown schedule '1F1B' (did you mean 1f1b?)"),
        (["check", "zbh1", "-P", "4", "-M", "8"], "(did you mean zb_h1?)"),
        (["check", "interleaved-1f1b", "-P", "4", "-M", "8", "-V", "2"], "(did you mean interleaved_1f1b?)"),
    ]
    for argv, hint in cases:
        code, _, err = run_main(argv)
        assert code == 2 and hint in err, (argv, err)
    # the unknown flag is reported with the command's usage, not the top level's
    _, _, err = run_main(["check", "1f1b", "-P", "4", "-M", "8", "--memory-limt", "4"])
    assert err.startswith("usage: pipec check") and "unrecognized arguments: --memory-limt 4" in err
    code, _, err = run_main(["check", "xyzzy", "-P", "4", "-M", "8"])
    assert code == 2 and "did you mean" not in err  # nothing close: no guess


def test_dash_capital_v_prints_the_version(capsys) -> None:
    from pipec.cli import main

    assert main(["-V"]) == 0
    assert capsys.readouterr().out.startswith("pipec ")


def test_help_speaks_to_users_not_of_modules() -> None:
    from pipec.cli import COMMANDS

    for command in COMMANDS:
        code, out, _ = run_main([command, "--help"])
        assert code == 0
        text = out.replace("-m pipec.run", "")  # torchrun's form of the command, a thing to type
        assert "pipec." not in text and "TEST_MAX" not in text, (command, text)
    _, out, _ = run_main(["list", "--help"])
    assert "exit codes: 0 ok, 2 bad input or usage" in out and "1 the schedule is invalid" not in out


def test_a_v1_cost_list_for_a_v2_schedule_names_per_rank_share(tmp_path: Path) -> None:
    costs = tmp_path / "v1.json"
    costs.write_text('{"F": [1, 1, 1, 1], "B": [2, 2, 2, 2], "W": [1, 1, 1, 1], "activation": [1, 1, 1, 1]}')
    code, _, err = run_main(["simulate", "zbv", "-P", "4", "-M", "8", "-V", "2", "--cost", str(costs)])
    assert code == 2 and "cost 'F' has 4 entries, the schedule has 8 stages" in err and "--per-rank-share" in err
    argv = ["simulate", "zbv", "-P", "4", "-M", "8", "-V", "2", "--cost", str(costs), "--per-rank-share"]
    code, out, _ = run_main(argv)
    assert code == 0 and "makespan 25.5" in out  # spread: each chunk takes half a rank share's F, B, W


def test_costs_filled_with_defaults_are_named_and_tune_wants_the_backward_split() -> None:
    code, out, err = run_main(["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "F=1.5,B=3"])
    assert code == 0 and "note: --cost gives no I or W; using I=2, W=1" in err
    assert "B=3,I=2,W=1" in out  # the note says what was simulated
    code, _, err = run_main(["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "F=1,I=2,W=1"])
    assert code == 0 and err == ""  # complete: nothing to say
    code, _, err = run_main(["tune", "-P", "2", "-M", "4", "--cost", "F=1,B=2", "--memory-limit", "2"])
    assert code == 2 and "give the backward's split, B and W or I and W (it has B)" in err


def _peaks(table: str, header: str, column: int) -> list[float]:
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 1
    return [float(line.split()[column]) for line in lines[start : start + 4]]


def test_check_and_simulate_read_a_cost_files_activation_list_alike(tmp_path: Path) -> None:
    costs = tmp_path / "act.json"
    costs.write_text('{"F": 1, "B": 2, "W": 1, "activation": [1.5, 1, 1, 1]}')
    _, checked, _ = run_main(["check", "1f1b", "-P", "4", "-M", "8", "--cost", str(costs)])
    _, simulated, _ = run_main(["simulate", "1f1b", "-P", "4", "-M", "8", "--cost", str(costs)])
    assert _peaks(checked, "rank   ops", 2) == _peaks(simulated, "rank      busy", 5) == [6, 3, 2, 1]


def test_peaks_in_stage_units_say_so_where_v_is_over_1() -> None:
    _, out, _ = run_main(["check", "zbv", "-P", "4", "-M", "8", "-V", "2"])
    assert "units: micro-batches of one stage's activations (pipec tune, --per-rank-share: of a rank's V=2" in out
    assert "so 8 here is 4 there" in out
    _, out, _ = run_main(["simulate", "zbv", "-P", "4", "-M", "8", "-V", "2"])
    assert "so 8 here is 4 there" in out
    _, out, _ = run_main(["check", "1f1b", "-P", "4", "-M", "8"])
    assert "units:" not in out  # V=1: a stage is a rank's share, one unit either way


def test_the_gallerys_nccl_figures_are_what_pipec_simulate_prints() -> None:
    """docs/schedules.md, "Where nccl still differs": each line's makespans are `pipec simulate --cost`'s (which
    places the send/recv for the costs), nccl against ideal; zb_h1 at F=2,I=2,W=1 is not among them (49 both)."""

    text = (ROOT / "docs" / "schedules.md").read_text()
    lines = re.findall(r"^- `([^`]+)` \*\*(\w+)\*\*: ([\d.]+) against ([\d.]+);", text, re.MULTILINE)
    assert len(lines) >= 10
    assert ("F=2,I=2,W=1", "zb_h1") not in {(c, n) for c, n, _, _ in lines}
    chunked = {n for n in re.findall(r"^\| \[(\w+)\]\(#\w+\) \| 4, 8, 2 \|", text, re.MULTILINE)}
    for costs, name, nccl, ideal in lines[::3]:  # a third of them: each is two simulations
        argv = ["simulate", name, "-P", "4", "-M", "8", "--cost", costs, *(["-V", "2"] if name in chunked else [])]
        for p2p, expected in (("nccl", nccl), ("ideal", ideal)):
            code, out, _ = run_main([*argv, "--p2p", p2p])
            assert code == 0 and out.splitlines()[1].startswith(f"makespan {expected} "), (argv, p2p, out)


def _doc_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def test_every_file_a_document_shows_whole_is_in_the_repository() -> None:

    for name, text in _doc_texts().items():
        for path in re.findall(r"^```pipe .*\bfile=(\S+\.pipe)\b", text, re.MULTILINE):  # schedules, not streams
            assert (ROOT / path).is_file(), f"{name} shows {path}, which a user following it does not have"


def test_what_the_documented_commands_write_is_ignored_by_git() -> None:
    import shutil

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # not a checkout: nothing to leave untracked
    outputs = set()
    for text in _doc_texts().values():
        for line in re.findall(r"^\$? ?(pipec (?:run|tune|compile|viz|simulate) .*)$", text, re.MULTILINE):
            outputs |= set(re.findall(r"(?:-o|--save|--report|--trace|--checkpoint) ([\w.-]+)", line))
    assert {"ckpt", "weights.pt", "best.pipe", "run.json"} <= outputs
    result = subprocess.run(["git", "check-ignore", "--no-index", *sorted(outputs)], cwd=ROOT, capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert set(result.stdout.split()) == outputs, f"not ignored: {sorted(outputs - set(result.stdout.split()))}"


def test_simulate_compares_schedules_side_by_side_in_units_that_compare_across_v() -> None:
    code, out, _ = run_main(["simulate", "1f1b", "zb_h1", "zbv", "-P", "4", "-M", "8", "--activation-bytes", "1048576"])
    assert code == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    assert rows["1f1b"][1:5] == ["1", "33", "27.3%", "4"] and rows["1f1b"][5:] == ["4.0", "MiB"]
    assert rows["zbv"][1:5] == ["2", "25.5", "5.9%", "4"]  # = pipec simulate zbv ... --per-rank-share
    _, alone, _ = run_main(["simulate", "zbv", "-P", "4", "-M", "8", "--per-rank-share"])
    assert "makespan 25.5 " in alone
    code, out, _ = run_main(["simulate", "1f1b", "zbv", "-P", "4", "-M", "8", "-V", "2"])
    assert code == 2 and "1f1b: 1F1B runs one stage per rank" in out and out.count("\n") == 6


def test_show_fits_a_width_and_viz_refuses_a_picture_format_it_does_not_write(tmp_path: Path) -> None:
    code, out, _ = run_main(["show", "zbv", "-P", "8", "-M", "32", "-V", "2", "--width", "100"])
    rows = out.splitlines()[1:9]
    assert code == 0 and all(len(row) <= 100 for row in rows) and max(map(len, rows)) > 80
    code, _, err = run_main(["viz", "1f1b", "-P", "2", "-M", "2", "-o", str(tmp_path / "x.png")])
    assert code == 2 and "pipec viz draws SVG; name it" in err and not (tmp_path / "x.png").exists()


def test_written_outputs_are_announced(tmp_path: Path) -> None:
    argv = ["viz", "zbv", "-P", "4", "-M", "8", "-V", "2", "-o", "z.svg", "--trace", "z.json"]
    code, out, _ = run_main(argv, tmp_path)
    assert code == 0 and out == "wrote z.svg\nwrote z.json\n"
    code, out, _ = run_main(["compile", "1f1b", "-P", "2", "-M", "2", "-o", "s.txt"], tmp_path)
    assert code == 0 and out == "wrote s.txt\n" and (tmp_path / "s.txt").read_text().startswith("rank 0:")


def test_a_float_rounding_zero_prints_as_0() -> None:
    code, out, _ = run_main(["simulate", "1f1b", "-P", "4", "-M", "8", "--cost", "F=0.3,B=0.7,W=0.1"])
    assert code == 0 and "e-1" not in out and out.splitlines()[-1].split()[4] == "0"


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    from conftest import on_gloo

    command = on_gloo([sys.executable, "-m", "pipec", "run", *argv])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_run_logs_every_k_steps_with_eta_says_what_it_wrote_and_a_finished_resume_starts_nothing(
    tmp_path: Path,
) -> None:
    common = ["1f1b", "-P", "1", "-M", "2", "--model", "examples.workload:mlp", "--steps", "5", "--checkpoint", "ck"]
    done = _run([*common, "--log-every", "2", "--report", "r.json"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["0", "1", "3", "4"]  # every 2nd, the first and the last
    assert all(" elapsed " in line and line.endswith(" s") and ", eta " in line for line in steps)
    assert steps[-1].endswith("eta 0.0 s") and "wrote r.json" in done.stdout
    again = _run([*common, "--resume", "ck"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[1:] == ["no step left to train: ck/step-00000005 has trained 5 of --steps 5"]


def test_torchrun_does_not_retry_bad_input_at_full_cost(tmp_path: Path) -> None:
    """torchrun restarts on any failure; a worker's input error is the same in every attempt, so the restarts exit
    at once, saying so, and each attempt says it once (not once per worker)."""
    import shutil

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "-m", "pipec.run", "1f1b",
               "-P", "2", "-M", "4", "--model", "examples.workload:nope", "--backend", "gloo"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert said[0] == "error: --model examples.workload:nope: examples.workload has no function nope", said
    assert 1 <= len(said) <= 3 and all(line.startswith("error: not retried (torchrun restart ") for line in said[1:])


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = task / "children"
        if children.exists():
            found += [int(c) for c in children.read_text().split()]
    return found


def test_a_stopped_rank_fails_the_run_after_the_timeout_not_a_minute_later(tmp_path: Path) -> None:
    import signal
    import time

    from conftest import on_gloo

    argv = ["1f1b", "-P", "2", "-M", "2", "--model", "examples.workload:mlp", "--steps", "100000", "--timeout", "2"]
    command = on_gloo([sys.executable, "-m", "pipec", "run", *argv])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):  # the workers are training
                break
        workers = [c for c in _children(proc.pid) if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 3, err
    assert "was stopped (SIGSTOP or a debugger) for 2 s (--timeout); killed" in err
    assert took < 20, took  # --timeout 2 and the teardown; it was about 2 x timeout + 10 s


def test_a_model_whose_import_hangs_is_said_to_be_hanging(tmp_path: Path) -> None:
    import time

    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    command = [sys.executable, "-m", "pipec", "run", "1f1b", "-P", "2", "-M", "2", "--model", "hangs:build"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    began = time.monotonic()
    try:
        assert proc.stdout is not None
        first, line = proc.stdout.readline(), proc.stdout.readline()
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith("pipec run: compiling and verifying 1f1b, then checking --model hangs:build"), first
    assert line.startswith("pipec run: still importing and checking --model hangs:build after 10 s"), line
    assert took < 60


def test_run_says_what_it_is_doing_before_it_imports_torch(tmp_path: Path) -> None:
    """The first line comes before torch is imported (seconds on a busy machine): blocked torch, it is there."""
    result = _run_without_torch(tmp_path)
    assert result.stdout.startswith("pipec run: compiling and verifying 1f1b, then checking --model examples.workload")

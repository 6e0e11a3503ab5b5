import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "support"))

# `pytest -m "not slow"` is the quick loop (about a minute on 2 cores); the whole suite runs in CI.
# multiprocess: everything under tests/runtime (real gloo process groups, most tests spawn workers) and the tests
# named below that start torch's runtime. slow: those, and the tests that took over 1.5 s under a loaded 2-core
# machine (`pytest --durations=0`, 2026-12-01): property searches, fuzzing, grids over the library.
MULTIPROCESS_FOLDERS = ("runtime",)
MULTIPROCESS = ("emit/test_torch_csv.py::test_torch_runtime_runs_pipec_csv_like_its_own_schedule",)
SLOW = (
    "frontend/test_fuzz_pipe.py::test_pipec_test_bounds_the_parameter_space_it_enumerates",
    "frontend/test_fuzz_pipe.py::test_hostile_pipe_text_ends_in_a_message",
    "frontend/test_fuzz_pipe.py::test_runaway_programs_name_what_stopped_them",
    "frontend/test_fuzz_pipe.py::test_mutated_schedules_end_in_a_verdict_or_a_message",
    "frontend/test_fuzz_streams.py::test_mutated_stream_files_end_in_a_verdict_or_a_message",
    "frontend/test_fuzz_streams.py::test_many_ranks_stay_linear",
    "frontend/test_fuzz_streams.py::test_fuzzed_costs_end_in_a_result_or_a_message",
    "passes/test_list_schedule.py::test_the_cost_aware_library_never_gets_stuck_and_verifies",
    "passes/test_list_schedule.py::test_the_v_rules_never_get_stuck_under_other_costs",
    "test_compile.py::test_every_library_schedule_compiles_completely",
    "test_compile.py::test_streams_round_trip_through_every_format",
    "tune/test_tune_properties.py::test_never_worse_than_the_library_and_never_invalid",
    "tune/test_tune_properties.py::test_grid_points",
    "tune/test_tune_exact.py::test_exact_equals_the_brute_force",
    "tune/test_tune.py::test_progress_lines_after_two_seconds_when_asked",
    "tune/test_tune_clock.py::test_a_search_cut_by_its_budget_returns_the_same_result_on_a_loaded_machine",
    "verify/test_verify_sync.py::test_insert_syncs_keeps_any_valid_program_deadlock_free",
    "verify/test_verify_properties.py::test_verdicts_equal_the_executor",
    "verify/test_verify_properties.py::test_valid_orders_are_accepted_and_run",
    "verify/test_replicated_properties.py::test_replicated_verdicts_equal_the_executor_and_the_simulator",
    "verify/test_verify.py::test_library_is_accepted_under_every_model",
    "verify/test_verify.py::test_placed_streams_are_accepted_and_reach_the_compute_orders_makespan",
    "testing/test_testing_kit.py::test_every_drawn_parameter_set_compiles",
    "testing/test_testing_kit.py::test_pipec_test_passes_every_library_schedule",
    "emit/test_conformance.py::test_compute_orders_equal_torch",
    "cli/test_cli_outputs.py::test_standard_output_failures_are_reported_not_raised",
    "cli/test_cli_outputs.py::test_random_flag_abuse_never_ends_in_a_traceback_or_an_internal_error",
    "sim/test_sim_properties.py::test_simulator_verdicts_equal_the_verifier",
    "sim/test_sim_properties.py::test_streams_placed_for_any_costs_are_accepted_and_run",
    "docs/test_docs.py::test_console_block",
)
TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: over a second or so; `pytest -m 'not slow'` leaves them out")
    config.addinivalue_line("markers", "multiprocess: starts processes (gloo process groups, pipec run, torchrun)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        where = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        name = f"{where}::{getattr(item, 'originalname', item.name)}"
        if where.split("/")[0] in MULTIPROCESS_FOLDERS or name in MULTIPROCESS:
            item.add_marker(pytest.mark.multiprocess)
            item.add_marker(pytest.mark.slow)
        elif name in SLOW:
            item.add_marker(pytest.mark.slow)


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

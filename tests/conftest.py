"""Shared fixtures: one captured runner per kind over a toy world, per session.

torch.compile costs seconds per size on the CPU, so runners are captured once
and shared; the capture list is short (1, 2, 4, 8) yet every raw size 1..8 is
exercised, most of them padded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.
# Triton reads TRITON_INTERPRET as it jits its own library functions (at
# import), so it is set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphrunner import GraphRunner, create_runner, decode_buffer_specs  # noqa: E402
from graphrunner.testing import ToyWorld, torch_threads  # noqa: E402

TEST_CAPTURE_SIZES = [1, 2, 4, 8]
SLOW = os.environ.get("GRAPHRUNNER_SLOW", "0") != "0"
# Engine runs capture no token-batch runner unless a test asks for one
# (tests/test_token_batch_engine.py): each would compile a second program.
os.environ.setdefault("GRAPHRUNNER_TOKEN_BATCHES", "0")
# Commands the tests start (the CLI, server and tensor-parallel ranks) run one
# torch thread, as the tests themselves do: two workers' threads spinning on
# two cores would make each several times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The default run draws the same examples every time, so a CI run cannot flake
# on a lucky draw; the slow run (``make test-slow``) explores fresh ones.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if SLOW else "fixed")
HAS_CUDA = torch.cuda.is_available()
#: Every capture mechanism, by the label its runner reports: the runner kind
#: and the options that select the mechanism.
MECHANISMS: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("eager", {}),
    "cpu": ("cpu", {}),
    "cuda": ("cuda", {}),
    "cuda+compile": ("cuda", {"compile": True}),
}
RUNNER_KINDS = ["eager", "cpu"] + (["cuda", "cuda+compile"] if HAS_CUDA else [])
#: RUNNER_KINDS as parameters, the CUDA ones marked so ``-m "not cuda"`` drops them.
RUNNER_PARAMS = [
    pytest.param(k, marks=pytest.mark.cuda) if k.startswith("cuda") else k for k in RUNNER_KINDS
]


#: The longest tests whose ground another test of the default run covers:
#: run with ``GRAPHRUNNER_SLOW=1`` (``make test-slow``), so ``make test`` stays
#: inside CI's time on two cores.
SLOW_TESTS = (
    "tests/test_small_batch.py::test_served_tokens_equal_transformers",
    "tests/test_bridge_moe.py::test_the_compiled_cpu_runner_equals_transformers",
    "tests/test_tensor_parallel.py::test_sharded_cpu_runner_equals_one_process",
    "tests/test_spec_sampling.py::test_a_sampling_request_depends_on_its_seed_alone[mtp-self]",
    "tests/test_bridge_live.py::test_a_wide_pool_answers_as_transformers_reading_only_live_"
    "columns[cpu-gemma2]",
    "tests/test_tensor_parallel_checkpoint.py::test_two_ranks_give_transformers_greedy_tokens",
    "tests/test_cpu_bfloat16.py::test_bfloat16_cpu_runner_within_tolerance_of_eager_and_near_"
    "float32_tokens",
    "tests/test_decode_attention.py::test_kernels_compile_for_hopper",
    "tests/test_gguf_cache.py::test_processes_converting_one_file_at_once_all_get_it",
    "tests/test_serve_load.py::",
    "tests/test_spec_logprobs.py::test_speculative_logprobs_are_the_eager_log_softmax_of_each_"
    "token[eagle-random]",
    "tests/test_exit_with_parent.py::test_a_child_ends_soon_after_its_launcher_is_killed[unwatched]",
    "tests/test_padded_suite.py::test_random_lifecycles_match_eager_with_sanitizer_on[eager]",
    "tests/test_tensor_parallel.py::test_sharded_eager_decode_equals_one_process",
    "tests/test_overlap.py::test_overlap_gives_the_plain_engines_tokens_and_frees_every_slot[cpu-4]",
    "tests/test_tensor_parallel_alone.py::test_compiled_cpu_programs_hold_the_collectives_and_"
    "equal_no_group",
    "tests/test_chunked_prefill.py::test_chunked_prefill_through_the_compiled_runner[cpu]",
    "tests/test_bridge.py::test_the_compiled_cpu_runner_equals_transformers",
    # CI time: each covered by a cheaper case of the same test or a neighbour.
    "tests/test_cuda_runner.py::test_compiled_forward_matches_eager_on_the_reference_model[cpu]",
    "tests/test_cli_quantize.py::test_generate_quantized_prints_transformers_tokens[fp16-cpu]",
    "tests/test_oracle.py::test_greedy_tokens_equal_transformers_generate[cpu-4]",
    "tests/test_cli_tp.py::test_a_failing_rank_ends_the_run_naming_it",
    "tests/test_cli_tp.py::test_tp_one_runs_the_collectives_in_a_group_of_its_own",
    "tests/test_small_batch.py::test_kernel_compiles_for_hopper_with_vector_loads",
    "tests/test_engine_multistep_logprobs.py::test_each_token_has_the_entry_of_one_step_per_"
    "launch[greedy-2]",
    "tests/test_tensor_parallel.py::test_ranks_with_different_capture_sizes_are_refused_naming_both",
    "tests/test_spec_sampling.py::test_temperature_0_is_greedy_alone_and_beside_sampling_"
    "requests[mtp-random]",
    "tests/test_serve_modes.py::test_each_schedule_serves_generates_tokens_and_frees_what_it_cut["
    "multistep]",
    "tests/test_cli_exits.py::test_a_signal_mid_run_ends_with_one_line[15-143-terminated]",
    "tests/test_engine_multistep.py::test_an_end_token_stops_rows_inside_a_launch_as_one_step_"
    "does[1-4]",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="long: GRAPHRUNNER_SLOW=1")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if not SLOW and item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(skip_slow)


def runner_device(label: str) -> str:
    return "cuda" if label.startswith("cuda") else "cpu"


def make_runner(label: str, forward: Any, specs: Any, **kwargs: Any) -> GraphRunner:
    """The runner of mechanism ``label`` (a key of MECHANISMS) on its device."""
    kind, options = MECHANISMS[label]
    kwargs.setdefault("device", runner_device(label))
    kwargs.setdefault("show_progress", False)
    return create_runner(forward, specs, **options, **kwargs, kind=kind)


class CapturedToy:
    """A toy world and a runner captured over it; ``kind`` is the mechanism's label."""

    def __init__(self, kind: str, capture_sizes: list[int]) -> None:
        self.kind = kind
        self.world = ToyWorld(runner_device(kind))
        self.runner = make_runner(
            kind, self.world.model, decode_buffer_specs(), capture_sizes=capture_sizes
        )
        self.runner.capture()


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()  # a CLI command sets its own (--threads)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=RUNNER_PARAMS)
def captured_toy(request: pytest.FixtureRequest) -> Iterator[CapturedToy]:
    yield CapturedToy(request.param, TEST_CAPTURE_SIZES)


def clear_kernel_choice() -> None:
    """Forget the CPU's features, the C++ kernels' status and each compact
    product's path: all read again at their next use (after the environment
    changed ``GRAPHRUNNER_CPU_DISABLE``, or a test pretended another CPU)."""
    from graphrunner_ref.model.cpu_features import cpu_features, kernel_path
    from graphrunner_ref.model.cpu_kernels import kernel_status

    kernel_status.cache_clear()
    cpu_features.cache_clear()
    kernel_path.cache_clear()


@pytest.fixture
def fresh_features(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Feature detection and path choice read again, and again after the test
    (its monkeypatch, ``GRAPHRUNNER_CPU_DISABLE`` unset, to set what it needs)."""
    monkeypatch.delenv("GRAPHRUNNER_CPU_DISABLE", raising=False)
    clear_kernel_choice()
    yield monkeypatch
    monkeypatch.undo()
    clear_kernel_choice()


def eager_greedy(bundle: Any) -> dict[int, list[int]]:
    """``bundle``'s greedy tokens for three short prompts (6 new each) through
    its engine over an eager runner captured at size 4: request id -> tokens."""
    from graphrunner_ref import Engine, create_decode_runner
    from graphrunner_ref.engine.workload import requests_from_prompts

    runner = create_decode_runner(bundle, "eager", capture_sizes=[4])
    runner.capture()
    trace = requests_from_prompts([[1, 2, 3], [4, 5], [6]], max_new_tokens=6)
    result = Engine(bundle, runner).run(trace)
    return {rid: list(tokens) for rid, tokens in result.outputs.items()}


@pytest.fixture(scope="session")
def slow() -> bool:
    return SLOW


#: Distinct (runner, captured size, raw size) cases replayed by the padded suite.
PADDED_CASES: set[tuple[str, int, int]] = set()


@dataclass(slots=True)
class PaddedTally:
    """What ``tests/test_padded_suite.py`` checked for one runner label.

    ``steps``: decode steps replayed and compared with the eager reference;
    ``padded``: those that replayed a graph larger than the live batch;
    ``eager_fallbacks``: those above the largest graph. ``bytes_compared``:
    the live output bytes plus the state bytes (KV outside slot 0,
    ``req_to_token``) each step compared; ``bytes_differed``: those that
    failed the comparison (the test fails on any, so a green run prints 0).
    """

    steps: int = 0
    padded: int = 0
    eager_fallbacks: int = 0
    bytes_compared: int = 0
    bytes_differed: int = 0


#: PaddedTally per runner label, filled by the padded suite's lifecycles.
PADDED_TALLY: dict[str, PaddedTally] = {}
#: One line per churn soak run (``tests/test_soak.py``), printed at the end.
SOAK_REPORTS: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if PADDED_CASES:
        runners = sorted({kind for kind, _, _ in PADDED_CASES})
        terminalreporter.write_line(
            f"padded suite: {len(PADDED_CASES)} distinct (runner, captured size, raw size) "
            f"cases replayed across runners {runners}"
        )
    for label, t in sorted(PADDED_TALLY.items()):
        terminalreporter.write_line(
            f"padded lifecycles [{label}]: {t.padded:,} padded replays of {t.steps:,} steps "
            f"({t.eager_fallbacks:,} eager fallbacks); {t.bytes_compared:,} bytes of outputs "
            f"and state compared with eager, {t.bytes_differed:,} differed"
        )
    for line in SOAK_REPORTS:
        terminalreporter.write_line(line)

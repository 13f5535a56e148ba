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
#: ``GRAPHRUNNER_EXPLORE=1`` (``make test-explore``) draws fresh Hypothesis examples,
#: thousands of them in the padded suite; it changes how much is drawn, never
#: which tests run: ``make test`` runs every test.
EXPLORE = os.environ.get("GRAPHRUNNER_EXPLORE", "0") != "0"
# Engine runs capture no token-batch runner unless a test asks for one
# (tests/test_token_batch_engine.py): each would compile a second program.
os.environ.setdefault("GRAPHRUNNER_TOKEN_BATCHES", "0")
# Commands the tests start (the CLI, server and tensor-parallel ranks) run one
# torch thread, as the tests themselves do: two workers' threads spinning on
# two cores would make each several times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# generate and serve save the CPU step's program in a per-user folder by
# default; building one costs about 3x a plain compile, and every test's model
# and sizes differ, so the commands the tests start compile without it.
# tests/test_aot_default.py holds the default itself, in a folder of its own.
os.environ.setdefault("GRAPHRUNNER_AOT_CACHE", "none")

# The default run draws the same examples every time, so a CI run cannot flake
# on a lucky draw; the exploring run draws fresh ones.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if EXPLORE else "fixed")
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


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


@pytest.fixture(params=["avx2", "avx512"])
def attention_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU decode attention run on each of its paths in turn (one this
    CPU lacks skipped), the path chosen for this CPU restored after."""
    from graphrunner_ref.model.attention_cpu import (
        cpp_attention_status,
        runnable_paths,
        using_path,
    )

    why = cpp_attention_status()
    if why is not None:
        pytest.skip(f"the C++ attention cannot run here: {why}")
    if request.param not in runnable_paths():
        pytest.skip(f"this CPU cannot run the {request.param} attention path")
    with using_path(request.param):
        yield request.param


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

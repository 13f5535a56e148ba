"""The CPU runner's program calls its kernels from inductor's Python wrapper
by default, with no size or stride assert (``DIRECT_CALL_OPTIONS``; the
caller's ``inductor_options`` may set them back), and from its C++ wrapper
with ``inductor_options=CPP_WRAPPER``, and gives the eager forward's outputs
every way."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from conftest import make_runner
from graphrunner import DecodeBatch, GraphRunner, decode_buffer_specs
from graphrunner.mechanisms import InductorCapture
from graphrunner.mechanisms.inductor import CPP_WRAPPER
from graphrunner.testing import ToyWorld


def _runner(world: ToyWorld, options: Mapping[str, Any] | None) -> GraphRunner:
    runner = make_runner(
        "cpu", world.model, decode_buffer_specs(), capture_sizes=[4], inductor_options=options
    )
    runner.capture()
    return runner


def _builtin_calls(runner: GraphRunner, batch: DecodeBatch) -> Counter[str]:
    """The C functions called from Python frames during one replay, by name
    (the Python wrapper calls each kernel as ``kernel``, and each size assert;
    the C++ wrapper is called once, as ``inductor_entry_cpp``)."""
    count: Counter[str] = Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            count[getattr(arg, "__name__", "")] += 1

    sys.setprofile(hook)
    try:
        runner.replay(batch)
    finally:
        sys.setprofile(None)
    return count


def test_each_wrapper_calls_what_it_should_with_the_eager_outputs() -> None:
    world = ToyWorld()
    runners = {"default": _runner(world, None), "cpp": _runner(world, CPP_WRAPPER)}
    wrappers = {}
    for name, runner in runners.items():
        assert isinstance(runner.mechanism, InductorCapture)
        assert runner.direct_fallbacks == 0
        wrappers[name] = runner.mechanism.wrapper
    assert wrappers == {"default": "python", "cpp": "c++"}
    for raw_bs in (1, 3, 4):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        for runner in runners.values():
            torch.testing.assert_close(runner.replay(batch), expected)
    batch = world.make_batch(3, seed=7)
    calls = {name: _builtin_calls(runner, batch) for name, runner in runners.items()}
    # The Python wrapper calls its kernels from Python, by default with no asserts.
    assert calls["default"]["kernel"] > 0 and calls["default"]["assert_size_stride"] == 0
    assert calls["default"]["inductor_entry_cpp"] == 0
    # The C++ wrapper is one call from Python.
    assert calls["cpp"]["inductor_entry_cpp"] == 1 and calls["cpp"]["kernel"] == 0
    assert calls["cpp"]["assert_size_stride"] == 0


def test_the_callers_options_go_over_the_direct_call_defaults() -> None:
    # No compile: the options the program will be built with.
    assert InductorCapture().compiler.patches["size_asserts"] is False
    asserts = InductorCapture(inductor_options={"size_asserts": True})
    assert asserts.compiler.patches["size_asserts"] is True

"""The CPU runner's program calls its kernels from inductor's Python wrapper
by default and from its C++ wrapper with ``inductor_options=CPP_WRAPPER``,
and gives the eager forward's outputs either way."""

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
    (the Python wrapper calls each kernel, size assert and buffer; the C++
    wrapper is called once, as ``inductor_entry_cpp``)."""
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


def test_the_cpp_wrapper_calls_the_kernels_from_cpp_with_the_eager_outputs() -> None:
    world = ToyWorld()
    default = _runner(world, None)
    cpp = _runner(world, CPP_WRAPPER)
    assert isinstance(default.mechanism, InductorCapture)
    assert isinstance(cpp.mechanism, InductorCapture)
    assert (default.mechanism.wrapper, cpp.mechanism.wrapper) == ("python", "c++")
    assert default.direct_fallbacks == cpp.direct_fallbacks == 0
    for raw_bs in (1, 3, 4):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        torch.testing.assert_close(default.replay(batch), expected)
        torch.testing.assert_close(cpp.replay(batch), expected)
    batch = world.make_batch(3, seed=7)
    cpp_calls, python_calls = _builtin_calls(cpp, batch), _builtin_calls(default, batch)
    assert cpp_calls["inductor_entry_cpp"] == 1 and cpp_calls["assert_size_stride"] == 0
    assert python_calls["inductor_entry_cpp"] == 0 and python_calls["assert_size_stride"] > 0

"""The CPU runner's program calls its kernels from inductor's C++ wrapper by
default, from the Python wrapper when asked or when the C++ one cannot be
built (warned), and gives the eager forward's outputs either way."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from graphrunner import CpuGraphRunner, decode_buffer_specs
from graphrunner.mechanisms import InductorCapture
from graphrunner.mechanisms.inductor import CPU_INDUCTOR_DEFAULTS
from graphrunner.testing import ToyWorld


def _runner(world: ToyWorld, options: Mapping[str, Any] | None) -> CpuGraphRunner:
    runner = CpuGraphRunner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[4],
        show_progress=False,
        inductor_options=options,
    )
    runner.capture()
    return runner


def _builtin_calls(runner: CpuGraphRunner, batch: object) -> Counter[str]:
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


def test_the_default_program_calls_its_kernels_from_cpp_with_the_eager_outputs():
    world = ToyWorld()
    default = _runner(world, None)
    python = _runner(world, {"cpp_wrapper": False})
    assert isinstance(default.mechanism, InductorCapture)
    assert (default.mechanism.wrapper, python.mechanism.wrapper) == ("c++", "python")
    assert default.direct_fallbacks == python.direct_fallbacks == 0
    for raw_bs in (1, 3, 4):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        torch.testing.assert_close(default.replay(batch), expected)
        torch.testing.assert_close(python.replay(batch), expected)
    batch = world.make_batch(3, seed=7)
    cpp_calls, python_calls = _builtin_calls(default, batch), _builtin_calls(python, batch)
    assert cpp_calls["inductor_entry_cpp"] == 1 and cpp_calls["assert_size_stride"] == 0
    assert python_calls["inductor_entry_cpp"] == 0 and python_calls["assert_size_stride"] > 0


def test_a_cpp_wrapper_that_cannot_be_built_leaves_the_python_one_warned(
    monkeypatch: pytest.MonkeyPatch,
):
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx

    def no_cpp_wrapper(gm: Any, inputs: Any, config_patches: Any = None, **kw: Any) -> Any:
        if (config_patches or {}).get("cpp_wrapper"):
            raise RuntimeError("no C++ compiler for the wrapper")
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", no_cpp_wrapper)
    world = ToyWorld()
    with pytest.warns(RuntimeWarning, match="cpp_wrapper.*no C\\+\\+ compiler for the wrapper"):
        runner = _runner(world, None)
    assert runner.mechanism.wrapper == "python"
    batch = world.make_batch(3, seed=3)
    expected, _ = world.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), expected)
    # Asked for by name, the C++ wrapper's failure is the caller's to see.
    with pytest.raises(Exception, match="no C\\+\\+ compiler for the wrapper"):
        _runner(ToyWorld(), {"cpp_wrapper": True})


def test_the_defaults_are_what_the_runner_compiles_with():
    mechanism = InductorCapture()
    assert all(mechanism.compiler.patches[k] == v for k, v in CPU_INDUCTOR_DEFAULTS.items())
    assert InductorCapture(inductor_options={"cpp_wrapper": False}).wrapper == "python"

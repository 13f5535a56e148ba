"""The compile step shared by the CPU runner and the CUDA runner's
``compile=True``: one ``torch.compile(dynamic=False)`` per size, each on its
own code object, with a backend that records the inductor program it made.

A distinct code object per size keeps dynamo's per-code recompile limit out
of the way: with one shared code object, every size past the limit would
silently run eagerly. The recorded program can then be called directly on
the tensors it was compiled for, skipping dynamo's frame evaluation and
guards: sound for the reason a graph replay is, since the inputs are the
static buffers and the model's own tensors at fixed addresses and shapes,
and the forward must be a pure tensor program (as graphs require too).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphrunner.declare.buffers import BufferView
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.util.warn import warn_at_caller

__all__ = ["CUDAGRAPH_OPTION", "SizeCompiler", "inductor_patches"]

#: The inductor option that makes inductor capture CUDA graphs of its own.
CUDAGRAPH_OPTION = "triton.cudagraphs"

_Program = tuple[Callable[..., Sequence[torch.Tensor]], list[torch.Tensor]]


def inductor_patches(mode: str | None, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Inductor config patches for ``mode`` plus ``options``, with inductor's
    own CUDA graphs refused: graphrunner captures the graph itself, and a
    graph captured over inductor's graphs is unsound (an illegal memory access
    on replay)."""
    from torch._inductor import list_mode_options

    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"compile_mode={mode!r}; expected a str or None")
    try:
        patches = dict(list_mode_options(mode)) if mode else {}
    except RuntimeError as e:  # inductor names the known modes
        raise ValueError(f"compile_mode={mode!r}: {e}") from None
    if patches.get(CUDAGRAPH_OPTION):
        raise ValueError(
            f"compile_mode={mode!r} turns on inductor's own CUDA graphs, which must never be "
            f"captured inside graphrunner's; use 'default' or 'max-autotune-no-cudagraphs'"
        )
    user = dict(options or {})
    if user.get(CUDAGRAPH_OPTION):
        raise ValueError(
            f"inductor_options[{CUDAGRAPH_OPTION!r}]=True turns on inductor's own CUDA "
            f"graphs, which must never be captured inside graphrunner's"
        )
    return {**patches, **user, CUDAGRAPH_OPTION: False}


def _step(forward: Any, view: BufferView) -> Outputs:
    return forward(view)


def _fresh_step(bs: int) -> types.FunctionType:
    # A distinct code object per size (see the module doc), named in profiles.
    code = _step.__code__.replace(co_name=f"graphrunner_step_bs{bs}")
    return types.FunctionType(code, _step.__globals__, code.co_name)


def _identical(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where the other has NaN: padded rows
    may compute NaN (e.g. the log of a padded position) on both paths."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if torch.equal(x, y):
        return True
    return x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))


class SizeCompiler:
    """Compiles a forward once per size with inductor and keeps each size's
    program with the tensors it was compiled for.

    Args:
        patches: inductor config patches (see :func:`inductor_patches`).
    """

    def __init__(self, patches: Mapping[str, Any]) -> None:
        self.patches = dict(patches)
        self._programs: dict[int, list[_Program]] = {}
        #: Sizes launched through dynamo because their program cannot be called directly.
        self.direct_fallbacks = 0

    def _recording_backend(self, bs: int) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            compiled = compile_fx(gm, example_inputs, config_patches=self.patches)
            if not callable(compiled):  # compile_fx's union also covers AOT artefacts
                raise TypeError(f"inductor returned {type(compiled).__name__}, not a callable")
            self._programs.setdefault(bs, []).append((compiled, list(example_inputs)))
            return compiled

        return backend

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        """The dynamo-compiled step of size ``bs``; compiles on its first call."""
        compiled = torch.compile(
            _fresh_step(bs), backend=self._recording_backend(bs), dynamic=False
        )
        return lambda: compiled(forward, view)

    def programs(self, bs: int) -> int:
        return len(self._programs.get(bs, []))

    def launcher(self, bs: int, fn: Launcher) -> Launcher:
        """Size ``bs``'s program called directly; where that cannot be, ``fn``
        (the dynamo path), counted in :attr:`direct_fallbacks` and warned once."""
        direct = self._direct(bs, fn)
        if direct is not None:
            return direct
        self.direct_fallbacks += 1
        if self.direct_fallbacks == 1:
            warn_at_caller(
                f"size {bs}: the compiled program cannot be called directly (graph break, "
                f"or outputs not reproduced); running it through dynamo, with its guard "
                f"cost (counted in runner.direct_fallbacks, warned once)"
            )
        return fn

    def _direct(self, bs: int, fn: Launcher) -> Launcher | None:
        """A launcher calling size ``bs``'s one program directly, or None where
        there is not exactly one (a graph break, or nothing compiled) or its
        outputs differ from ``fn``'s (the dynamo path)."""
        programs = self._programs.get(bs, [])
        if len(programs) != 1:
            return None
        program, inputs = programs[0]
        expected, spec = pytree.tree_flatten(fn())
        got = list(program(*inputs))
        if not _same(expected, got):
            return None
        if spec == pytree.tree_flatten(torch.empty(0))[1]:  # a single tensor: skip pytree
            return lambda: program(*inputs)[0]
        return lambda: pytree.tree_unflatten(list(program(*inputs)), spec)

    def drop(self) -> None:
        self._programs.clear()
        self.direct_fallbacks = 0  # a retried capture counts (and warns) afresh

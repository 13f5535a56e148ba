"""The CPU runner: one ``torch.compile(dynamic=False)`` program per size.

On CPU there is no graph to replay; a compiled, shape-specialised program over
the static buffers plays that part, and padding lets any batch up to the
largest size run where an exact size would otherwise be required.

Replay calls the compiled program directly on the tensors it was compiled
for, skipping dynamo's frame evaluation and guards (over a third of a small
step's host time). That is sound for the same reason a CUDA graph replay is:
the inputs are the static buffers and the model's own tensors, at fixed
addresses and shapes, and the forward must be a pure tensor program (no
Python side effects), as CUDA graphs require too. A size whose program cannot
be called directly (a graph break, or outputs that do not match the dynamo
path at capture) keeps the dynamo path, counted in ``direct_fallbacks`` and
warned once.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphrunner.buffers import BufferView
from graphrunner.runner import GraphRunner, Launcher, Outputs

__all__ = ["CpuGraphRunner"]

_Program = tuple[Callable[..., Sequence[torch.Tensor]], list[torch.Tensor]]


def _step(forward: Any, view: BufferView) -> Outputs:
    return forward(view)


def _fresh_step(bs: int) -> types.FunctionType:
    # Dynamo caches compiled code per code object and stops recompiling past
    # a limit; a distinct code object per size keeps every size compiled, and
    # names each one in profiles.
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


class CpuGraphRunner(GraphRunner):
    """Compiles the forward once per captured size with inductor; replays it padded.

    Keyword ``inductor_options`` are inductor config patches (as
    ``torch.compile(options=...)`` takes them).
    """

    kind = "cpu"

    def __init__(
        self, *args: Any, inductor_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.inductor_options = dict(inductor_options or {})
        self.direct_fallbacks = 0
        self._programs: dict[int, list[_Program]] = {}

    def _drop_captures(self) -> None:
        super()._drop_captures()
        self._programs.clear()
        self.direct_fallbacks = 0  # a retried capture counts (and warns) afresh

    def _recording_backend(self, bs: int) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            compiled = compile_fx(gm, example_inputs, config_patches=self.inductor_options)
            if not callable(compiled):  # compile_fx's union also covers AOT artefacts
                raise TypeError(f"inductor returned {type(compiled).__name__}, not a callable")
            self._programs.setdefault(bs, []).append((compiled, list(example_inputs)))
            return compiled

        return backend

    def _step_fn(self, bs: int, view: BufferView) -> Launcher:
        compiled = torch.compile(
            _fresh_step(bs), backend=self._recording_backend(bs), dynamic=False
        )
        forward = self.forward
        return lambda: compiled(forward, view)

    def _capture(self, bs: int, fn: Launcher) -> Launcher:
        direct = self._direct_launcher(bs, fn)
        if direct is not None:
            return direct
        self.direct_fallbacks += 1
        if self.direct_fallbacks == 1:
            warnings.warn(
                f"size {bs}: the compiled program cannot be called directly (graph break or "
                f"outputs not reproduced); replaying through dynamo, with its guard cost "
                f"(counted in runner.direct_fallbacks, warned once)",
                RuntimeWarning,
                # the caller of runner.capture(): through GraphRunner.capture,
                # capture_graphs, _capture_one and this method
                stacklevel=5,
            )
        return fn

    def _direct_launcher(self, bs: int, fn: Launcher) -> Launcher | None:
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

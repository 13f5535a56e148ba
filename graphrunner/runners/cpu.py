"""The CPU runner: one ``torch.compile(dynamic=False)`` callable per size.

On CPU there is no graph to replay; a compiled, shape-specialised callable
over the static buffers plays that part. Padding makes any batch up to the
largest size run, where an exact size would otherwise be required.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from graphrunner.buffers import BufferView
from graphrunner.runner import GraphRunner, Launcher, Outputs

__all__ = ["CpuGraphRunner"]


def _step(forward: Any, view: BufferView) -> Outputs:
    return forward(view)


def _fresh_step(bs: int) -> types.FunctionType:
    # Dynamo caches compiled code per code object and stops recompiling past
    # a limit; a distinct code object per size keeps every size compiled, and
    # names each one in profiles.
    code = _step.__code__.replace(co_name=f"graphrunner_step_bs{bs}")
    return types.FunctionType(code, _step.__globals__, code.co_name)


class CpuGraphRunner(GraphRunner):
    """Compiles the forward once per captured size; replays it padded.

    Keyword ``compile_options`` go to :func:`torch.compile` (``dynamic`` is
    always False: each size is its own static program).
    """

    kind = "cpu"

    def __init__(self, *args: Any, compile_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.compile_options = dict(compile_options or {})
        self.compile_options["dynamic"] = False

    def _step_fn(self, bs: int, view: BufferView) -> Launcher:
        compiled = torch.compile(_fresh_step(bs), **self.compile_options)
        forward = self.forward
        return lambda: compiled(forward, view)

    def _capture(self, bs: int, fn: Launcher) -> Launcher:
        # The warm-up runs compiled it; the compiled callable is the "graph".
        return fn

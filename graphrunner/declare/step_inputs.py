"""What the replay path and a forward see of a step's inputs, as protocols.

:class:`ReplayInputs` is what :meth:`graphrunner.GraphRunner.replay` takes:
any object with a host-side int ``batch_size`` whose declared buffers are
tensor attributes (a decode batch, a speculative batch, an engine's own
object). Which attributes it carries is declared by the runner's buffer
specs, not by a type: the replay path reads them by name and checks them
(:func:`graphrunner.writers.base.check_sources`).

:class:`StepTensors` is what a forward reads: named tensors, one per declared
buffer (a :class:`~graphrunner.declare.buffers.BufferView` at capture and
replay, the checked live batch on the eager path).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from graphrunner.declare.buffers import BufferView

__all__ = ["ReplayInputs", "StepTensors", "view_tensors"]


class ReplayInputs(Protocol):
    """One step's inputs: ``batch_size`` live requests (a host int, never
    read from the device), and one tensor attribute per declared buffer, of
    ``batch_size * rows_per_request`` rows."""

    @property
    def batch_size(self) -> int:
        """Live requests in the step."""
        ...


class StepTensors(Protocol):
    """Named tensors a forward reads: ``inputs.<buffer name>`` is that
    buffer's rows (``[bs * rows_per_request, *extra_shape]``)."""

    def __getattr__(self, name: str) -> torch.Tensor: ...


def view_tensors(view: BufferView) -> StepTensors:
    """``view`` typed as a forward reads it: a :class:`BufferView`'s
    attributes are its buffers' tensors by name (set from its mapping, so
    the type checker cannot see them)."""
    return cast(StepTensors, view)

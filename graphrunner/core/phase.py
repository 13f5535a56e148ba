"""A phase as a value: what a runner captures (buffers, outputs, forward,
backend hooks, tokens per row), independent of how (the mechanism). A phase
and a mechanism make a runner (:func:`graphrunner.create_runner`)."""

from __future__ import annotations

from dataclasses import dataclass

from graphrunner.declare.buffers import BufferSpec, check_width
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["Phase"]


@dataclass(frozen=True, slots=True)
class Phase:
    """What is captured, independent of how (the mechanism).

    Args:
        name: the phase's name (``decode``, ``verify``, ``eagle_extend``, ...).
        forward: the step, called with the buffers' view (the phase's inputs).
        specs: its static buffers, derived from
            :data:`graphrunner.declare.decode.DECODE_FIELDS` plus its extras.
        outputs: its declared outputs (None: one row per request on axis 0).
        backend: the attention backend's hooks (None: none needed).
        width: tokens per request of its per-token buffers (``W``), or None
            for a one-token step; a batch of another width runs eagerly.
    """

    name: str
    forward: ForwardFn
    specs: tuple[BufferSpec, ...]
    outputs: OutputsDecl | None = None
    backend: BaseGraphBackend | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if self.width is not None:
            check_width("width", self.width)

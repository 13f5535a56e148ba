"""A phase as a value: what a runner captures (buffers, outputs, forward,
backend hooks, tokens per row), independent of how (the mechanism). A phase
and a mechanism make a runner (:func:`graphrunner.create_runner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphrunner.declare.buffers import Axis, BufferSpec, check_width
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn

if TYPE_CHECKING:
    from graphrunner.sampling.penalties import TokenCounts

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
        max_requests: a token batch's most requests in one step (the size of
            its request axis; its sizes count tokens), None for a phase whose
            buffers all count requests.
        steps: decode steps one launch runs (a multi-step phase's N), 1 for
            every other phase.
        end_token: the token that stops a row inside a multi-step launch
            (None: rows run every step), the engine's to match.
        token_counts: the per-request token counts a sampled step with
            penalties reads and records into (the engine resets a row at
            admission and counts the first token), None for a step without.
    """

    name: str
    forward: ForwardFn
    specs: tuple[BufferSpec, ...]
    outputs: OutputsDecl | None = None
    backend: BaseGraphBackend | None = None
    width: int | None = None
    max_requests: int | None = None
    steps: int = 1
    end_token: int | None = None
    token_counts: TokenCounts | None = None

    def __post_init__(self) -> None:
        if self.width is not None:
            check_width("width", self.width)
        token_axis = [s.name for s in self.specs if s.axis is Axis.TOKEN]
        if bool(token_axis) != (self.max_requests is not None):
            raise ValueError(
                f"phase {self.name!r}: buffers on the token axis {token_axis}, "
                f"max_requests={self.max_requests!r}; a token batch declares its most "
                f"requests per step, and only it"
            )
        if self.max_requests is not None:
            check_width("max_requests", self.max_requests)
            if self.width is not None:
                raise ValueError(f"phase {self.name!r}: a token batch has no width")

    @property
    def token_batch(self) -> bool:
        """Whether this phase pads two axes, tokens and requests (its sizes count tokens)."""
        return self.max_requests is not None

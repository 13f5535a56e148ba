"""A phase as a value: what a runner captures (buffers, outputs, forward,
backend hooks, tokens per row), composed with a mechanism by
:meth:`graphrunner.GraphRunner.from_phase`; and the inputs of a speculative step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from graphrunner.declare.buffers import BufferSpec, check_width
from graphrunner.declare.hooks import GraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["Phase", "PhaseArgs", "SpecBatch", "check_width"]


class PhaseArgs(TypedDict):
    """The :class:`~graphrunner.GraphRunner` arguments a :class:`Phase` fixes."""

    forward: ForwardFn
    specs: tuple[BufferSpec, ...]
    outputs: OutputsDecl | None
    backend: GraphBackend | None
    width: int | None


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
    backend: GraphBackend | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if self.width is not None:
            check_width("width", self.width)

    def runner_args(self) -> PhaseArgs:
        """The runner arguments this phase fixes (the mechanism's are the caller's)."""
        return PhaseArgs(
            forward=self.forward,
            specs=self.specs,
            outputs=self.outputs,
            backend=self.backend,
            width=self.width,
        )


class SpecBatch:
    """The inputs of a speculative step: named device tensors plus the host
    mirrors ``req_pool_indices_cpu`` and ``seq_lens_cpu`` (CPU int64 ``[bs]``).

    ``batch_size`` comes from the host mirror (never a device read).
    """

    def __init__(
        self,
        *,
        req_pool_indices_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        **tensors: torch.Tensor,
    ) -> None:
        self.req_pool_indices_cpu = req_pool_indices_cpu
        self.seq_lens_cpu = seq_lens_cpu
        self.__dict__.update(tensors)

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices_cpu.shape[0])

    if TYPE_CHECKING:  # its named tensors, as the phase input protocols see them

        def __getattr__(self, name: str) -> torch.Tensor: ...

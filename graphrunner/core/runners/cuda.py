"""The CUDA runner: a :class:`GraphRunner` over :class:`CudaGraphCapture`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.mechanisms import CudaGraphCapture
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["CudaGraphRunner"]


class CudaGraphRunner(GraphRunner):
    """One CUDA graph per size, captured largest first on a side stream into
    one shared memory pool; replay returns views of the graph's static outputs.

    Args:
        forward, specs: as :class:`GraphRunner`; ``device`` defaults to ``"cuda"``.
        compile: capture an inductor-compiled forward (one program per size,
            compiled in warm-up, called directly inside the graph).
        compile_mode, inductor_options: inductor settings with ``compile=True``;
            those that turn on inductor's own CUDA graphs (``"reduce-overhead"``,
            ``"max-autotune"``, ``triton.cudagraphs``) are refused.
        dynamic_batch: with ``compile=True``, one program with a symbolic batch
            dimension for every size (default), or one per size (False).
        fullgraph: with ``compile=True``, refuse a graph break by name.
        populate: how a replay writes the buffers: ``"torch"`` (default),
            ``"fused"`` (one Triton launch) or ``"graph"`` (the launch inside
            each graph); see :class:`~graphrunner.mechanisms.CudaGraphCapture`.
        **kwargs: the other :class:`GraphRunner` arguments.
    """

    def __init__(
        self,
        forward: ForwardFn,
        specs: Sequence[BufferSpec],
        *,
        compile: bool = False,
        compile_mode: str | None = None,
        inductor_options: Mapping[str, Any] | None = None,
        populate: str = "torch",
        dynamic_batch: bool = True,
        fullgraph: bool = False,
        device: torch.device | str = "cuda",
        **kwargs: Any,
    ) -> None:
        mechanism = CudaGraphCapture(
            compile=compile,
            compile_mode=compile_mode,
            inductor_options=inductor_options,
            populate=populate,
            dynamic_batch=dynamic_batch,
            fullgraph=fullgraph,
        )
        super().__init__(forward, specs, device=device, mechanism=mechanism, **kwargs)
        self.mechanism: CudaGraphCapture = mechanism

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The captured graph of each size."""
        return self.mechanism.graphs

"""CUDA graphs: one ``torch.cuda.CUDAGraph`` per size, all in one memory pool,
optionally over an inductor-compiled forward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.declare.buffers import BufferView, StaticBuffers
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher

if TYPE_CHECKING:
    from graphrunner.writers.fused import InGraphPopulate

__all__ = ["POPULATE_MODES", "CudaGraphCapture", "pool_bytes"]

#: How a replay writes the static buffers: grouped torch ops (the reference),
#: one fused Triton launch outside the graph, or that launch captured inside
#: each graph (see :mod:`graphrunner.writers.fused`).
POPULATE_MODES = ("torch", "fused", "graph")


def pool_bytes(segments: Sequence[Mapping[str, Any]], pool: tuple[int, int], device: int) -> int:
    """Bytes reserved by memory pool ``pool`` on ``device``, from the segments
    of ``torch.cuda.memory_snapshot()``.

    The pool itself is measured, not free device memory: ``torch.cuda.graph``
    empties the allocator's cache on entry, so a free-memory delta around a
    capture counts that release too (and can come out negative).
    """
    return sum(
        int(s["total_size"])
        for s in segments
        if tuple(s.get("segment_pool_id", ())) == tuple(pool) and s.get("device") == device
    )


class CudaGraphCapture(CaptureMechanism):
    """Captures one CUDA graph per size on a side stream, all in one pool.

    Args:
        compile: capture an inductor-compiled forward, compiled during the
            first size's warm-up and called directly inside each graph.
        dynamic_batch: with ``compile=True``, one program with a symbolic
            batch dimension serves every size (True, the default); False
            compiles one shape-specialised program per size.
        fullgraph: with ``compile=True``, refuse a graph break by name
            (``UncapturableError``).
        compile_mode, inductor_options: as
            :class:`~graphrunner.mechanisms.inductor.InductorCapture`, with
            ``compile=True`` only; those that turn on inductor's own CUDA
            graphs are refused.
        populate: ``"torch"`` (default: grouped torch ops, the reference),
            ``"fused"`` (one Triton launch per replay, outside the graph) or
            ``"graph"`` (that launch captured inside each graph; a replay is
            one table copy plus the graph). ``"torch"`` is the default; the
            fused modes are opt-in (``docs/gpu.md``).

    Needs a CUDA device; on a CPU build of torch every graph and stream call
    raises, so construction fails early with a clear error instead.
    """

    kind = "cuda"

    def __init__(
        self,
        *,
        compile: bool = False,
        compile_mode: str | None = None,
        inductor_options: Mapping[str, Any] | None = None,
        populate: str = "torch",
        dynamic_batch: bool = True,
        fullgraph: bool = False,
    ) -> None:
        if populate not in POPULATE_MODES:
            raise ValueError(f"populate={populate!r}; expected one of {POPULATE_MODES}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaGraphRunner needs a CUDA device (torch.cuda.is_available() is False)"
            )
        if not isinstance(compile, bool):
            raise TypeError(f"compile={compile!r}; expected a bool")
        if not compile and (compile_mode is not None or inductor_options):
            raise ValueError(
                f"compile_mode={compile_mode!r}, inductor_options={inductor_options!r}: "
                f"they apply only with compile=True"
            )
        from graphrunner.mechanisms.compile import SizeCompiler, inductor_patches  # at first use

        patches = inductor_patches(compile_mode, inductor_options)
        self.compiler = (
            SizeCompiler(patches, dynamic=dynamic_batch, fullgraph=fullgraph) if compile else None
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._device = torch.device("cuda")
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), shared by every size
        self._stream: torch.cuda.Stream | None = None
        self.populate_mode = populate
        self._in_graph: InGraphPopulate | None = None
        self._capturing_bs = 0  # the size whose warm-ups and capture run now

    @property
    def label(self) -> str:
        return "cuda+compile" if self.compiler else "cuda"

    @property
    def direct_fallbacks(self) -> int:
        """Sizes whose graph records the dynamo path (compile only)."""
        return self.compiler.direct_fallbacks if self.compiler else 0

    @property
    def compilations(self) -> int:
        return self.compiler.compilations if self.compiler else 0

    @property
    def cache_hits(self) -> int:
        return self.compiler.cache_hits if self.compiler else 0

    def bind(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaGraphRunner buffers must be on a CUDA device, got {device}")
        self._device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)

    def bind_buffers(self, buffers: StaticBuffers) -> None:
        # The fused writers load only where asked for (their kernel module is large).
        from graphrunner.writers.fused import FusedPopulate, InGraphPopulate

        if buffers.two_axes and self.populate_mode != "torch":
            raise ValueError(
                f"populate={self.populate_mode!r} writes buffers of one axis; a token batch "
                f"(tokens and requests) takes populate='torch'"
            )
        if self.populate_mode == "fused":
            self.populate_writer = FusedPopulate(buffers)
        elif self.populate_mode == "graph":
            self.populate_writer = self._in_graph = InGraphPopulate(buffers)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            raise RuntimeError("CudaGraphCapture is not bound to a device (bind() first)")
        return self._stream

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        if self._in_graph is not None:
            # Warm-ups and the capture run the populate kernel on an all-padding table.
            self._in_graph.before_capture(bs)
            self._capturing_bs = bs
        if self.compiler is not None:
            return self.compiler.step_fn(bs, forward, view)
        tensors = view
        return lambda: forward(tensors)

    def warmup(self, fn: Launcher) -> Outputs:
        stream, current = self._side_stream(), torch.cuda.current_stream(self._device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            if self._in_graph is not None:
                self._in_graph.launch_captured(self._capturing_bs)  # compiled outside capture
            out = fn()
        current.wait_stream(stream)
        return out

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        target = fn
        if self.compiler is not None:
            with torch.cuda.stream(self._side_stream()):
                target = self.compiler.launcher(bs, fn)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self._device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream()):
            if self._in_graph is not None:
                self._in_graph.launch_captured(bs)  # populate inside the graph, ahead of it
            out = target()
        torch.cuda.synchronize(self._device)
        self.graphs[bs] = graph

        in_graph = self._in_graph

        def launch() -> Outputs:
            if in_graph is not None:
                in_graph.before_replay()
            graph.replay()
            return out

        return launch

    def drop(self) -> None:
        if self.compiler is not None:
            self.compiler.drop()
        self.graphs.clear()

    def memory_bytes(self) -> int | None:
        if self._pool is None:
            return None
        torch.cuda.synchronize(self._device)
        index = self._device.index if self._device.index is not None else 0
        return pool_bytes(torch.cuda.memory_snapshot(), self._pool, index)

    def programs(self, bs: int) -> int | None:
        return self.compiler.programs(bs) if self.compiler is not None else None

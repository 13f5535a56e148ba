"""The CUDA runner: ``torch.cuda.CUDAGraph`` per size, one shared memory pool."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.runner import GraphRunner, Launcher, Outputs

__all__ = ["CudaGraphRunner"]


class CudaGraphRunner(GraphRunner):
    """Captures one CUDA graph per size on a side stream, all in one pool.

    Needs a CUDA device; on a CPU build of torch every graph and stream call
    raises, so construction fails early with a clear error instead.
    """

    kind = "cuda"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaGraphRunner needs a CUDA device (torch.cuda.is_available() is False)"
            )
        kwargs.setdefault("device", "cuda")
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(f"CudaGraphRunner buffers must be on a CUDA device, got {self.device}")
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _warmup(self, fn: Launcher) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _capture(self, bs: int, fn: Launcher) -> Launcher:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            out = fn()
        torch.cuda.synchronize(self.device)
        self.graphs[bs] = graph

        def launch() -> Outputs:
            graph.replay()
            return out

        return launch

    def _drop_captures(self) -> None:
        super()._drop_captures()
        self.graphs.clear()

    def _memory_in_use(self) -> int | None:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

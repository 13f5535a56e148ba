"""The capture loop, shared by every runner."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from graphrunner import nvtx
from graphrunner.populate import populate
from graphrunner.report import CaptureReport, SizeReport

if TYPE_CHECKING:
    from graphrunner.runner import GraphRunner

__all__ = ["WARMUP_RUNS", "capture_graphs"]

#: Runs before capture so lazy initialisation (autotuning, compilation,
#: allocator growth) happens outside the graph.
WARMUP_RUNS = 2


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Collect once, then freeze what is alive, so the collections that still
    run during capture scan only what capture creates, not the whole heap.

    ``gc.unfreeze`` cannot tell our frozen objects from the application's: an
    application that froze its own heap before capture keeps everything frozen.
    """
    app_froze = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not app_froze:
            gc.unfreeze()


def _capture_one(runner: GraphRunner, bs: int) -> SizeReport:
    start, mem_before = time.perf_counter(), runner._memory_in_use()
    # Capture records an all-padding batch: every index points at slot 0.
    populate(runner.buffers, None, 0, bs)
    view = runner.buffers.view(bs)
    runner.backend.init_capture_metadata(bs, view)
    fn = runner._step_fn(bs, view)
    for _ in range(WARMUP_RUNS):
        runner._warmup(fn)
    runner._launchers[bs] = runner._capture(bs, fn)
    mem_after = runner._memory_in_use()
    memory = None if mem_before is None or mem_after is None else mem_after - mem_before
    return SizeReport(bs, time.perf_counter() - start, memory)


def capture_graphs(runner: GraphRunner) -> CaptureReport:
    """Capture every size of ``runner``, largest first.

    Largest first so that the shared memory pool is sized by the first graph
    and smaller ones reuse its blocks.
    """
    report = CaptureReport()
    runner.backend.init_graph_state(runner.max_bs)
    sizes = sorted(runner.capture_sizes, reverse=True)
    bar = tqdm(sizes, desc=f"capture ({runner.kind})", disable=not runner.show_progress)
    with bar, _frozen_gc(), torch.no_grad(), nvtx.range(f"capture {runner.kind}"):
        for bs in bar:
            bar.set_postfix(bs=bs)
            with nvtx.range(f"capture bs={bs}"):
                report.sizes.append(_capture_one(runner, bs))
    return report

"""The capture loop, shared by every runner and mechanism."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from graphrunner.declare.buffers import StaticBuffers
from graphrunner.declare.hooks import GraphBackend
from graphrunner.declare.outputs import OutputLayout
from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher
from graphrunner.sizing.report import CaptureReport, SizeReport
from graphrunner.util import nvtx
from graphrunner.writers.base import populate

__all__ = ["WARMUP_RUNS", "capture_all"]

#: Runs before a CUDA graph capture so lazy initialisation (autotuning,
#: compilation, allocator growth) happens outside the graph (a mechanism
#: says how many it needs: :attr:`CaptureMechanism.warmup_runs`).
WARMUP_RUNS = CaptureMechanism.warmup_runs


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


def _capture_one(
    bs: int,
    forward: ForwardFn,
    buffers: StaticBuffers,
    backend: GraphBackend,
    mechanism: CaptureMechanism,
    layout: OutputLayout,
) -> tuple[Launcher, SizeReport]:
    start = time.perf_counter()
    # Capture records an all-padding batch: every index points at slot 0.
    populate(buffers, None, 0, bs)
    view = buffers.view(bs)
    backend.init_capture_metadata(bs, view)
    fn = mechanism.step_fn(bs, forward, view)
    compile_seconds = 0.0
    for _ in range(mechanism.warmup_runs):
        compiled, warm_start = mechanism.compilations, time.perf_counter()
        # Outputs are checked on the first warm-up: a wrong declaration fails
        # before anything is captured (with none, on the capture's own run).
        layout.check(mechanism.warmup(fn), buffers.size_of(bs))
        if mechanism.compilations > compiled:  # this warm-up traced and compiled
            compile_seconds += time.perf_counter() - warm_start
    memory_before = mechanism.memory_bytes()
    compiled, capture_start = mechanism.compilations, time.perf_counter()
    launcher = mechanism.capture(bs, fn)
    if mechanism.compilations > compiled:  # a mechanism that compiles as it captures
        compile_seconds += time.perf_counter() - capture_start
    if not mechanism.warmup_runs:  # the outputs the capture computed, else one launch
        outputs = mechanism.captured_outputs()
        layout.check(launcher() if outputs is None else outputs, buffers.size_of(bs))
    memory_after = mechanism.memory_bytes()
    memory = None if memory_before is None or memory_after is None else memory_after - memory_before
    seconds = time.perf_counter() - start
    programs = mechanism.programs(bs)
    compile_s = None if programs is None else compile_seconds
    return launcher, SizeReport(bs, seconds, memory, programs, compile_s)


def capture_all(
    sizes: Sequence[int],
    forward: ForwardFn,
    buffers: StaticBuffers,
    backend: GraphBackend,
    mechanism: CaptureMechanism,
    layout: OutputLayout,
    *,
    show_progress: bool = True,
) -> tuple[dict[int, Launcher], CaptureReport]:
    """Capture every size, largest first; return each size's launcher and the report.

    Largest first so that the shared memory pool is sized by the first graph
    and smaller ones reuse its blocks. On failure the caller drops whatever
    the mechanism captured.
    """
    launchers: dict[int, Launcher] = {}
    report = CaptureReport()
    compiled, hits = mechanism.compilations, mechanism.cache_hits
    backend.init_graph_state(max(sizes))
    order = sorted(sizes, reverse=True)
    label = mechanism.label
    bar = tqdm(order, desc=f"capture ({label})", disable=not show_progress)
    heap = _frozen_gc() if mechanism.freezes_heap else contextlib.nullcontext()
    with bar, heap, torch.no_grad(), nvtx.range(f"capture {label}"):
        for bs in bar:
            bar.set_postfix(bs=bs)
            with nvtx.range(f"capture bs={bs}"):
                launchers[bs], size = _capture_one(bs, forward, buffers, backend, mechanism, layout)
            report.sizes.append(size)
    report.compilations = mechanism.compilations - compiled
    report.cache_hits = mechanism.cache_hits - hits
    return launchers, report

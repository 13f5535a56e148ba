"""The runners users know by name, and a factory by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.core.future_map import FutureMap
from graphrunner.core.phase import Phase
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners.cpu import CpuGraphRunner
from graphrunner.core.runners.cuda import CudaGraphRunner
from graphrunner.core.runners.eager import EagerRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.declare.state_ops import StateOps
from graphrunner.mechanisms import ForwardFn, check_mechanism_options
from graphrunner.sanitizer.padding import PaddingSanitizer

__all__ = [
    "RUNNERS",
    "CpuGraphRunner",
    "CudaGraphRunner",
    "EagerRunner",
    "best_runner_kind",
    "create_runner",
]

RUNNERS: dict[str, type[GraphRunner]] = {
    "cuda": CudaGraphRunner,
    "cpu": CpuGraphRunner,
    "eager": EagerRunner,
}


def best_runner_kind() -> str:
    """``"cuda"`` where a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def create_runner(
    kind: str,
    step: ForwardFn | Phase,
    specs: Sequence[BufferSpec] | None = None,
    *,
    device: torch.device | str | None = None,
    capture_sizes: Sequence[int] | None = None,
    max_bs: int | None = None,
    outputs: OutputsDecl | None = None,
    backend: BaseGraphBackend | None = None,
    width: int | None = None,
    sanitizer: PaddingSanitizer | None = None,
    future_map: FutureMap | None = None,
    state_ops: StateOps | None = None,
    show_progress: bool = True,
    compile: bool = False,
    compile_mode: str | None = None,
    inductor_options: Mapping[str, Any] | None = None,
    populate: str = "torch",
    dynamic_batch: bool = True,
    fullgraph: bool = False,
) -> GraphRunner:
    """A runner of ``kind`` (``"cuda"``, ``"cpu"`` or ``"eager"``: the mechanism)
    for ``step`` (what is captured). Not yet captured: call ``capture()``.

    Args:
        kind: the mechanism: CUDA graphs, inductor programs called directly,
            or eager (see :func:`best_runner_kind`).
        step: a :class:`~graphrunner.Phase` (its forward, buffers, outputs,
            backend and width), or a forward ``inputs -> outputs`` whose
            buffers ``specs`` declares.
        specs: the static buffers and their pad rules, with a forward only.
        device: where the buffers live; default ``"cuda"`` for ``kind="cuda"``,
            else ``"cpu"``.
        capture_sizes, max_bs: the batch sizes captured (default: powers of
            two and multiples of 8 up to ``max_bs``).
        outputs, backend, width: with a forward only (a phase carries them):
            the declared outputs, the attention backend's hooks, tokens per
            request.
        sanitizer: check every replay (a debug mode).
        future_map: ``input_ids`` may hold future references (overlap).
        state_ops: recorded state operations run before each launch.
        show_progress: a progress bar while capturing.
        compile, compile_mode, inductor_options, populate, dynamic_batch: the
            mechanism's options; ``compile``, ``populate`` for ``cuda`` only,
            the inductor settings for ``cuda`` (with ``compile``) and ``cpu``;
            ``dynamic_batch=False`` compiles one program per size instead of
            one for every size; ``fullgraph=True`` (``cpu``, ``cuda`` with
            ``compile``) refuses a forward with a graph break by name
            (``graphrunner.mechanisms.UncapturableError``).

    Raises:
        ValueError: an unknown ``kind``; a phase with ``specs``, ``outputs``,
            ``backend`` or ``width`` given too, or a forward without ``specs``.
        TypeError: a mechanism option ``kind`` does not take (named).
    """
    mechanism_options = _given_mechanism_options(
        compile=compile,
        compile_mode=compile_mode,
        inductor_options=inductor_options,
        populate=populate,
        dynamic_batch=dynamic_batch,
        fullgraph=fullgraph,
    )
    check_mechanism_options(kind, mechanism_options)
    phase = _as_phase(step, specs, outputs=outputs, backend=backend, width=width)
    return RUNNERS[kind](
        **phase.runner_args(),
        device=device if device is not None else ("cuda" if kind == "cuda" else "cpu"),
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        sanitizer=sanitizer,
        future_map=future_map,
        state_ops=state_ops,
        show_progress=show_progress,
        **mechanism_options,
    )


#: Each mechanism option's default: only options given otherwise reach a mechanism.
_MECHANISM_DEFAULTS: dict[str, Any] = {
    "compile": False,
    "compile_mode": None,
    "inductor_options": None,
    "populate": "torch",
    "dynamic_batch": True,
    "fullgraph": False,
}


def _given_mechanism_options(**options: Any) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not _MECHANISM_DEFAULTS[k]}


def _as_phase(
    step: ForwardFn | Phase,
    specs: Sequence[BufferSpec] | None,
    *,
    outputs: OutputsDecl | None,
    backend: BaseGraphBackend | None,
    width: int | None,
) -> Phase:
    if isinstance(step, Phase):
        given = {"specs": specs, "outputs": outputs, "backend": backend, "width": width}
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: a Phase carries its own ({step.name!r}); expected None with a phase"
                )
        return step
    if specs is None:
        raise ValueError("specs: a forward needs its buffers declared; expected a BufferSpec list")
    if not callable(step):
        raise TypeError(f"step must be a Phase or a callable forward, got {type(step).__name__}")
    return Phase("custom", step, tuple(specs), outputs=outputs, backend=backend, width=width)

"""``GraphRunner``: the base that owns the buffers, the sizes, capture and replay.

Subclasses say only how one size is compiled, captured and launched; the
buffers, populate, size policy, capture loop and replay path are shared.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from graphrunner.backend import GraphBackend, NullBackend
from graphrunner.buffers import BufferSpec, BufferView, PadRule, StaticBuffers
from graphrunner.report import CaptureReport, RunnerStats
from graphrunner.sizes import default_capture_sizes, pad_to, validate_capture_sizes

if TYPE_CHECKING:
    from graphrunner.sanitizer import PaddingSanitizer

__all__ = ["ForwardFn", "GraphRunner", "Launcher", "Outputs"]

Outputs = torch.Tensor | dict[str, torch.Tensor] | tuple[torch.Tensor, ...]
#: The model's step: reads named tensors (a BufferView, or a live batch for eager).
ForwardFn = Callable[[Any], Outputs]
#: Re-runs a captured size on the static buffers; returns its static outputs.
Launcher = Callable[[], Outputs]


def _resolve_sizes(capture_sizes: Sequence[int] | None, max_bs: int | None) -> list[int]:
    if capture_sizes is None:
        if max_bs is None:
            raise ValueError("give capture_sizes or max_bs")
        return default_capture_sizes(max_bs)
    sizes = validate_capture_sizes(capture_sizes)
    if max_bs is not None and max_bs != sizes[-1]:
        raise ValueError(f"max_bs={max_bs} disagrees with the largest capture size {sizes[-1]}")
    return sizes


def _check_fill_matches_backend(specs: Sequence[BufferSpec], backend: GraphBackend) -> None:
    # A seq_lens fill that differs from the backend's would send padded rows
    # somewhere the backend did not plan for.
    for spec in specs:
        is_seq_lens_fill = spec.name == "seq_lens" and spec.rule is PadRule.FILL
        if is_seq_lens_fill and spec.fill_value != backend.seq_len_fill_value:
            raise ValueError(
                f"seq_lens fill_value {spec.fill_value} differs from the backend's "
                f"seq_len_fill_value {backend.seq_len_fill_value}"
            )


class GraphRunner(abc.ABC):
    """Captures ``forward`` at fixed batch sizes; replays any smaller batch padded.

    Args:
        forward: the model's step; called with a :class:`BufferView` whose
            attributes are the declared buffers' first ``bs`` rows. Returns a
            tensor, a dict or a tuple of tensors whose first dim is ``bs`` (or
            ``bs * tokens_per_row``).
        specs: the static buffers and their pad rules, e.g.
            :func:`graphrunner.decode_buffer_specs`.
        device: where the buffers live.
        capture_sizes: sorted unique sizes to capture; default
            :func:`graphrunner.sizes.default_capture_sizes` of ``max_bs``.
        max_bs: the largest size (with the default sizes).
        backend: the attention backend's hooks (default: none needed).
        tokens_per_row: tokens per request in per-token buffers (1 for decode).
        sanitizer: a :class:`graphrunner.sanitizer.PaddingSanitizer` checking
            every replay (a debug mode), or None.
        show_progress: a progress bar during capture.
    """

    #: The name :func:`graphrunner.runners.create_runner` knows this runner by.
    kind: ClassVar[str]

    def __init__(
        self,
        forward: ForwardFn,
        specs: Sequence[BufferSpec],
        *,
        device: torch.device | str,
        capture_sizes: Sequence[int] | None = None,
        max_bs: int | None = None,
        backend: GraphBackend | None = None,
        tokens_per_row: int = 1,
        sanitizer: PaddingSanitizer | None = None,
        show_progress: bool = True,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if not specs:
            raise ValueError("specs must declare at least one static buffer")
        self.forward = forward
        self.backend: GraphBackend = backend if backend is not None else NullBackend()
        _check_fill_matches_backend(specs, self.backend)
        self._sizes = _resolve_sizes(capture_sizes, max_bs)
        self.buffers = StaticBuffers(specs, self._sizes[-1], device, tokens_per_row=tokens_per_row)
        self.sanitizer = sanitizer
        self.show_progress = show_progress
        self.stats = RunnerStats()
        self.capture_report: CaptureReport | None = None
        self._launchers: dict[int, Launcher] = {}
        self._warned_fallback = False

    @property
    def capture_sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def max_bs(self) -> int:
        return self._sizes[-1]

    @property
    def device(self) -> torch.device:
        return self.buffers.device

    @property
    def is_captured(self) -> bool:
        return len(self._launchers) == len(self._sizes)

    def graph_size_for(self, raw_bs: int) -> int:
        """The captured size a batch of ``raw_bs`` replays (BatchSizeError if none)."""
        return pad_to(self._sizes, raw_bs)

    def capture(self) -> CaptureReport:
        """Capture every size, largest first, sharing one memory pool.

        All or nothing: if any size fails, every size captured so far is
        dropped and the error propagates. Capturing twice is an error.
        """
        from graphrunner.capture import capture_graphs

        if self._launchers:
            raise RuntimeError(f"{type(self).__name__} is already captured; build a new runner")
        try:
            self.capture_report = capture_graphs(self)
        except BaseException:
            self._drop_captures()
            raise
        return self.capture_report

    def replay(self, inputs: Any) -> Outputs:
        """Run one step for ``inputs`` (a :class:`graphrunner.inputs.DecodeInputs`).

        Returns the outputs of the live rows: views ``[:raw_bs]`` into static
        memory that the next replay overwrites. Copy what must outlive it.

        A batch larger than the largest captured size runs the eager forward
        on the same checks (and sanitizer), warned once and counted in
        ``stats.eager_fallbacks``; a batch of no rows raises
        :class:`~graphrunner.sizes.BatchSizeError`. Runs under ``no_grad``.
        """
        from graphrunner.replay import replay

        return replay(self, inputs)

    # -- what a subclass decides ---------------------------------------------

    def _step_fn(self, bs: int, view: BufferView) -> Launcher:
        """The callable warmed up and captured for size ``bs``."""
        return lambda: self.forward(view)

    def _warmup(self, fn: Launcher) -> None:
        fn()

    @abc.abstractmethod
    def _capture(self, bs: int, fn: Launcher) -> Launcher:
        """Capture ``fn`` for size ``bs``; return what replays it."""

    def _drop_captures(self) -> None:
        """Forget every captured size (a subclass also frees what it holds)."""
        self._launchers.clear()

    def _memory_in_use(self) -> int | None:
        """Device bytes in use now, or None where it cannot be measured."""
        return None

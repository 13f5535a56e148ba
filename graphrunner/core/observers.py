"""The debug work around a replay, as one hook object: the padding sanitizer
and NVTX ranges watch the one step order of
:meth:`graphrunner.GraphRunner.replay`; they are not second copies of it.

Each replay asks the runner's :class:`StepHooks` which observer watches this
step (:meth:`StepHooks.start`: NVTX ranges only while a tool or a profiler
listens), then calls, in order: :meth:`~StepObserver.begin`, then (inputs
checked, state ops run) :meth:`~StepObserver.before_write` and
:meth:`~StepObserver.after_write` around populate, then (backend metadata
set) :meth:`~StepObserver.before_launch` and
:meth:`~StepObserver.after_launch` around the launch, and
:meth:`~StepObserver.end` always, last (also after an error). With nothing on,
the observer is :data:`NO_OBSERVER`, whose hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from graphrunner.declare.buffers import BufferSpec, Size, StaticBuffers
from graphrunner.declare.outputs import Outputs, poison_outputs
from graphrunner.sanitizer.captured import CapturedState
from graphrunner.sanitizer.padding import PaddingSanitizer, ReplayCheck
from graphrunner.sanitizer.reads import check_reads, unowned_rows
from graphrunner.util import nvtx

__all__ = ["NO_OBSERVER", "NvtxRanges", "SanitizedSteps", "StepHooks", "StepObserver"]


class StepObserver:
    """No-op hooks; an observer overrides those it needs."""

    #: Whether the inputs are checked in full on every replay (else once).
    full_checks = False

    def begin(self, kind: str, bs: Size) -> None:
        """A step starts: ``kind`` ``"replay"`` of captured size ``bs``, or
        ``"eager"`` of ``bs`` live rows."""

    def before_write(self, bs: Size) -> None:
        """Populate of a size-``bs`` graph is about to write the buffers."""

    def after_write(self) -> None:
        """Populate wrote the buffers."""

    def before_launch(
        self,
        buffers: StaticBuffers,
        inputs: object,
        raw_bs: Size,
        bs: Size | None,
        specs: Sequence[BufferSpec] | None = None,
    ) -> None:
        """The step is about to launch: ``bs`` the padded size, None for the
        eager path (no padded rows; ``specs`` the declarations its inputs follow)."""

    def after_launch(self, outputs: Outputs) -> None:
        """The launch returned the live rows' ``outputs``."""

    def end(self) -> None:
        """The step ended (returned or raised)."""


class NvtxRanges(StepObserver):
    """Named NVTX ranges (and torch profiler ranges): the step, populate, launch."""

    def __init__(self) -> None:
        self._open: list[object] = []

    def _push(self, name: str) -> None:
        scope = nvtx.range(name)
        scope.__enter__()
        self._open.append(scope)

    def _pop(self) -> None:
        self._open.pop().__exit__(None, None, None)  # type: ignore[attr-defined]

    def begin(self, kind: str, bs: Size) -> None:
        self._push(f"{kind} bs={bs}")

    def before_write(self, bs: Size) -> None:
        self._push(f"populate bs={bs}")

    def after_write(self) -> None:
        self._pop()

    def before_launch(
        self,
        buffers: StaticBuffers,
        inputs: object,
        raw_bs: Size,
        bs: Size | None,
        specs: Sequence[BufferSpec] | None = None,
    ) -> None:
        if bs is not None:
            self._push(f"launch bs={bs}")

    def after_launch(self, outputs: Outputs) -> None:
        if len(self._open) > 1:
            self._pop()

    def end(self) -> None:
        while self._open:  # balanced even when the step raised
            self._pop()


class SanitizedSteps(StepObserver):
    """The padding sanitizer around each step: inputs checked in full, tails,
    live indexes and guarded state checked before the launch, guarded state
    and finite outputs after it; the previous step's outputs poisoned, so one
    held past the next replay fails as an overwritten graph output would."""

    full_checks = True

    def __init__(
        self,
        sanitizer: PaddingSanitizer,
        captured: Callable[[], CapturedState | None] = lambda: None,
        relaunch: Callable[[Size, Size], Outputs] | None = None,
    ) -> None:
        self.sanitizer = sanitizer
        self._captured = captured
        self._relaunch = relaunch  # (raw_bs, bs) -> the graph's live outputs again
        self._check: ReplayCheck | None = None
        self._where: tuple[StaticBuffers, Size, Size] | None = None  # the padded launch's
        self._held: Outputs | None = None

    def begin(self, kind: str, bs: Size) -> None:
        state = self._captured()
        if state is not None:  # the tensors the captured forward reads are still its own
            state.check()

    def before_launch(
        self,
        buffers: StaticBuffers,
        inputs: object,
        raw_bs: Size,
        bs: Size | None,
        specs: Sequence[BufferSpec] | None = None,
    ) -> None:
        if bs is None:
            self._check = self.sanitizer.snapshot(inputs, raw_bs, specs=specs)
            self._where = None
        else:
            self._check = self.sanitizer.before_launch(buffers, inputs, raw_bs, bs)
            self._where = (buffers, raw_bs, bs)
        if self._held is not None:  # poison what the last step returned, not this step's inputs
            fields = [getattr(inputs, s.name, None) for s in buffers.specs]
            spare = [*buffers.tensors.values(), *(t for t in fields if isinstance(t, torch.Tensor))]
            poison_outputs(self._held, spare)

    def after_launch(self, outputs: Outputs) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.after_launch(outputs)
            where, relaunch_at = self._where, self._relaunch
            if relaunch_at is not None and where is not None and self.sanitizer.check_reads:
                buffers, raw_bs, bs = where

                def relaunch() -> Outputs:
                    return relaunch_at(raw_bs, bs)

                sanitizer = self.sanitizer
                table = None if sanitizer.req_pool is None else sanitizer.req_pool.req_to_token
                unowned = [unowned_rows(g, check.inputs, raw_bs, table) for g in sanitizer.guarded]
                check_reads(
                    sanitizer.guarded,
                    check.snapshots,
                    buffers,
                    raw_bs,
                    bs,
                    outputs,
                    relaunch,
                    vocab_size=sanitizer.vocab_size,
                    seed=sanitizer.stats.replays_checked,
                    unowned=unowned,
                )
        self._held = outputs

    def end(self) -> None:
        self._check = None


class _Both(StepObserver):
    """The sanitizer and NVTX ranges together."""

    full_checks = True

    def __init__(self, ranges: NvtxRanges, sanitized: SanitizedSteps) -> None:
        self.parts = (ranges, sanitized)

    def begin(self, kind: str, bs: Size) -> None:
        for part in self.parts:
            part.begin(kind, bs)

    def before_write(self, bs: Size) -> None:
        for part in self.parts:
            part.before_write(bs)

    def after_write(self) -> None:
        for part in self.parts:
            part.after_write()

    def before_launch(
        self,
        buffers: StaticBuffers,
        inputs: object,
        raw_bs: Size,
        bs: Size | None,
        specs: Sequence[BufferSpec] | None = None,
    ) -> None:
        for part in self.parts:
            part.before_launch(buffers, inputs, raw_bs, bs, specs)

    def after_launch(self, outputs: Outputs) -> None:
        for part in self.parts:
            part.after_launch(outputs)

    def end(self) -> None:
        for part in reversed(self.parts):
            part.end()


#: The observer of a step nobody watches: every hook a no-op.
NO_OBSERVER = StepObserver()


class StepHooks:
    """A runner's one hook object: its sanitizer's checks (with ``captured``,
    the runner's :class:`CapturedState` once captured, and ``relaunch``, which
    launches a captured size again for the read check) and NVTX ranges (while
    a tool or a torch profiler listens, :func:`graphrunner.util.nvtx.active`).

    :meth:`start` gives each step its observer: :data:`NO_OBSERVER` when
    neither is on."""

    def __init__(
        self,
        sanitizer: PaddingSanitizer | None,
        captured: Callable[[], CapturedState | None] = lambda: None,
        relaunch: Callable[[Size, Size], Outputs] | None = None,
    ) -> None:
        ranges = NvtxRanges()
        sanitized = None if sanitizer is None else SanitizedSteps(sanitizer, captured, relaunch)
        self.sanitizer = sanitizer
        self._unwatched: StepObserver = NO_OBSERVER if sanitized is None else sanitized
        self._watched: StepObserver = ranges if sanitized is None else _Both(ranges, sanitized)

    def start(self) -> StepObserver:
        """The observer of the step that starts now."""
        # nvtx.active() read inline (attributes, no call): this runs every
        # replay, and the call measured a few % of a lean replay's host time.
        switch = nvtx.SWITCH
        watched = switch.enabled and (
            switch.injected or torch.autograd.profiler._is_profiler_enabled
        )
        return self._watched if watched else self._unwatched

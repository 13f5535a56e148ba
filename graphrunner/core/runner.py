"""``GraphRunner``: a phase (buffers, outputs, forward) composed with a
capture mechanism (CUDA graphs, inductor programs, eager).

The runner owns the buffers, the size policy, the stats and the captured
launchers; :mod:`graphrunner.core.capture` and :mod:`graphrunner.core.replay` are the
two lifecycle steps it calls, and the mechanism says only how one size is
prepared, captured and launched.
"""

from __future__ import annotations

from threading import get_ident

import torch

from graphrunner.core.capture import capture_all
from graphrunner.core.input_check import InputGate
from graphrunner.core.observers import StepHooks, StepObserver
from graphrunner.core.options import RunnerOptions
from graphrunner.core.phase import Phase
from graphrunner.core.replay import Graph, NotCapturedError, batch_size_of, run_eager
from graphrunner.core.runner_setup import (
    check_fill_matches_backend,
    graph_table,
    resolve_sizes,
    token_count,
    token_field,
    width_field,
    width_reason,
)
from graphrunner.declare.buffers import Axis, Size, StaticBuffers, StepSize, units
from graphrunner.declare.hooks import GraphBackend, NullBackend, as_graph_backend
from graphrunner.declare.inputs import StepInputs
from graphrunner.declare.outputs import OutputLayout, Outputs
from graphrunner.declare.state_ops import check_state_ops, run_state_ops
from graphrunner.mechanisms import CaptureMechanism
from graphrunner.mechanisms.base import ForwardFn, Launcher, PopulateWriter
from graphrunner.sanitizer.captured import CapturedState
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.sizing.histogram import BatchSizeHistogram
from graphrunner.sizing.report import CaptureReport, RunnerStats
from graphrunner.sizing.sizes import pad_to
from graphrunner.util.exclusive import Exclusive
from graphrunner.util.warn import warn_at_caller
from graphrunner.writers.base import TorchWriter

__all__ = ["ForwardFn", "GraphRunner", "Launcher", "Outputs"]


class GraphRunner:
    """Captures a phase's forward at fixed batch sizes; replays any smaller
    batch padded. Build one with :func:`graphrunner.create_runner`.

    Args:
        phase: what is captured (:class:`~graphrunner.Phase`): the forward,
            called with a :class:`~graphrunner.BufferView` whose attributes
            are the declared buffers' rows for ``bs`` requests (a buffer of
            ``r`` rows per request shows ``bs * r``); the buffers and their
            pad rules; the declared outputs (checked at capture); the
            attention backend's hooks; the tokens per request.
        options: how (:class:`~graphrunner.core.RunnerOptions`): the
            mechanism, device, sizes, sanitizer, future map, state ops.
    """

    def __init__(self, phase: Phase, options: RunnerOptions) -> None:
        if not isinstance(phase, Phase):
            raise TypeError(f"phase={phase!r}; expected a graphrunner.Phase")
        if not callable(phase.forward):
            raise TypeError(f"forward must be callable, got {type(phase.forward).__name__}")
        if not phase.specs:
            raise ValueError("specs must declare at least one static buffer")
        specs, device = phase.specs, options.resolved_device
        self.phase = phase
        self.options = options
        self.forward = phase.forward
        self.mechanism: CaptureMechanism = options.mechanism()
        self.outputs = OutputLayout(phase.outputs)
        backend = NullBackend() if phase.backend is None else phase.backend
        if hasattr(backend, "seq_len_fill_value"):  # else refused as incomplete just below
            check_fill_matches_backend(specs, backend)
        self.backend: GraphBackend = as_graph_backend(backend)
        self._sizes = resolve_sizes(options.capture_sizes, options.max_bs, tokens=phase.token_batch)
        future_map = options.future_map
        tokens = None if future_map is None else future_map.tokens
        # A token batch's sizes count tokens; its request axis holds max_requests.
        top = self._sizes[-1]
        self.buffers = StaticBuffers(
            specs,
            phase.max_requests or top,
            device,
            future_tokens=tokens,
            max_tokens=top if phase.token_batch else None,
        )
        #: The token-axis buffer whose live rows count a token batch's tokens (None: one axis).
        self._token_field = token_field(specs) if phase.token_batch else None
        #: Checks each replay's inputs once (graphrunner.core.input_check).
        self.input_gate = InputGate(self.buffers)
        self.future_map = future_map
        self.mechanism.bind(self.buffers.device)
        self.mechanism.bind_buffers(self.buffers)
        #: Who writes the buffers at replay: the mechanism's writer, or the torch one.
        self.writer: PopulateWriter = self.mechanism.populate_writer or TorchWriter(self.buffers)
        self.captured_state: CapturedState | None = None
        self.sanitizer = options.sanitizer  # builds the observers of each replay
        self.show_progress = options.show_progress
        self.stats = RunnerStats()
        self.batch_sizes = BatchSizeHistogram()  # raw sizes served: graphs and eager
        self.capture_report: CaptureReport | None = None
        self._launchers: dict[int, Launcher] = {}
        self._graph_for: dict[int, Graph] = {}  # raw size -> the graph it replays
        self._warned_fallback = False
        self.state_ops = check_state_ops(options.state_ops)
        self.state_ops_run = 0  # state ops its pre-launch steps ran
        self.width = phase.width
        self._exclusive = Exclusive(f"{type(self).__name__}.replay")
        # The no-op backend plans nothing: its hook is not called.
        self._plans_metadata = type(self.backend) is not NullBackend
        # The buffer whose host-side rows tell a batch's width (first per-token one).
        self._width_field = None if self.width is None else width_field(specs, self.width)
        # A batch size alone does not pick the graph: check the width, or count tokens.
        self._slow_lookup = self._width_field is not None or self._token_field is not None

    @property
    def kind(self) -> str:
        """The runner kind (``cuda``, ``cpu``, ``eager``): its mechanism's."""
        return self.mechanism.kind

    @property
    def capture_sizes(self) -> list[int]:
        """The captured sizes: batch sizes, or a token batch's token counts."""
        return list(self._sizes)

    @property
    def max_bs(self) -> int:
        """The largest captured size (a token batch: its most tokens)."""
        return self._sizes[-1]

    @property
    def max_requests(self) -> int:
        """The most requests a captured step holds (a token batch: its
        phase's ``max_requests``; otherwise :attr:`max_bs`)."""
        return self.buffers.max_bs

    @property
    def device(self) -> torch.device:
        return self.buffers.device

    @property
    def is_captured(self) -> bool:
        return len(self._launchers) == len(self._sizes)

    @property
    def graph_keys(self) -> list[int]:
        """What each capture is keyed by, its batch size, sorted (empty
        before :meth:`capture`)."""
        return sorted(self._launchers)

    @property
    def direct_fallbacks(self) -> int:
        """Compiled sizes that run through dynamo, not their program called directly."""
        return self.mechanism.direct_fallbacks

    @property
    def compilations(self) -> int:
        """Inductor compilations this runner's mechanism ran (capture only:
        replays call the programs directly and never compile)."""
        return self.mechanism.compilations

    def graph_size_for(self, raw_bs: int) -> int:
        """The captured size a batch of ``raw_bs`` replays (BatchSizeError if none)."""
        return pad_to(self._sizes, raw_bs)

    def capture(self) -> CaptureReport:
        """Capture every size, largest first, sharing one memory pool.

        All or nothing: if any size fails, every size captured so far is
        dropped and the error propagates. Capturing twice is an error.
        """
        if self._launchers:
            raise RuntimeError(f"{type(self).__name__} is already captured; build a new runner")
        try:
            launchers, self.capture_report = capture_all(
                self._sizes,
                self.forward,
                self.buffers,
                self.backend,
                self.mechanism,
                self.outputs,
                show_progress=self.show_progress,
            )
        except BaseException:
            self._launchers = {}
            self.mechanism.drop()
            raise
        self._launchers, self._graph_for = (
            launchers,
            graph_table(launchers, self._sizes, self.buffers),
        )
        #: What the captured forward reads, checked under the sanitizer.
        self.captured_state = CapturedState(self.forward)
        return self.capture_report

    def replay(self, inputs: StepInputs) -> Outputs:
        """Run one step for ``inputs``: any object with the declared buffers as
        attributes, the host mirrors and a host-side int ``batch_size``
        (:class:`~graphrunner.StepInputs`, e.g. a :class:`DecodeBatch`).

        Returns the live rows' outputs, sliced by the declared outputs and valid
        until the next replay (CUDA: views of static memory; with a sanitizer
        every mechanism poisons them at the next replay): copy what must
        outlive the step. A batch above the largest size runs eagerly on the
        same checks, warned once and counted in ``stats.eager_fallbacks``; no
        rows is a :class:`~graphrunner.sizing.sizes.BatchSizeError`; before
        :meth:`capture`, a :class:`NotCapturedError`; a second thread inside,
        a :class:`~graphrunner.util.exclusive.ConcurrentUseError`. Runs
        without grad. The sanitizer and NVTX ranges watch it through one hook
        object (:mod:`graphrunner.core.observers`), a no-op when off.
        """
        grad = self._enter()  # one thread at a time (a second is refused, named), no grad
        hooks = self._hooks.start()  # the sanitizer and NVTX ranges: a no-op when off
        try:
            raw_bs: Size = getattr(inputs, "batch_size", None)  # type: ignore[assignment]
            graph: Graph = self._graph_for.get(raw_bs) if type(raw_bs) is int else None  # type: ignore[assignment]
            if graph is None or self._slow_lookup:
                raw_bs, graph, reason = self._eager_reason(inputs, raw_bs, graph)  # may raise
                if reason is not None:
                    return self._replay_eager(inputs, raw_bs, reason, hooks)
            bs = graph.bs
            hooks.begin("replay", bs)
            sources = self.input_gate.sources(inputs, raw_bs, self.backend, full=hooks.full_checks)
            self.pre_launch()  # the recorded state ops, on the forward's stream
            hooks.before_write(bs)
            ops = self.writer.write(sources, raw_bs, bs)  # the one populate
            hooks.after_write()
            if self._plans_metadata:
                self.backend.init_replay_metadata(bs, raw_bs, graph.view, inputs)
            hooks.before_launch(self.buffers, inputs, raw_bs, bs)
            out = self.outputs.live(graph.launcher(), raw_bs)
            hooks.after_launch(out)
            self._count(raw_bs, bs, ops)
            return out
        finally:
            self._leave(hooks, grad)

    def _enter(self) -> bool:
        """Take the replay lock (a second thread is refused, named) and switch
        grad off; whether grad was on (an engine's loop under no_grad pays no switch).
        ``Exclusive.enter``'s three lines, inlined: the call alone measured
        3% of a lean replay's host time (``bench.bench_replay_host --cpu``,
        whose goal, 0.5x the checked populate, it brought to the edge)."""
        exclusive = self._exclusive
        if not exclusive.lock.acquire(blocking=False):
            exclusive.refuse()
        exclusive.owner = get_ident()
        grad = torch.is_grad_enabled()
        if grad:
            torch.set_grad_enabled(False)
        return grad

    def _leave(self, hooks: StepObserver, grad: bool) -> None:
        hooks.end()
        if grad:
            torch.set_grad_enabled(True)
        self._exclusive.leave()

    def _count(self, raw_bs: Size, bs: Size, ops: int) -> None:
        if type(raw_bs) is not int:  # a token batch's stats and histogram count tokens
            raw_bs, bs = units(Axis.TOKEN, raw_bs), units(Axis.TOKEN, bs)
        self.stats.count_replay(raw_bs, bs, ops)  # type: ignore[arg-type]
        self.batch_sizes.add(raw_bs)

    def _relaunch_live(self, raw_bs: Size, bs: Size) -> Outputs:
        """Launch captured size ``bs`` again; its live rows' outputs (the
        sanitizer's read check)."""
        return self.outputs.live(self._launchers[units(Axis.TOKEN, bs)](), raw_bs)

    @property
    def sanitizer(self) -> PaddingSanitizer | None:
        """The padding sanitizer checking every replay, or None; settable
        (its observer is rebuilt)."""
        return self._hooks.sanitizer

    @sanitizer.setter
    def sanitizer(self, sanitizer: PaddingSanitizer | None) -> None:
        #: The sanitizer and NVTX ranges that observe each replay.
        self._hooks = StepHooks(sanitizer, lambda: self.captured_state, self._relaunch_live)

    def pre_launch(self) -> None:
        """The runner-owned pre-launch step: the recorded state ops, once per step."""
        if self.state_ops is not None:  # most runners record none
            self.state_ops_run += run_state_ops(self.state_ops)

    def relaunch(self, bs: int) -> Outputs:
        """Launch captured size ``bs`` again on the buffers as they are: no
        populate, no checks, no stats (for tests that prove a graph leaves its
        inputs unchanged, and for benchmarks of the launch alone)."""
        launcher = self._launchers.get(bs)
        if launcher is None:
            raise NotCapturedError(f"size {bs} is not captured (sizes {self._sizes})")
        with torch.no_grad():
            return launcher()

    def eager_reason(self, inputs: StepInputs, raw_bs: Size) -> str | None:
        """Why ``inputs`` cannot replay a captured graph (it then runs eagerly,
        counted and warned once), or None: a batch above the largest size, or
        one of another width than the captured one (host shapes only); a
        token batch above the largest token count or with more requests
        than the phase's ``max_requests``."""
        if isinstance(raw_bs, StepSize):
            if raw_bs.tokens > self.max_bs:
                return f"{raw_bs.tokens} tokens are above the largest captured size {self.max_bs}"
            if raw_bs.requests > self.max_requests:
                return (
                    f"{raw_bs.requests} requests are above the token batch's "
                    f"max_requests={self.max_requests}"
                )
            return None
        if raw_bs > self.max_bs:
            return f"batch size {raw_bs} is above the largest captured size {self.max_bs}"
        return width_reason(inputs, self._width_field, self.width, raw_bs)

    def _eager_reason(
        self, inputs: StepInputs, raw_bs: object, graph: Graph | None
    ) -> tuple[Size, Graph, str | None]:
        """The batch's size, checked (raises naming what is wrong), the graph
        it replays, and why it runs eagerly instead, or None (:meth:`eager_reason`)."""
        requests = batch_size_of(inputs)
        size: Size = requests
        if self._token_field is not None:
            size = StepSize(token_count(inputs, self._token_field, requests), requests)
            graph = self._graph_for.get(size.tokens)
        if graph is None and not self._graph_for:
            name = type(self).__name__
            raise NotCapturedError(f"{name} is not captured (batch of {size}); call capture()")
        return size, graph, self.eager_reason(inputs, size)  # type: ignore[return-value]

    def _replay_eager(
        self, inputs: StepInputs, raw_bs: Size, reason: str, observer: StepObserver
    ) -> Outputs:
        def warn_once() -> None:
            if not self._warned_fallback:
                self._warned_fallback = True
                warn_at_caller(
                    f"{reason}; running it eagerly "
                    f"(counted in runner.stats.eager_fallbacks, warned once)"
                )

        one_axis = units(Axis.REQUEST, raw_bs)
        same = width_reason(inputs, self._width_field, self.width, one_axis) is None
        out = run_eager(self, inputs, raw_bs, warn_once, observer, same_width=same)
        # Counted once it ran: a failed forward counts nothing (a token batch counts tokens).
        counted = units(Axis.TOKEN, raw_bs)
        self.stats.count_eager(counted)
        self.batch_sizes.add(counted)
        return out

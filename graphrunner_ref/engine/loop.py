"""A small engine loop: continuous batching over a request trace, every decode step
through a runner, optionally checked against the eager forward.

Per engine step (the plain schedule): admit the requests that have arrived
(while rows, request slots and KV room last), prefill each eagerly; run one
decode step of the running batch through the runner; sample greedily on the
device; read the step's tokens (and new KV slots) back to the host in ONE
``.tolist()``; retire finished requests (token budget or end token) via
``filter``, freeing their pool rows and KV pages; merge the prefilled ones in
for the next step. ``Engine(overlap=True)`` schedules step N+1 while step N
runs instead (:mod:`graphrunner_ref.engine.overlap_schedule`): the scheduling is a strategy
of the one engine, and the model kind is data of it (its registered
:class:`~graphrunner_ref.engine.registry.DecodeStep`).

KV is allocated in whole pages of ``bundle.page_size`` slots (1: one slot per
token). A prefill takes the prompt's pages, its tokens in the first slots in
order; a decode step gives a row a fresh page when its length is a multiple of
the page size, else the slot after its last token (see
:meth:`DecodeBatch.prepare_decode`). Each request owns the pages it was given
and frees them whole.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from graphrunner import DecodeBatch, GraphRunner
from graphrunner.declare import StepInputs
from graphrunner.phases import with_sampling
from graphrunner.pools import starts_page, whole_pages
from graphrunner.sampling import check_seed
from graphrunner.util import ChunkSafeCall, Exclusive
from graphrunner_ref.engine.admission import Admission, check_token_budget
from graphrunner_ref.engine.bundle import ServingBundle, create_decode_runner, decode_step
from graphrunner_ref.engine.check import CheckMode
from graphrunner_ref.engine.interrupts import deferred_interrupts
from graphrunner_ref.engine.multistep import check_multistep
from graphrunner_ref.engine.online import RequestSource
from graphrunner_ref.engine.policy import schedule_for
from graphrunner_ref.engine.ranks import rank0_admits, replay_size_check
from graphrunner_ref.engine.results import (
    AdmissionError,
    EngineResult,
    EngineStats,
    LiveRequest,
    Run,
)
from graphrunner_ref.engine.run_counts import RunnerCounts
from graphrunner_ref.engine.sampling import (
    SampledRows,
    StepOut,
    check_logprobs,
    check_step_out,
    first_logprobs,
    record_logprobs,
    step_logprobs,
    tokens_of,
)
from graphrunner_ref.engine.schedule import Schedule, SyncSchedule
from graphrunner_ref.engine.workload import Request

T = TypeVar("T")

__all__ = [
    "AdmissionError",
    "Engine",
    "EngineResult",
    "EngineStats",
    "Schedule",
    "SyncSchedule",
    "create_decode_runner",
]


class Engine:
    """Runs request traces on ``bundle``'s model with decode steps through ``runner``.

    Args:
        bundle: the model and its pools, of any registered kind
            (:mod:`graphrunner_ref.engine.registry`); a run frees everything
            it allocated, also when it raises.
        runner: a captured runner over the bundle's decode step (see
            :func:`~graphrunner_ref.engine.bundle.create_decode_runner`).
        check: run the eager forward on every decode step and compare (see
            :meth:`~graphrunner_ref.engine.check.CheckMode.replay`); counts go to
            ``stats``. Refused for a model with Mamba layers.
        end_token: a token that finishes its request (it is kept in the output).
        atol: tolerance on logits and KV values in check mode.
        on_finish: called with ``(rid, tokens)`` as each request finishes (text
            output streams through it); not for requests cut by ``max_steps``.
        on_token: called with ``(rid, token)`` as each token is recorded,
            before ``on_finish`` of the request's last.
        stop: called with ``(rid, tokens)`` after each recorded token; True
            finishes the request there (stop strings: the CLI's ``--stop``).
        overlap: schedule step N+1 on the host while step N runs
            (:class:`~graphrunner_ref.engine.overlap_schedule.OverlapSchedule`); the runner
            needs a future map, and check mode is not available with it.
        seed: the run seed: a request that samples without a seed of its own
            draws from :func:`~graphrunner.sampling.request_seed` of it and its
            id. With a runner built ``sampling=True`` every token (prefill's
            first too) is drawn by each request's
            :class:`~graphrunner.sampling.SamplingParams` (none: greedy);
            otherwise every request must be greedy.
        logprobs: N >= 1 collects each token's log-probability and the top N
            (``EngineResult.logprobs``); needs a runner built ``logprobs=N``.
        steps_per_launch: N in 1..8 decode steps per runner launch
            (:class:`~graphrunner_ref.engine.multistep.MultiStepSchedule`); the
            runner is built with the same N and end token (and ``logprobs``);
            ``check`` checks each launch (:meth:`~graphrunner_ref.engine.check.CheckMode.launch`);
            ``overlap`` prepares launch i+1 while launch i runs
            (:class:`~graphrunner_ref.engine.multistep_overlap.MultiStepOverlapSchedule`);
            ``max_steps`` counts a launch's N steps whole.
        max_num_batched_tokens: the tokens one engine step may process: the
            running requests' decode tokens first, then prompt chunks (a long
            prompt is prefilled over several steps, each chunk attending to
            the KV its earlier chunks wrote); None: each prompt whole in the
            step it is admitted. Native Llama and transformers bundles; a
            Mamba / hybrid one is refused by name.
        token_runner: a captured runner of the token-batch phase over the
            model (:func:`~graphrunner_ref.engine.bundle.create_token_runner`):
            each step's prompt chunks run through it as one padded step;
            None: each chunk eagerly, alone.

    ``decoder`` is the bundle's :class:`~graphrunner_ref.engine.bundle.DecodeStep`;
    ``admit``, ``decode``, ``replay``, ``advance``, ``record_token``, ``free``
    and ``join`` are the step operations a :class:`Schedule` composes.
    """

    def __init__(
        self,
        bundle: ServingBundle,
        runner: GraphRunner,
        *,
        check: bool = False,
        end_token: int | None = None,
        atol: float = 1e-4,
        on_finish: Callable[[int, list[int]], None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        stop: Callable[[int, list[int]], bool] | None = None,
        overlap: bool = False,
        seed: int = 0,
        logprobs: int = 0,
        steps_per_launch: int = 1,
        max_num_batched_tokens: int | None = None,
        token_runner: GraphRunner | None = None,
    ) -> None:
        self.seed = check_seed("seed", seed)
        steps = check_multistep(runner, steps_per_launch, end_token, overlap, check, logprobs)
        self.steps_per_launch = steps
        self.decoder = decode_step(bundle)
        if check and self.decoder.rerun_reason is not None:
            raise ValueError(
                f"check=True: {self.decoder.rerun_reason}; expected check=False for a model "
                "with Mamba layers"
            )
        if self.decoder.state_ops is not None and runner.state_ops is not self.decoder.state_ops:
            raise ValueError(
                "runner.state_ops is not the bundle's request pool: its recorded state ops "
                "would never run; build it with create_decode_runner"
            )
        if overlap and check:
            raise ValueError("check=True with overlap=True: expected one of them")
        self.bundle: ServingBundle = bundle
        self.runner = runner
        self.check, self.end_token, self.atol = check, end_token, atol
        self.on_finish, self.on_token, self.stop = on_finish, on_token, stop
        # A step's callbacks, called after its bookkeeping (_fire_callbacks).
        self._callbacks: list[Callable[[], object]] = []
        self.device = bundle.device
        # Two threads in one run would interleave on the same pools and batch.
        self._exclusive = Exclusive(f"{type(self).__name__}.run")
        self.sampling = SampledRows.declared_by(runner)
        self.sampling_rows = SampledRows(self.device)
        self.logprobs = check_logprobs(logprobs, self.sampling)
        self._rank_check = replay_size_check(bundle, runner)
        #: The engine's parts: admission, check mode (check=True) and schedule.
        budget = check_token_budget(bundle, max_num_batched_tokens)
        self.admitter = Admission(self, rank0_admits(bundle), budget, token_runner)
        self.check_mode = CheckMode(self) if check else None
        self.schedule: Schedule = schedule_for(runner, steps, overlap, self.check_mode)
        # A step's own frames (scheduler, populate) make many small calls too:
        # kept off a stack chunk's end as the programs' are, learnt across runs
        # (the schedule's step looked up at each call: it may be replaced).
        self._step = ChunkSafeCall(lambda run: self.schedule.step(self, run))
        self._sync: Callable[[], None] = (
            torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        )

    def run(
        self,
        trace: Sequence[Request],
        *,
        max_steps: int | None = None,
        progress: bool = False,
        source: RequestSource | None = None,
    ) -> EngineResult:
        """Serve ``trace`` until every request finishes or ``max_steps`` decode steps ran.

        ``source``: requests arriving while the run goes on
        (:class:`~graphrunner_ref.engine.online.RequestSource`, asked at every
        step boundary); the run then lasts until the source closes.

        Raises :class:`AdmissionError` when nothing is running and the next
        arrived request does not fit in the free request rows and KV pages
        (held outside this run): waiting would never end. A Ctrl-C raises its
        ``KeyboardInterrupt`` at the next step boundary (twice: at once), and
        the run frees every row and page it held
        (:mod:`~graphrunner_ref.engine.interrupts`).
        """
        with self._exclusive.held(), deferred_interrupts() as interrupted:
            return self._run(trace, max_steps, progress, interrupted, source)

    def _run(
        self,
        trace: Sequence[Request],
        max_steps: int | None,
        progress: bool,
        interrupted: Callable[[], None],
        source: RequestSource | None = None,
    ) -> EngineResult:
        self.admitter.validate(trace)
        run = Run(
            deque(sorted(trace, key=lambda r: (r.arrival_step, r.rid))),
            DecodeBatch.empty(self.device, self.bundle.max_context_len),
            {r.rid: [] for r in trace},
        )
        start = RunnerCounts.of(self.runner)
        self.schedule.begin(self, max_steps)
        try:
            with tqdm(total=max_steps, desc="decode", unit="step", disable=not progress) as bar:
                while _more(run, source) and (max_steps is None or run.stats.steps < max_steps):
                    if not run.live and not run.prefilling:  # idle: jump to the next arrival
                        run.clock = max(run.clock, run.pending[0].arrival_step)
                    begin = time.perf_counter()
                    bar.update(self._step(run))
                    run.stats.step_seconds += time.perf_counter() - begin
                    self._fire_callbacks()
                    run.clock += 1
                    interrupted()  # a Ctrl-C held since the step began raises here
            for req in run.live:  # cut by max_steps
                run.outputs[req.request.rid] = req.tokens
            interrupted()
        finally:  # on an error too: a failed run leaks no pool row or KV page
            self._callbacks = []
            for req in list(run.held.values()):
                self.free(run, req)
            self.schedule.end(self)
        RunnerCounts.of(self.runner).record_since(start, run.stats, self.steps_per_launch)
        return EngineResult(run.outputs, frozenset(run.finished), run.stats, run.logprobs)

    @property
    def admission(self) -> Callable[[int], int] | None:
        """The hook turning the count of arrived requests that fit into the
        count admitted (a sharded model's ranks admit rank 0's), or None."""
        return self.admitter.agree

    @admission.setter
    def admission(self, agree: Callable[[int], int] | None) -> None:
        self.admitter.agree = agree

    def kv_need(self, tokens: int) -> int:
        """KV slots that ``tokens`` tokens take: whole pages."""
        return whole_pages(tokens, self.bundle.page_size)

    def empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def admit(self, run: Run) -> list[tuple[LiveRequest, torch.Tensor]]:
        """Prefill arrived requests in order while they fit; returns each with
        its first token (a 0-d device tensor); see
        :class:`~graphrunner_ref.engine.admission.Admission`."""
        # Host time, no device sync (an overlapped schedule admits while the
        # last step runs): on a GPU, prefill's device work may be waited for
        # in the step's read back instead.
        begin = time.perf_counter()
        try:
            return self.admitter.admit(run)
        finally:
            run.stats.prefill_seconds += time.perf_counter() - begin

    def first_token(self, live: LiveRequest, logits: torch.Tensor) -> torch.Tensor:
        """Prefill's token from its last logits ``[vocab]`` (0-d, on device)."""
        token = self.sampling_rows.first_token(live, logits) if self.sampling else logits.argmax()
        if self.logprobs:
            live.logprobs.append(first_logprobs(logits, token, self.logprobs))
        return token

    def decode(
        self, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``live`` (row ``i`` is ``live[i]``); returns each
        row's token and new KV slot, on device."""
        batch.prepare_decode(self.bundle.req_pool, self.bundle.kv_alloc)
        try:
            if self.check_mode is not None:
                out = self.check_mode.replay(batch, stats, live)
            else:
                out, seconds = self.timed(lambda: self.replay(batch, live))
                stats.decode_seconds += seconds
            if self.logprobs:  # a read back of its own: only when asked
                record_logprobs(live, step_logprobs(out, self.logprobs))
        except BaseException:  # the step's fresh pages are no request's yet: free them here
            self._free_fresh_pages(batch)
            raise
        stats.steps += 1
        stats.launches += 1
        stats.decode_tokens += batch.batch_size
        stats.batch_sizes[batch.batch_size] = stats.batch_sizes.get(batch.batch_size, 0) + 1
        return tokens_of(out), batch.out_cache_loc

    def _free_fresh_pages(self, batch: DecodeBatch) -> None:
        """Free the pages :meth:`DecodeBatch.prepare_decode` just handed out: those of
        the rows that started a page (the others wrote inside a page they own)."""
        page = self.bundle.page_size
        first_slots = batch.out_cache_loc.tolist()  # a failure path: a read back is fine
        lens = (batch.seq_lens_cpu - 1).tolist()  # lengths before the step
        fresh = [
            s + o
            for s, n in zip(first_slots, lens, strict=True)
            if starts_page(n, page)
            for o in range(page)
        ]
        self.bundle.kv_alloc.free(fresh)

    def replay(self, batch: DecodeBatch, live: Sequence[LiveRequest] = ()) -> StepOut:
        """The runner's step on ``batch`` (``live[i]`` its row ``i``, whose
        sampling rows go with it when the runner samples)."""
        if self._rank_check is not None:
            self._rank_check(batch.batch_size)
        inputs = self.decoder.inputs(batch)
        if self.sampling:
            inputs = with_sampling(inputs, self.sampling_rows.of(live))
        return check_step_out(self.runner.replay(inputs))

    def launch(self, inputs: StepInputs) -> StepOut:
        """The runner's step on inputs a schedule built itself (a multi-step
        launch), its outputs checked."""
        return check_step_out(self.runner.replay(inputs))

    def timed(self, fn: Callable[[], T]) -> tuple[T, float]:
        self._sync()
        start = time.perf_counter()
        out = fn()
        self._sync()
        return out, time.perf_counter() - start

    def advance(self, run: Run, req: LiveRequest, token: int) -> bool:
        """Record ``token``; retire the request if it is done. Returns whether it was."""
        done = self.record_token(run, req, token)
        if done:
            self.free(run, req)
        return done

    def record_token(self, run: Run, req: LiveRequest, token: int) -> bool:
        """Append ``token``; when the budget or the end token is reached, record
        the request's output as finished. Returns whether it is done."""
        req.tokens.append(token)
        if self.on_token is not None:
            self._callbacks.append(functools.partial(self.on_token, req.request.rid, token))
        if (
            len(req.tokens) < req.request.max_new_tokens
            and token != self.end_token
            and not (self.stop is not None and self.stop(req.request.rid, req.tokens))
        ):
            return False
        run.outputs[req.request.rid] = req.tokens
        run.finished.add(req.request.rid)
        if self.on_finish is not None:
            self._callbacks.append(functools.partial(self.on_finish, req.request.rid, req.tokens))
        return True

    def _fire_callbacks(self) -> None:
        """The step's ``on_token`` / ``on_finish`` calls, in order, once its
        bookkeeping is done: one that raises (or a Ctrl-C inside it) leaves
        every request's rows and KV pages recorded, so the run frees them all."""
        callbacks, self._callbacks = self._callbacks, []
        for call in callbacks:
            call()

    def free(self, run: Run, req: LiveRequest) -> None:
        del run.held[req.request.rid]
        self.bundle.req_pool.free([req.req_index])
        self.bundle.kv_alloc.free(req.pages)

    def join(self, run: Run, joining: list[LiveRequest], first_ids: torch.Tensor) -> None:
        new = DecodeBatch.from_requests(
            [r.req_index for r in joining],
            [len(r.request.prompt) for r in joining],
            first_ids,
            device=self.device,
            max_context_len=self.bundle.max_context_len,
        )
        run.batch.merge(new)
        run.live.extend(joining)


def _more(run: Run, source: RequestSource | None) -> bool:
    """Whether ``run`` goes on: a request pending, prefilling or live (an
    online source adds its arrivals first, at this step boundary)."""
    if source is not None:
        source.feed(run)
    return bool(run.pending or run.live or run.prefilling)

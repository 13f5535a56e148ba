"""The engine: requests in, one step at a time, outputs out.

:class:`Engine` serves requests by continuous batching, every decode step
through a captured runner, optionally checked against the eager forward. Its
API is vLLM's ``LLMEngine`` and nano-vllm's: :meth:`Engine.add_request`,
:meth:`Engine.abort`, :meth:`Engine.step` (a list of
:class:`~graphrunner_ref.engine.results.RequestOutput`),
:meth:`Engine.has_unfinished` and :meth:`Engine.stats`. ``generate``, ``demo``
and the benches drive it through :meth:`Engine.run` (a whole trace, stepped);
``graphrunner serve``'s engine thread calls it directly.

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

import dataclasses
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
from graphrunner.pools import starts_page
from graphrunner.sampling import TOKEN_BITMASK, SamplingParams, check_seed
from graphrunner.util import ChunkSafeCall, Exclusive
from graphrunner_ref.engine.admission import Admission, check_token_budget, prefix_cache_of
from graphrunner_ref.engine.bundle import ServingBundle, create_decode_runner, decode_step
from graphrunner_ref.engine.check import CheckMode
from graphrunner_ref.engine.grammar import GrammarFactory
from graphrunner_ref.engine.interrupts import deferred_interrupts
from graphrunner_ref.engine.multistep import check_multistep
from graphrunner_ref.engine.policy import schedule_for
from graphrunner_ref.engine.ranks import rank0_admits, replay_size_check
from graphrunner_ref.engine.results import (
    AdmissionError,
    EngineResult,
    EngineStats,
    FinishReason,
    LiveRequest,
    RequestOutput,
    Run,
    TokenLogprobs,
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
    "RequestOutput",
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
        prefix_caching: share the KV of prompts' full pages between requests
            (the bundle's ``kv_alloc`` a
            :class:`~graphrunner.pools.CachedKVAllocator`): a request is
            admitted at its first uncached token, and its full pages serve
            later prompts once its prefill is whole (and its output's, once it
            finishes). Native Llama and transformers bundles; a Mamba /
            hybrid one is refused by name.
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
        prefix_caching: bool = False,
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
        # The open run (None: no request in flight) and the request API's books.
        self._run: Run | None = None
        self._counts = RunnerCounts.of(runner)  # the runner's counters when it opened
        self._out: dict[int, RequestOutput] = {}  # owed by step(), in the order of their events
        self._owner: dict[int, LiveRequest] = {}  # the request each owed output is of
        self._rids: set[int] = set()  # every request added and not yet finished
        self._aborted: set[int] = set()  # running requests to cut after their next token
        self._next_rid = 0
        self.device = bundle.device
        # Two threads in one run would interleave on the same pools and batch.
        self._exclusive = Exclusive(f"{type(self).__name__}.run")
        self.sampling = SampledRows.declared_by(runner)
        self.sampling_rows = SampledRows(
            self.device,
            runner.phase.token_counts,
            end_token,
            words=_bitmask_words(runner),
        )
        self.logprobs = check_logprobs(logprobs, self.sampling)
        self._rank_check = replay_size_check(bundle, runner)
        #: The engine's parts: admission, check mode (check=True) and schedule.
        budget = check_token_budget(bundle, max_num_batched_tokens)
        self.token_runner = token_runner
        self.prefix_cache = prefix_cache_of(bundle, prefix_caching)
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

    # -- the request API: add, abort, step ---------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        rid: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        grammar: GrammarFactory | None = None,
    ) -> int:
        """Queue a request for the next :meth:`step`; its id (``rid``, or the
        next free one). ``ignore_eos``: the end token does not finish it;
        ``stop_token_ids``: tokens that do, besides; ``min_tokens``: those end
        tokens are held back (never drawn) until it holds that many new
        tokens, inside the step (all three vLLM's); ``grammar``: a factory of
        its grammar's matchers (structured output: only the tokens the
        grammar allows, masked inside the step; the grammar's end finishes
        it; a runner built ``structured=True``). Checked
        here as a run checks its trace: ``ValueError`` or ``TypeError``
        naming the field, nothing queued."""
        with self._exclusive.held():
            run = self._open()
            rid = self._next_rid if rid is None else rid
            if rid in self._rids:
                raise ValueError(
                    f"add_request: rid={rid} is still in the engine; expected a new id"
                )
            request = Request(
                rid,
                tuple(prompt),
                max_new_tokens,
                run.clock,
                sampling,
                ignore_eos=ignore_eos,
                stop_token_ids=tuple(stop_token_ids),
                min_tokens=min_tokens,
                grammar=grammar,
            )
            self.admitter.validate([request])
            run.pending.append(request)
            self._rids.add(rid)
            self._next_rid = max(self._next_rid, rid + 1)
            return rid

    def abort(self, rid: int) -> None:
        """End request ``rid``: a waiting one at once, a running one after
        its next token (where every schedule frees a finished request's row
        and pages); its last output says ``"abort"``. An unknown or already
        finished id is ignored (it may have finished meanwhile)."""
        with self._exclusive.held():
            run = self._run
            if run is None or rid not in self._rids or rid in self._aborted:
                return
            waiting = [r for r in run.pending if r.rid == rid]
            if not waiting:
                self._aborted.add(rid)
                return
            run.pending.remove(waiting[0])
            self._out[rid] = RequestOutput(rid, finish_reason="abort")

    def step(self) -> list[RequestOutput]:
        """One engine step (admission, prompt chunks, a decode step or launch,
        retirements) over what :meth:`add_request` queued; what it gave each
        request, in the order they got it. A finished request leaves the
        engine with its last output. Nothing to run: only the outputs still
        owed (an abort of a waiting request). A Ctrl-C waits for the step's
        end; its outputs then come with the next call."""
        with self._exclusive.held(), deferred_interrupts() as interrupted:
            run = self._open()
            if _busy(run):
                self._advance(run)
            interrupted()
            return self._drain(run)

    def has_unfinished(self) -> bool:
        """Whether a request is waiting, prefilling or running, or an output
        is still owed by :meth:`step`."""
        run = self._run
        return run is not None and (_busy(run) or bool(self._out))

    def running(self) -> int:
        """Requests admitted and not finished: prefilling or decoding."""
        run = self._run
        return 0 if run is None else len(run.live) + len(run.prefilling)

    def stats(self) -> EngineStats:
        """What the engine did since the first request was added (or the
        last :meth:`close`)."""
        run = self._run
        if run is None:
            return EngineStats()
        stats = dataclasses.replace(run.stats, batch_sizes=dict(run.stats.batch_sizes))
        RunnerCounts.of(self.runner).record_since(self._counts, stats, self.steps_per_launch)
        return stats

    def close(self) -> None:
        """Drop every request, free every row and page they hold and what the
        schedule prepared; the engine is empty again. Safe after a failed
        :meth:`step` (whose requests it frees)."""
        with self._exclusive.held():
            self._close()

    def run(
        self,
        trace: Sequence[Request],
        *,
        max_steps: int | None = None,
        progress: bool = False,
    ) -> EngineResult:
        """Serve ``trace`` until every request finishes or ``max_steps`` decode
        steps ran: the request API driven over a whole trace (each request
        added at its ``arrival_step``), its outputs gathered.

        Raises :class:`AdmissionError` when nothing is running and the next
        arrived request does not fit in the free request rows and KV pages
        (held outside this run): waiting would never end. A Ctrl-C raises its
        ``KeyboardInterrupt`` at the next step boundary (twice: at once), and
        the run frees every row and page it held
        (:mod:`~graphrunner_ref.engine.interrupts`).
        """
        with self._exclusive.held(), deferred_interrupts() as interrupted:
            if self._rids or self._out:
                raise RuntimeError(
                    f"Engine.run: {len(self._rids)} requests added by add_request are open; "
                    "expected them finished, or close() first"
                )
            self.admitter.validate(trace)
            self._close()  # a fresh run: its own stats
            return self._run_trace(trace, max_steps, progress, interrupted)

    def _run_trace(
        self,
        trace: Sequence[Request],
        max_steps: int | None,
        progress: bool,
        interrupted: Callable[[], None],
    ) -> EngineResult:
        run = self._open(max_steps)
        run.pending.extend(sorted(trace, key=lambda r: (r.arrival_step, r.rid)))
        self._rids.update(r.rid for r in trace)
        outputs: dict[int, list[int]] = {r.rid: [] for r in trace}
        logprobs: dict[int, list[TokenLogprobs]] = {}
        finished: set[int] = set()
        try:
            with tqdm(total=max_steps, desc="decode", unit="step", disable=not progress) as bar:
                while _busy(run) and (max_steps is None or run.stats.steps < max_steps):
                    bar.update(self._advance(run))
                    for out in self._drain(run):
                        outputs[out.rid].extend(out.tokens)
                        if self.logprobs:
                            logprobs.setdefault(out.rid, []).extend(out.logprobs)
                        if out.finished:
                            finished.add(out.rid)
                    interrupted()  # a Ctrl-C held since the step began raises here
            for req in run.live:  # cut by max_steps
                outputs[req.request.rid] = req.tokens
                if self.logprobs:
                    logprobs[req.request.rid] = req.logprobs
            interrupted()
            stats = self.stats()
        finally:  # on an error too: a failed run leaks no pool row or KV page
            self._close()
        return EngineResult(outputs, frozenset(finished), stats, logprobs)

    def _open(self, max_steps: int | None = None) -> Run:
        """The open run (requests in flight), begun when none is."""
        if self._run is None:
            self._run = Run(deque(), DecodeBatch.empty(self.device, self.bundle.max_context_len))
            self._counts = RunnerCounts.of(self.runner)
            self.schedule.begin(self, max_steps)
        return self._run

    def _close(self) -> None:
        run, self._run = self._run, None
        self._callbacks, self._out, self._owner = [], {}, {}
        self._rids, self._aborted = set(), set()
        if run is None:
            return
        try:
            for req in list(run.held.values()):
                self.free(run, req)
        finally:
            self.schedule.end(self)

    def _advance(self, run: Run) -> int:
        """One engine step of ``run`` and its callbacks; the decode steps it ran."""
        if not run.live and not run.prefilling:  # idle: jump to the next arrival
            run.clock = max(run.clock, run.pending[0].arrival_step)
        begin = time.perf_counter()
        steps = self._step(run)
        run.stats.step_seconds += time.perf_counter() - begin
        self._fire_callbacks()
        run.clock += 1
        return steps

    def _drain(self, run: Run) -> list[RequestOutput]:
        """The outputs the last steps owe, in order; finished requests leave."""
        outs, self._out = list(self._out.values()), {}
        owners, self._owner = self._owner, {}
        for out in outs:
            req = owners.get(out.rid)
            if req is not None:
                out.cached_tokens = req.cached
            if self.logprobs and req is not None:  # the new tokens' own, at the list's end
                total = len(req.tokens)
                out.logprobs = req.logprobs[total - len(out.tokens) : total]
            if out.finished:
                self._rids.discard(out.rid)
                self._aborted.discard(out.rid)
                run.finished.discard(out.rid)
        return outs

    @property
    def admission(self) -> Callable[[int], int] | None:
        """The hook turning the count of arrived requests that fit into the
        count admitted (a sharded model's ranks admit rank 0's), or None."""
        return self.admitter.agree

    @admission.setter
    def admission(self, agree: Callable[[int], int] | None) -> None:
        self.admitter.agree = agree

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
            prefilled = self.admitter.admit(run)
            return [(live, self.first_token(live, logits)) for live, logits in prefilled]
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
        """Append ``token``; when the budget, the end token, the ``stop`` hook
        or an abort ends the request, record it as finished. Returns whether
        it is done."""
        rid = req.request.rid
        req.tokens.append(token)
        out = self._out.get(rid)
        if out is None:
            out = self._out[rid] = RequestOutput(rid)
            self._owner[rid] = req
        out.tokens.append(token)
        if req.matcher is not None and not req.matcher.accept_token(token):
            raise RuntimeError(
                f"request {rid}: token {token} drawn outside its grammar; the step's "
                "token_bitmask should have masked it"
            )
        if self.on_token is not None:
            self._callbacks.append(functools.partial(self.on_token, rid, token))
        reason = self._finish_reason(req, token)
        if reason is None:
            return False
        out.finish_reason = reason
        run.finished.add(rid)
        if self.on_finish is not None:
            self._callbacks.append(functools.partial(self.on_finish, rid, req.tokens))
        return True

    def _finish_reason(self, req: LiveRequest, token: int) -> FinishReason | None:
        """Why ``req`` finishes at its last token ``token``, or None (the
        ``stop`` hook is asked only when nothing else ends it)."""
        request = req.request
        rid = request.rid
        if rid in self._aborted:
            return "abort"
        if req.matcher is not None and req.matcher.is_terminated():
            return "stop"
        if token == self.end_token and not request.ignore_eos:
            return "stop"
        if token in request.stop_token_ids:
            return "stop"
        if len(req.tokens) >= req.request.max_new_tokens:
            return "length"
        if self.stop is not None and self.stop(rid, req.tokens):
            return "stop"
        return None

    def _fire_callbacks(self) -> None:
        """The step's ``on_token`` / ``on_finish`` calls, in order, once its
        bookkeeping is done: one that raises (or a Ctrl-C inside it) leaves
        every request's rows and KV pages recorded, so the run frees them all."""
        callbacks, self._callbacks = self._callbacks, []
        for call in callbacks:
            call()

    def free(self, run: Run, req: LiveRequest) -> None:
        """Free ``req``'s request row and KV pages; a finished one's full
        pages (its prompt's and its output's) stay cached for later prompts."""
        del run.held[req.request.rid]
        self.bundle.req_pool.free([req.req_index])
        cache = self.prefix_cache
        if cache is not None and req.request.rid in run.finished:
            written = (*req.request.prompt, *req.tokens)[: len(req.slots)]
            cache.insert(written, req.slots)
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


def _bitmask_words(runner: GraphRunner) -> int:
    """The words of a row of the grammar's bitmask ``runner``'s step reads (0: none)."""
    mask = runner.buffers.tensors.get(TOKEN_BITMASK)
    return 0 if mask is None else int(mask.shape[-1])


def _busy(run: Run) -> bool:
    """Whether ``run`` has a request waiting, prefilling or running."""
    return bool(run.pending or run.live or run.prefilling)

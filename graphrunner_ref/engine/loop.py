"""The engine: requests in, one step at a time, outputs out.

:class:`Engine` serves requests by continuous batching, every decode step
through a captured runner, optionally checked against the eager forward. Its
API is vLLM's ``LLMEngine`` and nano-vllm's: :meth:`Engine.add_request`,
:meth:`Engine.abort`, :meth:`Engine.step` (a list of
:class:`~graphrunner_ref.engine.results.RequestOutput`),
:meth:`Engine.has_unfinished` and :meth:`Engine.stats`. ``generate``, ``demo``
and the benches drive it through :meth:`Engine.run` (a whole trace, stepped);
``graphrunner serve``'s engine thread calls it directly.

Per engine step, three stages, each one module: the scheduler plans it as
data (:meth:`Scheduler.plan <graphrunner_ref.engine.scheduler.Scheduler.plan>`:
the running rows it decodes, the requests admitted, the prompt chunks it
prefills); the schedule runs the plan through the runners
(:meth:`ModelRunner.run <graphrunner_ref.engine.model_runner.ModelRunner.run>`:
chunks, first tokens, one decode step, ONE read back of tokens and new KV
slots), or one of its variants chosen at build (overlap, several decode
steps a launch: :mod:`~graphrunner_ref.engine.schedule`); the postprocess
records what it gave (:meth:`Postprocess.process
<graphrunner_ref.engine.postprocess.Postprocess.process>`: tokens, ends,
frees, joins). The model kind is data of the engine (its registered
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
import time
from collections import deque
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from graphrunner import DecodeBatch, GraphRunner
from graphrunner.sampling import TOKEN_BITMASK, SamplingParams, check_seed
from graphrunner.util import ChunkSafeCall, Exclusive, deferred_interrupts
from graphrunner_ref.engine.admission import admits_of, check_token_budget, prefix_cache_of
from graphrunner_ref.engine.bundle import ServingBundle, create_decode_runner, decode_step
from graphrunner_ref.engine.check import CheckMode
from graphrunner_ref.engine.grammar import GrammarFactory
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.multistep import check_multistep
from graphrunner_ref.engine.postprocess import Outputs, Postprocess
from graphrunner_ref.engine.ranks import rank0_admits, replay_size_check
from graphrunner_ref.engine.results import (
    AdmissionError,
    EngineResult,
    EngineStats,
    RequestOutput,
    Run,
    TokenLogprobs,
)
from graphrunner_ref.engine.run_counts import RunnerCounts
from graphrunner_ref.engine.sampling import SampledRows, check_logprobs
from graphrunner_ref.engine.schedule import Schedule, schedule_for
from graphrunner_ref.engine.scheduler import Scheduler
from graphrunner_ref.engine.workload import Request

__all__ = [
    "AdmissionError",
    "Engine",
    "EngineResult",
    "EngineStats",
    "RequestOutput",
    "Schedule",
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

    The engine's parts, built once: ``scheduler`` (plans each step),
    ``model`` (the :class:`~graphrunner_ref.engine.model_runner.ModelRunner`),
    ``schedule`` (how a plan runs: the model runner's own, or a variant),
    ``post`` (the :class:`~graphrunner_ref.engine.postprocess.Postprocess`)
    and ``check_mode``.
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
        decoder = decode_step(bundle)
        if check and decoder.rerun_reason is not None:
            raise ValueError(
                f"check=True: {decoder.rerun_reason}; expected check=False for a model "
                "with Mamba layers"
            )
        if decoder.state_ops is not None and runner.state_ops is not decoder.state_ops:
            raise ValueError(
                "runner.state_ops is not the bundle's request pool: its recorded state ops "
                "would never run; build it with create_decode_runner"
            )
        if overlap and check:
            raise ValueError("check=True with overlap=True: expected one of them")
        self.bundle: ServingBundle = bundle
        self.token_runner = token_runner
        self.check, self.end_token = check, end_token
        self.device = bundle.device
        # The open run (None: no request in flight) and the request API's books.
        self._run: Run | None = None
        # The runner's counters when the engine was built or last closed (a
        # run's stats count from there; taken here, not as a request opens a
        # run, so that adding one reads nothing of the runner).
        self._counts = RunnerCounts.of(runner)
        self._books = Outputs()
        self._rids: set[int] = set()  # every request added and not yet finished
        self._next_rid = 0
        # Two threads in one run would interleave on the same pools and batch.
        self._exclusive = Exclusive(f"{type(self).__name__}.run")
        self.sampling = SampledRows.declared_by(runner)
        rows = SampledRows(
            self.device, runner.phase.token_counts, end_token, words=_bitmask_words(runner)
        )
        self.logprobs = check_logprobs(logprobs, self.sampling)
        budget = check_token_budget(bundle, max_num_batched_tokens)
        self.prefix_cache = prefix_cache_of(bundle, prefix_caching)
        self.scheduler = Scheduler(
            bundle,
            runner.max_bs,
            self.seed,
            budget,
            self.prefix_cache,
            rank0_admits(bundle),
            token_sizes=() if token_runner is None else token_runner.capture_sizes,
        )
        self.model = ModelRunner(
            bundle,
            runner,
            decoder,
            rows,
            sampling=self.sampling,
            logprobs=self.logprobs,
            token_runner=token_runner,
            prefix_cache=self.prefix_cache,
            rank_check=replay_size_check(bundle, runner),
            end_token=end_token,
            atol=atol,
        )
        self.check_mode = self.model.check_mode = CheckMode(self.model) if check else None
        self.admits = admits_of(self.model)
        self.post = Postprocess(
            bundle,
            self._books,
            end_token=end_token,
            prefix_cache=self.prefix_cache,
            on_token=on_token,
            on_finish=on_finish,
            stop=stop,
        )
        self.schedule: Schedule = schedule_for(self.model, self.post, runner, steps, overlap)
        # A step's own frames (scheduler, populate) make many small calls too:
        # kept off a stack chunk's end as the programs' are, learnt across runs.
        self._step = ChunkSafeCall(self._step_once)

    @property
    def runner(self) -> GraphRunner:
        """The captured decode runner the model runner replays (replaceable
        between runs: a wrapper that injects faults, say)."""
        return self.model.runner

    @runner.setter
    def runner(self, runner: GraphRunner) -> None:
        self.model.runner = runner
        self.admits = admits_of(self.model)
        self._counts = RunnerCounts.of(runner)

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
        stop: Callable[[list[int]], bool] | None = None,
    ) -> int:
        """Queue a request for the next :meth:`step`; its id (``rid``, or the
        next free one). ``ignore_eos``: the end token does not finish it;
        ``stop_token_ids``: tokens that do, besides; ``min_tokens``: those end
        tokens are held back (never drawn) until it holds that many new
        tokens, inside the step (all three vLLM's); ``grammar``: a factory of
        its grammar's matchers (structured output: only the tokens the
        grammar allows, masked inside the step; the grammar's end finishes
        it; a runner built ``structured=True``); ``stop``: called with its
        tokens after each one, True finishes it (a served request's stop
        strings). Checked here as a run checks its trace: ``ValueError`` or
        ``TypeError`` naming the field, nothing queued."""
        with self._exclusive.held():
            run = self._open()
            rid = self._next_rid if rid is None else rid
            if rid in self._rids:
                raise ValueError(
                    f"add_request: rid={rid} is still in the engine; expected a new id"
                )
            request = self.admits.request(
                rid,
                prompt,
                max_new_tokens,
                run.clock,
                sampling,
                ignore_eos=ignore_eos,
                stop_token_ids=tuple(stop_token_ids),
                min_tokens=min_tokens,
                grammar=grammar,
                stop=stop,
            )
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
            if run is None or rid not in self._rids or rid in self._books.aborted:
                return
            waiting = [r for r in run.pending if r.rid == rid]
            if not waiting:
                self._books.aborted.add(rid)
                return
            run.pending.remove(waiting[0])
            self._books.owed[rid] = RequestOutput(rid, finish_reason="abort")

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
        return run is not None and (_busy(run) or bool(self._books.owed))

    def running(self) -> int:
        """Requests admitted and not finished: prefilling or decoding."""
        run = self._run
        return 0 if run is None else len(run.live) + len(run.prefilling)

    def stats(self) -> EngineStats:
        """What the engine did since the first request was added (or the
        last :meth:`close`); the runner's rows and sanitizer checks since
        the engine was built or last closed."""
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
        (:func:`graphrunner.util.deferred_interrupts`).
        """
        with self._exclusive.held(), deferred_interrupts() as interrupted:
            if self._rids or self._books.owed:
                raise RuntimeError(
                    f"Engine.run: {len(self._rids)} requests added by add_request are open; "
                    "expected them finished, or close() first"
                )
            self.admits.check(trace)
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
                        if out.finish_reason is not None:
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
            batch = DecodeBatch.empty(self.device, self.bundle.max_context_len)
            self._run = Run(deque(), batch, max_steps=max_steps)
        return self._run

    def _close(self) -> None:
        run, self._run = self._run, None
        self.post.callbacks = []
        self._counts = RunnerCounts.of(self.runner)
        self._books.clear()
        self._rids = set()
        if run is None:
            return
        try:
            for req in list(run.held.values()):
                self.post.free(run, req)
        finally:
            self.schedule.end()

    def _advance(self, run: Run) -> int:
        """One engine step of ``run`` and its callbacks; the decode steps it ran."""
        if not run.live and not run.prefilling:  # idle: jump to the next arrival
            run.clock = max(run.clock, run.pending[0].arrival_step)
        begin = time.perf_counter()
        steps = self._step(run)
        run.stats.step_seconds += time.perf_counter() - begin
        if self.post.callbacks:  # on_token / on_finish, outside the step's time
            self.post.fire_callbacks()
        run.clock += 1
        return steps

    def _step_once(self, run: Run) -> int:
        """One engine step: plan, run, postprocess; the decode steps it ran."""
        plan = self.scheduler.plan(run)
        result = self.schedule.run(run, plan)
        self.post.process(run, result)
        return result.steps

    def _drain(self, run: Run) -> list[RequestOutput]:
        """The outputs the last steps owe, in order; finished requests leave."""
        books = self._books
        outs, books.owed = list(books.owed.values()), {}
        owners, books.owner = books.owner, {}
        for out in outs:
            req = owners.get(out.rid)
            if req is not None:
                out.cached_tokens = req.cached
            if self.logprobs and req is not None:  # the new tokens' own, at the list's end
                total = len(req.tokens)
                out.logprobs = req.logprobs[total - len(out.tokens) : total]
            if out.finish_reason is not None:
                self._rids.discard(out.rid)
                books.aborted.discard(out.rid)
                run.finished.discard(out.rid)
        return outs

    @property
    def admission(self) -> Callable[[int], int] | None:
        """The hook turning the count of arrived requests that fit into the
        count admitted (a sharded model's ranks admit rank 0's), or None."""
        return self.scheduler.agree

    @admission.setter
    def admission(self, agree: Callable[[int], int] | None) -> None:
        self.scheduler.agree = agree


def _bitmask_words(runner: GraphRunner) -> int:
    """The words of a row of the grammar's bitmask ``runner``'s step reads (0: none)."""
    mask = runner.buffers.tensors.get(TOKEN_BITMASK)
    return 0 if mask is None else int(mask.shape[-1])


def _busy(run: Run) -> bool:
    """Whether ``run`` has a request waiting, prefilling or running."""
    return bool(run.pending or run.live or run.prefilling)

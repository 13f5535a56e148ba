"""Chain speculative decoding: draft ``K`` tokens per request, verify the
bonus token and the drafts in one target forward of width ``K + 1``, accept
the longest matching prefix, emit the accepted tokens and the target's next
token. Greedy, so the output equals plain greedy decoding token for token.
A request that samples (``Request.sampling`` with temperature > 0) goes
through rejection sampling (:mod:`graphrunner.sampling.speculative`) with its
own counter-based stream, so its tokens follow the target's distribution and
depend on its seed alone, not on the batch. Given a ``sampled_verify``
runner (the factory's engines are), a round that samples accepts and rejects
inside that captured verify (:func:`~graphrunner.phases.verify.rejection_forward`);
without one, on the verify's logits after its replay (the same rule).

Every round allocates ``K + 1`` fresh KV slots per request (positions
``L .. L + K``) and frees the rejected ones as soon as the verify is read, so
no slot leaks; a run frees everything it allocated, also when it raises.
KV pages of one slot only (``page_size == 1``).

With a prefix cache (a drafter that ``reads_cached_prefix``: MTP, the
target's own drafts), a prompt's cached prefix is mapped into its row and
its prefill starts at the first uncached token; its prompt is indexed once
prefilled, and freeing it drops its references (the pages stay cached).

A request with a grammar (structured output) has its drafts checked against
it: before the verify, its matcher walks the bonus token and the drafts,
filling the bitmask of each position (``RoundState.bitmask``) until a draft
it refuses, then rolls back; the verify masks its targets with those rows, so
a refused draft is rejected at its position and every emitted token is one
the grammar allows; the emitted tokens then advance the matcher, and its
completion finishes the request. This reads the drafts back to the host
once a round with a grammar, and needs a matcher that can ``rollback``
(xgrammar's can).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from graphrunner import GraphRunner
from graphrunner.pools import CachedKVAllocator
from graphrunner.sampling import (
    ALLOW_ALL,
    apply_token_bitmask,
    bitmask_words,
    check_seed,
    sample_rows,
)
from graphrunner_ref.engine.drafters import Drafter, RoundState, SpecRequest
from graphrunner_ref.engine.loop import AdmissionError
from graphrunner_ref.engine.ranks import refuse_sharded
from graphrunner_ref.engine.results import TokenLogprobs
from graphrunner_ref.engine.sampling import check_logprobs, first_logprobs
from graphrunner_ref.engine.scheduler import prefix_then_fresh, seed_of
from graphrunner_ref.engine.spec_stats import SpeculativeResult, SpeculativeStats
from graphrunner_ref.engine.spec_verify import RoundVerifier, round_logprobs
from graphrunner_ref.engine.workload import Request, check_trace
from graphrunner_ref.model.build import ModelBundle

__all__ = ["SpeculativeEngine", "SpeculativeResult", "SpeculativeStats"]


@dataclass(slots=True)
class _SpecRun:
    pending: deque[Request]
    outputs: dict[int, list[int]]
    live: list[SpecRequest] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    clock: int = 0


class SpeculativeEngine:
    """Serves request traces with chain speculative decoding.

    Args:
        bundle: the target model and its pools (``page_size`` 1).
        verify: a captured runner of :func:`~graphrunner.phases.verify_phase` of
            width ``drafter.k + 1`` over ``bundle.model``.
        drafter: proposes the drafts (:mod:`graphrunner_ref.engine.drafters`).
        end_token: a token that finishes its request (kept in the output).
        seed: the run seed: a request that samples without a seed of its own
            draws from :func:`~graphrunner.sampling.request_seed` of it and its id.
        sampled_verify: builds (once, on the first round where a request
            samples) the captured verify that samples
            (``verify_phase(..., sampling=True)`` of the same width); None:
            such rounds test the drafts on ``verify``'s logits, outside it.
        logprobs: N >= 1 collects each emitted token's log-probability and
            the top N from the target's unfiltered softmax
            (``SpeculativeResult.logprobs``).
    """

    def __init__(
        self,
        bundle: ModelBundle,
        verify: GraphRunner,
        drafter: Drafter,
        *,
        end_token: int | None = None,
        seed: int = 0,
        sampled_verify: Callable[[], GraphRunner] | None = None,
        logprobs: int = 0,
        prefix_cache: CachedKVAllocator | None = None,
    ) -> None:
        if bundle.page_size != 1:
            raise ValueError(
                f"speculative decoding: page_size={bundle.page_size}; expected 1 (one slot "
                f"per token)"
            )
        refuse_sharded(bundle, "speculative decoding (draft heads are not sharded)")
        width = getattr(verify, "width", None)
        if width != drafter.k + 1:
            raise ValueError(
                f"verify runner width {width}: expected drafter.k + 1 = {drafter.k + 1}"
            )
        if prefix_cache is not None and not drafter.reads_cached_prefix:
            raise ValueError(
                f"prefix_cache with a {type(drafter).__name__}: its draft KV at a position "
                "holds the next token too, which a cached prefix's page does not key; "
                "expected prefix_cache=None (--no-prefix-caching)"
            )
        if prefix_cache is not None and prefix_cache is not bundle.kv_alloc:
            raise ValueError("prefix_cache: expected the bundle's kv_alloc (a CachedKVAllocator)")
        self.bundle, self.verify, self.drafter = bundle, verify, drafter
        self.prefix_cache = prefix_cache
        self.k, self.end_token = drafter.k, end_token
        self.device = bundle.device
        self.seed = check_seed("seed", seed)
        self._sampling = False  # whether the running trace has a request that samples
        self.logprobs = check_logprobs(logprobs, True)
        self.verifier = RoundVerifier(bundle, verify, sampled_verify)

    def run(
        self, trace: Sequence[Request], *, max_steps: int | None = None, progress: bool = False
    ) -> SpeculativeResult:
        """Serve ``trace`` until every request finished or ``max_steps`` rounds
        ran; greedy outputs by request id (a cut request's so far)."""
        self._validate(trace)
        self._sampling = any(r.samples for r in trace)
        run = _SpecRun(
            deque(sorted(trace, key=lambda r: (r.arrival_step, r.rid))),
            {r.rid: [] for r in trace},
        )
        try:
            with tqdm(
                total=max_steps, desc="speculative", unit="round", disable=not progress
            ) as bar:
                while (run.pending or run.live) and (
                    max_steps is None or run.stats.steps < max_steps
                ):
                    if not run.live:
                        run.clock = max(run.clock, run.pending[0].arrival_step)
                    self._admit(run)
                    if run.live:
                        self._round(run)
                        bar.update(1)
                    run.clock += 1
            for req in run.live:  # cut by max_steps
                run.outputs[req.request.rid] = req.tokens
                if self.logprobs:
                    run.logprobs[req.request.rid] = req.logprobs
        finally:  # on an error too: a failed run leaks no row or slot
            for req in list(run.live):
                self._free(req)
        return SpeculativeResult(run.outputs, frozenset(run.finished), run.stats, run.logprobs)

    def _validate(self, trace: Sequence[Request]) -> None:
        ctx = self.bundle.max_context_len
        check_trace(trace, self.bundle.config.vocab_size)
        for r in trace:
            if self._need(r) > ctx:
                raise ValueError(
                    f"request {r.rid}: prompt {len(r.prompt)} + max_new_tokens "
                    f"{r.max_new_tokens} + {self.k} draft tokens needs a context of "
                    f"{self._need(r)}; expected <= max_context_len {ctx}"
                )

    def _need(self, r: Request) -> int:
        return r.max_len + self.k + 1  # the last round's fresh slots included

    def _admit(self, run: _SpecRun) -> None:
        b = self.bundle
        reserved = sum(self._need(r.request) - len(r.slots) for r in run.live)
        while run.pending and run.pending[0].arrival_step <= run.clock:
            req = run.pending[0]
            room = b.kv_alloc.available_size() - reserved
            fits = self._need(req) <= room and b.req_pool.available_size() > 0
            if len(run.live) >= self.verify.max_bs or not fits:
                if not run.live:
                    raise AdmissionError(
                        f"request {req.rid} can never be admitted: it needs 1 request row and "
                        f"{self._need(req)} KV slots, and nothing running could free them"
                    )
                return
            run.pending.popleft()
            reserved += self._need(req) - len(req.prompt)
            self._prefill(run, req)

    def _prefill(self, run: _SpecRun, request: Request) -> None:
        b = self.bundle
        live = SpecRequest(
            request, b.req_pool.alloc(1)[0], sampling_seed=seed_of(request, self.seed)
        )
        run.live.append(live)
        if request.grammar is not None:
            live.matcher = _matcher(request)
        cached = self._prompt_slots(live)
        run.stats.cached_tokens += cached
        prompt = torch.tensor(request.prompt[cached:], dtype=torch.int64, device=self.device)
        slots = torch.tensor(live.slots[cached:], dtype=torch.int64, device=self.device)
        hidden = b.model.extend_hidden(live.req_index, prompt, slots, prefix_len=cached)
        if self.prefix_cache is not None:  # its full pages serve later prompts
            self.prefix_cache.insert(request.prompt, live.slots)
        logits = b.model.logits(hidden[-1]).view(1, -1)
        if live.matcher is not None:
            mask = self._bitmask(1)
            live.matcher.fill_next_token_bitmask(mask, 0)
            logits = apply_token_bitmask(logits, mask.to(self.device))
        if request.samples:  # drawn as the plain engine draws it: position len(prompt), draw 0
            rows = self.verifier.rows([live])
            at = torch.tensor([len(request.prompt)], device=self.device)
            token = sample_rows(logits, rows, at)[0]
        else:
            token = logits.argmax()
        live.bonus = int(token)
        run.stats.prefills += 1
        run.stats.prefill_tokens += len(request.prompt) - cached
        entries = [first_logprobs(logits[0], token, self.logprobs)] if self.logprobs else None
        if self._emit(run, live, [live.bonus], entries):
            self.drafter.prefill(live, prompt, hidden)

    def _prompt_slots(self, live: SpecRequest) -> int:
        """``live``'s prompt slots (``live.slots``): with a prefix cache, its
        cached prefix's first, held and mapped into its row. Returns how many
        tokens were cached (its prefill starts there)."""
        prompt, b, cache = live.request.prompt, self.bundle, self.prefix_cache
        if cache is None:
            live.slots = b.kv_alloc.alloc(len(prompt))
            return 0
        live.slots, cached = prefix_then_fresh(cache, prompt, len(prompt))
        if cached:
            b.req_pool.write(live.req_index, 0, live.slots[:cached])
        return cached

    def _round(self, run: _SpecRun) -> None:
        b, k, start = self.bundle, self.k, time.perf_counter()
        flat = b.kv_alloc.alloc((k + 1) * len(run.live))  # all or nothing
        slots = [flat[i : i + k + 1] for i in range(0, len(flat), k + 1)]
        state = RoundState(list(run.live), slots, self.device)
        if self._sampling:
            state.sampling = self.verifier.rows(state.live)
        try:  # the fresh slots are no request's until the verify is read: freed here
            for req, fresh in zip(state.live, slots, strict=True):
                b.req_pool.write(req.req_index, len(req.slots), fresh)
            drafts = self.drafter.propose(state)
            if any(r.matcher is not None for r in state.live):
                state.bitmask = self._grammar_rows(state, drafts, run.stats)
            verified = self.verifier(state, drafts)
            self.drafter.accept(state, verified)  # queued before the round's one read back
            host = torch.cat(
                [verified.targets.reshape(-1), verified.accepted, verified.drafts.reshape(-1)]
            ).tolist()
            entries = round_logprobs(verified, self.logprobs) if self.logprobs else None
        except BaseException:
            b.kv_alloc.free(flat)
            raise
        self._commit(run, state, host, entries)
        self._count(run.stats, len(state.live), time.perf_counter() - start)

    def _bitmask(self, rows: int) -> torch.Tensor:
        """Host bitmask rows that allow every token."""
        words = bitmask_words(self.bundle.config.vocab_size)
        return torch.full((rows, words), ALLOW_ALL, dtype=torch.int32)

    def _grammar_rows(
        self, state: RoundState, drafts: torch.Tensor, stats: SpeculativeStats
    ) -> torch.Tensor:
        """The round's ``RoundState.bitmask``: each matcher walks its request's
        drafts (``[bs, K]``), a row per position, up to the first it refuses,
        and is rolled back to where it was."""
        w = self.k + 1
        mask = self._bitmask(len(state.live) * w)
        for i, (req, row) in enumerate(zip(state.live, drafts.tolist(), strict=True)):
            matcher = req.matcher
            if matcher is None:
                continue
            walked = 0
            for j in range(w):
                matcher.fill_next_token_bitmask(mask, i * w + j)
                if j == self.k:
                    break
                if not matcher.accept_token(row[j]):
                    stats.grammar_refused += 1
                    break
                walked += 1
                if matcher.is_terminated():  # a complete grammar has no next row
                    break
            matcher.rollback(walked)
        return mask.to(self.device, non_blocking=True)

    def _commit(
        self,
        run: _SpecRun,
        state: RoundState,
        host: list[int],
        entries: list[list[TokenLogprobs]] | None,
    ) -> None:
        """Keep each request's accepted slots, free the rejected ones, emit
        (with each token's log-probabilities when ``entries`` has them)."""
        w, bs = self.k + 1, len(state.live)
        stats = run.stats
        for i, (req, fresh) in enumerate(zip(state.live, state.slots, strict=True)):
            accepted = host[bs * w + i]
            targets = host[i * w : (i + 1) * w]
            drafts_ok = host[bs * (w + 1) + i * self.k :][:accepted]  # greedy: the targets'
            req.slots.extend(fresh[: accepted + 1])
            self.bundle.kv_alloc.free(fresh[accepted + 1 :])
            req.bonus = targets[accepted]
            stats.proposed += self.k
            stats.accepted += accepted
            before = len(req.tokens)
            kept = entries[i][: accepted + 1] if entries is not None else None
            self._emit(run, req, [*drafts_ok, req.bonus], kept)
            stats.decode_tokens += len(req.tokens) - before

    def _emit(
        self,
        run: _SpecRun,
        req: SpecRequest,
        tokens: list[int],
        entries: list[TokenLogprobs] | None = None,
    ) -> bool:
        """Append ``tokens`` (and their ``entries``) up to the budget or the
        end token; retire the request when done. Returns whether it still runs."""
        budget, matcher = req.request.max_new_tokens, req.matcher
        for i, token in enumerate(tokens):
            req.tokens.append(token)
            if entries is not None:
                req.logprobs.append(entries[i])
            if matcher is not None and not matcher.accept_token(token):
                raise RuntimeError(
                    f"request {req.request.rid}: token {token} emitted outside its grammar; "
                    "the verify's bitmask should have masked it"
                )
            ended = token == self.end_token or (matcher is not None and matcher.is_terminated())
            if len(req.tokens) >= budget or ended:
                run.outputs[req.request.rid] = req.tokens
                if entries is not None:
                    run.logprobs[req.request.rid] = req.logprobs
                run.finished.add(req.request.rid)
                run.live.remove(req)
                self._free(req)
                return False
        return True

    def _free(self, req: SpecRequest) -> None:
        self.bundle.req_pool.free([req.req_index])
        self.bundle.kv_alloc.free(req.slots)
        req.slots = []

    @staticmethod
    def _count(stats: SpeculativeStats, bs: int, seconds: float) -> None:
        stats.steps += 1
        stats.decode_seconds += seconds
        stats.batch_sizes[bs] = stats.batch_sizes.get(bs, 0) + 1


def _matcher(request: Request) -> Any:
    """A fresh matcher of ``request``'s grammar, one that can roll back."""
    assert request.grammar is not None
    matcher = request.grammar()
    if not callable(getattr(matcher, "rollback", None)):
        raise ValueError(
            f"request {request.rid}: its grammar's matcher ({type(matcher).__name__}) has no "
            "rollback(n); speculative decoding walks the drafts and rolls back: expected "
            "a matcher that can (xgrammar's GrammarMatcher)"
        )
    return matcher

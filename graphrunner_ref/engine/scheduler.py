"""The scheduler: what each engine step does, decided as data
(:class:`~graphrunner_ref.engine.results.StepPlan`) from the run's requests
and the pools alone; it calls nothing on the engine.

Admission is first come, first served: :func:`admit_count` takes the arrived
requests in arrival order while each finds a free request row, KV pages for
its whole budget beside what the running requests were promised, and a row
of the runner's largest batch; the first that does not fit stops admission,
and the later ones wait behind it (no request overtakes another). With a
prefix cache, a request also waits while another request's prefill is still
to write pages of the prompt they share (:func:`waits_for_shared_prefill`):
admitted then, it would compute them a second time; admitted a step or two
later, it finds them cached.

An admitted request takes its request row and its prompt's KV pages at
once (with a prefix cache, its cached full pages first, mapped into its row,
and its prefill starts at the first uncached token). Under a token budget
(vLLM's ``max_num_batched_tokens``) the running rows' decode tokens come
first, then prompt chunks in order, so a long prompt is split over steps
and never stalls the running requests for its whole prefill (each step
prefills at least one token). Where the chunks run as one captured token
batch, a step whose chunk tokens fall just above a captured size is trimmed
to that size (:func:`fit_captured`): padding a 1,056-token step to the next
size, 2,048, would compute twice its tokens; 1,024 now and 32 next step
compute what they need. A small saving is not worth the step it costs the
trimmed prompt (:data:`MIN_TRIM_TOKENS`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from graphrunner.pools import CachedKVAllocator, whole_pages
from graphrunner.sampling import request_seed
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import AdmissionError, Chunk, LiveRequest, Run, StepPlan
from graphrunner_ref.engine.workload import Request

__all__ = [
    "MIN_TRIM_TOKENS",
    "Scheduler",
    "admit_count",
    "fit_captured",
    "seed_of",
    "waits_for_shared_prefill",
]

#: The padded tokens a trim must save (:func:`fit_captured`): fewer cost less
#: than the step it adds to the trimmed prompt's first token (a step's fixed
#: cost, its decode rows and the host's work, is that of ~100 prompt tokens
#: on one CPU core).
MIN_TRIM_TOKENS = 128


class Scheduler:
    """Plans each engine step of a run (:meth:`plan`).

    Args:
        bundle: the model's pools (request rows, KV pages, page size).
        max_bs: the rows of the runner's largest batch.
        seed: the run seed (a request without a seed of its own draws from it).
        token_budget: the tokens one step may process (decode rows first,
            then prompt chunks); None: every admitted prompt whole in the
            step it is admitted.
        prefix_cache: the KV allocator as the prefix cache, or None.
        agree: turns the count of requests that fit into the count admitted
            (a sharded model's ranks admit rank 0's,
            :func:`~graphrunner_ref.engine.ranks.rank0_admits`), or None.
        token_sizes: the token counts the token runner captured, ascending
            (a step's chunks are trimmed to fit them, :func:`fit_captured`,
            when that saves ``min_trim`` padded tokens or more); empty:
            chunks run as planned.
    """

    def __init__(
        self,
        bundle: ServingBundle,
        max_bs: int,
        seed: int,
        token_budget: int | None = None,
        prefix_cache: CachedKVAllocator | None = None,
        agree: Callable[[int], int] | None = None,
        token_sizes: Sequence[int] = (),
    ) -> None:
        self.bundle, self.max_bs, self.seed = bundle, max_bs, seed
        self.token_budget, self.prefix_cache, self.agree = token_budget, prefix_cache, agree
        self.token_sizes = tuple(token_sizes)
        self.min_trim = MIN_TRIM_TOKENS

    def plan(self, run: Run) -> StepPlan:
        """The next step of ``run``: its running rows, the arrived requests
        admitted (request row and prompt pages taken, in ``run.prefilling``),
        and the prompt chunks it prefills within the token budget. Raises
        :class:`AdmissionError` when nothing runs and the next arrived request
        can never fit."""
        total = self.token_budget
        budget = None if total is None else max(total - len(run.live), 1)
        chunks, budget = _plan_chunks(run, 0, budget)
        admitted: list[LiveRequest] = []
        if budget is None or budget > 0:
            count = admit_count(self.bundle, self.max_bs, self.prefix_cache, run)
            if self.agree is not None:
                count = self.agree(count)
            for _ in range(count):
                admitted.append(self._start(run, run.pending.popleft()))
            run.prefilling.extend(admitted)
            chunks += _plan_chunks(run, len(run.prefilling) - len(admitted), budget)[0]
        if self.token_sizes:
            chunks = fit_captured(chunks, self.token_sizes, self.min_trim)
        return StepPlan(tuple(run.live), tuple(chunks), tuple(admitted))

    def _start(self, run: Run, req: Request) -> LiveRequest:
        """``req`` admitted: its request row and the KV pages of its prompt
        (decode continues in the last page), held by the run until freed. With
        a prefix cache, the prompt's cached full pages come first, mapped into
        its row, and its prefill starts at the first uncached token."""
        b = self.bundle
        live = LiveRequest(req, b.req_pool.alloc(1)[0], seed=seed_of(req, self.seed))
        live.matcher = req.grammar() if req.grammar is not None else None
        run.held[req.rid] = live
        need = whole_pages(len(req.prompt), b.page_size)
        cache = self.prefix_cache
        if cache is None:
            live.pages = b.kv_alloc.alloc(need)
        else:
            live.pages, live.cached = prefix_then_fresh(cache, req.prompt, need)
            live.prefilled = live.cached
            run.stats.cached_tokens += live.cached
            if live.cached:
                b.req_pool.write(live.req_index, 0, live.pages[: live.cached])
        live.slots = live.pages[: len(req.prompt)]
        return live


def seed_of(request: Request, run_seed: int) -> int:
    """The request's own seed, or the one derived from the run seed and its id."""
    own = request.sampling.seed if request.sampling is not None else None
    return own if own is not None else request_seed(run_seed, request.rid)


def prefix_then_fresh(
    cache: CachedKVAllocator, prompt: Sequence[int], need: int
) -> tuple[list[int], int]:
    """``need`` KV slots for ``prompt``: its cached prefix's pages held, then
    fresh ones; and how many of its tokens were cached (its prefill starts
    there). On a failure nothing stays held. The engine's scheduler and the
    speculative engine admit a prompt through it."""
    hit = cache.match(prompt)
    shared = cache.acquire(hit.pages)
    try:
        own = cache.alloc(need - hit.cached_tokens)
    except BaseException:
        cache.release(hit.pages)
        raise
    return shared + own, hit.cached_tokens


def _plan_chunks(run: Run, first: int, budget: int | None) -> tuple[list[Chunk], int | None]:
    """The chunks of ``run.prefilling[first:]``, in order, ``budget`` prompt
    tokens at most (None: every prompt whole); the budget left."""
    chunks: list[Chunk] = []
    for live in run.prefilling[first:]:
        if budget is not None and budget <= 0:
            break
        start, prompt = live.prefilled, len(live.request.prompt)
        end = prompt if budget is None else min(prompt, start + budget)
        chunks.append((live, start, end))
        if budget is not None:
            budget -= end - start
    return chunks, budget


def fit_captured(
    chunks: list[Chunk], sizes: Sequence[int], min_saving: int = MIN_TRIM_TOKENS
) -> list[Chunk]:
    """``chunks`` (``T`` tokens) trimmed from the end to the largest captured
    size ``S <= T`` when padding ``T`` up to the next size ``P`` would cost
    more than it defers (``P - T > T - S``) and at least ``min_saving``
    tokens; the trimmed tokens come in a later step (a chunk's prefill
    resumes where it stopped). Unchanged when ``T`` is a size, above the
    largest (run eagerly, unpadded), or below the smallest."""
    total = sum(end - start for _, start, end in chunks)
    at = bisect.bisect_left(sizes, total)
    if at == 0 or at == len(sizes) or sizes[at] == total:
        return chunks
    below, above = sizes[at - 1], sizes[at]
    if above - total <= max(total - below, min_saving - 1):
        return chunks
    fitted: list[Chunk] = []
    left = below
    for live, start, end in chunks:
        if left == 0:
            break
        take = min(end - start, left)
        fitted.append((live, start, start + take))
        left -= take
    return fitted


def admit_count(
    bundle: ServingBundle, max_bs: int, prefix_cache: CachedKVAllocator | None, run: Run
) -> int:
    """How many of ``run``'s arrived requests, in order, fit: a free request
    row each, KV pages for its whole budget beside what the running requests
    were promised, and a row of the runner's largest batch (``max_bs``).
    Raises :class:`AdmissionError` when nothing runs and the first one can
    never fit (nothing running will ever free room for it)."""
    b = bundle
    # KV slots (whole pages) promised to running requests but not yet allocated.
    admitted = [*run.live, *run.prefilling]
    reserved = sum(whole_pages(r.request.max_len, b.page_size) - len(r.pages) for r in admitted)
    room = b.kv_alloc.available_size() - reserved
    rows = b.req_pool.available_size()
    count = 0
    page = b.page_size if prefix_cache is not None else 0
    prefills = [(r.request.prompt, r.prefilled) for r in run.prefilling]
    for req in run.pending:
        if req.arrival_step > run.clock:
            break
        if page and waits_for_shared_prefill(req.prompt, prefills, page):
            break  # first come, first served: later arrivals wait behind it
        need = whole_pages(req.max_len, b.page_size)
        if len(admitted) + count >= max_bs or need > room or not rows:
            if not admitted and not count:
                raise AdmissionError(
                    f"request {req.rid} can never be admitted: it needs 1 request row "
                    f"and {_kv_amount(b.page_size, need)}, nothing is running, and "
                    f"{rows} request rows and {_kv_amount(b.page_size, room)} are free"
                )
            break  # first come, first served: later arrivals wait behind it
        room, rows, count = room - need, rows - 1, count + 1
        prefills.append((req.prompt, 0))  # admitted now, prefilled from this step
    return count


def waits_for_shared_prefill(
    prompt: Sequence[int], prefills: Sequence[tuple[Sequence[int], int]], page: int
) -> bool:
    """Whether a request of ``prompt`` should wait for ``prefills``, the
    prompts being prefilled, each with its tokens written so far: one of them
    shares full pages of ``prompt`` (``page`` tokens each, its last token
    never, as the cache matches) that are not written yet. A prefill always
    moves on, so the wait ends."""
    shareable = (len(prompt) - 1) // page * page
    for other, written in prefills:
        done = written // page * page
        if done < shareable and _common_prefix(prompt, other, shareable) // page * page > done:
            return True
    return False


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of ``a`` and ``b``'s common prefix, at most ``limit``: a
    binary search over slice comparisons (C speed for long prompts)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _kv_amount(page: int, slots: int) -> str:
    return f"{slots} KV slots" if page == 1 else f"{slots // page} KV pages of {page} slots"

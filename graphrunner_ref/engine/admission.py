"""Admission: prefill the requests the scheduling policy admits
(:func:`~graphrunner_ref.engine.policy.admit_count`), whole or in chunks
under a per-step token budget, each with its first token once its prompt is
in the KV cache, and the trace's checks before a run."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch

from graphrunner import GraphRunner
from graphrunner.phases import token_batch_inputs
from graphrunner.pools import CachedKVAllocator, whole_pages
from graphrunner_ref.engine.policy import admit_count
from graphrunner_ref.engine.results import LiveRequest, Run
from graphrunner_ref.engine.sampling import check_greedy, check_penalties, seed_of
from graphrunner_ref.engine.steps import EngineSteps
from graphrunner_ref.engine.workload import Request, check_trace

__all__ = ["Admission", "check_token_budget", "extends_prefix", "prefix_cache_of"]


class Admission:
    """The engine's admission: which arrived requests join, and their prefill.

    Args:
        engine: the step operations and facts it reads (the engine).
        agree: turns the count that fits into the count admitted (a sharded
            model's ranks admit rank 0's,
            :func:`~graphrunner_ref.engine.ranks.rank0_admits`), or None.
        token_budget: the tokens one engine step may process (vLLM's
            ``max_num_batched_tokens``): the running requests' decode tokens
            first, then prompt chunks, so a long prompt is split over steps
            and never stalls the running requests for its whole prefill
            (each step prefills at least one token). None: every admitted
            prompt is prefilled whole in the step it is admitted.
        token_runner: a runner of the token-batch phase
            (:func:`~graphrunner.phases.token_batch_phase` of the model's
            ``forward_token_batch``) that runs each step's chunks as one
            padded, captured step; None: each chunk eagerly, alone.
    """

    def __init__(
        self,
        engine: EngineSteps,
        agree: Callable[[int], int] | None = None,
        token_budget: int | None = None,
        token_runner: GraphRunner | None = None,
    ) -> None:
        self.engine = engine
        self.agree = agree
        self.token_budget = token_budget
        self.token_runner = token_runner

    def admit(self, run: Run) -> list[tuple[LiveRequest, torch.Tensor]]:
        """Prefill ``run``'s arrived requests in order while they fit, within
        the step's token budget; returns those whose prompt is now whole in
        the KV cache, each with its last prompt token's logits (float
        ``[vocab]``, on device), from which the engine draws its first token.
        The step's chunks (those of every prompt it advances) run as one
        token batch through the engine's token runner where it has one.
        Raises :class:`AdmissionError` when nothing runs and the next one can
        never fit."""
        # Decode rows first, then prompt tokens; a prompt always moves on.
        total = self.token_budget
        budget = None if total is None else max(total - len(run.live), 1)
        chunks, budget = _plan_chunks(run, 0, budget)
        if budget is None or budget > 0:
            count = admit_count(self.engine, run)
            if self.agree is not None:
                count = self.agree(count)
            for _ in range(count):
                run.prefilling.append(_start(self.engine, run, run.pending.popleft()))
            chunks += _plan_chunks(run, len(chunks), budget)[0]
        return _prefill(self.engine, run, chunks, self.token_runner)

    def validate(self, trace: Sequence[Request]) -> None:
        """``trace`` checked before a run: valid requests, each fitting the
        context and the KV pool, greedy unless the engine samples."""
        _validate_trace(self.engine, trace)


def _start(engine: EngineSteps, run: Run, req: Request) -> LiveRequest:
    """``req`` admitted: its request row and the KV pages of its prompt (decode
    continues in the last page), held by the run until freed. With a prefix
    cache, the prompt's cached full pages come first, mapped into its row,
    and its prefill starts at the first uncached token."""
    b = engine.bundle
    live = LiveRequest(req, b.req_pool.alloc(1)[0], seed=seed_of(req, engine.seed))
    live.matcher = req.grammar() if req.grammar is not None else None
    run.held[req.rid] = live
    need = whole_pages(len(req.prompt), b.page_size)
    cache = engine.prefix_cache
    if cache is None:
        live.pages = b.kv_alloc.alloc(need)
    else:
        live.pages = _cached_pages(cache, live, need)
        run.stats.cached_tokens += live.cached
        if live.cached:
            b.req_pool.write(live.req_index, 0, live.pages[: live.cached])
    live.slots = live.pages[: len(req.prompt)]
    return live


def _cached_pages(cache: CachedKVAllocator, live: LiveRequest, need: int) -> list[int]:
    """``need`` KV slots for ``live``'s prompt: its cached prefix's pages held
    (``live.cached`` and ``live.prefilled`` set to their tokens), then fresh
    ones; on a failure nothing stays held."""
    hit = cache.match(live.request.prompt)
    shared = cache.acquire(hit.pages)
    try:
        own = cache.alloc(need - hit.cached_tokens)
    except BaseException:
        cache.release(hit.pages)
        raise
    live.cached = live.prefilled = hit.cached_tokens
    return shared + own


#: One prompt chunk of a step: the request, and its prompt tokens ``start:end``.
Chunk = tuple[LiveRequest, int, int]


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


def _prefill(
    engine: EngineSteps, run: Run, chunks: list[Chunk], runner: GraphRunner | None
) -> list[tuple[LiveRequest, torch.Tensor]]:
    """Run the step's ``chunks`` (each attends to the KV its earlier chunks
    wrote): one token batch through ``runner``, or each eagerly. Returns the
    requests whose prompt is now whole, with their last logits ``[vocab]``."""
    if not chunks:
        return []
    if runner is not None:
        logits = _token_batch(engine, runner, chunks)
        last = [logits[i] for i in range(len(chunks))]
    else:
        last = [_extend(engine, live, start, end) for live, start, end in chunks]
    joining: list[tuple[LiveRequest, torch.Tensor]] = []
    for (live, start, end), row in zip(chunks, last, strict=True):
        live.prefilled = end
        run.stats.prefill_tokens += end - start
        run.stats.prefill_chunks += 1
        if engine.prefix_cache is not None:  # its full pages written so far serve later prompts
            engine.prefix_cache.insert(live.request.prompt[:end], live.slots[:end])
        if end < len(live.request.prompt):
            continue  # the budget is spent inside this prompt
        run.prefilling.remove(live)
        joining.append((live, row))
        run.stats.prefills += 1
    return joining


def _token_batch(engine: EngineSteps, runner: GraphRunner, chunks: list[Chunk]) -> torch.Tensor:
    """The chunks as one token batch (their slots recorded in ``req_to_token``
    first) through ``runner``: each chunk's last-token logits ``[chunks, vocab]``."""
    pool = engine.bundle.req_pool
    ids: list[int] = []
    slots: list[int] = []
    for live, start, end in chunks:
        pool.write(live.req_index, start, live.slots[start:end])
        ids += live.request.prompt[start:end]
        slots += live.slots[start:end]
    inputs = token_batch_inputs(
        input_ids=ids,
        out_cache_loc=slots,
        req_pool_indices=[live.req_index for live, _, _ in chunks],
        seq_lens=[end for _, _, end in chunks],
        extend_lens=[end - start for _, start, end in chunks],
        device=engine.device,
    )
    return cast(torch.Tensor, runner.replay(inputs))


def _extend(engine: EngineSteps, live: LiveRequest, start: int, end: int) -> torch.Tensor:
    """Prompt tokens ``start:end`` of ``live`` into the KV cache; the logits
    of the last (float32 ``[vocab]``)."""
    device = engine.device
    ids = torch.tensor(live.request.prompt[start:end], dtype=torch.int64).to(
        device, non_blocking=True
    )
    slots = torch.tensor(live.slots[start:end], dtype=torch.int64).to(device, non_blocking=True)
    model = engine.bundle.model
    if start == 0:  # a whole prompt, or its first chunk: every model kind
        return model.forward_extend(live.req_index, ids, slots)
    return cast(_ChunkedModel, model).forward_extend(live.req_index, ids, slots, prefix_len=start)


class _ChunkedModel(Protocol):
    """A model whose prefill extends a cached prefix (native Llama, the bridge)."""

    def forward_extend(
        self,
        req_pool_index: int,
        token_ids: torch.Tensor,
        kv_slots: torch.Tensor,
        *,
        prefix_len: int,
    ) -> torch.Tensor: ...


def extends_prefix(bundle: object) -> bool:
    """Whether ``bundle``'s model prefills a chunk after a cached prefix
    (``forward_extend(..., prefix_len=)``: native Llama, the bridge)."""
    extend = getattr(getattr(bundle, "model", None), "forward_extend", None)
    return extend is not None and "prefix_len" in inspect.signature(extend).parameters


def check_token_budget(bundle: object, token_budget: int | None) -> int | None:
    """``token_budget`` (``max_num_batched_tokens``) checked: None, or an int
    >= 1 for a model whose prefill extends a cached prefix; a Mamba or
    hybrid model (its state is not carried across chunks) is refused by name."""
    if token_budget is None:
        return None
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"max_num_batched_tokens={token_budget!r}; expected an int >= 1 or None")
    if not extends_prefix(bundle):
        model = getattr(bundle, "model", None)
        raise ValueError(
            f"max_num_batched_tokens={token_budget}: chunked prefill needs a model whose "
            f"prefill extends a cached prefix; {type(model).__name__} carries no state across "
            f"chunks (Mamba / hybrid layers): expected None (--no-chunked-prefill)"
        )
    return token_budget


def _validate_trace(engine: EngineSteps, trace: Sequence[Request]) -> None:
    ctx, kv_room = engine.bundle.max_context_len, engine.bundle.kv_alloc.size
    check_trace(trace, engine.bundle.config.vocab_size)
    if not engine.sampling:
        check_greedy(trace)
    check_penalties(trace, engine.sampling_rows.counts, engine.bundle.config.vocab_size)
    for r in trace:
        _check_ignore_eos(engine, r)
        if r.grammar is not None and not engine.sampling_rows.words:
            raise ValueError(
                f"request {r.rid}: a grammar (structured output) needs a runner whose step "
                "masks the grammar's tokens; build it with create_decode_runner(..., "
                "sampling=True, structured=True)"
            )
        if r.max_len > min(ctx, kv_room):
            raise ValueError(
                f"request {r.rid}: prompt {len(r.prompt)} + max_new_tokens "
                f"{r.max_new_tokens} - 1 = {r.max_len} tokens; expected <= "
                f"max_context_len {ctx} and <= KV slots {kv_room}"
            )


def _check_ignore_eos(engine: EngineSteps, r: Request) -> None:
    """``r``'s ``ignore_eos`` refused where the runner stops rows itself:
    several steps a launch end a row inside the launch at the engine's end
    token, for every request alike."""
    if r.ignore_eos and engine.end_token is not None and engine.runner.phase.steps > 1:
        raise ValueError(
            f"request {r.rid}: ignore_eos=True with {engine.runner.phase.steps} steps per "
            f"launch: the runner ends every row at token {engine.end_token} inside a launch; "
            "expected ignore_eos=False, or one step a launch"
        )


def prefix_cache_of(bundle: object, prefix_caching: bool) -> CachedKVAllocator | None:
    """``bundle``'s KV allocator as the engine's prefix cache, with
    ``prefix_caching`` on (None off); refused by name where the model keeps
    state rather than pages (Mamba / hybrid) or its pool shares none."""
    if not prefix_caching:
        return None
    model = getattr(bundle, "model", None)
    if not extends_prefix(bundle):
        raise ValueError(
            f"prefix_caching=True: {type(model).__name__} carries state, not KV pages, "
            "across a prompt (Mamba / hybrid layers): expected prefix_caching=False "
            "(--no-prefix-caching)"
        )
    cache = getattr(bundle, "kv_alloc", None)
    if not isinstance(cache, CachedKVAllocator):
        raise ValueError(
            f"prefix_caching=True: the bundle's kv_alloc is a {type(cache).__name__}; "
            "expected a graphrunner.pools.CachedKVAllocator"
        )
    return cache

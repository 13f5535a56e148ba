"""What may enter the engine: a trace's requests checked before they are
queued (:func:`validate_trace`), and the engine options that depend on the
model: the token budget of chunked prefill (:func:`check_token_budget`) and
the prefix cache (:func:`prefix_cache_of`). Which requests join a step is
the scheduler's (:mod:`~graphrunner_ref.engine.scheduler`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from graphrunner.pools import CachedKVAllocator
from graphrunner.sampling import MAX_HOLD_TOKENS, TokenCounts
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.workload import Request

__all__ = [
    "check_greedy",
    "check_penalties",
    "check_token_budget",
    "check_trace",
    "extends_prefix",
    "prefix_cache_of",
    "validate_trace",
]


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


def validate_trace(engine: ModelRunner, trace: Sequence[Request]) -> None:
    """``trace`` checked before a run: valid requests, each fitting the
    context and the KV pool, greedy unless the engine samples; a
    ``ValueError`` or ``TypeError`` naming the request and the field."""
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


def _check_ignore_eos(engine: ModelRunner, r: Request) -> None:
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


def check_trace(trace: Sequence[Request], vocab_size: int) -> None:
    """Request ids unique and every prompt and stop token in ``0..vocab_size
    - 1`` (ValueError naming the request and the token)."""
    if len({r.rid for r in trace}) != len(trace):
        raise ValueError("request ids must be unique")
    for r in trace:
        for what, ids in (("token id", r.prompt), ("stop_token_ids has", r.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"request {r.rid}: {what} {bad[0]} outside the vocabulary 0..{vocab_size - 1}"
                )


def check_greedy(trace: Sequence[Request]) -> None:
    """Every request of ``trace`` greedy (for a runner that does not sample),
    or a ValueError naming the first that is not."""
    for r in trace:
        if r.sampling is not None and not r.sampling.greedy:
            raise ValueError(
                f"request {r.rid}: temperature {r.sampling.temperature} needs a runner that "
                "samples; build it with create_decode_runner(..., sampling=True)"
            )


def check_penalties(trace: Sequence[Request], counts: TokenCounts | None, vocab: int) -> None:
    """Every penalized request's logit bias within ``vocab`` and a runner that
    applies penalties (``counts``, its token counts), and every request with
    ``min_tokens`` on such a runner with at most ``MAX_HOLD_TOKENS`` end tokens
    (the end token and ``stop_token_ids``), or a ValueError naming the first
    request that fails."""
    for r in trace:
        if r.min_tokens and counts is None:
            raise ValueError(
                f"request {r.rid}: min_tokens={r.min_tokens} needs a runner that holds end "
                "tokens back in its step; build it with create_decode_runner(..., "
                "sampling=True, penalties=True), or expected min_tokens=0"
            )
        if r.min_tokens and len(set(r.stop_token_ids)) >= MAX_HOLD_TOKENS:
            raise ValueError(
                f"request {r.rid}: min_tokens={r.min_tokens} with {len(set(r.stop_token_ids))} "
                f"stop_token_ids; expected at most {MAX_HOLD_TOKENS - 1} (the end token "
                "besides)"
            )
        if r.sampling is None or not r.sampling.penalized:
            continue
        if counts is None:
            raise ValueError(
                f"request {r.rid}: repetition_penalty, presence_penalty, frequency_penalty or "
                "logit_bias needs a runner that applies them; build it with "
                "create_decode_runner(..., sampling=True, penalties=True)"
            )
        try:
            r.sampling.check_vocab(vocab)
        except ValueError as e:
            raise ValueError(f"request {r.rid}: {e}") from None

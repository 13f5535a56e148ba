"""What may enter the engine: what its runner and pools admit, as data
(:func:`admits_of`; each request is checked against it as it is built,
:meth:`~graphrunner_ref.engine.workload.Admits.request`), and the engine options
that depend on the model: the token budget of chunked prefill
(:func:`check_token_budget`) and the prefix cache (:func:`prefix_cache_of`).
Which requests join a step is the scheduler's
(:mod:`~graphrunner_ref.engine.scheduler`)."""

from __future__ import annotations

import inspect

from graphrunner.pools import CachedKVAllocator
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.workload import Admits

__all__ = ["admits_of", "check_token_budget", "extends_prefix", "prefix_cache_of"]


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


def admits_of(engine: ModelRunner) -> Admits:
    """What ``engine``'s runner and pools admit, as data (read again when
    its runner is replaced): the requests' checks read it and call nothing
    on the engine."""
    steps = engine.runner.phase.steps
    return Admits(
        vocab_size=engine.bundle.config.vocab_size,
        max_context_len=engine.bundle.max_context_len,
        kv_slots=engine.bundle.kv_alloc.size,
        samples=engine.sampling,
        penalties=engine.sampling_rows.counts is not None,
        structured=bool(engine.sampling_rows.words),
        launch_end=engine.end_token if steps > 1 else None,
        steps=steps,
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

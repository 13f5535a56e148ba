"""Build a speculative engine over a model bundle: the verify runner, the
draft head and its runners, each captured on the chosen mechanism."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_type_hints

from graphrunner import (
    GraphRunner,
    KVCache,
    PaddingSanitizer,
    create_runner,
)
from graphrunner.declare import check_width
from graphrunner.phases import (
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    frozen_kv_mtp_phase,
    frozen_kv_sanitizer,
    verify_phase,
)
from graphrunner_ref.engine.admission import prefix_cache_of
from graphrunner_ref.engine.drafters import Drafter, EagleDrafter, MtpDrafter, TargetDrafter
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.engine.ranks import refuse_sharded
from graphrunner_ref.engine.speculative import SpeculativeEngine
from graphrunner_ref.model.build import ModelBundle
from graphrunner_ref.model.draft import EagleHead, FrozenKvMtpHead, init_draft_weights

__all__ = ["DRAFTS", "DRAFT_HEADS", "METHODS", "DraftHead", "speculative_engine"]

#: The target's own tokens as drafts, shifted by this many (``wrong``: none accepted).
_TARGET_SHIFT = {"self": 0, "wrong": 1}
#: The draft sources (``--draft``): a seeded random head of the method, or the target.
DRAFTS = ("random", *_TARGET_SHIFT)


class _Capture:
    """Runner arguments shared by every phase of one engine."""

    def __init__(
        self, bundle: ModelBundle, kind: str, options: dict[str, Any], check: bool, **kwargs: Any
    ) -> None:
        self.bundle, self.kind, self.options, self.check = bundle, kind, options, check
        self.kwargs = kwargs

    def common(self, sanitizer: PaddingSanitizer | None) -> dict[str, Any]:
        return {
            "device": self.bundle.device,
            "kind": self.kind,
            **self.options,
            "sanitizer": sanitizer if self.check else None,
            **self.kwargs,
        }

    def pools_sanitizer(self, kv: KVCache) -> PaddingSanitizer:
        b = self.bundle
        return PaddingSanitizer.for_pools(
            b.req_pool, kv, kv_allocator=b.kv_alloc, vocab_size=b.config.vocab_size
        )


def _captured(runner: GraphRunner) -> GraphRunner:
    runner.capture()
    return runner


def speculative_engine(
    bundle: ModelBundle,
    kind: str,
    *,
    method: str = "mtp",
    draft: str = "random",
    k: int = 2,
    capture_sizes: list[int] | None = None,
    max_bs: int | None = None,
    seed: int = 0,
    check_padding: bool = False,
    show_progress: bool = False,
    end_token: int | None = None,
    run_seed: int = 0,
    logprobs: int = 0,
    prefix_caching: bool = False,
    **mechanism_options: Any,
) -> SpeculativeEngine:
    """A :class:`SpeculativeEngine` over ``bundle`` with every runner captured.

    Args:
        kind: the runner kind (``cuda``, ``cpu``, ``eager``) of every phase.
        method: ``eagle`` or ``mtp``: the draft head built for ``random``.
        draft: ``random`` (a seeded random head of ``method``), ``self`` (the
            target proposes its own tokens: every draft accepted) or ``wrong``
            (those tokens shifted by one: none accepted).
        k: draft tokens per round; the verify runs ``k + 1`` tokens per request.
        seed: the seed of the random draft head's weights.
        check_padding: the padding sanitizer around every phase's replays.
        run_seed: the run seed sampling requests without a seed of their own
            derive theirs from (:class:`SpeculativeEngine`'s ``seed``).
        logprobs: N >= 1 collects each token's log-probability and top N.
        prefix_caching: share the KV of prompts' cached prefixes (the
            bundle's ``kv_alloc`` a ``CachedKVAllocator``); refused for an
            EAGLE head (:func:`caches_prefix` says which drafts take it).
    """
    refuse_sharded(bundle, "speculative decoding (draft heads are not sharded)")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; expected one of {list(METHODS)}")
    if draft not in DRAFTS:
        raise ValueError(f"draft={draft!r}; expected one of {list(DRAFTS)}")
    k = check_width("k", k)
    cap = _Capture(
        bundle,
        kind,
        mechanism_options,
        check_padding,
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        show_progress=show_progress,
    )
    verify = create_runner(
        verify_phase(bundle.model, k + 1), **cap.common(cap.pools_sanitizer(bundle.kv_cache))
    )
    drafter = _drafter(cap, method, draft, k, seed)

    def sampled_verify() -> GraphRunner:
        sanitizer = cap.pools_sanitizer(bundle.kv_cache)
        return _captured(
            create_runner(verify_phase(bundle.model, k + 1, sampling=True), **cap.common(sanitizer))
        )

    return SpeculativeEngine(
        bundle,
        _captured(verify),
        drafter,
        end_token=end_token,
        seed=run_seed,
        sampled_verify=sampled_verify,
        logprobs=logprobs,
        prefix_cache=prefix_cache_of(bundle, prefix_caching),
    )


def caches_prefix(method: str, draft: str) -> bool:
    """Whether the drafter of ``method`` and ``draft`` reads a cached prefix
    (``Drafter.reads_cached_prefix``): the target's own drafts and MTP do,
    an EAGLE head does not."""
    if draft in _TARGET_SHIFT:
        return TargetDrafter.reads_cached_prefix
    drafter = get_type_hints(DRAFT_HEADS[method])["return"]
    return bool(drafter.reads_cached_prefix)


def _drafter(cap: _Capture, method: str, draft: str, k: int, seed: int) -> Drafter:
    """The ``draft`` source: the target itself (``self``, ``wrong``), or a
    seeded random head of ``method`` (:data:`DRAFT_HEADS`)."""
    if draft in _TARGET_SHIFT:
        return _target(cap, k, _TARGET_SHIFT[draft])
    return DRAFT_HEADS[method](cap, k, seed)


def _target(cap: _Capture, k: int, shift: int) -> Drafter:
    b = cap.bundle
    target_decode = create_decode_runner(
        b,
        cap.kind,
        capture_sizes=cap.kwargs["capture_sizes"],
        max_bs=cap.kwargs["max_bs"],
        check_padding=cap.check,
        **cap.options,
    )
    return TargetDrafter(b.model, _captured(target_decode), k, shift=shift)


def _mtp(cap: _Capture, k: int, seed: int) -> MtpDrafter:
    b = cap.bundle
    head = FrozenKvMtpHead(b.model, steps=k, topk=1)
    init_draft_weights(head, seed)
    sanitizer = frozen_kv_sanitizer(b.req_pool, b.kv_cache)
    runner = _captured(create_runner(frozen_kv_mtp_phase(head), **cap.common(sanitizer)))

    def sampled() -> GraphRunner:
        fresh = frozen_kv_sanitizer(b.req_pool, b.kv_cache)
        phase = frozen_kv_mtp_phase(head, sampling=True)
        return _captured(create_runner(phase, **cap.common(fresh)))

    return MtpDrafter(runner, k, sampled)


def _eagle(cap: _Capture, k: int, seed: int) -> EagleDrafter:
    b = cap.bundle
    cfg = b.config
    draft_kv = KVCache(
        b.kv_alloc.size, 1, cfg.num_kv_heads, cfg.head_dim, b.kv_cache.dtype, b.device
    )
    eagle = EagleHead(b.model, draft_kv)
    init_draft_weights(eagle, seed)
    sanitizer = cap.pools_sanitizer(draft_kv)
    extend = create_runner(eagle_draft_extend_phase(eagle, k + 1), **cap.common(sanitizer))
    decode: GraphRunner | None = None
    if k > 1:  # the seed comes from the extend; decode steps make the other k - 1
        sanitizer = cap.pools_sanitizer(draft_kv)
        runner = create_runner(eagle_draft_decode_phase(eagle), **cap.common(sanitizer))
        decode = _captured(runner)
    return EagleDrafter(eagle, _captured(extend), decode, k)


#: Builds a draft head's drafter from the engine's runner arguments, the
#: draft tokens per round and the head's seed.
DraftHead = Callable[[_Capture, int, int], Drafter]

#: The draft heads by method (``--speculative``): a new head is one builder
#: and one row here.
DRAFT_HEADS: dict[str, DraftHead] = {"eagle": _eagle, "mtp": _mtp}
METHODS = tuple(DRAFT_HEADS)

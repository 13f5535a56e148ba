"""The model registry: each kind of model the engine serves, as one value.

A :class:`ModelKind` says how the engine recognises a checkpoint of its kind,
reads its shape, loads it over graphrunner's pools and steps it (its
:class:`DecodeStep`). The engine path asks the registry, never a list of
bundle types: :func:`kind_for` picks the kind that serves a config (the
newest registration asked first, so a kind registered later can claim
checkpoints a built-in one would take), :func:`kind_of` the kind of a
loaded bundle. The built-in kinds (the native Llama, Mamba / hybrid models,
any transformers decoder through the bridge) register in
:mod:`graphrunner_ref.engine.kinds`; a new kind is one module defining its
:class:`ModelKind` and one :func:`register` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphrunner import (
    DecodeBatch,
    GraphBackend,
    KVCache,
    PaddingSanitizer,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from graphrunner.phases import SpecBatch
from graphrunner.pools import HybridReqToTokenPool
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.model.config import ModelConfig

__all__ = [
    "DecodeStep",
    "ModelKind",
    "ServingBundle",
    "kind_for",
    "kind_of",
    "kinds",
    "register",
    "unregister",
]


class _Vocab(Protocol):
    @property
    def vocab_size(self) -> int: ...


class _DecodeModel(Protocol):
    def forward_extend(
        self, req_pool_index: int, token_ids: torch.Tensor, kv_slots: torch.Tensor
    ) -> torch.Tensor: ...


class ServingBundle(Protocol):
    """What the engine reads of a model and its pools (every kind's bundle has it).

    ``req_pool.req_to_token`` is int32 ``[max_requests + 1, max_context_len]``;
    ``kv_alloc`` hands out whole pages of ``page_size`` KV slots; ``kv_cache``
    stores them (None for a model without attention layers);
    ``model.forward_extend`` prefills one request: its token ids int64 ``[n]``
    cached at ``kv_slots`` int64 ``[n]`` (and recorded in its ``req_to_token``
    row), returning the last token's logits float32 ``[vocab]``.
    """

    @property
    def model(self) -> _DecodeModel: ...
    @property
    def req_pool(self) -> ReqToTokenPool: ...
    @property
    def kv_alloc(self) -> TokenToKVPoolAllocator: ...
    @property
    def kv_cache(self) -> KVCache | None: ...
    @property
    def config(self) -> _Vocab: ...
    @property
    def max_context_len(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """How one kind of bundle decodes, as data.

    forward: the model's decode forward, ``inputs -> logits [bs, vocab]``.
    backend: the attention hooks runners call (a no-op without attention).
    inputs: a prepared :class:`DecodeBatch` -> what ``forward`` reads; None:
        the batch itself.
    sanitizer: the bundle's pools -> a padding sanitizer (``check_padding``).
    state_ops: the pool whose recorded state ops run before each launch.
    mamba: the step's fields include each row's Mamba slot.
    rerun_reason: why an eager rerun of a step (``Engine(check=True)``) would
        be wrong for this kind; None where it is fine.
    fullgraph: a compiled forward must compile whole (modules graphrunner did
        not write: a graph break is refused by name, never run piecewise).
    """

    forward: Callable[[Any], torch.Tensor]
    backend: GraphBackend
    inputs: Callable[[DecodeBatch], SpecBatch] | None
    sanitizer: Callable[[], PaddingSanitizer]
    state_ops: HybridReqToTokenPool | None = None
    mamba: bool = False
    rerun_reason: str | None = None
    fullgraph: bool = False


def _accepts_every_option(config: EngineConfig) -> None:
    pass


@dataclass(frozen=True, slots=True)
class ModelKind:
    """How one kind of model is recognised, loaded and stepped.

    name: the kind's unique name.
    bundle_type: the class of the bundles ``load`` returns (how a loaded
        bundle finds its kind).
    recognises: ``config -> bool``: whether this kind serves the config's
        model (``config.checkpoint``, ``config.model``, ``config.model_impl``).
    shape: ``config -> ModelConfig``: what the checks read before anything is
        loaded (the vocabulary, the context, the sizes a memory estimate counts).
    load: ``(config, max_requests, context) -> bundle``: the model over pools
        for ``max_requests`` requests of ``context`` tokens.
    step: ``bundle -> DecodeStep``: how the engine decodes it.
    check: ``config -> None``: raises :class:`UsageError` for an option this
        kind cannot run, before anything is loaded (default: none refused).
    impl: the ``--model-impl`` choice that runs this kind (``native`` or
        ``transformers``).
    memory_checked: whether the command line's memory estimate (an attention
        model's pools and graphs) stands for this kind's footprint.
    """

    name: str
    bundle_type: type
    recognises: Callable[[EngineConfig], bool]
    shape: Callable[[EngineConfig], ModelConfig]
    load: Callable[[EngineConfig, int, int], ServingBundle]
    step: Callable[[Any], DecodeStep]
    check: Callable[[EngineConfig], None] = _accepts_every_option
    impl: str = "native"
    memory_checked: bool = True


_KINDS: list[ModelKind] = []


def register(kind: ModelKind) -> ModelKind:
    """Add ``kind`` to the registry (asked before every kind registered
    earlier); returns it. A second kind of the same name is refused."""
    if any(k.name == kind.name for k in _KINDS):
        raise ValueError(f"kind.name={kind.name!r}: a kind of that name is registered already")
    _KINDS.append(kind)
    return kind


def unregister(name: str) -> None:
    """Remove the kind named ``name`` (a test's toy kind, once it is done)."""
    _KINDS[:] = [k for k in _KINDS if k.name != name]


def kinds() -> tuple[ModelKind, ...]:
    """The registered kinds, in the order :func:`kind_for` asks them."""
    return tuple(reversed(_KINDS))


def kind_for(config: EngineConfig) -> ModelKind:
    """The kind that serves ``config``'s model: the first of :func:`kinds`
    that recognises it; :class:`UsageError` when none does."""
    for kind in kinds():
        if kind.recognises(config):
            return kind
    model = config.source or config.model
    raise UsageError(
        f"{model}: no registered model kind serves it (kinds: {', '.join(k.name for k in kinds())})"
    )


def kind_of(bundle: object) -> ModelKind:
    """The kind whose ``load`` makes bundles like ``bundle``; ``TypeError``
    for a bundle of no registered kind."""
    for kind in kinds():
        if isinstance(bundle, kind.bundle_type):
            return kind
    raise TypeError(
        f"bundle={type(bundle).__name__}: expected a bundle of a registered model kind "
        f"({', '.join(k.bundle_type.__name__ for k in kinds())})"
    )

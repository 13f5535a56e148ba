"""The one bundle protocol the engine serves, and the one runner factory over it.

A bundle is a model together with the pools it was built over: a Llama
:class:`~graphrunner_ref.model.build.ModelBundle`, a Mamba / hybrid
:class:`~graphrunner_ref.io.mamba_checkpoint.StateSpaceBundle`, or a
transformers model through the bridge
(:class:`~graphrunner_ref.bridge.TransformersBundle`). The engine reads
only what :class:`ServingBundle` names. What differs between the kinds is
one value, a :class:`DecodeStep` (:func:`decode_step` picks it): the decode
fields, the attention hooks, the sanitizer, the recorded state ops the runner
runs before launch, and how a :class:`DecodeBatch` becomes the step's inputs.
:func:`create_decode_runner` builds a runner for any bundle from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphrunner import (
    DecodeBatch,
    FutureMap,
    GraphBackend,
    GraphRunner,
    KVCache,
    PaddingSanitizer,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_runner,
    decode_phase,
)
from graphrunner.declare import NullBackend, ReplayInputs
from graphrunner.phases import check_steps_per_launch
from graphrunner.pools import HybridReqToTokenPool
from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.engine.mamba_step import MambaSanitizer, StateSpaceInputs
from graphrunner_ref.engine.multistep_runner import (
    multistep_of,
    multistep_phase_of,
    remember_multistep,
)
from graphrunner_ref.engine.ranks import agree_on_sizes
from graphrunner_ref.io.mamba_checkpoint import StateSpaceBundle
from graphrunner_ref.model.build import ModelBundle
from graphrunner_ref.model.hybrid import HybridLM

__all__ = [
    "DecodeStep",
    "ServingBundle",
    "create_decode_runner",
    "decode_step",
    "multistep_of",
]


class _Vocab(Protocol):
    @property
    def vocab_size(self) -> int: ...


class _DecodeModel(Protocol):
    def forward_extend(
        self, req_pool_index: int, token_ids: torch.Tensor, kv_slots: torch.Tensor
    ) -> torch.Tensor: ...


class ServingBundle(Protocol):
    """What the engine reads of a model and its pools (every bundle kind has it).

    ``req_pool.req_to_token`` is int32 ``[max_requests + 1, max_context_len]``;
    ``kv_alloc`` hands out whole pages of ``page_size`` KV slots; ``kv_cache``
    stores them (None for a model without attention layers).
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
    """How one bundle kind decodes, as data.

    forward: the model's decode forward, ``inputs -> logits [bs, vocab]``.
    backend: the attention hooks runners call (a no-op for pure Mamba).
    inputs: a prepared :class:`DecodeBatch` -> what ``forward`` reads.
    sanitizer: the bundle's pools -> a padding sanitizer (``check_padding``).
    state_ops: the pool whose recorded state ops run before each launch.
    mamba: the step's fields include each row's Mamba slot.
    rerun_reason: why an eager rerun of a step (``Engine(check=True)``) would
        be wrong for this kind; None where it is fine.
    """

    forward: Callable[[Any], torch.Tensor]
    backend: GraphBackend
    inputs: Callable[[DecodeBatch], ReplayInputs]
    sanitizer: Callable[[], PaddingSanitizer]
    state_ops: HybridReqToTokenPool | None = None
    mamba: bool = False
    rerun_reason: str | None = None


def decode_step(
    bundle: ModelBundle | StateSpaceBundle | TransformersBundle | ServingBundle,
) -> DecodeStep:
    """The :class:`DecodeStep` of ``bundle``: a Llama or a transformers bundle
    decodes the plain fields; a state-space bundle adds each row's Mamba slot and runs its
    request pool's recorded state ops before launch."""
    if isinstance(bundle, StateSpaceBundle):
        ssm = bundle
        model = ssm.model
        backend: GraphBackend = model.attn_backend if isinstance(model, HybridLM) else NullBackend()
        return DecodeStep(
            forward=model.forward_decode,
            backend=backend,
            inputs=lambda batch: StateSpaceInputs(batch, ssm.req_pool),
            sanitizer=lambda: MambaSanitizer.for_pools(
                ssm.req_pool,
                ssm.kv_cache,
                kv_allocator=ssm.kv_alloc,
                mamba_pool=ssm.mamba_pool,
                vocab_size=ssm.config.vocab_size,
            ),
            state_ops=ssm.req_pool,
            mamba=True,
            rerun_reason="an eager rerun would advance each request's Mamba state twice",
        )
    if not isinstance(bundle, ModelBundle | TransformersBundle):
        raise TypeError(
            f"bundle={type(bundle).__name__}: expected a ModelBundle, a StateSpaceBundle "
            "or a TransformersBundle"
        )
    llama = bundle
    return DecodeStep(
        forward=llama.model.forward_decode,
        backend=llama.model.attn_backend,
        inputs=lambda batch: batch,
        sanitizer=lambda: PaddingSanitizer.for_pools(
            llama.req_pool,
            llama.kv_cache,
            kv_allocator=llama.kv_alloc,
            vocab_size=llama.config.vocab_size,
        ),
    )


def create_decode_runner(
    bundle: ModelBundle | StateSpaceBundle | TransformersBundle,
    kind: str,
    *,
    capture_sizes: Sequence[int] | None = None,
    max_bs: int | None = None,
    show_progress: bool = False,
    check_padding: bool = False,
    future_map: FutureMap | None = None,
    sampling: bool = False,
    logprobs: int = 0,
    steps_per_launch: int = 1,
    end_token: int | None = None,
    **mechanism_options: Any,
) -> GraphRunner:
    """A ``kind`` runner (``cuda``, ``cpu``, ``eager``) over the bundle's decode
    step (:func:`decode_step`), with its backend's hooks and pad value. Not yet
    captured.

    ``check_padding=True`` guards the bundle's pools with its padding sanitizer
    around every replay (a debug mode: it copies the pools per step).
    ``future_map`` lets ``input_ids`` carry future references (overlap
    scheduling; Llama bundles only). ``sampling=True`` picks each row's token
    inside the step (:func:`~graphrunner.phases.decode_phase`: the
    sampling buffers join the decode ones, the outputs are ``{"logits",
    "tokens"}``); an :class:`Engine` then samples each request by its
    :class:`~graphrunner.sampling.SamplingParams`. ``logprobs=N`` (N >= 1,
    with ``sampling=True``) adds each row's chosen-token log-probability
    ``"logprob"`` ``[bs]`` and the top-N ``"top_logprobs"`` / ``"top_ids"``
    ``[bs, N]`` to the outputs. ``steps_per_launch=N`` (2..8) captures N
    decode steps per launch (:mod:`graphrunner.phases.multistep`; outputs
    ``{"tokens", "count", "logits"}``, with ``logprobs`` each step's ``[bs, N]``
    / ``[bs, N, n]``), rows stopping at ``end_token`` (the engine's); Llama
    bundles only (with ``future_map`` each launch stores each row's last token there).
    ``mechanism_options`` go to the runner's mechanism, e.g. ``compile=True``
    for ``cuda``; a transformers bundle compiles with ``fullgraph=True`` (a
    model that cannot be captured is refused naming its line). A
    tensor-parallel model's ranks must resolve the same capture sizes (checked
    across ranks: ``ValueError`` naming each rank's list).
    """
    step = decode_step(bundle)
    steps = check_steps_per_launch("steps_per_launch", steps_per_launch)
    if logprobs and not sampling:
        raise ValueError(f"logprobs={logprobs!r} needs sampling=True (the sampled step)")
    if future_map is not None and step.mamba:
        raise ValueError(
            "future_map: overlap scheduling is not supported for a model with Mamba "
            "layers; expected future_map=None"
        )
    if steps > 1:
        phase = multistep_phase_of(
            step.forward, step.backend, step.mamba, steps, end_token, future_map, logprobs, sampling
        )
    else:
        phase = decode_phase(
            step.forward,
            backend=step.backend,
            future=future_map is not None,
            mamba=step.mamba,
            sampling=sampling,
            logprobs=logprobs,
        )
    compiles = kind == "cpu" or mechanism_options.get("compile", False)
    if isinstance(bundle, TransformersBundle) and compiles:
        # Modules graphrunner did not write: a graph break is refused by name,
        # never run piecewise.
        mechanism_options.setdefault("fullgraph", True)
    runner = create_runner(
        kind,
        phase,
        device=bundle.device,
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        show_progress=show_progress,
        sanitizer=step.sanitizer() if check_padding else None,
        future_map=future_map,
        state_ops=step.state_ops,
        **mechanism_options,
    )
    if steps > 1:
        remember_multistep(runner, steps, end_token)
    return agree_on_sizes(bundle, runner)

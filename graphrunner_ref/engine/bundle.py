"""The runner factory the engine serves any model through.

A bundle is a model together with the pools it was built over (the engine
reads only what :class:`~graphrunner_ref.engine.registry.ServingBundle`
names). What differs between the model kinds is one value, a
:class:`DecodeStep`, which each kind's registration makes
(:func:`decode_step` asks the registry): the decode fields, the attention
hooks, the sanitizer, the recorded state ops the runner runs before launch,
and how a :class:`DecodeBatch` becomes the step's inputs.
:func:`create_decode_runner` builds a runner for any bundle from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphrunner import (
    FutureMap,
    GraphRunner,
    GuardedTensor,
    PaddingSanitizer,
    create_runner,
    decode_phase,
)
from graphrunner.phases import check_steps_per_launch, token_batch_phase
from graphrunner.sampling import TokenCounts
from graphrunner_ref.engine import kinds
from graphrunner_ref.engine.multistep_runner import multistep_of, multistep_phase_of
from graphrunner_ref.engine.ranks import agree_on_sizes
from graphrunner_ref.engine.registry import DecodeStep, ServingBundle, kind_of

__all__ = [
    "DecodeStep",
    "ServingBundle",
    "create_decode_runner",
    "create_token_runner",
    "decode_step",
    "multistep_of",
]

#: The built-in kinds are registered before any bundle asks for its step.
BUILT_IN_KINDS = kinds.BUILT_IN


#: The most prompts one token-batch step holds (its request axis): a step's
#: budget goes to few prompts; a step of more runs eagerly, counted.
TOKEN_BATCH_REQUESTS = 8


def takes_token_batches(bundle: ServingBundle) -> bool:
    """Whether ``bundle``'s model runs a token batch (``forward_token_batch``:
    the native Llama)."""
    return callable(getattr(getattr(bundle, "model", None), "forward_token_batch", None))


def create_token_runner(
    bundle: ServingBundle,
    kind: str,
    max_tokens: int,
    *,
    capture_sizes: Sequence[int] | None = None,
    show_progress: bool = False,
    check_padding: bool = False,
    **mechanism_options: Any,
) -> GraphRunner:
    """A ``kind`` runner of the token-batch phase over ``bundle``'s
    ``forward_token_batch`` (prompt chunks, prefilled as one padded step),
    captured at ``capture_sizes`` token counts (None: the library's
    :func:`~graphrunner.sizing.default_token_sizes` up to ``max_tokens``,
    the engine's per-step budget), :data:`TOKEN_BATCH_REQUESTS` requests a
    step. ``check_padding``: the bundle's sanitizer around every replay.
    Not yet captured."""
    if not takes_token_batches(bundle):
        raise TypeError(f"{type(bundle.model).__name__} has no forward_token_batch")
    step = decode_step(bundle)
    model: Any = bundle.model
    phase = token_batch_phase(model.forward_token_batch, max_requests=TOKEN_BATCH_REQUESTS)
    sizes = list(capture_sizes) if capture_sizes else None
    _key_saved_program(kind, bundle, mechanism_options, phase="token batch")
    return create_runner(
        phase,
        kind=kind,
        device=bundle.device,
        capture_sizes=sizes,
        max_bs=None if sizes else max_tokens,
        show_progress=show_progress,
        sanitizer=step.sanitizer() if check_padding else None,
        **mechanism_options,
    )


def aot_key(bundle: ServingBundle) -> dict[str, str]:
    """What a saved CPU program of ``bundle`` is keyed by besides the library's
    own fields (:mod:`graphrunner.mechanisms.aot`): the model (its class and
    config, hashed), the classes of its modules in order (hashed: which
    product each projection runs, e.g. int4-q8's q/k/v on float32 inputs),
    its dtype and its KV cache's, its quantize mode, this CPU's features and
    compact-weight kernel paths, and the C++ kernels' builds (a program saved
    against another build's ops or weight layout is never loaded)."""
    import hashlib

    from graphrunner_ref.model.attention_cpu import ATTENTION_BUILD
    from graphrunner_ref.model.cpu_features import KERNEL_PATHS, cpu_features, kernel_summary
    from graphrunner_ref.model.cpu_kernels import KERNEL_BUILD

    model: Any = bundle.model
    config = f"{type(model).__qualname__}:{getattr(model, 'config', None)!r}"
    modules = ",".join(type(m).__qualname__ for m in model.modules())
    dtype = next((str(p.dtype) for p in model.parameters()), "none")
    kv_cache = getattr(bundle, "kv_cache", None)
    kv_dtype = "none" if kv_cache is None else str(kv_cache.dtype)
    quantize = getattr(model, "quantization", None)
    known = {p.product for p in KERNEL_PATHS}
    products = [p for p in (quantize, f"{quantize}-q8") if p in known]
    return {
        "model": hashlib.sha256(config.encode()).hexdigest()[:16],
        "modules": hashlib.sha256(modules.encode()).hexdigest()[:16],
        "dtype": dtype.removeprefix("torch."),
        "kv dtype": kv_dtype.removeprefix("torch."),
        "quantize": str(quantize),
        "cpu features": f"{cpu_features().describe()}; kernels {kernel_summary(products)}",
        "kernel builds": f"{KERNEL_BUILD}, {ATTENTION_BUILD}",
    }


def _key_saved_program(
    kind: str, bundle: ServingBundle, mechanism_options: dict[str, Any], **fields: str
) -> None:
    """Where a CPU runner saves its program (``aot_cache``), key it by
    ``fields`` (what the phase is) and :func:`aot_key` too, unless the
    caller gave an ``aot_key`` of its own."""
    if kind == "cpu" and mechanism_options.get("aot_cache") is not None:
        mechanism_options.setdefault("aot_key", {**fields, **aot_key(bundle)})


def _guard_counts(sanitizer: PaddingSanitizer, counts: TokenCounts | None) -> PaddingSanitizer:
    """``sanitizer`` guarding the token counts too: a step writes only its live
    rows' counts (row 0 never) and never the prompt marks (the host's)."""
    if counts is not None:
        sanitizer.guarded += [
            GuardedTensor("token_counts", counts.counts, "req_pool_indices", sink_rows=0),
            GuardedTensor("prompt_tokens", counts.prompt, None, sink_rows=0, unit="request row"),
        ]
    return sanitizer


def decode_step(bundle: ServingBundle) -> DecodeStep:
    """The :class:`DecodeStep` of ``bundle``, made by its registered kind
    (``TypeError`` for a bundle of no registered kind)."""
    return kind_of(bundle).step(bundle)


def create_decode_runner(
    bundle: ServingBundle,
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
    penalties: bool = False,
    structured: bool = False,
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
    ``penalties=True`` (with ``sampling``) applies each request's repetition,
    presence and frequency penalties and logit bias inside the step, over
    per-request token counts indexed by request-pool row (the phase's
    ``token_counts``, :class:`~graphrunner.sampling.TokenCounts`).
    ``structured=True`` (with ``sampling``, one step a launch, no
    ``future_map``) declares a grammar's ``token_bitmask`` int32
    ``[bs, ceil(vocab / 32)]`` and masks the sampler's logits with it inside
    the step (:mod:`graphrunner.sampling.bitmask`); the engine fills it
    from each request's grammar before every step, so the step needs this
    step's token first: not with overlap or several steps a launch.
    With ``aot_cache=DIR`` (``cpu``) the program is saved in ``DIR`` and later
    captures load it without tracing, keyed by :func:`aot_key` too.
    ``mechanism_options`` go to the runner's mechanism, e.g. ``compile=True``
    for ``cuda``; a step that asks for it (the transformers bridge's)
    compiles with ``fullgraph=True`` (a model that cannot be captured is
    refused naming its line). A
    tensor-parallel model's ranks must resolve the same capture sizes (checked
    across ranks: ``ValueError`` naming each rank's list).
    """
    step = decode_step(bundle)
    steps = check_steps_per_launch("steps_per_launch", steps_per_launch)
    if logprobs and not sampling:
        raise ValueError(f"logprobs={logprobs!r} needs sampling=True (the sampled step)")
    if penalties and not sampling:
        raise ValueError("penalties=True needs sampling=True (the sampled step)")
    _check_structured(structured, sampling, steps, future_map)
    counts = (
        TokenCounts(bundle.req_pool.req_to_token.shape[0], bundle.config.vocab_size, bundle.device)
        if penalties
        else None
    )
    if future_map is not None and step.mamba:
        raise ValueError(
            "future_map: overlap scheduling is not supported for a model with Mamba "
            "layers; expected future_map=None"
        )
    if steps > 1:
        phase = multistep_phase_of(
            step.forward,
            step.backend,
            step.mamba,
            steps,
            end_token,
            future_map,
            logprobs,
            sampling,
            counts,
        )
    else:
        phase = decode_phase(
            step.forward,
            backend=step.backend,
            future=future_map is not None,
            mamba=step.mamba,
            sampling=sampling,
            logprobs=logprobs,
            penalties=counts,
            token_bitmask=bundle.config.vocab_size if structured else None,
        )
    _key_saved_program(
        kind,
        bundle,
        mechanism_options,
        steps=str(steps),
        sampling=f"{sampling}/{logprobs}"
        + ("/penalties" if penalties else "")
        + ("/bitmask" if structured else ""),
    )
    compiles = kind == "cpu" or mechanism_options.get("compile", False)
    if step.fullgraph and compiles:
        mechanism_options.setdefault("fullgraph", True)
    runner = create_runner(
        phase,
        kind=kind,
        device=bundle.device,
        capture_sizes=capture_sizes,
        max_bs=max_bs,
        show_progress=show_progress,
        sanitizer=_guard_counts(step.sanitizer(), counts) if check_padding else None,
        future_map=future_map,
        state_ops=step.state_ops,
        **mechanism_options,
    )
    return agree_on_sizes(bundle, runner)


def _check_structured(
    structured: bool, sampling: bool, steps: int, future_map: FutureMap | None
) -> None:
    """``structured=True`` refused by name where the host cannot fill each
    step's bitmask after the last step's token: without the sampled step,
    with several steps a launch, or with overlap (a future map)."""
    if not structured:
        return
    if not sampling:
        raise ValueError("structured=True needs sampling=True (the sampled step masks)")
    if steps > 1:
        raise ValueError(
            f"structured=True with steps_per_launch={steps}: a grammar's bitmask follows "
            "each token, which a launch of several steps draws on the device; expected 1"
        )
    if future_map is not None:
        raise ValueError(
            "structured=True with a future_map (overlap scheduling): the next step's "
            "bitmask needs this step's token on the host; expected future_map=None"
        )

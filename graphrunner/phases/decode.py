"""The decode phase as a value: one token per request on
:func:`~graphrunner.declare.decode.decode_buffer_specs`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.phases.base import Phase
from graphrunner.phases.sampled import LOGPROB_OUTPUTS, SAMPLED_OUTPUTS, sampled_forward
from graphrunner.sampling import SAMPLING_FIELDS

if TYPE_CHECKING:
    from graphrunner.sampling.penalties import TokenCounts

__all__ = ["decode_phase"]


def decode_phase(
    forward: ForwardFn,
    *,
    backend: GraphBackend | None = None,
    outputs: OutputsDecl | None = None,
    host_seq_lens: bool = False,
    future: bool = False,
    mamba: bool = False,
    sampling: bool = False,
    logprobs: int = 0,
    penalties: TokenCounts | None = None,
    token_bitmask: int | None = None,
) -> Phase:
    """``forward`` over the decode buffers (int64 ``[bs]`` each, see
    :func:`~graphrunner.declare.decode.decode_buffer_specs` for the flags),
    ``seq_lens`` padded with the backend's fill value. ``sampling=True``:
    ``forward`` returns logits ``[bs, vocab]`` and the phase picks each row's
    token inside the step (:mod:`graphrunner.phases.sampled`: the sampling
    buffers added, outputs ``{"logits", "tokens"}``; ``outputs`` must be None);
    ``logprobs=n`` (with ``sampling``) adds each row's chosen-token
    log-probability ``"logprob"`` ``[bs]`` and the top ``n`` ``"top_logprobs"``
    / ``"top_ids"`` ``[bs, n]``; ``penalties`` (a
    :class:`~graphrunner.sampling.TokenCounts`, with ``sampling``) adds the
    penalty buffers and applies them in the step (the phase's ``token_counts``);
    ``token_bitmask=V``: a grammar's mask (:mod:`graphrunner.sampling.bitmask`)."""
    if logprobs and not sampling:
        raise ValueError(f"logprobs={logprobs!r} needs sampling=True (the sampled step)")
    if penalties is not None and not sampling:
        raise ValueError("penalties: token counts need sampling=True (the sampled step)")
    if token_bitmask is not None and not sampling:
        raise ValueError(f"token_bitmask={token_bitmask!r} needs sampling=True (it masks)")
    fill = (backend if backend is not None else NullBackend()).seq_len_fill_value
    specs = decode_buffer_specs(
        seq_len_fill_value=fill, host_seq_lens=host_seq_lens, future=future, mamba=mamba
    )
    if sampling:
        if outputs is not None:
            raise ValueError("outputs: a sampled decode phase declares its own; expected None")
        specs = [*specs, *SAMPLING_FIELDS, *(penalties.FIELDS if penalties else ())]
        if token_bitmask is not None:  # the sampler reads it by name
            from graphrunner.sampling.bitmask import bitmask_spec

            specs.append(bitmask_spec(token_bitmask))
        forward = sampled_forward(forward, logprobs_n=logprobs, counts=penalties)
        outputs = LOGPROB_OUTPUTS if logprobs else SAMPLED_OUTPUTS
    return Phase(
        "decode", forward, tuple(specs), outputs=outputs, backend=backend, token_counts=penalties
    )

"""Programmatic dependent launch (PDL) for a Llama decoder's Triton kernels.

:func:`use_programmatic_launch` makes the decode attention's two kernels and
the small-batch linears launch with PDL (see
:mod:`~graphrunner_ref.model.kernels.pdl` for what each kernel then guarantees);
the kernels inductor generates between them keep plain launches unless
:data:`~graphrunner_ref.model.kernels.pdl.INDUCTOR_OPTIONS` is passed to the CUDA
runner (inductor's own waits). Opt-in: a captured size keeps the launches it
was captured with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from graphrunner_ref.model.kernels.pdl import check_device

if TYPE_CHECKING:
    from graphrunner_ref.model.llama import LlamaDecoder, LlamaDecoderLayer

__all__ = ["use_programmatic_launch"]


def use_programmatic_launch(model: LlamaDecoder, enabled: bool = True) -> None:
    """Launch ``model``'s Triton kernels programmatically (``enabled``) or
    plainly (the default). Call it before capture.

    Raises ``ValueError`` for a non-bool ``enabled``, or, to enable, a model
    whose KV cache is not on a CUDA device of compute capability 9.0+.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"use_programmatic_launch: enabled={enabled!r}: expected a bool")
    if enabled:
        check_device(model.kv_cache.k_buffers[0].device, "use_programmatic_launch")
    model.programmatic_launch = enabled
    model.attn_backend.programmatic_launch = enabled
    for layer in model.model.layers:
        cast("LlamaDecoderLayer", layer).programmatic_launch = enabled

"""Target verify: the target model over ``W = K + 1`` tokens per request (the
bonus token and ``K`` drafts), on the same buffers, populate and replay as decode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.outputs import OutputSpec
from graphrunner.phases.base import WidthRunner, check_width

if TYPE_CHECKING:  # the models implement these phases; phases sit below them
    from graphrunner.model.llama import LlamaDecoder

__all__ = ["TargetVerifyRunner", "verify_buffer_specs"]

_I64 = torch.int64


def verify_buffer_specs(width: int) -> list[BufferSpec]:
    """Per-token (``W`` rows per request): ``input_ids``, ``positions``,
    ``out_cache_loc``, padded with 0 (slot 0). Per request: ``req_pool_indices``
    (0) and ``seq_lens``, the length after the step, padded with ``W``: a
    padded row is ``W`` tokens at slot 0 and its prefix ``seq_lens - W`` is 0,
    never negative."""
    w = check_width("width", width)
    return [
        BufferSpec("input_ids", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec("positions", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec("out_cache_loc", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec("req_pool_indices", _I64, PadRule.ZERO, index=True),
        BufferSpec("seq_lens", _I64, PadRule.WIDTH, width=w),
    ]


class TargetVerifyRunner(WidthRunner):
    """Captures the target's ``forward_tokens`` at ``width`` tokens per request.

    Replay returns ``logits`` float32 ``[bs * W, vocab]`` and ``hidden``
    ``[bs * W, hidden]`` of the live requests. Every token's KV slot must be
    recorded in ``req_to_token`` before the replay (as decode's
    ``prepare_decode`` does for one token).
    """

    def __init__(self, model: LlamaDecoder, width: int, **kwargs: Any) -> None:
        per_token = OutputSpec(rows_per_request=width)
        super().__init__(
            model.forward_tokens,
            verify_buffer_specs(width),
            width=width,
            outputs={"logits": per_token, "hidden": per_token},
            backend=model.attn_backend,
            **kwargs,
        )

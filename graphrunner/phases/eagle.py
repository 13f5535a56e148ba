"""The EAGLE draft-extend phase: the draft head over the ``W`` verified
tokens of each request, filling its own KV and proposing the next round's seed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.declare.outputs import OutputSpec
from graphrunner.phases.base import WidthRunner, check_width

if TYPE_CHECKING:  # the models implement these phases; phases sit below them
    from graphrunner.model.draft import EagleHead

__all__ = ["EagleDraftDecodeRunner", "EagleDraftExtendRunner", "eagle_draft_extend_specs"]

_I64 = torch.int64


def eagle_draft_extend_specs(
    width: int, hidden_size: int, hidden_dtype: torch.dtype
) -> list[BufferSpec]:
    """Per token (``W`` rows per request): ``input_ids``, ``positions``,
    ``out_cache_loc`` (0: slot 0) and the target's ``hidden_states`` (0). Per
    request: ``req_pool_indices`` (0), ``seq_lens`` (the length after the
    extend; ``W`` on padded rows, so their prefix is 0), ``extend_lens`` and
    ``accept_lens`` (``W``: a padded row's select index ``row * W + W - 1``
    stays inside its own row)."""
    w = check_width("width", width)
    return [
        BufferSpec("input_ids", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec("positions", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec("out_cache_loc", _I64, PadRule.ZERO, rows_per_request=w, index=True),
        BufferSpec(
            "hidden_states",
            hidden_dtype,
            PadRule.ZERO,
            rows_per_request=w,
            extra_shape=(hidden_size,),
        ),
        BufferSpec("req_pool_indices", _I64, PadRule.ZERO, index=True),
        BufferSpec("seq_lens", _I64, PadRule.WIDTH, width=w),
        BufferSpec("extend_lens", _I64, PadRule.WIDTH, width=w, index=True),
        BufferSpec("accept_lens", _I64, PadRule.WIDTH, width=w, index=True),
    ]


class EagleDraftExtendRunner(WidthRunner):
    """Captures :meth:`EagleHead.forward_extend` at ``width`` tokens per request.

    Replay returns ``topk_p`` float32 ``[bs, k]``, ``topk_index`` int64
    ``[bs, k]`` and the selected ``hidden`` ``[bs, hidden]``.
    """

    def __init__(self, head: EagleHead, width: int, **kwargs: Any) -> None:
        target = head.target
        dtype = target.model.embed_tokens.weight.dtype
        super().__init__(
            head.forward_extend,
            eagle_draft_extend_specs(width, target.config.hidden_size, dtype),
            width=width,
            outputs=OutputSpec(),
            backend=target.attn_backend,
            **kwargs,
        )


class EagleDraftDecodeRunner(GraphRunner):
    """Captures :meth:`EagleHead.forward_decode`: one draft token per request
    (the draft steps after the seed), on the decode buffers plus the previous
    step's ``hidden_states`` ``[bs, hidden]`` (0 on padded rows). Writes the
    head's own KV at ``out_cache_loc`` (slot 0 on padded rows)."""

    def __init__(self, head: EagleHead, **kwargs: Any) -> None:
        target = head.target
        backend = target.attn_backend
        hidden = BufferSpec(
            "hidden_states",
            target.model.embed_tokens.weight.dtype,
            PadRule.ZERO,
            extra_shape=(target.config.hidden_size,),
        )
        specs = [*decode_buffer_specs(seq_len_fill_value=backend.seq_len_fill_value), hidden]
        super().__init__(
            head.forward_decode, specs, outputs=OutputSpec(), backend=backend, **kwargs
        )

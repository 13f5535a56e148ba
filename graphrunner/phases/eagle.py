"""The EAGLE draft phases: draft extend (the head over the ``W`` verified
tokens of each request, filling its own KV and proposing the next round's
seed) and draft decode (one draft token per request)."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.core.create import runner_parts
from graphrunner.core.options import RunnerOptions
from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec, Index, PadRule
from graphrunner.declare.decode import decode_buffer_specs, per_token_fields
from graphrunner.declare.outputs import OutputSpec
from graphrunner.phases.base import Phase, check_width
from graphrunner.phases.models import EagleDraftModel

__all__ = [
    "EagleDraftExtendRunner",
    "eagle_draft_decode_phase",
    "eagle_draft_extend_phase",
    "eagle_draft_extend_specs",
]

_I64 = torch.int64

#: The per-request lengths draft extend adds, padded with ``W``.
EXTEND_LENGTHS: tuple[str, ...] = ("extend_lens", "accept_lens")


def _hidden(hidden_size: int, dtype: torch.dtype, rows_per_request: int = 1) -> BufferSpec:
    # The target's hidden states, 0 on padded rows (never stale, never NaN).
    return BufferSpec(
        "hidden_states",
        dtype,
        PadRule.ZERO,
        rows_per_request=rows_per_request,
        extra_shape=(hidden_size,),
    )


def eagle_draft_extend_specs(
    width: int, hidden_size: int, hidden_dtype: torch.dtype
) -> list[BufferSpec]:
    """The decode fields at ``W`` tokens per request
    (:func:`~graphrunner.declare.decode.per_token_fields`) plus the target's
    per-token ``hidden_states`` (0) and per-request ``extend_lens`` and
    ``accept_lens`` (``W``: a padded row's select index ``row * W + W - 1``
    stays inside its own row)."""
    w = check_width("width", width)
    lengths = [
        BufferSpec(n, _I64, PadRule.WIDTH, width=w, index=True, indexes=Index.COUNT)
        for n in EXTEND_LENGTHS
    ]
    return [*per_token_fields(w), _hidden(hidden_size, hidden_dtype, w), *lengths]


def eagle_draft_extend_phase(head: EagleDraftModel, width: int) -> Phase:
    """:meth:`EagleDraftModel.forward_extend` at ``width`` tokens per request; outputs
    ``topk_p`` float32 ``[bs, k]``, ``topk_index`` int64 ``[bs, k]`` and the
    selected ``hidden`` ``[bs, hidden]``."""
    specs = eagle_draft_extend_specs(width, head.hidden_size, head.hidden_dtype)
    return Phase(
        "eagle_extend",
        head.forward_extend,
        tuple(specs),
        outputs=OutputSpec(),
        backend=head.attn_backend,
        width=width,
    )


def eagle_draft_decode_phase(head: EagleDraftModel) -> Phase:
    """:meth:`EagleDraftModel.forward_decode`: one draft token per request (the draft
    steps after the seed), on the decode buffers plus the previous step's
    ``hidden_states`` ``[bs, hidden]`` (0 on padded rows). Writes the head's
    own KV at ``out_cache_loc`` (slot 0 on padded rows)."""
    backend = head.attn_backend
    hidden = _hidden(head.hidden_size, head.hidden_dtype)
    specs = (*decode_buffer_specs(seq_len_fill_value=backend.seq_len_fill_value), hidden)
    return Phase("eagle_decode", head.forward_decode, specs, outputs=OutputSpec(), backend=backend)


class EagleDraftExtendRunner(GraphRunner):
    """``create_runner(eagle_draft_extend_phase(head, width), ...)``.

    Replay returns ``topk_p`` float32 ``[bs, k]``, ``topk_index`` int64
    ``[bs, k]`` and the selected ``hidden`` ``[bs, hidden]``.
    """

    def __init__(
        self,
        head: EagleDraftModel,
        width: int,
        *,
        options: RunnerOptions | None = None,
        **fields: Any,
    ) -> None:
        phase = eagle_draft_extend_phase(head, width)
        super().__init__(*runner_parts(phase, None, options, fields))

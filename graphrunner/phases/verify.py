"""Target verify: the target model over ``W = K + 1`` tokens per request (the
bonus token and ``K`` drafts), on the same buffers, populate and replay as decode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.declare.decode import per_token_fields
from graphrunner.declare.outputs import OutputSpec
from graphrunner.phases.base import Phase

if TYPE_CHECKING:  # the models implement these phases; phases sit below them
    from graphrunner.model.llama import LlamaDecoder

__all__ = ["TargetVerifyRunner", "verify_buffer_specs", "verify_phase"]


def verify_buffer_specs(width: int) -> list[BufferSpec]:
    """The decode fields at ``width`` tokens per request
    (:func:`~graphrunner.declare.decode.per_token_fields`): per-token
    ``input_ids``, ``positions``, ``out_cache_loc`` padded with 0 (slot 0); per
    request ``req_pool_indices`` (0) and ``seq_lens``, the length after the
    step, padded with ``W`` (a padded row's prefix ``seq_lens - W`` is 0)."""
    return per_token_fields(width)


def verify_phase(model: LlamaDecoder, width: int) -> Phase:
    """The target's ``forward_tokens`` at ``width`` tokens per request.

    Outputs ``logits`` float32 ``[bs * W, vocab]`` and ``hidden``
    ``[bs * W, hidden]``, ``W`` rows per request.
    """
    per_token = OutputSpec(rows_per_request=width)
    return Phase(
        "verify",
        model.forward_tokens,
        tuple(verify_buffer_specs(width)),
        outputs={"logits": per_token, "hidden": per_token},
        backend=model.attn_backend,
        width=width,
    )


class TargetVerifyRunner(GraphRunner):
    """:func:`verify_phase` on the mechanism given in ``kwargs``.

    Replay returns ``logits`` float32 ``[bs * W, vocab]`` and ``hidden``
    ``[bs * W, hidden]`` of the live requests. Every token's KV slot must be
    recorded in ``req_to_token`` before the replay (as decode's
    ``prepare_decode`` does for one token).
    """

    def __init__(self, model: LlamaDecoder, width: int, **kwargs: Any) -> None:
        super().__init__(**verify_phase(model, width).runner_args(), **kwargs)

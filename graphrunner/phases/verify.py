"""Target verify: the target model over ``W = K + 1`` tokens per request (the
bonus token and ``K`` drafts), on the same buffers, populate and replay as decode.

With ``sampling=True`` the verify also accepts or rejects the drafts inside
the captured step, by rejection sampling
(:func:`~graphrunner.sampling.rejection_sample`): it reads the sampling rows
(:data:`~graphrunner.sampling.SAMPLING_FIELDS`) and the ``q`` each draft was
drawn from, and returns the tokens to emit and the drafts that hold, so a
speculative round samples without leaving the graph. Greedy rows in the same
batch keep the argmax rule bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.decode import per_token_fields
from graphrunner.declare.outputs import OutputSpec
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.phases.base import Phase
from graphrunner.phases.models import VerifyModel
from graphrunner.sampling import SAMPLING_FIELD_NAMES, SAMPLING_FIELDS

__all__ = [
    "DRAFT_PROBS",
    "rejection_forward",
    "verify_buffer_specs",
    "verify_phase",
]

#: The buffer of the drafts' distributions ``q`` a sampled verify reads.
DRAFT_PROBS = "draft_probs"


def verify_buffer_specs(width: int) -> list[BufferSpec]:
    """The decode fields at ``width`` tokens per request
    (:func:`~graphrunner.declare.decode.per_token_fields`): per-token
    ``input_ids``, ``positions``, ``out_cache_loc`` padded with 0 (slot 0); per
    request ``req_pool_indices`` (0) and ``seq_lens``, the length after the
    step, padded with ``W`` (a padded row's prefix ``seq_lens - W`` is 0)."""
    return per_token_fields(width)


def draft_probs_spec(width: int, vocab: int) -> BufferSpec:
    """``draft_probs`` float32 ``[bs, K, vocab]`` (``K = width - 1``): the
    distribution each draft was drawn from (one-hot for drafts not drawn);
    padded rows 0, under which a padded row's test stays finite."""
    return BufferSpec(DRAFT_PROBS, torch.float32, PadRule.ZERO, extra_shape=(width - 1, vocab))


def rejection_forward(forward: ForwardFn, width: int) -> ForwardFn:
    """``forward`` (the target's ``forward_tokens``) followed by rejection
    sampling of its ``K = width - 1`` drafts: the drafts are the inputs'
    ``input_ids`` after each row's bonus token, the first draft's position
    ``positions`` of column 1. Adds ``targets`` int64 ``[bs, W]`` (column
    ``j``: the token emitted when ``j`` drafts hold) and ``accepted`` int64
    ``[bs]`` to the forward's outputs."""
    from graphrunner.sampling.speculative import rejection_sample  # speculative runs only

    def step(b: Any) -> dict[str, torch.Tensor]:
        out = forward(b)
        if not isinstance(out, dict):
            raise TypeError(
                f"a sampled verify needs the forward's dict of outputs; got {type(out).__name__}"
            )
        logits = out["logits"]
        # The vocabulary by name, never a -1: under a symbolic batch the
        # compiler cannot prove a -1 equals it, and the sampler's broadcasts
        # on that axis then fail to trace.
        bs, vocab = logits.shape[0] // width, logits.shape[-1]
        ids, positions = b.input_ids.view(bs, width), b.positions.view(bs, width)
        rows = {name: getattr(b, name) for name in SAMPLING_FIELD_NAMES}
        targets, accepted = rejection_sample(
            logits.view(bs, width, vocab),
            ids[:, 1:],
            getattr(b, DRAFT_PROBS),
            rows,
            positions[:, 1],
        )
        return {**out, "targets": targets, "accepted": accepted}

    return step


def verify_phase(model: VerifyModel, width: int, *, sampling: bool = False) -> Phase:
    """The target's ``forward_tokens`` at ``width`` tokens per request.

    Outputs ``logits`` float32 ``[bs * W, vocab]`` and ``hidden``
    ``[bs * W, hidden]``, ``W`` rows per request. ``sampling``: the step
    also reads the sampling rows and ``draft_probs`` (:func:`draft_probs_spec`)
    and returns ``targets`` ``[bs, W]`` and ``accepted`` ``[bs]``
    (:func:`rejection_forward`); needs ``width >= 2``.
    """
    per_token = OutputSpec(rows_per_request=width)
    specs = verify_buffer_specs(width)
    outputs = {"logits": per_token, "hidden": per_token}
    forward: ForwardFn = model.forward_tokens
    if sampling:
        if width < 2:
            raise ValueError(f"width={width}: a sampled verify needs at least one draft (>= 2)")
        specs += [*SAMPLING_FIELDS, draft_probs_spec(width, model.vocab_size)]
        outputs |= {"targets": OutputSpec(), "accepted": OutputSpec()}
        forward = rejection_forward(forward, width)
    return Phase(
        "verify",
        forward,
        tuple(specs),
        outputs=outputs,
        backend=model.attn_backend,
        width=width,
    )

"""A step that picks its tokens inside the captured graph.

:func:`sampled_forward` wraps a forward returning logits ``[bs, vocab]``: the
step reads the per-request sampling buffers
(:data:`~graphrunner.sampling.SAMPLING_FIELDS`, padded rows at temperature 1,
top-k 1) and returns ``{"logits": [bs, vocab], "tokens": [bs]}``, the token
of each row drawn by :func:`~graphrunner.sampling.sample` from the row's seed
and the position the drawn token takes (``positions + 1``). A greedy row
(temperature 0) takes ``argmax``, bit for bit. With ``logprobs=N`` (N >= 1)
the step also returns the chosen tokens' log-probabilities ``"logprob"``
``[bs]`` and the top-N ``"top_logprobs"`` ``[bs, N]`` (descending) with
their ids ``"top_ids"`` ``[bs, N]``, from the unfiltered softmax
(:func:`~graphrunner.sampling.logprobs`). The step is a
:class:`~graphrunner.mechanisms.base.SplitForward`: the forward, then the
sampler over its logits, which a saved program runs after the model.

With ``counts`` (a :class:`~graphrunner.sampling.TokenCounts`) the sampler
draws from :mod:`~graphrunner.sampling.processors`' logits (penalties,
``min_tokens``, and a ``token_bitmask`` where the step declares one;
``logits`` and log-probabilities stay the model's), counting each token.

:func:`with_sampling` hands a step its sampling rows beside any decode
inputs (a :class:`~graphrunner.DecodeBatch`), as one
:class:`~graphrunner.phases.SpecBatch`: a sealed batch's step is sealed too
(the rows checked once, there), so the replay path checks it in O(1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.declare.buffers import BufferSpec
from graphrunner.declare.outputs import OutputSpec
from graphrunner.mechanisms.base import ForwardFn, SplitForward
from graphrunner.phases.base import SpecBatch
from graphrunner.sampling import SAMPLING_FIELD_NAMES, SAMPLING_FIELDS, logprobs, sample

if TYPE_CHECKING:
    from graphrunner.sampling.penalties import TokenCounts

__all__ = ["LOGPROB_OUTPUTS", "SAMPLED_OUTPUTS", "pick", "sampled_forward", "with_sampling"]

#: The outputs of a sampled step: one row per request each.
SAMPLED_OUTPUTS: Mapping[str, OutputSpec] = {"logits": OutputSpec(), "tokens": OutputSpec()}
#: A sampled step's outputs with log-probabilities (``logprobs=N``): one row per request each.
LOGPROB_OUTPUTS: Mapping[str, OutputSpec] = {
    **SAMPLED_OUTPUTS,
    "logprob": OutputSpec(),
    "top_logprobs": OutputSpec(),
    "top_ids": OutputSpec(),
}


def sampled_forward(
    forward: ForwardFn, *, logprobs_n: int = 0, counts: TokenCounts | None = None
) -> ForwardFn:
    """``forward`` (logits ``[bs, vocab]``) followed by the in-graph sampler;
    ``logprobs_n`` >= 1 adds the log-probability outputs (:data:`LOGPROB_OUTPUTS`);
    ``counts``: the penalties and logit bias apply, and the tokens are counted."""
    if isinstance(logprobs_n, bool) or not isinstance(logprobs_n, int) or logprobs_n < 0:
        raise ValueError(f"logprobs={logprobs_n!r}; expected an int >= 0 (0: none)")

    def tail(logits: Any, b: Any) -> dict[str, torch.Tensor]:
        if not isinstance(logits, torch.Tensor):
            raise TypeError(
                f"a sampled step needs the forward's logits tensor [bs, vocab]; got "
                f"{type(logits).__name__}"
            )
        tokens = pick(logits, b, b.req_pool_indices, b.positions + 1, counts)
        if not logprobs_n:
            return {"logits": logits, "tokens": tokens}
        lp = logprobs(logits, tokens, logprobs_n)
        return {
            "logits": logits,
            "tokens": tokens,
            "logprob": lp.chosen,
            "top_logprobs": lp.top,
            "top_ids": lp.top_ids,
        }

    # The model and the sampler apart: a saved program holds the model, and
    # the sampler, whose work depends on the live rows, runs after it.
    return SplitForward(forward, tail)


def pick(
    logits: torch.Tensor,
    b: Any,
    req_pool_indices: torch.Tensor,
    position: torch.Tensor,
    counts: TokenCounts | None,
) -> torch.Tensor:
    """Each row's token (int64 ``[n]``) from ``logits [n, V]`` by ``b``'s
    sampling buffers at ``position``, processed first with ``counts`` (then
    counted) or ``b.token_bitmask`` (:mod:`graphrunner.sampling.processors`)."""
    # Padded rows (request row 0, the reserved one) never sample nor need a
    # logits pass: a batch of greedy requests skips them on the CPU, however
    # it is padded.
    live = req_pool_indices != 0
    mask = getattr(b, "token_bitmask", None)  # declared by a step that masks
    if counts is not None or mask is not None:
        from graphrunner.sampling.processors import process_logits

        logits = process_logits(logits, b, req_pool_indices, position, counts, mask, live=live)
    token = sample(
        logits, b.temperature, b.top_k, b.top_p, b.min_p, b.sampling_seed, position, live=live
    )
    if counts is not None:
        counts.record(req_pool_indices, token)
    return token


def with_sampling(base: Any, rows: Mapping[str, torch.Tensor]) -> SpecBatch:
    """``base`` (a :class:`~graphrunner.DecodeBatch`, a
    :class:`~graphrunner.phases.SpecBatch`, or any step inputs with its
    tensors as attributes) with the sampling rows of its requests, as one
    :class:`~graphrunner.phases.SpecBatch`.

    A sealed ``base`` gives a sealed step (:meth:`SpecBatch.extending`): the
    rows are checked here, once, against their declarations, and rows that do
    not fit leave the step unsealed, for the replay to refuse naming the field.

    Args:
        base: the step's other inputs: its tensors (the decode fields, the
            host mirrors) are the step's; ``batch_size`` is the mirrors' length.
        rows: :func:`~graphrunner.sampling.sampling_tensors` of the batch's
            requests in row order: ``temperature``, ``top_p``, ``min_p``
            float32 ``[bs]``; ``top_k``, ``sampling_seed`` int64 ``[bs]``;
            and, for a step with penalties, all of
            :func:`~graphrunner.sampling.penalty_tensors`'s rows; and
            ``token_bitmask`` (int32 ``[bs, ceil(V / 32)]``) for a step that masks.

    Raises:
        ValueError: a sampling field is missing, or some penalty fields are
            given without the others.
    """
    chosen, specs = _sampling_rows(rows)
    return SpecBatch.extending(base, specs, **chosen)


def _sampling_rows(
    rows: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[BufferSpec]]:
    """The rows a step takes (sampling, every penalty field or none, a
    bitmask), and their declarations."""
    missing = [n for n in SAMPLING_FIELD_NAMES if n not in rows]
    if missing:
        raise ValueError(f"rows: missing sampling fields {missing}")
    from graphrunner.sampling.penalties import PENALTY_FIELDS

    specs = list(SAMPLING_FIELDS)
    given = [s for s in PENALTY_FIELDS if s.name in rows]
    if given and len(given) != len(PENALTY_FIELDS):
        names = [s.name for s in PENALTY_FIELDS]
        raise ValueError(
            f"rows: penalty fields {[s.name for s in given]}; expected all of {names} or none"
        )
    specs += given
    mask = rows.get("token_bitmask")
    if mask is not None:  # its words per row, as the step declares them
        from graphrunner.sampling.bitmask import bitmask_spec

        words = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() else 1
        specs.append(bitmask_spec(32 * words))
    return {s.name: rows[s.name] for s in specs}, specs

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
inputs (a :class:`~graphrunner.DecodeBatch`): a sealed batch stays sealed, so
the replay path checks it in O(1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from graphrunner.declare.inputs import StepInputs
from graphrunner.declare.outputs import OutputSpec
from graphrunner.declare.sealed import host_min_max, is_keyed_type, is_sealed_inputs
from graphrunner.mechanisms.base import ForwardFn, SplitForward
from graphrunner.sampling import SAMPLING_FIELD_NAMES, logprobs, sample

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


def with_sampling(base: object, rows: Mapping[str, torch.Tensor]) -> StepInputs:
    """``base`` (any step inputs, e.g. a :class:`~graphrunner.DecodeBatch`)
    with the sampling rows of its requests, as one step's inputs.

    Args:
        base: the step's other inputs; every attribute not a sampling field
            is read from it (``batch_size``, the decode fields, host mirrors).
        rows: :func:`~graphrunner.sampling.sampling_tensors` of the batch's
            requests in row order: ``temperature``, ``top_p``, ``min_p``
            float32 ``[bs]``; ``top_k``, ``sampling_seed`` int64 ``[bs]``;
            and, for a step with penalties, all of
            :func:`~graphrunner.sampling.penalty_tensors`'s rows; and
            ``token_bitmask`` for a step that masks.
    """
    return cast(StepInputs, _WithSampling(base, rows))


class _WithSampling:
    """``base`` with sampling rows (see :func:`with_sampling`)."""

    def __init__(self, base: object, rows: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in SAMPLING_FIELD_NAMES if n not in rows]
        if missing:
            raise ValueError(f"rows: missing sampling fields {missing}")
        from graphrunner.sampling.penalties import PENALTY_FIELD_NAMES as penalty

        if (given := [n for n in penalty if n in rows]) and len(given) != len(penalty):
            raise ValueError(f"rows: penalty fields {given}; expected all of {penalty} or none")
        self._base = base
        mask = ("token_bitmask",) if "token_bitmask" in rows else ()
        self._rows = {n: rows[n] for n in (*SAMPLING_FIELD_NAMES, *given, *mask)}

    def __getattr__(self, name: str) -> Any:
        rows = self.__dict__.get("_rows")
        if rows is not None and name in rows:
            return rows[name]
        return getattr(self.__dict__["_base"], name)

    # The sealed-inputs protocol (graphrunner.declare.sealed), when the base
    # speaks it: the sampling rows are made and checked by sampling_tensors.
    @property
    def device(self) -> torch.device:
        device: torch.device = getattr(self._base, "device")  # noqa: B009
        return device

    def is_sealed(self) -> bool:
        # A keyed seal (a SpecBatch's) vouches for its key's layouts only,
        # not for the decode fields the gate trusts a sealed wrapper with.
        base = self._base
        return is_sealed_inputs(base) and not is_keyed_type(type(base)) and base.is_sealed()

    @property
    def sealed(self) -> bool:
        return self.is_sealed()

    def host_range(self, name: str) -> tuple[int, int] | None:
        base = self._base
        if is_sealed_inputs(base):
            return base.host_range(name)
        return host_min_max(getattr(base, name))

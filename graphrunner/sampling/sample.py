"""The in-graph sampler: temperature, top-k, top-p, min-p, one counter-based
uniform per row, branch-free over the batch.

Order and semantics (transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper`` applied in
that order, then a softmax):

1. temperature: ``logits / T`` (``T == 0``: the row is greedy, see below);
2. top-k: keep the tokens whose scaled logit is >= the k-th largest (ties
   with the k-th are kept); ``k == 0`` or ``k >= V`` keeps all;
3. top-p: over the softmax of what top-k kept, drop the tokens whose
   cumulative probability counted from the least probable is <= ``1 - p``:
   the smallest set of most probable tokens that reaches ``p``, never empty;
4. min-p: over the softmax of what top-p kept, drop the tokens below
   ``min_p`` times the most probable one's probability;
5. the kept tokens' softmax is the distribution drawn from.

The draw is an inverse CDF: the row's tokens sorted by probability (a stable
descending sort, so equal logits keep their vocabulary order), one uniform
``u`` from :func:`graphrunner.sampling.random.uniform` (seed, position,
draw 0), the first sorted token whose cumulative probability exceeds ``u``.
One uniform per row and one sort (which top-k and top-p need anyway) is
cheaper than Gumbel-max's ``[n, V]`` noise. The uniform has 24 bits, so a
token's drawn probability is its own within ``2**-24`` (a token below that
may never be drawn at a given (seed, position)).

Rows with ``temperature == 0`` take ``logits.argmax(-1)``, bit for bit (first
index among ties); their other parameters still compute finite numbers and
are discarded through ``torch.where``. On a CUDA device nothing here branches
on data, syncs or allocates state: :func:`sample` captures in a CUDA graph.

On the CPU a step is a compiled program, not a device graph: when no live row
samples, :func:`sample` computes only the argmax (``torch.cond`` compiled, an ``if``
eagerly), the same tokens. The draw sorts every row's vocabulary: SmolLM2 at batch 8
took 48 ms for it against the argmax's 0.5 ms, on every served greedy step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import torch

from graphrunner.sampling.argmax import row_argmax
from graphrunner.sampling.gate import unless
from graphrunner.sampling.random import uniform

__all__ = ["Logprobs", "filtered_probs", "logprobs", "rows_probs", "sample", "sample_rows"]


def _sorted_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities float32 ``[n, V]`` in descending order, 0 where
    filtered, each row summing to 1; their vocabulary ids int64 ``[n, V]``)."""
    x = logits.to(torch.float32)
    vocab = x.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    # Shifted by the row max before dividing: a tiny temperature gives -inf
    # for the others, never inf - inf.
    scaled = (x - x.amax(dim=-1, keepdim=True)) / t.unsqueeze(-1)
    values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    neg_inf = torch.full_like(values, float("-inf"))

    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = values.gather(-1, (k - 1).unsqueeze(-1))
    keep = values >= kth

    probs = torch.softmax(torch.where(keep, values, neg_inf), dim=-1)
    # Cumulative probability from the least probable token, as TopPLogitsWarper
    # sums it (ascending), so the cut lands where transformers puts it.
    from_tail = probs.flip(-1).cumsum(-1).flip(-1)
    first = torch.arange(vocab, device=x.device) == 0
    keep = keep & ((from_tail > (1 - top_p).unsqueeze(-1)) | first)

    probs = torch.softmax(torch.where(keep, values, neg_inf), dim=-1)
    # The most probable token always stays (as top-p keeps it): a row whose
    # min-p is not a number still keeps one token.
    keep = keep & ((probs >= (min_p.unsqueeze(-1) * probs[..., :1])) | first)

    return torch.softmax(torch.where(keep, values, neg_inf), dim=-1), ids


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution :func:`sample` draws from, in vocabulary order.

    Args: as :func:`sample` (no seed or position: nothing random here).

    Returns: float32 ``[n, V]``, each row summing to 1: softmax(logits / T)
    filtered by top-k, top-p, min-p and renormalised; a one-hot at
    ``logits.argmax(-1)`` on rows with ``temperature == 0``. The ``p`` (and
    ``q``) of speculative rejection sampling.
    """
    probs, ids = _sorted_filtered(logits, temperature, top_k, top_p, min_p)
    sampled = torch.zeros_like(probs).scatter(-1, ids, probs)
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(temperature.unsqueeze(-1) == 0, one_hot, sampled)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draw: int = 0,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row, drawn from :func:`filtered_probs`'s distribution.

    Args:
        logits: float ``[n, V]`` (any float dtype; computed in float32).
        temperature: float32 ``[n]``; 0 makes the row greedy (``argmax``).
        top_k: int64 ``[n]``; 0 (or >= V) keeps every token.
        top_p: float32 ``[n]`` in (0, 1]; 1 keeps every token.
        min_p: float32 ``[n]`` in [0, 1]; 0 keeps every token.
        seed: int64 ``[n]``, the request's seed.
        position: int64 ``[n]``, the position of the token being drawn.
        draw: the draw index of the random stream (0 unless a caller needs
            several independent numbers for one position).
        live: bool ``[n]``, the rows whose tokens are used (None: all). On the CPU,
            none at ``temperature > 0``: every row takes its argmax (the module doc).

    Returns: int64 ``[n]``, the token ids. A live row's token depends only on
    its own logits, parameters, seed, position and ``draw``.
    """
    sampling = temperature > 0
    any_samples = (sampling if live is None else sampling & live).any()
    drawn = functools.partial(_drawn, draw=draw)
    return unless(
        any_samples, drawn, _argmax, (logits, temperature, top_k, top_p, min_p, seed, position)
    )


def _argmax(logits: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    """Every row's greedy token: a batch in which no live row samples."""
    return row_argmax(logits)


def _drawn(*operands: torch.Tensor, draw: int) -> torch.Tensor:
    """:func:`sample`'s draw of every row (greedy rows: the argmax)."""
    logits, temperature, top_k, top_p, min_p, seed, position = operands
    probs, ids = _sorted_filtered(logits, temperature, top_k, top_p, min_p)
    cdf = probs.cumsum(-1)
    u = uniform(seed, position, draw).unsqueeze(-1) * cdf[..., -1:]
    # The first sorted token whose cdf exceeds u; clamped to the last kept
    # token, should u * total round up to the total.
    last = (probs > 0).sum(-1, keepdim=True) - 1
    # Never below 0: a row of no finite probability (a parameter that is not
    # a number) picks its first sorted token instead of indexing out of range.
    index = torch.minimum((cdf <= u).sum(-1, keepdim=True), last).clamp_(min=0)
    token = ids.gather(-1, index).squeeze(-1)
    return torch.where(temperature == 0, row_argmax(logits), token)


def rows_probs(logits: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """:func:`filtered_probs` of ``logits [n, V]`` under the sampling ``rows``
    (``temperature``, ``top_k``, ``top_p``, ``min_p``, each ``[n]``): ``[n, V]``."""
    return filtered_probs(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"])


def sample_rows(
    logits: torch.Tensor, rows: Mapping[str, torch.Tensor], position: torch.Tensor
) -> torch.Tensor:
    """:func:`sample` of ``logits [n, V]`` by the sampling ``rows`` (the
    :data:`~graphrunner.sampling.SAMPLING_FIELDS` by name, each ``[n]``) at
    ``position [n]``: tokens int64 ``[n]``."""
    return sample(
        logits,
        rows["temperature"],
        rows["top_k"],
        rows["top_p"],
        rows["min_p"],
        rows["sampling_seed"],
        position,
    )


class Logprobs(NamedTuple):
    """Log-probabilities from the unfiltered softmax of the raw logits.

    ``chosen``: float32 ``[n]``, the chosen tokens'; ``top``: float32
    ``[n, N]``, the ``N`` largest, descending; ``top_ids``: int64 ``[n, N]``,
    their token ids.
    """

    chosen: torch.Tensor
    top: torch.Tensor
    top_ids: torch.Tensor


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> Logprobs:
    """The chosen tokens' and the top-``n`` log-probabilities of
    ``log_softmax(logits)`` (no temperature, no filter: what other servers
    report).

    Args:
        logits: float ``[rows, V]``.
        tokens: int64 ``[rows]``, the tokens chosen (e.g. by :func:`sample`).
        n: how many top log-probabilities per row, an int in ``[0, V]``.
    """
    vocab = logits.shape[-1]
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab:
        raise ValueError(f"n={n!r}; expected an int in [0, {vocab}] (the vocabulary size)")
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    top, top_ids = torch.topk(lp, n, dim=-1)
    return Logprobs(chosen, top, top_ids)

"""Speculative rejection sampling: a draft token ``d`` drawn from the
draft's distribution ``q`` is accepted with probability ``min(1, p(d) / q(d))``
(``p`` the target's); the first rejected column is resampled from the
normalised residual ``max(0, p - q)``, and when every draft holds the token
after them is drawn from ``p``. The emitted tokens then follow the target's
distribution exactly, whatever ``q`` is (Leviathan et al. 2023, Chen et al. 2023).

``p`` and ``q`` are :func:`~graphrunner.sampling.filtered_probs` of the
target's and the draft's logits under the request's own filters. A drafter
whose tokens are not drawn (a greedy draft loop) passes no ``q``: its drafts
are deterministic, ``q`` is their one-hot, and the rule stays exact.

Every random number is counter-based (:func:`~graphrunner.sampling.uniform`
of the request's seed and the drawn token's position), one draw index per use:
:data:`DRAFT_DRAW` for the draft's token, :data:`ACCEPT_DRAW` for the accept
test, :data:`RESIDUAL_DRAW` for the residual (or the bonus) token. Rows with
temperature 0 keep the greedy rule bit for bit: accept while the draft equals
the target's argmax, then the target's argmax. Tensor ops only, no branch on
data, no sync.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graphrunner.sampling.random import uniform
from graphrunner.sampling.sample import rows_probs

__all__ = [
    "ACCEPT_DRAW",
    "DRAFT_DRAW",
    "RESIDUAL_DRAW",
    "deterministic_probs",
    "draft_sample",
    "inverse_cdf",
    "rejection_sample",
]

#: Draw indices of the random stream at one position (0 is the plain sampler's).
DRAFT_DRAW = 1
ACCEPT_DRAW = 2
RESIDUAL_DRAW = 3


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index drawn from the unnormalised ``probs [..., V]`` (>= 0, some
    positive) by the uniform ``u [...]`` in ``[0, 1)``: the first index in
    vocabulary order whose cumulative mass exceeds ``u`` times the total
    (always a positive one). Returns int64 ``[...]``."""
    cdf = probs.cumsum(-1)
    mark = u.unsqueeze(-1) * cdf[..., -1:]
    last = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # the last positive index
    return torch.minimum((cdf <= mark).sum(-1, keepdim=True), last).squeeze(-1)


def deterministic_probs(drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ``q`` of drafts that were not drawn: float32 ``[n, K, vocab]``,
    each draft's one-hot (``drafts`` int64 ``[n, K]``)."""
    q = torch.zeros(*drafts.shape, vocab, dtype=torch.float32, device=drafts.device)
    return q.scatter_(-1, drafts.unsqueeze(-1), 1.0)


def draft_sample(
    logits: torch.Tensor, rows: Mapping[str, torch.Tensor], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft token per row and the distribution it was drawn from.

    Args:
        logits: the draft's logits float ``[n, V]``.
        rows: the sampling rows (``temperature``, ``top_k``, ``top_p``,
            ``min_p``, ``sampling_seed``), each ``[n]``.
        positions: int64 ``[n]``, the position the drafted token takes.

    Returns: (tokens int64 ``[n]``, ``q`` float32 ``[n, V]``); greedy rows
    take ``logits.argmax(-1)`` (their ``q`` is its one-hot).
    """
    q = rows_probs(logits, rows)
    u = uniform(rows["sampling_seed"], positions, DRAFT_DRAW)
    tokens = torch.where(rows["temperature"] == 0, logits.argmax(-1), inverse_cdf(q, u))
    return tokens, q


def rejection_sample(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rows: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject ``K`` drafts per row against the target.

    Args:
        target_logits: float ``[n, W, V]`` with ``W = K + 1``: column ``j``
            scores the token after the bonus and ``j`` drafts.
        drafts: int64 ``[n, K]``, drawn from ``draft_probs``.
        draft_probs: float ``[n, K, V]``, the ``q`` each draft was drawn from
            (filtered, rows summing to 1); None when the drafts are
            deterministic (``q`` their one-hot).
        rows: the sampling rows, each ``[n]``.
        positions: int64 ``[n]``, the position of the first draft (column 0).

    Returns: (``tokens`` int64 ``[n, W]``: column ``j`` is the token emitted
    when ``j`` drafts hold, the residual's draw for ``j < K`` and ``p``'s for
    ``j = K``; ``accepted`` int64 ``[n]``, the drafts that hold, a prefix).
    """
    n, w, vocab = target_logits.shape
    k = w - 1
    if drafts.shape != (n, k):
        raise ValueError(
            f"drafts has shape {tuple(drafts.shape)}; expected ({n}, {k}) for target logits "
            f"of shape {tuple(target_logits.shape)}"
        )
    # Each row's parameters repeated per column; expand, not repeat_interleave,
    # which may read its output size back from the device inside a capture.
    per_column = {name: t.unsqueeze(1).expand(n, w).reshape(-1) for name, t in rows.items()}
    p = rows_probs(target_logits.reshape(n * w, vocab), per_column).view(n, w, vocab)
    q = deterministic_probs(drafts, vocab) if draft_probs is None else draft_probs
    q = q.to(p.dtype)
    q = torch.cat([q, torch.zeros_like(p[:, :1])], 1)  # column K drafts nothing: residual p
    seed = per_column["sampling_seed"]
    where = (positions.unsqueeze(-1) + torch.arange(w, device=positions.device)).reshape(-1)
    u_accept = uniform(seed, where, ACCEPT_DRAW).view(n, w)[:, :k]
    u_residual = uniform(seed, where, RESIDUAL_DRAW).view(n, w)
    index = drafts.unsqueeze(-1)
    p_d = p[:, :k].gather(-1, index).squeeze(-1)
    q_d = q[:, :k].gather(-1, index).squeeze(-1)
    holds = u_accept * q_d < p_d  # u < p / q, without dividing; always when p >= q
    residual = (p - q).clamp_min(0)
    # A residual with no mass is never drawn from (its column always holds):
    # p there keeps the numbers finite.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    tokens = inverse_cdf(residual, u_residual)
    greedy = (rows["temperature"] == 0).unsqueeze(-1)
    argmax = target_logits.argmax(-1)
    tokens = torch.where(greedy, argmax, tokens)
    holds = torch.where(greedy, drafts == argmax[:, :k], holds)
    return tokens, holds.long().cumprod(1).sum(1)

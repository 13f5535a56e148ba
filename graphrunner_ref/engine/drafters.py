"""Draft sources for chain speculative decoding: what proposes ``K`` tokens
per request each round, and what it keeps between rounds.

- :class:`MtpDrafter`: the frozen-KV MTP head's draft loop, one replay.
- :class:`EagleDrafter`: the EAGLE head; its seed comes from the draft
  extend after each verify, the other ``K - 1`` tokens from draft decode steps.
- :class:`TargetDrafter`: the target itself, ``K`` decode steps (``self``:
  every draft accepted), or those tokens shifted by one (``wrong``: none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from graphrunner import GraphRunner
from graphrunner.phases import SpecBatch, with_sampling
from graphrunner.sampling import draft_sample
from graphrunner_ref.engine.spec_round import RoundState, SpecRequest, Verified
from graphrunner_ref.model.draft import EagleHead
from graphrunner_ref.model.llama import LlamaDecoder

__all__ = [
    "Drafter",
    "EagleDrafter",
    "MtpDrafter",
    "RoundState",
    "SpecRequest",
    "TargetDrafter",
    "Verified",
]


class Drafter(Protocol):
    """Proposes ``K`` tokens per request and keeps its state across rounds.

    ``reads_cached_prefix``: True when what it keeps of a prompt is the
    target's KV and the last position's feature only, so a prompt whose
    prefix the prefix cache holds is prefilled from its first uncached
    token (``prefill`` then sees that token onwards)."""

    k: int
    reads_cached_prefix: bool

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the target's prefill: ``prompt`` int64 ``[n]`` (cached at
        ``req.slots``; a cached prefix's tokens left out), ``hidden``
        ``[n, hidden]`` the target's features."""

    def propose(self, state: RoundState) -> torch.Tensor:
        """Draft tokens int64 ``[bs, K]`` on the device."""
        ...

    def accept(self, state: RoundState, verified: Verified) -> None:
        """After the verify (its outputs, valid until the next replay)."""


def replay_named(runner: GraphRunner, inputs: SpecBatch) -> dict[str, torch.Tensor]:
    """``runner.replay(inputs)`` for a phase whose outputs are a dict."""
    out = runner.replay(inputs)
    if not isinstance(out, dict):
        raise TypeError(f"{type(runner).__name__} returned {type(out).__name__}; expected a dict")
    return out


def replay_tensor(runner: GraphRunner, inputs: SpecBatch) -> torch.Tensor:
    """``runner.replay(inputs)`` for a phase whose output is one tensor."""
    out = runner.replay(inputs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(runner).__name__} returned {type(out).__name__}; expected a tensor")
    return out


def _stack_bonus(state: RoundState) -> torch.Tensor:
    return state.tensor([r.bonus for r in state.live])


class TargetDrafter:
    """The target proposes its own greedy tokens with ``K`` decode steps
    (``shift=1``: each shifted by one token, so none is ever accepted)."""

    reads_cached_prefix = True  # it keeps nothing of the prompt

    def __init__(self, model: LlamaDecoder, decode: GraphRunner, k: int, *, shift: int = 0):
        self.model, self.decode, self.k, self.shift = model, decode, k, shift

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        pass

    def propose(self, state: RoundState) -> torch.Tensor:
        ids, drafts, probs = _stack_bonus(state), [], []
        rows = state.sampling if self.shift == 0 else None  # shifted drafts stay deterministic
        for j in range(self.k):
            logits = replay_tensor(self.decode, state.decode_step(j, ids))
            if rows is None:
                ids = logits.argmax(-1)
            else:
                ids, q = draft_sample(logits, rows, state.positions(j + 1))
                probs.append(q)
            drafts.append(ids)
        state.draft_probs = torch.stack(probs, 1) if probs else None
        vocab = self.model.config.vocab_size
        return (torch.stack(drafts, 1) + self.shift) % vocab

    def accept(self, state: RoundState, verified: Verified) -> None:
        pass


def _rows_at(hidden: torch.Tensor, accepted: torch.Tensor, width: int) -> torch.Tensor:
    """Each request's row ``accepted`` of its ``width`` per-token rows."""
    rows = torch.arange(accepted.shape[0], device=accepted.device) * width + accepted
    return hidden.index_select(0, rows)


class MtpDrafter:
    """Frozen-KV MTP: one replay of the draft loop (``steps = K``, top-1).

    ``sampled`` builds (once, on the first round where a request samples) the
    captured loop that draws its tokens (``FrozenKvMtpRunner(sampling=True)``);
    without it a sampling round takes the greedy loop's deterministic drafts.
    """

    reads_cached_prefix = True  # the target's KV (frozen) and the last feature

    def __init__(
        self, runner: GraphRunner, k: int, sampled: Callable[[], GraphRunner] | None = None
    ) -> None:
        self.runner, self.k, self._build = runner, k, sampled
        self._sampled: GraphRunner | None = None

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        req.feature = hidden[-1]

    def propose(self, state: RoundState) -> torch.Tensor:
        features = torch.stack([r.feature for r in state.live])  # type: ignore[misc]
        inputs = state.batch(
            state.lens,
            input_ids=_stack_bonus(state),
            positions=state.positions(-1),
            hidden_states=features,
        )
        if state.sampling is not None and self._build is not None:
            if self._sampled is None:
                self._sampled = self._build()
            out = self._sampled.replay(with_sampling(inputs, state.sampling))
            if not isinstance(out, dict):
                raise TypeError(f"the sampled MTP loop returned {type(out).__name__}")
            state.draft_probs = out["probs"].clone()
        else:
            out = replay_named(self.runner, inputs)
        return out["tokens"][:, :, 0].clone()

    def accept(self, state: RoundState, verified: Verified) -> None:
        features = _rows_at(verified.hidden, verified.accepted, self.k + 1)
        for req, feature in zip(state.live, features, strict=True):
            req.feature = feature


class EagleDrafter:
    """EAGLE: row ``p`` pairs the token at ``p + 1`` with the feature at ``p``.

    The seed (the first draft) of a round comes from the previous draft
    extend (or the prefill's); draft decode steps give the other ``K - 1``,
    writing the head's KV in the round's fresh slots; the draft extend over
    the verified tokens then rewrites those slots' draft KV with the target's
    features and proposes the next round's seed.

    Not through the prefix cache: the head's KV at position ``p`` holds the
    token at ``p + 1`` too, which a cached page of tokens ``..p`` does not
    key (two prompts sharing it may differ there).
    """

    reads_cached_prefix = False

    def __init__(
        self, head: EagleHead, extend: GraphRunner, decode: GraphRunner | None, k: int
    ) -> None:
        if decode is None and k > 1:
            raise ValueError(f"k={k}: the draft decode runner is needed for k > 1")
        self.head, self.extend, self.decode, self.k = head, extend, decode, k

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        n, device = prompt.shape[0], prompt.device
        shifted = torch.cat([prompt[1:], torch.tensor([req.bonus], device=device)])
        inputs = SpecBatch(
            req_pool_indices_cpu=torch.tensor([req.req_index]),
            seq_lens_cpu=torch.tensor([n]),
            input_ids=shifted,
            positions=torch.arange(n, device=device),
            out_cache_loc=torch.tensor(req.slots, device=device),
            hidden_states=hidden,
            req_pool_indices=torch.tensor([req.req_index], device=device),
            accept_lens=torch.tensor([n], device=device),
        )
        with torch.no_grad():
            out = self.head.forward_extend(inputs)
        req.seed, req.feature = out["topk_index"][0, 0], out["hidden"][0]

    def propose(self, state: RoundState) -> torch.Tensor:
        ids = torch.stack([r.seed for r in state.live])  # type: ignore[misc]
        features = torch.stack([r.feature for r in state.live])  # type: ignore[misc]
        rows, probs = state.sampling, []
        if rows is not None:  # draw the first draft from the feature it came from
            ids, q = draft_sample(self._logits(features), rows, state.positions(1))
            probs.append(q)
        drafts = [ids]
        for j in range(1, self.k):
            step = state.decode_step(j - 1, ids, hidden_states=features)
            out = replay_named(self.decode, step)  # type: ignore[arg-type]  # k > 1
            ids, features = out["topk_index"][:, 0], out["hidden"]
            if rows is not None:
                ids, q = draft_sample(self._logits(features), rows, state.positions(j + 1))
                probs.append(q)
            drafts.append(ids)
        state.draft_probs = torch.stack(probs, 1) if probs else None
        return torch.stack(drafts, 1)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """The head's logits ``[bs, V]`` of its features (what its top-1 came from)."""
        with torch.no_grad():
            return self.head.target.logits(features)

    def accept(self, state: RoundState, verified: Verified) -> None:
        v, bs = verified, len(state.live)
        # The token at p + 1 for every verified position p: the drafts, then (at
        # the last accepted position) the target's own next token.
        shifted = torch.cat([v.drafts, v.drafts.new_zeros(bs, 1)], 1)
        column = torch.arange(self.k + 1, device=shifted.device)
        at_accepted = column == v.accepted[:, None]
        shifted = torch.where(at_accepted, v.targets.gather(1, v.accepted[:, None]), shifted)
        out = replay_named(
            self.extend,
            state.tokens_step(
                shifted.reshape(-1),
                hidden_states=v.hidden,
                extend_lens=state.tensor([self.k + 1] * bs),
                accept_lens=v.accepted + 1,
            ),
        )
        seeds, features = out["topk_index"][:, 0].clone(), out["hidden"].clone()
        for req, seed, feature in zip(state.live, seeds, features, strict=True):
            req.seed, req.feature = seed, feature

"""Draft sources for chain speculative decoding: what proposes ``K`` tokens
per request each round, and what it keeps between rounds.

- :class:`MtpDrafter`: the frozen-KV MTP head's draft loop, one replay.
- :class:`EagleDrafter`: the EAGLE head; its seed comes from the draft
  extend after each verify, the other ``K - 1`` tokens from draft decode steps.
- :class:`TargetDrafter`: the target itself, ``K`` decode steps (``self``:
  every draft accepted), or those tokens shifted by one (``wrong``: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.model.draft import EagleHead
from graphrunner.model.llama import LlamaDecoder
from graphrunner.phases.base import SpecBatch
from graphrunner.sampling.speculative import draft_sample

__all__ = [
    "Drafter",
    "EagleDrafter",
    "MtpDrafter",
    "RoundState",
    "SpecRequest",
    "TargetDrafter",
    "Verified",
]


@dataclass(slots=True)
class SpecRequest:
    """One running request: its pool row, the KV slot of every committed
    position, the tokens emitted, the bonus token (emitted, not yet cached)
    and the draft's state (device tensors)."""

    request: Any
    req_index: int
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    bonus: int = 0
    feature: torch.Tensor | None = None  # [hidden]: the draft's feature for the next round
    seed: torch.Tensor | None = None  # 0-d: EAGLE's first draft token for the next round
    sampling_seed: int = 0  # the request's random stream (its own seed or the run's)


@dataclass(frozen=True, slots=True)
class Verified:
    """A round's verify, on the device: ``drafts`` int64 ``[bs, K]``, the
    target's greedy ``targets`` int64 ``[bs, W]`` (``targets[:, j]`` follows
    the bonus and ``j`` drafts), its ``hidden`` ``[bs * W, hidden]`` and the
    drafts ``accepted`` per request, int64 ``[bs]``."""

    drafts: torch.Tensor
    targets: torch.Tensor
    hidden: torch.Tensor
    accepted: torch.Tensor


@dataclass(slots=True)
class RoundState:
    """One round of ``bs`` requests: ``W = K + 1`` fresh KV slots each, for
    positions ``L .. L + K`` (recorded in ``req_to_token`` before the round).

    ``sampling``: the requests' sampling rows (each ``[bs]``) when some
    request samples, else None (every draft greedy, as always). A drafter
    that draws its drafts sets ``draft_probs`` float32 ``[bs, K, V]``, the
    ``q`` each was drawn from; None means deterministic drafts.
    """

    live: list[SpecRequest]
    slots: list[list[int]]
    device: torch.device
    sampling: dict[str, torch.Tensor] | None = None
    draft_probs: torch.Tensor | None = None

    @property
    def lens(self) -> list[int]:
        """Committed tokens per request (``L``)."""
        return [len(r.slots) for r in self.live]

    def tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def batch(self, seq_lens: list[int], **tensors: torch.Tensor) -> SpecBatch:
        """Inputs with the rows and ``seq_lens`` as host mirrors and device twins."""
        rows = [r.req_index for r in self.live]
        return SpecBatch(
            req_pool_indices_cpu=torch.tensor(rows),
            seq_lens_cpu=torch.tensor(seq_lens),
            req_pool_indices=self.tensor(rows),
            seq_lens=self.tensor(seq_lens),
            **tensors,
        )

    def positions(self, offset: int, width: int = 1) -> torch.Tensor:
        """Positions ``L + offset .. L + offset + width - 1`` per request, flattened."""
        return self.tensor([n + offset + i for n in self.lens for i in range(width)])

    def decode_step(self, j: int, ids: torch.Tensor, **extra: torch.Tensor) -> SpecBatch:
        """Decode inputs of token ``j`` of the round (position ``L + j``, its fresh slot)."""
        return self.batch(
            [n + j + 1 for n in self.lens],
            input_ids=ids,
            positions=self.positions(j),
            out_cache_loc=self.tensor([s[j] for s in self.slots]),
            **extra,
        )

    def tokens_step(self, input_ids: torch.Tensor, **extra: torch.Tensor) -> SpecBatch:
        """Inputs of all ``W`` tokens of the round (positions ``L .. L + K``)."""
        width = len(self.slots[0]) if self.slots else 1
        return self.batch(
            [n + width for n in self.lens],
            input_ids=input_ids,
            positions=self.positions(0, width),
            out_cache_loc=self.tensor(self.slots).reshape(-1),
            **extra,
        )


class Drafter(Protocol):
    """Proposes ``K`` tokens per request and keeps its state across rounds."""

    k: int

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the target's prefill: ``prompt`` int64 ``[n]`` (cached at
        ``req.slots``), ``hidden`` ``[n, hidden]`` the target's features."""

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
    """Frozen-KV MTP: one replay of the draft loop (``steps = K``, top-1)."""

    def __init__(self, runner: GraphRunner, k: int) -> None:
        self.runner, self.k = runner, k

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        req.feature = hidden[-1]

    def propose(self, state: RoundState) -> torch.Tensor:
        features = torch.stack([r.feature for r in state.live])  # type: ignore[misc]
        out = replay_named(
            self.runner,
            state.batch(
                state.lens,
                input_ids=_stack_bonus(state),
                positions=state.positions(-1),
                hidden_states=features,
            ),
        )
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
    """

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

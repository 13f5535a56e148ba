"""The state of one speculative round: the running requests, the round's
fresh slots and inputs, and what the verify gave."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.phases import SpecBatch

__all__ = ["RoundState", "SpecRequest", "Verified"]


@dataclass(slots=True)
class SpecRequest:
    """One running request: its pool row, the KV slot of every committed
    position, the tokens emitted, the bonus token (emitted, not yet cached)
    and the draft's state (device tensors)."""

    request: Any
    req_index: int
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs per token, when asked
    bonus: int = 0
    feature: torch.Tensor | None = None  # [hidden]: the draft's feature for the next round
    seed: torch.Tensor | None = None  # 0-d: EAGLE's first draft token for the next round
    sampling_seed: int = 0  # the request's random stream (its own seed or the run's)
    matcher: Any = None  # its grammar's state after its emitted tokens (structured output)


@dataclass(frozen=True, slots=True)
class Verified:
    """A round's verify, on the device: ``drafts`` int64 ``[bs, K]``, the
    ``targets`` int64 ``[bs, W]`` (``targets[:, j]``: the token emitted when
    ``j`` drafts hold: the target's argmax, or for a sampling request the
    residual's draw), its ``hidden`` ``[bs * W, hidden]``, the drafts
    ``accepted`` per request, int64 ``[bs]``, and its ``logits`` float32
    ``[bs * W, vocab]`` (None when not kept)."""

    drafts: torch.Tensor
    targets: torch.Tensor
    hidden: torch.Tensor
    accepted: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class RoundState:
    """One round of ``bs`` requests: ``W = K + 1`` fresh KV slots each, for
    positions ``L .. L + K`` (recorded in ``req_to_token`` before the round).

    ``sampling``: the requests' sampling rows (each ``[bs]``) when some
    request samples, else None (every draft greedy, as always). A drafter
    that draws its drafts sets ``draft_probs`` float32 ``[bs, K, V]``, the
    ``q`` each was drawn from; None means deterministic drafts.

    ``bitmask``: when a request has a grammar, int32 ``[bs * W,
    ceil(V / 32)]`` on the device, row ``i * W + j`` the tokens request
    ``i``'s grammar allows at position ``L + j`` after the bonus token and
    drafts ``0 .. j - 1`` (every token for a request without one, and past a
    draft its grammar refuses); the verify masks its targets with it.
    """

    live: list[SpecRequest]
    slots: list[list[int]]
    device: torch.device
    sampling: dict[str, torch.Tensor] | None = None
    draft_probs: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None

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

"""What a speculative run returns: its outputs and its stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SpeculativeResult", "SpeculativeStats"]


@dataclass(slots=True)
class SpeculativeStats:
    """What a speculative run did: rounds, tokens, and how many drafts held."""

    steps: int = 0  # rounds (one verify each)
    prefills: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (a cached prefix's not)
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    decode_tokens: int = 0  # tokens emitted by rounds (prefill's first tokens excluded)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    grammar_refused: int = 0  # drafts a request's grammar did not allow (never accepted)
    decode_seconds: float = 0.0  # drafting, verify and accept
    batch_sizes: dict[int, int] = field(default_factory=dict)  # rounds per live bs

    @property
    def prefix_hit_rate(self) -> float:
        """The admitted prompt tokens' share that the prefix cache held."""
        prompt = self.cached_tokens + self.prefill_tokens
        return self.cached_tokens / prompt if prompt else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per round, on average (1 + accepted drafts)."""
        rows = self.request_rounds
        return self.decode_tokens / rows if rows else 0.0

    @property
    def request_rounds(self) -> int:
        """Rounds summed over requests (a round of ``bs`` requests counts ``bs``)."""
        return sum(bs * n for bs, n in self.batch_sizes.items())


@dataclass(frozen=True, slots=True)
class SpeculativeResult:
    """Generated tokens per request id (prompt excluded), the finished ids,
    the stats, and with ``logprobs=N`` each token's log-probability and top N
    by request id (as :class:`~graphrunner_ref.engine.results.EngineResult`'s)."""

    outputs: dict[int, list[int]]
    finished: frozenset[int]
    stats: SpeculativeStats
    logprobs: dict[int, list[Any]] = field(default_factory=dict)

"""Stop strings (``generate --stop TEXT``): a request finishes at the first
token after which its text holds one, and its answer ends before it (the
stop string itself is not part of the answer, as in vLLM's default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Decoder", "StopStrings", "cut_at_stop"]


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to its first stop string, and that string (None: no stop)."""
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


class StopStrings:
    """The engine's ``stop`` hook for ``stops`` (non-empty texts), reading
    each request's tokens through ``codec``.

    Only the last few tokens are decoded per call (enough to hold the longest
    stop string, at least a byte a token), so a step costs the same however
    long the answer grows. :attr:`hits` records which string stopped each
    request.
    """

    def __init__(self, codec: Decoder, stops: Sequence[str]) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stops={list(stops)!r}: expected non-empty texts")
        self.codec, self.stops = codec, list(stops)
        self._window = max(len(s.encode("utf-8")) for s in self.stops) + 1
        self.hits: dict[int, str] = {}

    def __call__(self, rid: int, tokens: list[int]) -> bool:
        _, stop = cut_at_stop(self.codec.decode(tokens[-self._window :]), self.stops)
        if stop is not None:
            self.hits[rid] = stop
        return stop is not None

"""What the engine asks of a request's grammar (structured output).

A request that must follow a grammar carries a factory of matchers
(:data:`GrammarFactory`); the engine makes the request's matcher when it
admits it, and each step asks it for the next token's bitmask
(``fill_next_token_bitmask``, into the step's ``token_bitmask`` row,
:mod:`graphrunner.sampling.bitmask`), then advances it with the token drawn
(``accept_token``); a matcher that ``is_terminated`` ends its request with
``finish_reason`` ``"stop"``. The names are xgrammar's, so an
``xgrammar.GrammarMatcher`` is one; the engine imports no grammar library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["GrammarFactory", "GrammarMatcher"]


class GrammarMatcher(Protocol):
    """One request's place in its grammar."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> object:
        """Write row ``index`` of ``bitmask`` (int32 ``[n, ceil(V / 32)]``,
        on the host): bit ``t % 32`` of word ``t // 32`` set where token
        ``t`` may come next."""
        ...

    def accept_token(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar is complete (its stop token accepted)."""
        ...


#: Makes a fresh matcher at the grammar's start (one per request admitted).
GrammarFactory = Callable[[], GrammarMatcher]

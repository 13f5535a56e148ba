"""What a buffer's live values index (:attr:`graphrunner.declare.buffers.BufferSpec.indexes`)."""

from __future__ import annotations

import enum

__all__ = ["Index"]


class Index(enum.Enum):
    """What the live values of a buffer index, so the padding sanitizer can
    check them whatever the phase (:attr:`BufferSpec.indexes`)."""

    REQUEST_ROW = "request row"  # a req_to_token row: allocated, never the padding row 0, once
    KV_SLOT = "KV slot"  # the slot a token writes: allocated, not 0, once, the one recorded
    #: a slot reserved for a step a row may take (multi-step decode): allocated
    #: and once, or 0 where the row takes no such step
    RESERVED_KV_SLOT = "reserved KV slot"
    MAMBA_SLOT = "Mamba slot"  # a Mamba state slot: never the sink 0
    TOKEN = "token"  # a token id: in the vocabulary (when the sanitizer knows its size)
    POSITION = "position"  # a token's position: the req_to_token column the length implies
    LENGTH = "length"  # tokens in the cache after the step: 1..the req_to_token width
    COUNT = "count"  # a count of the step's tokens: 1..the buffer's width
    #: a token batch's tokens of each request, in order (its tokens are the
    #: next ones on the token axis): >= 1, summing to the live tokens
    TOKEN_COUNT = "token count"
    #: a request's row on a token batch's token axis (its last token: the
    #: row its outputs come from)
    TOKEN_ROW = "token row"

"""What the speculative phases read of the models they capture.

A phase builder takes a model object and reads a few facts of it (its hidden
size and dtype, its vocabulary, its attention backend) and the method it
captures. These protocols are that contract, so a model of one's own plugs in
by having these attributes; graphrunner's reference models are one
implementation of them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from graphrunner.declare.hooks import GraphBackend
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["EagleDraftModel", "MtpDraftModel", "VerifyModel"]


class _DraftFacts(Protocol):
    """The facts a draft phase sizes its buffers from."""

    @property
    def hidden_size(self) -> int:
        """The width of the target's hidden states the draft reads."""

    @property
    def hidden_dtype(self) -> torch.dtype:
        """Their dtype."""

    @property
    def attn_backend(self) -> GraphBackend:
        """The attention backend whose hooks the captured step runs."""


class VerifyModel(Protocol):
    """A target model that :func:`~graphrunner.phases.verify_phase` captures."""

    @property
    def vocab_size(self) -> int:
        """Columns of its logits (the sampled verify's ``draft_probs`` width)."""

    @property
    def attn_backend(self) -> GraphBackend:
        """The attention backend whose hooks the captured step runs."""

    @property
    def forward_tokens(self) -> ForwardFn:
        """``W`` tokens per request: ``logits`` ``[bs * W, vocab]`` and
        ``hidden`` ``[bs * W, hidden]``."""


class EagleDraftModel(_DraftFacts, Protocol):
    """An EAGLE head that the draft extend and draft decode phases capture."""

    @property
    def forward_extend(self) -> ForwardFn:
        """The head over ``W`` verified tokens per request."""

    @property
    def forward_decode(self) -> ForwardFn:
        """One draft token per request."""


class MtpDraftModel(_DraftFacts, Protocol):
    """A frozen-KV MTP head that :func:`~graphrunner.phases.frozen_kv_mtp_phase` captures."""

    @property
    def forward_draft(self) -> ForwardFn:
        """The whole draft loop (top-k)."""

    @property
    def forward_draft_sampled(self) -> ForwardFn:
        """The whole draft loop, sampled."""

"""What each phase's forward reads: a typing Protocol per phase.

Each is a static mirror of its phase's buffers (the declared specs are the
truth; tests/test_phases.py keeps every protocol's attributes equal to its
phase's buffer names). Shapes: ``bs`` requests, ``W`` tokens per request.
"""

from __future__ import annotations

from typing import Protocol

import torch

from graphrunner.declare.inputs import StepInputs

__all__ = ["EagleDecodeInputs", "EagleExtendInputs", "MtpInputs", "VerifyInputs"]


class VerifyInputs(StepInputs, Protocol):
    """Target verify: the decode fields, per token (``input_ids``,
    ``positions``, ``out_cache_loc`` int64 ``[bs * W]``) or per request
    (``req_pool_indices``, ``seq_lens`` int64 ``[bs]``, the length after the step)."""


class EagleDecodeInputs(StepInputs, Protocol):
    """EAGLE draft decode: the decode fields (int64 ``[bs]``) plus the
    previous draft step's ``hidden_states`` ``[bs, hidden]``."""

    hidden_states: torch.Tensor


class EagleExtendInputs(VerifyInputs, Protocol):
    """EAGLE draft extend: :class:`VerifyInputs` plus the target's per-token
    ``hidden_states`` ``[bs * W, hidden]`` and per-request ``extend_lens``
    and ``accept_lens`` int64 ``[bs]`` (in ``1..W``)."""

    hidden_states: torch.Tensor
    extend_lens: torch.Tensor
    accept_lens: torch.Tensor


class MtpInputs(Protocol):
    """Frozen-KV MTP: the decode fields less ``out_cache_loc`` (int64 ``[bs]``:
    the bonus token ``input_ids``, ``req_pool_indices``, the committed
    ``seq_lens``, the last committed ``positions``) plus the target's
    ``hidden_states`` ``[bs, hidden]``."""

    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    hidden_states: torch.Tensor

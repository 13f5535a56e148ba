"""The sampled decode step for the padded tests and the padding fuzz: the
phase as ``create_decode_runner(..., sampling=True)`` builds it, and the
sampling rows of a batch (greedy, hot, top-k, top-p, min-p, all at once)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphrunner.phases import Phase, decode_phase
from graphrunner.phases.sampled import SAMPLED_OUTPUTS, sampled_forward
from graphrunner.sampling import SAMPLING_FIELDS, SamplingParams, sampling_tensors

#: The rows' sampling, cycled over a batch.
SAMPLING_ROWS = (
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.95, min_p=0.05),
)


def sampling_rows(raw_bs: int, seed: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The sampling buffers' live rows of ``raw_bs`` requests (``[raw_bs]``
    each), parameters and seeds varying with ``seed``."""
    params = [SAMPLING_ROWS[(seed + i) % len(SAMPLING_ROWS)] for i in range(raw_bs)]
    return sampling_tensors(params, [seed * 101 + 7 * i for i in range(raw_bs)], device)


def sampled_decode_phase(forward: Callable[[Any], Any], backend: Any) -> Phase:
    """The decode phase picking its tokens in the graph (the sampling
    buffers join the decode ones; outputs ``{"logits", "tokens"}``)."""
    base = decode_phase(forward, backend=backend)
    return Phase(
        "sampled_decode",
        sampled_forward(base.forward),
        (*base.specs, *SAMPLING_FIELDS),
        outputs=SAMPLED_OUTPUTS,
        backend=base.backend,
    )

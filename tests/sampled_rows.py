"""The sampled decode step for the padded tests and the padding fuzz: the
phase as ``create_decode_runner(..., sampling=True)`` builds it, the
sampling rows of a batch (greedy, hot, top-k, top-p, min-p, all at once),
and the inputs of the verify that samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphrunner.declare.inputs import StepInputs
from graphrunner.phases import Phase, SpecBatch, decode_phase
from graphrunner.phases.sampled import SAMPLED_OUTPUTS, sampled_forward, with_sampling
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


def sampled_verify_inputs(verify: SpecBatch, width: int, vocab: int, seed: int) -> StepInputs:
    """``verify`` (``width`` tokens per request) with a ``q`` per draft (a
    random distribution over the vocabulary, float32 ``[bs, width - 1,
    vocab]``) and :func:`sampling_rows`."""
    bs, device = verify.batch_size, verify.input_ids.device
    gen = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(bs, width - 1, vocab, generator=gen).mul(3).softmax(-1).to(device)
    inputs = SpecBatch(**vars(verify), draft_probs=q)
    return with_sampling(inputs, sampling_rows(bs, seed, device))


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

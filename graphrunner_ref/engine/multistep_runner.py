"""The decode phase of several steps per launch over a bundle's decode step
(:func:`graphrunner.phases.multistep_phase`), and what a runner was built
with (read off its phase)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphrunner import FutureMap, GraphBackend, GraphRunner, Phase
from graphrunner.phases import multistep_phase
from graphrunner.sampling import TokenCounts

__all__ = ["multistep_of", "multistep_phase_of"]


def multistep_of(runner: GraphRunner) -> tuple[int, int | None]:
    """``(steps per launch, end token)`` of ``runner``'s phase: ``(1, None)``
    for a one-step runner (or one without a phase)."""
    phase = getattr(runner, "phase", None)
    if phase is None or phase.steps == 1:
        return 1, None
    return phase.steps, phase.end_token


def multistep_phase_of(
    forward: Callable[[Any], torch.Tensor],
    backend: GraphBackend,
    mamba: bool,
    steps: int,
    end_token: int | None,
    future_map: FutureMap | None,
    logprobs: int,
    sampling: bool,
    penalties: TokenCounts | None = None,
) -> Phase:
    """A bundle's decode step (``forward``, its ``backend``; ``mamba``: the
    step has Mamba layers), ``steps`` (> 1) per launch; with ``future_map``
    (overlap scheduling) its first step's ``input_ids`` may be future
    references and each launch stores each row's last token there;
    ``penalties``: the sampled picks apply them, counting between steps."""
    if mamba:
        raise ValueError(
            f"steps_per_launch={steps} with a model with Mamba layers: not supported; "
            f"expected steps_per_launch=1"
        )
    return multistep_phase(
        forward,
        steps,
        backend=backend,
        end_token=end_token,
        sampling=sampling,
        logprobs=logprobs,
        future_tokens=None if future_map is None else future_map.tokens,
        penalties=penalties,
    )

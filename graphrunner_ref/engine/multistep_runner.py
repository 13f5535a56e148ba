"""The decode runner of several steps per launch: the multi-step phase
(:mod:`graphrunner.phases.multistep`) over a bundle's decode step, and the
registry of what each such runner was built with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from graphrunner.core.future_map import FutureMap
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners import create_runner
from graphrunner.phases.multistep import (
    MULTISTEP_LOGPROB_OUTPUTS,
    MULTISTEP_OUTPUTS,
    check_device_metadata,
    multistep_buffer_specs,
    multistep_forward,
)
from graphrunner_ref.io.mamba_checkpoint import StateSpaceBundle
from graphrunner_ref.model.build import ModelBundle

if TYPE_CHECKING:  # the bundle's step; bundle.py builds these runners through here
    from graphrunner_ref.engine.bundle import DecodeStep

__all__ = ["multistep_of", "multistep_runner"]

#: Runners built with ``steps_per_launch`` N > 1: (N, their end token).
_MULTISTEP: WeakKeyDictionary[GraphRunner, tuple[int, int | None]] = WeakKeyDictionary()


def multistep_of(runner: GraphRunner) -> tuple[int, int | None]:
    """``(steps per launch, end token)`` of a runner from :func:`create_decode_runner`:
    ``(1, None)`` for a one-step runner."""
    return _MULTISTEP.get(runner, (1, None))


def multistep_runner(
    bundle: ModelBundle | StateSpaceBundle,
    step: DecodeStep,
    kind: str,
    steps: int,
    end_token: int | None,
    future_map: FutureMap | None,
    logprobs: int,
    sampling: bool,
    *,
    check_padding: bool,
    **options: Any,
) -> GraphRunner:
    """:func:`create_decode_runner` with ``steps_per_launch=steps`` (> 1); with
    ``future_map`` (overlap scheduling) its first step's ``input_ids`` may be
    future references and each launch stores each row's last token there."""
    if step.mamba:
        raise ValueError(
            f"steps_per_launch={steps} with a model with Mamba layers: not supported; "
            f"expected steps_per_launch=1"
        )
    check_device_metadata(step.backend)
    fill = step.backend.seq_len_fill_value
    runner = create_runner(
        kind,
        multistep_forward(
            step.forward,
            steps,
            seq_len_fill_value=fill,
            end_token=end_token,
            sampling=sampling,
            logprobs_n=logprobs,
            future_tokens=None if future_map is None else future_map.tokens,
        ),
        multistep_buffer_specs(
            steps, seq_len_fill_value=fill, sampling=sampling, future=future_map is not None
        ),
        device=bundle.device,
        backend=step.backend,
        outputs=MULTISTEP_LOGPROB_OUTPUTS if logprobs else MULTISTEP_OUTPUTS,
        width=steps,
        sanitizer=step.sanitizer() if check_padding else None,
        future_map=future_map,
        **options,
    )
    _MULTISTEP[runner] = (steps, end_token)
    return runner

"""What a schedule, the admission and the check mode may do with the engine.

:class:`~graphrunner_ref.engine.loop.Engine` implements :class:`EngineSteps`;
its strategies (the plain, overlap and multi-step schedules, the
:class:`~graphrunner_ref.engine.admission.Admission` and the
:class:`~graphrunner_ref.engine.check.CheckMode`) are typed against this
protocol, never against the engine itself, so none of them imports the loop:
the step operations they compose, and read-only facts about the bundle and the
run's settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from graphrunner import DecodeBatch, GraphRunner
from graphrunner.declare import StepInputs
from graphrunner.pools import CachedKVAllocator
from graphrunner_ref.engine.registry import DecodeStep, ServingBundle
from graphrunner_ref.engine.results import EngineStats, LiveRequest, Run
from graphrunner_ref.engine.sampling import SampledRows, StepOut

__all__ = ["EngineSteps"]

T = TypeVar("T")


class EngineSteps(Protocol):
    """The step operations and read-only facts a strategy of the engine uses."""

    # Read-only facts: the bundle, the runner, and the run's settings.
    @property
    def bundle(self) -> ServingBundle: ...
    @property
    def runner(self) -> GraphRunner: ...
    @property
    def decoder(self) -> DecodeStep: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def sampling(self) -> bool: ...
    @property
    def sampling_rows(self) -> SampledRows: ...
    @property
    def logprobs(self) -> int: ...
    @property
    def end_token(self) -> int | None: ...
    @property
    def seed(self) -> int: ...
    @property
    def atol(self) -> float: ...
    @property
    def prefix_cache(self) -> CachedKVAllocator | None: ...

    # The step operations.
    def admit(self, run: Run) -> list[tuple[LiveRequest, torch.Tensor]]:
        """Prefill the arrived requests that fit; each with its first token (0-d)."""
        ...

    def decode(
        self, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the running batch: each row's token and new KV slot."""
        ...

    def replay(self, batch: DecodeBatch, live: Sequence[LiveRequest] = ()) -> StepOut:
        """The runner's step on a prepared batch."""
        ...

    def launch(self, inputs: StepInputs) -> StepOut:
        """The runner's step on inputs a schedule built itself (checked outputs)."""
        ...

    def advance(self, run: Run, req: LiveRequest, token: int) -> bool:
        """Record ``token``; retire the request when done. Whether it was."""
        ...

    def record_token(self, run: Run, req: LiveRequest, token: int) -> bool:
        """Record ``token``; whether the request is done (not freed)."""
        ...

    def join(self, run: Run, joining: list[LiveRequest], first_ids: torch.Tensor) -> None:
        """Merge prefilled requests into the running batch."""
        ...

    def free(self, run: Run, req: LiveRequest) -> None:
        """Free a request's pool row and KV pages."""
        ...

    def empty(self) -> torch.Tensor:
        """An empty int64 device tensor."""
        ...

    def timed(self, fn: Callable[[], T]) -> tuple[T, float]:
        """``fn()`` and its seconds, the device synchronised around it."""
        ...

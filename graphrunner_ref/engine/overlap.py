"""Overlap scheduling: step N+1 is scheduled on the host while step N runs on
the device. It is a scheduling strategy of the one engine,
``Engine(bundle, runner, overlap=True)``
(:class:`~graphrunner_ref.engine.overlap_schedule.OverlapSchedule`, where the
protocol is described); :class:`OverlapEngine` is the earlier name of that
binding, kept.
"""

from __future__ import annotations

from graphrunner.core.runner import GraphRunner
from graphrunner_ref.engine.loop import Engine
from graphrunner_ref.engine.overlap_schedule import OverlapSchedule, _HostCopy
from graphrunner_ref.model.build import ModelBundle

__all__ = ["OverlapEngine", "OverlapSchedule", "_HostCopy"]


class OverlapEngine(Engine):
    """``Engine(bundle, runner, end_token=end_token, overlap=True)``.

    ``runner`` must be built with a future map (``create_model_runner(...,
    future_map=FutureMap(...))``). Check mode is not available with overlap:
    compare against a plain engine's tokens instead.
    """

    def __init__(
        self, bundle: ModelBundle, runner: GraphRunner, *, end_token: int | None = None
    ) -> None:
        super().__init__(bundle, runner, end_token=end_token, overlap=True)

"""How a step's plan runs: the :class:`Schedule` of a run, chosen once when
the engine is built (:func:`schedule_for`), one row each in :data:`SCHEDULES`.

The plain one is the model runner's own
(:meth:`ModelRunner.run <graphrunner_ref.engine.model_runner.ModelRunner.run>`):
prefill, decode, one read back. The others compose the model runner's
operations differently: overlap prepares step N+1 while step N runs
(:class:`~graphrunner_ref.engine.overlap_schedule.OverlapSchedule`),
several decode steps a launch
(:class:`~graphrunner_ref.engine.multistep.MultiStepSchedule`), and both
(:class:`~graphrunner_ref.engine.multistep_overlap.MultiStepOverlapSchedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from graphrunner import GraphRunner
from graphrunner_ref.engine.model_runner import ModelRunner
from graphrunner_ref.engine.multistep import MultiStepSchedule
from graphrunner_ref.engine.multistep_overlap import MultiStepOverlapSchedule
from graphrunner_ref.engine.overlap_schedule import OverlapSchedule
from graphrunner_ref.engine.postprocess import Postprocess
from graphrunner_ref.engine.results import Run, StepPlan, StepResult

__all__ = ["SCHEDULES", "Schedule", "schedule_for"]


class Schedule(Protocol):
    """How a step's plan runs on the device (a variant of the engine's run)."""

    def run(self, run: Run, plan: StepPlan) -> StepResult:
        """Run ``plan``; what it gave, for the postprocess to record."""
        ...

    def end(self) -> None:
        """Release what a step prepared but never launched (also after an error)."""
        ...


#: Builds a schedule from the model runner, the postprocess, the decode runner
#: and its decode steps per launch.
MakeSchedule = Callable[[ModelRunner, Postprocess, GraphRunner, int], Schedule]

#: The schedule of each (several steps per launch, overlap) pair.
SCHEDULES: dict[tuple[bool, bool], MakeSchedule] = {
    (False, False): lambda model, post, runner, steps: model,
    (False, True): lambda model, post, runner, steps: OverlapSchedule(model, post, runner),
    (True, False): lambda model, post, runner, steps: MultiStepSchedule(model, steps),
    (True, True): lambda model, post, runner, steps: MultiStepOverlapSchedule(
        model, post, runner, steps
    ),
}


def schedule_for(
    model: ModelRunner, post: Postprocess, runner: GraphRunner, steps: int, overlap: bool
) -> Schedule:
    """The schedule of ``steps`` decode steps per launch, with or without overlap."""
    return SCHEDULES[steps > 1, overlap](model, post, runner, steps)

"""How the engine orders a step's host and device work: the :class:`Schedule`
strategy of :class:`~graphrunner_ref.engine.loop.Engine` and its plain
:class:`SyncSchedule` (which schedule a run takes is the scheduling policy's
choice: :func:`~graphrunner_ref.engine.policy.schedule_for`)."""

from __future__ import annotations

from typing import Protocol

import torch

from graphrunner.pools import starts_page
from graphrunner_ref.engine.results import Run
from graphrunner_ref.engine.steps import EngineSteps

__all__ = ["Schedule", "SyncSchedule"]


class Schedule(Protocol):
    """How the engine orders a step's host and device work (a strategy of :class:`Engine`)."""

    def begin(self, engine: EngineSteps, max_steps: int | None) -> None: ...

    def step(self, engine: EngineSteps, run: Run) -> int:
        """Run one engine step; returns the decode steps it ran (0 or 1)."""
        ...

    def end(self, engine: EngineSteps) -> None:
        """Release what a step prepared but never launched (also after an error)."""
        ...


class SyncSchedule:
    """The plain schedule: admit, decode the running batch, read back (the
    step's one sync), retire, merge."""

    def begin(self, engine: EngineSteps, max_steps: int | None) -> None:
        pass

    def end(self, engine: EngineSteps) -> None:
        pass

    def step(self, engine: EngineSteps, run: Run) -> int:
        joining = engine.admit(run)
        bs = len(run.live)
        first_ids = torch.stack([ids for _, ids in joining]) if joining else engine.empty()
        next_ids, new_slots = (
            engine.decode(run.batch, run.stats, run.live) if bs else (engine.empty(),) * 2
        )
        host = torch.cat([next_ids, new_slots, first_ids]).tolist()  # the step's one sync
        run.stats.syncs += 1 if bs else 0
        page = engine.bundle.page_size
        keep = []
        for i, req in enumerate(run.live):
            slot = host[bs + i]
            if starts_page(len(req.slots), page):  # a fresh page: slot is its first
                req.pages.extend(range(slot, slot + page))
            req.slots.append(slot)
            if not engine.advance(run, req, host[i]):
                keep.append(i)
        run.batch.input_ids = next_ids  # what each row feeds next step
        if len(keep) < bs:
            run.batch.filter(keep)
            run.live[:] = [run.live[i] for i in keep]
        stay = [
            j
            for j, (req, _) in enumerate(joining)
            if not engine.advance(run, req, host[2 * bs + j])
        ]
        if stay:
            engine.join(run, [joining[j][0] for j in stay], first_ids[stay])
        return 1 if bs else 0

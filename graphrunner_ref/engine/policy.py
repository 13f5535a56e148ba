"""The scheduling policy: which arrived requests join the running batch
(admission) and how an engine step orders its host and device work (the
schedule).

Admission is first come, first served: :func:`admit_count` takes the arrived
requests in arrival order while each finds a free request row, KV pages for
its whole budget beside what the running requests were promised, and a row
of the runner's largest batch; the first that does not fit stops admission,
and the later ones wait behind it (no request overtakes another). With a
prefix cache, a request also waits while another request's prefill is still
to write pages of the prompt they share (:func:`waits_for_shared_prefill`):
admitted then, it would compute them a second time; admitted a step or two
later, it finds them cached.

The schedule follows two facts of the run, several decode steps per launch
and overlap, one row each in :data:`SCHEDULES`:
:class:`~graphrunner_ref.engine.schedule.SyncSchedule` (neither),
:class:`~graphrunner_ref.engine.overlap_schedule.OverlapSchedule`,
:class:`~graphrunner_ref.engine.multistep.MultiStepSchedule` and
:class:`~graphrunner_ref.engine.multistep_overlap.MultiStepOverlapSchedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from graphrunner import GraphRunner
from graphrunner.pools import whole_pages
from graphrunner_ref.engine.check import CheckMode
from graphrunner_ref.engine.multistep import MultiStepSchedule
from graphrunner_ref.engine.multistep_overlap import MultiStepOverlapSchedule
from graphrunner_ref.engine.overlap_schedule import OverlapSchedule
from graphrunner_ref.engine.results import AdmissionError, Run
from graphrunner_ref.engine.schedule import Schedule, SyncSchedule
from graphrunner_ref.engine.steps import EngineSteps

__all__ = ["SCHEDULES", "admit_count", "schedule_for", "waits_for_shared_prefill"]

#: Builds a schedule from the runner, the decode steps per launch and the check mode.
MakeSchedule = Callable[[GraphRunner, int, CheckMode | None], Schedule]

#: The schedule of each (several steps per launch, overlap) pair.
SCHEDULES: dict[tuple[bool, bool], MakeSchedule] = {
    (False, False): lambda runner, steps, check: SyncSchedule(),
    (False, True): lambda runner, steps, check: OverlapSchedule(runner),
    (True, False): lambda runner, steps, check: MultiStepSchedule(steps, check),
    (True, True): lambda runner, steps, check: MultiStepOverlapSchedule(runner, steps),
}


def schedule_for(
    runner: GraphRunner, steps: int, overlap: bool, check: CheckMode | None = None
) -> Schedule:
    """The schedule of ``steps`` decode steps per launch, with or without
    overlap; ``check`` checks each multi-step launch (a plain step's check is
    the engine's decode)."""
    return SCHEDULES[steps > 1, overlap](runner, steps, check)


def admit_count(engine: EngineSteps, run: Run) -> int:
    """How many of ``run``'s arrived requests, in order, fit: a free request
    row each, KV pages for its whole budget beside what the running requests
    were promised, and a row of the runner's largest batch. Raises
    :class:`AdmissionError` when nothing runs and the first one can never fit
    (nothing running will ever free room for it)."""
    b = engine.bundle
    # KV slots (whole pages) promised to running requests but not yet allocated.
    admitted = [*run.live, *run.prefilling]
    reserved = sum(whole_pages(r.request.max_len, b.page_size) - len(r.pages) for r in admitted)
    room = b.kv_alloc.available_size() - reserved
    rows = b.req_pool.available_size()
    count = 0
    page = b.page_size if engine.prefix_cache is not None else 0
    prefills = [(r.request.prompt, r.prefilled) for r in run.prefilling]
    for req in run.pending:
        if req.arrival_step > run.clock:
            break
        if page and waits_for_shared_prefill(req.prompt, prefills, page):
            break  # first come, first served: later arrivals wait behind it
        need = whole_pages(req.max_len, b.page_size)
        if len(admitted) + count >= engine.runner.max_bs or need > room or not rows:
            if not admitted and not count:
                raise AdmissionError(
                    f"request {req.rid} can never be admitted: it needs 1 request row "
                    f"and {_kv_amount(engine, need)}, nothing is running, and "
                    f"{rows} request rows and {_kv_amount(engine, room)} are free"
                )
            break  # first come, first served: later arrivals wait behind it
        room, rows, count = room - need, rows - 1, count + 1
        prefills.append((req.prompt, 0))  # admitted now, prefilled from this step
    return count


def waits_for_shared_prefill(
    prompt: Sequence[int], prefills: Sequence[tuple[Sequence[int], int]], page: int
) -> bool:
    """Whether a request of ``prompt`` should wait for ``prefills``, the
    prompts being prefilled, each with its tokens written so far: one of them
    shares full pages of ``prompt`` (``page`` tokens each, its last token
    never, as the cache matches) that are not written yet. A prefill always
    moves on, so the wait ends."""
    shareable = (len(prompt) - 1) // page * page
    for other, written in prefills:
        done = written // page * page
        if done < shareable and _common_prefix(prompt, other, shareable) // page * page > done:
            return True
    return False


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of ``a`` and ``b``'s common prefix, at most ``limit``: a
    binary search over slice comparisons (C speed for long prompts)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _kv_amount(engine: EngineSteps, slots: int) -> str:
    page = engine.bundle.page_size
    return f"{slots} KV slots" if page == 1 else f"{slots // page} KV pages of {page} slots"

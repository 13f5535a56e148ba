"""ChunkSafeCall: a program calling many small Python functions from a big
frame, at every caller depth, without mapping a stack chunk per call."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from graphrunner.util import stack_chunks
from graphrunner.util.stack_chunks import (
    PROBES,
    QUIET,
    RECHECK,
    SPACER_SLOTS,
    ChunkSafeCall,
)

resource = pytest.importorskip("resource")
CALLS = 100  # small calls per program call, as a wrapper's op calls


def thread_faults() -> int:
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def small(x: int) -> int:
    return x


def wrapper_like(slots: int) -> Callable[[], None]:
    """Inductor's wrapper in miniature: a frame of ``slots`` locals calling
    :func:`small` :data:`CALLS` times."""
    names = " = ".join(f"_{i}" for i in range(slots))
    namespace = {"small": small, "CALLS": CALLS}
    exec(
        f"def program():\n    if False:\n        {names} = None\n"
        "    for _ in range(CALLS):\n        small(1)\n",
        namespace,
    )
    return namespace["program"]  # type: ignore[return-value]


def at_depth(frames: int, fn: Callable[[], float]) -> float:
    return fn() if frames == 0 else at_depth(frames - 1, fn)


def faults_per_call(call: Callable[[], None], warm: int, measured: int = 8) -> float:
    for _ in range(warm):
        call()
    before = thread_faults()
    for _ in range(measured):
        call()
    return (thread_faults() - before) / measured


def test_no_caller_depth_maps_a_chunk_per_call() -> None:
    program = wrapper_like(1500)
    depths = range(0, 240)  # well over a 16 KB chunk's worth of small frames
    plain = {d: at_depth(d, lambda: faults_per_call(program, 2)) for d in depths}
    guarded = {
        d: at_depth(d, lambda: faults_per_call(ChunkSafeCall(program), 2 * PROBES * 4))
        for d in depths
    }
    thrashing = [d for d, f in plain.items() if f >= CALLS / 2]
    if not thrashing:
        pytest.skip(f"CPython {sys.version.split()[0]} maps no chunk per call at any depth")
    worst = max(guarded, key=guarded.__getitem__)
    assert guarded[worst] < CALLS / 10, (
        f"guarded, depth {worst} takes {guarded[worst]} faults a call "
        f"(plain: {[(d, plain[d]) for d in thrashing]})"
    )


class FakeFaults:
    """A fault counter charging each call of the program by the spacer in use."""

    def __init__(self, cost: dict[int, int]) -> None:
        self.cost = cost
        self.extra = 0  # faults of another cause, added to every call
        self.once = 0  # faults of another cause, added to the next call only
        self.total = 0
        self.visits = {spacer: 0 for spacer in cost}
        self.guard: ChunkSafeCall[int] | None = None

    def __call__(self) -> int:
        return self.total

    def program(self) -> int:
        assert self.guard is not None
        self.visits[self.guard.at] += 1
        self.total += self.cost[self.guard.at] + self.extra + self.once
        self.once = 0
        return 7


def guarded(cost: dict[int, int]) -> tuple[ChunkSafeCall[int], FakeFaults]:
    fake = FakeFaults(cost)
    fake.guard = ChunkSafeCall(fake.program, faults=fake)
    return fake.guard, fake


def test_a_faulting_spacer_is_left_for_the_first_clean_one() -> None:
    guard, _ = guarded({0: 100, 1: 100, 2: 0, 3: 0})
    assert [guard() for _ in range(2 * PROBES + 1)] == [7] * (2 * PROBES + 1)
    assert (guard.at, guard.settled) == (2, True)


def test_where_every_spacer_faults_the_fewest_faults_win() -> None:
    guard, _ = guarded({0: 50, 1: 9, 2: 30, 3: 12})
    for _ in range(PROBES * len(SPACER_SLOTS)):
        guard()
    assert (guard.at, guard.settled) == (1, True)


def test_a_clean_call_settles_at_once_and_is_checked_again() -> None:
    guard, fake = guarded({0: 0, 1: 0, 2: 0, 3: 0})
    guard()
    assert (guard.at, guard.settled) == (0, True)
    fake.cost[0] = 100  # the caller moved deeper: spacer 0 now faults
    for _ in range(RECHECK + 2 * PROBES):
        guard()
    assert (guard.at, guard.settled) == (1, True)
    assert fake.cost[guard.at] <= QUIET


def settled_at_1() -> tuple[ChunkSafeCall[int], FakeFaults]:
    """A guard settled on spacer 1 (4 faults a call: its frame's fresh chunk),
    spacer 0 mapping a chunk per op call."""
    guard, fake = guarded({0: 100, 1: 4, 2: 30, 3: 30})
    for _ in range(PROBES * len(SPACER_SLOTS)):
        guard()
    assert (guard.at, guard.settled) == (1, True)
    fake.visits = dict.fromkeys(fake.visits, 0)
    return guard, fake


def test_a_spike_of_another_cause_does_not_send_it_back_to_a_bad_spacer() -> None:
    guard, fake = settled_at_1()
    for _ in range(4 * RECHECK):
        if guard._calls % RECHECK == RECHECK - 1:  # the next call is measured
            fake.once = 40  # say a KV page written for the first time
        guard()
    assert fake.visits[0] == 0, "a spike elsewhere had the thrashing spacer probed"
    assert (guard.at, guard.settled) == (1, True)


def test_faults_ever_over_the_mark_choose_again_ever_more_rarely() -> None:
    guard, fake = settled_at_1()
    fake.extra = 10
    choices = 0
    for _ in range(2000):
        fake.extra *= 3  # every call over any mark a former call set
        was_settled = guard.settled
        guard()
        choices += was_settled and not guard.settled
    assert 3 <= choices <= 12, f"{choices} choices in 2000 calls: the gap should double"


def test_unmeasured_calls_cost_no_count() -> None:
    calls = []
    guard = ChunkSafeCall(lambda: 7, faults=lambda: calls.append(1) or 0)
    for _ in range(RECHECK * 3):
        guard()
    assert len(calls) == 2 * (1 + 3)  # the first call, then one call in RECHECK


def test_the_program_s_result_and_errors_pass_through() -> None:
    assert ChunkSafeCall(lambda: (1, 2))() == (1, 2)
    add = ChunkSafeCall(lambda a, b=0: a + b)
    assert [add(1, 2) for _ in range(3 * RECHECK)] == [3] * 3 * RECHECK
    assert add(1) == 1

    def fails() -> None:
        raise ValueError("from the program")

    with pytest.raises(ValueError, match="from the program"):
        ChunkSafeCall(fails)()


def test_disabled_calls_the_program_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = []
    guard = ChunkSafeCall(lambda: 7, faults=lambda: counted.append(1) or 0)
    monkeypatch.setattr(stack_chunks, "ENABLED", False)
    assert guard() == 7
    assert counted == []

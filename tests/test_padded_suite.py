"""The padded-size regression suite (marker ``padded``).

Hypothesis draws capture-size lists and request lifecycles (arrivals of
random lengths, finishes that free slots for reuse, decode steps) and replays
every step through each runner with the sanitizer on and stale values in every
buffer tail; live outputs must equal the eager forward of the unpadded batch.

``GRAPHRUNNER_EXPLORE=1`` (``make test-explore``) draws fresh examples, thousands
of them, with runs of several decode steps per step event, at least 10,000
padded replays per runner. Runners are captured once per capture list and shared by the
examples that draw it (the world is reset in place, so the graphs' addresses
hold); the counts go to ``conftest.PADDED_TALLY`` and print at the end.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import (
    EXPLORE,
    PADDED_CASES,
    PADDED_TALLY,
    RUNNER_PARAMS,
    PaddedTally,
    make_runner,
    runner_device,
)
from graphrunner import GraphRunner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.sanitizer.padding import PaddingSanitizer, SanitizerStats
from graphrunner.sizing.report import RunnerStats
from graphrunner.testing import ToyWorld
from poison import assert_state_matches, poison_tails, stale_values, state_is_bit_exact

pytestmark = pytest.mark.padded

# Compiled runners pay seconds per captured size, so they get fewer examples
# (each capture list is captured once and shared, so the exploring run's cost is
# mostly its decode steps).
EXAMPLES = {
    "eager": 2000 if EXPLORE else 60,
    "cpu": 1000 if EXPLORE else 4,
    "cuda": 2000 if EXPLORE else 30,
    "cuda+compile": 1000 if EXPLORE else 4,
}
#: The most decode steps one exploring step event runs in a row.
STEP_RUN = 64
#: Padded replays the exploring run must reach per runner, on its own budget (with
#: STEP_RUN 64 a thousand examples gave 15,000-17,500 on the CPU).
EXPLORE_PADDED_REPLAYS = 10_000
BUDGET_OVERRIDDEN = "GRAPHRUNNER_PADDED_EXAMPLES" in os.environ
if BUDGET_OVERRIDDEN:  # one budget for every runner
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["GRAPHRUNNER_PADDED_EXAMPLES"]))


@dataclass(frozen=True)
class Arrive:
    seq_lens: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    picks: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    count: int = 1  # decode steps in a row


# The exploring run draws runs of decode steps, so an example replays many padded
# steps for one capture; the default run draws exactly what it always drew.
def step_events() -> st.SearchStrategy[Step]:
    return st.builds(Step, st.integers(1, STEP_RUN)) if EXPLORE else st.just(Step())


events = st.one_of(
    st.builds(Arrive, st.lists(st.integers(1, 40), min_size=1, max_size=5).map(tuple)),
    st.builds(Finish, st.lists(st.integers(0, 63), min_size=1, max_size=3).map(tuple)),
    step_events(),
    step_events(),
)
capture_lists = st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True).map(sorted)


@dataclass
class Captured:
    """A world and a runner captured over it with a sanitizer, shared by every
    example that draws its capture list."""

    world: ToyWorld
    sanitizer: PaddingSanitizer
    runner: GraphRunner


#: Captured runners by (runner label, capture sizes): compiling costs seconds
#: per size, so each capture list is captured once per session.
_CAPTURED: dict[tuple[str, tuple[int, ...]], Captured] = {}


def captured(kind: str, sizes: list[int]) -> Captured:
    key = (kind, tuple(sizes))
    if key not in _CAPTURED:
        world = ToyWorld(runner_device(kind))
        sanitizer = PaddingSanitizer.for_pools(
            world.req_pool, world.kv, kv_allocator=world.kv_alloc
        )
        runner = make_runner(
            kind, world.model, decode_buffer_specs(), capture_sizes=sizes, sanitizer=sanitizer
        )
        runner.capture()
        _CAPTURED[key] = Captured(world, sanitizer, runner)
    return _CAPTURED[key]


def differing_bytes(got: torch.Tensor, want: torch.Tensor, *, exact: bool) -> int:
    """Bytes of ``got`` that fail the comparison with ``want``: bit-exact, or
    ``assert_close``'s default float tolerance; all of them on a shape or dtype mismatch."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return max(got.nbytes, want.nbytes)
    # Not exact: torch.testing.assert_close's defaults for float32.
    bad = got != want if exact else ~torch.isclose(got, want, rtol=1.3e-6, atol=1e-5)
    return int(bad.sum()) * got.element_size()


class Scenario:
    """A toy engine: pools, a decode batch, and a runner checked at every step.

    The world and runner come from :func:`captured`; the world is reset in
    place (its tensors keep their addresses, which the graphs hold) and the
    runner's and sanitizer's counters start from zero, as a fresh runner's would.
    """

    def __init__(self, kind: str, sizes: list[int], seed: int) -> None:
        shared = captured(kind, sizes)
        self.world = world = shared.world
        world.reset()
        self.sanitizer, self.runner = shared.sanitizer, shared.runner
        self.rng = random.Random(seed)
        self.batch = DecodeBatch.empty(world.device, world.cfg.max_context_len)
        self.runner.stats = RunnerStats()
        self.sanitizer.stats = SanitizerStats()
        self.tally = PADDED_TALLY.setdefault(self.runner.mechanism.label, PaddedTally())

    def arrive(self, seq_lens: tuple[int, ...]) -> None:
        room = self.world.req_pool.available_size()
        if room == 0:  # a full pool turns arrivals away, as a scheduler would
            return
        reqs = [self.world.add_request(self.rng, n) for n in seq_lens[:room]]
        vocab = self.world.cfg.vocab
        ids = torch.tensor([self.rng.randrange(vocab) for _ in reqs], dtype=torch.int64)
        self.batch.merge(
            DecodeBatch.from_requests(
                reqs,
                list(seq_lens[: len(reqs)]),
                ids.to(self.world.device),
                device=self.world.device,
                max_context_len=self.world.cfg.max_context_len,
            )
        )

    def finish(self, rows: set[int]) -> None:
        reqs = self.batch.req_pool_indices_cpu.tolist()
        for row in rows:
            self.world.release(reqs[row])
        self.batch.filter([r for r in range(len(reqs)) if r not in rows])

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def step(self) -> None:
        full = self.batch.seq_lens_cpu >= self.world.cfg.max_context_len
        self.finish(set(torch.nonzero(full).flatten().tolist()))
        if self.batch.is_empty():
            return
        self.batch.prepare_decode(self.world.req_pool, self.world.kv_alloc)
        self.world.record_step(self.batch)
        self.check_replay()

    def check_replay(self) -> None:
        world, runner, batch, tally = self.world, self.runner, self.batch, self.tally
        raw_bs = batch.batch_size
        before = world.state()
        expected, expected_state = world.eager_reference(batch)
        if raw_bs <= runner.max_bs:
            poison_tails(runner, raw_bs, stale_values(world, batch))
            PADDED_CASES.add((runner.mechanism.label, runner.graph_size_for(raw_bs), raw_bs))
        padded_rows, fallbacks = runner.stats.padded_rows, runner.stats.eager_fallbacks
        out = runner.replay(batch).clone()
        after = world.state()
        tally.steps += 1
        tally.padded += int(runner.stats.padded_rows > padded_rows)
        tally.eager_fallbacks += runner.stats.eager_fallbacks - fallbacks
        # Count what the assertions below compare, before they may stop the step.
        pairs = [(out, expected, False)]
        exact = state_is_bit_exact(runner.mechanism.label)
        pairs += [(after[name][1:], expected_state[name][1:], exact) for name in ("k", "v")]
        pairs.append((after["req_to_token"], before["req_to_token"], True))
        for got, want, bitwise in pairs:  # not `exact`: the checks below still read it
            tally.bytes_compared += want.nbytes
            tally.bytes_differed += differing_bytes(got, want, exact=bitwise)
        torch.testing.assert_close(out, expected)
        live_slots = set(batch.out_cache_loc.tolist())
        for name in ("k", "v"):
            assert_state_matches(
                after[name], expected_state[name], live_slots, exact=exact, name=name
            )
        assert torch.equal(after["req_to_token"], before["req_to_token"])
        batch.input_ids = out.argmax(-1)


def run(kind: str, sizes: list[int], ops: list[object], seed: int) -> Scenario:
    scenario = Scenario(kind, sizes, seed)
    for op in ops:
        if isinstance(op, Arrive):
            scenario.arrive(op.seq_lens)
        elif isinstance(op, Finish) and not scenario.batch.is_empty():
            scenario.finish({p % scenario.batch.batch_size for p in op.picks})
        elif isinstance(op, Step):
            scenario.steps(op.count)
    return scenario


@pytest.mark.filterwarnings("ignore:batch size .* is above the largest captured size")
@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_random_lifecycles_match_eager_with_sanitizer_on(kind: str):
    @settings(
        max_examples=EXAMPLES[kind],
        print_blob=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(capture_lists, st.lists(events, min_size=2, max_size=24), st.integers(0, 2**16))
    # More arrivals than the pool has rows: the full pool must turn them away.
    @example(sizes=[1], ops=[Arrive((1, 1, 1, 1, 1))] * 6 + [Step()], seed=0)
    # Padded replays at every raw size up to the largest graph, with a freed
    # slot reused in between: every runner covers these whatever is drawn.
    @example(
        sizes=[2, 6],
        ops=[
            Arrive((3, 9, 40)),
            Step(),
            Arrive((5, 1)),
            Step(),
            Finish((0, 2)),
            Step(),
            Arrive((7,)),
            Step(),
            Finish((1,)),
            Step(),
            Finish((0,)),
            Step(),
        ],
        seed=1,
    )
    def check(sizes: list[int], ops: list[object], seed: int) -> None:
        scenario = run(kind, sizes, ops, seed)
        stats = scenario.runner.stats  # eager fallbacks are checked too
        assert scenario.sanitizer.stats.replays_checked == stats.replays + stats.eager_fallbacks

    padded_before = PADDED_TALLY.get(kind, PaddedTally()).padded
    check()
    if EXPLORE and not BUDGET_OVERRIDDEN:
        padded = PADDED_TALLY[kind].padded - padded_before
        assert padded >= EXPLORE_PADDED_REPLAYS, (
            f"{kind}: the exploring budget ran {padded} padded replays; expected >= "
            f"{EXPLORE_PADDED_REPLAYS} (raise EXAMPLES or STEP_RUN)"
        )

"""The padded-size regression suite (marker ``padded``).

Hypothesis draws capture-size lists and request lifecycles (arrivals of
random lengths, finishes that free slots for reuse, decode steps) and replays
every step through each runner with the sanitizer on and stale values in every
buffer tail; live outputs must equal the eager forward of the unpadded batch.

``GRAPHRUNNER_SLOW=1`` (``make test-slow``) runs thousands of examples.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import PADDED_CASES, RUNNER_PARAMS, SLOW, make_runner, runner_device
from graphrunner import decode_buffer_specs
from graphrunner.batch import DecodeBatch
from graphrunner.sanitizer import PaddingSanitizer
from graphrunner.testing import ToyWorld
from poison import poison_tails, stale_values

pytestmark = pytest.mark.padded

# Compiled runners pay seconds per captured size, so they get fewer examples.
EXAMPLES = {
    "eager": 2000 if SLOW else 60,
    "cpu": 200 if SLOW else 4,
    "cuda": 2000 if SLOW else 30,
    "cuda+compile": 200 if SLOW else 4,
}
if "GRAPHRUNNER_PADDED_EXAMPLES" in os.environ:  # one budget for every runner
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["GRAPHRUNNER_PADDED_EXAMPLES"]))


@dataclass(frozen=True)
class Arrive:
    seq_lens: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    picks: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    pass


events = st.one_of(
    st.builds(Arrive, st.lists(st.integers(1, 40), min_size=1, max_size=5).map(tuple)),
    st.builds(Finish, st.lists(st.integers(0, 63), min_size=1, max_size=3).map(tuple)),
    st.just(Step()),
    st.just(Step()),
)
capture_lists = st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True).map(sorted)


class Scenario:
    """A toy engine: pools, a decode batch, and a runner checked at every step."""

    def __init__(self, kind: str, sizes: list[int], seed: int) -> None:
        self.world = world = ToyWorld(runner_device(kind))
        self.rng = random.Random(seed)
        self.sanitizer = PaddingSanitizer.for_pools(
            world.req_pool, world.kv, kv_allocator=world.kv_alloc
        )
        self.runner = make_runner(
            kind, world.model, decode_buffer_specs(), capture_sizes=sizes, sanitizer=self.sanitizer
        )
        self.runner.capture()
        self.batch = DecodeBatch.empty(world.device, world.cfg.max_context_len)

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

    def step(self) -> None:
        full = self.batch.seq_lens_cpu >= self.world.cfg.max_context_len
        self.finish(set(torch.nonzero(full).flatten().tolist()))
        if self.batch.is_empty():
            return
        self.batch.prepare_decode(self.world.req_pool, self.world.kv_alloc)
        self.world.record_step(self.batch)
        self.check_replay()

    def check_replay(self) -> None:
        world, runner, batch = self.world, self.runner, self.batch
        raw_bs = batch.batch_size
        before = world.state()
        expected, expected_state = world.eager_reference(batch)
        if raw_bs <= runner.max_bs:
            poison_tails(runner, raw_bs, stale_values(world, batch))
            PADDED_CASES.add((runner.mechanism.label, runner.graph_size_for(raw_bs), raw_bs))
        out = runner.replay(batch).clone()
        torch.testing.assert_close(out, expected)
        after = world.state()
        for name in ("k", "v"):
            assert torch.equal(after[name][1:], expected_state[name][1:]), name
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
            scenario.step()
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

    check()

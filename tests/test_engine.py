"""The engine loop on the embedded default model, through the eager runner
(same buffers and padding as the graph runners, no compile time)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from graphrunner_ref.engine.loop import AdmissionError, Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request, requests_from_prompts, synthetic_trace
from graphrunner_ref.model import ModelBundle, default_model

MAX_BS = 4


PAGE = 4  # KV slots per page in the paged cases


def _engine(
    *,
    check: bool = False,
    end_token: int | None = None,
    max_requests: int = MAX_BS,
    page_size: int = 1,
) -> Engine:
    bundle = default_model(max_requests=max_requests, page_size=page_size)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    return Engine(bundle, runner, check=check, end_token=end_token)


def _trace(n: int = 10, seed: int = 3) -> list[Request]:
    return synthetic_trace(
        num_requests=n,
        vocab_size=256,
        max_context_len=256,
        seed=seed,
        prompt_len=(1, 20),
        new_tokens=(1, 12),
        mean_gap=1.0,
    )


def _solo_greedy(bundle: ModelBundle, req: Request) -> list[int]:
    """The model alone, one request, no runner, no batching."""
    from graphrunner.batch.decode_batch import DecodeBatch

    index = bundle.req_pool.alloc(1)[0]
    slots = bundle.kv_alloc.alloc(len(req.prompt))
    tokens = [
        int(
            bundle.model.forward_extend(
                index, torch.tensor(req.prompt), torch.tensor(slots)
            ).argmax()
        )
    ]
    batch = DecodeBatch.from_requests(
        [index],
        [len(req.prompt)],
        torch.tensor(tokens),
        device="cpu",
        max_context_len=bundle.max_context_len,
    )
    while len(tokens) < req.max_new_tokens:
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, torch.tensor(tokens[-1:]))
        with torch.no_grad():
            tokens.append(int(bundle.model.forward_decode(batch).argmax()))
    return tokens


def test_continuous_batching_equals_each_request_alone() -> None:
    engine = _engine(check=True)
    trace = _trace()
    result = engine.run(trace)
    assert result.finished == {r.rid for r in trace}
    assert result.stats.mismatches == 0 and result.stats.checked_steps == result.stats.steps
    assert max(result.stats.batch_sizes) == MAX_BS and result.stats.padded_rows > 0
    solo = default_model(max_requests=1)
    for req in trace:
        assert len(result.outputs[req.rid]) == req.max_new_tokens
        assert result.outputs[req.rid] == _solo_greedy(solo, req)
        solo.req_pool.clear()
        solo.kv_alloc.clear()


def test_pools_are_free_after_a_run_and_after_a_cut_run() -> None:
    engine = _engine()
    b = engine.bundle
    full_kv, full_reqs = b.kv_alloc.available_size(), b.req_pool.available_size()
    engine.run(_trace())
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (full_kv, full_reqs)
    cut = engine.run(_trace(seed=4), max_steps=3)
    assert cut.stats.steps == 3 and len(cut.finished) < 10
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (full_kv, full_reqs)


def test_end_token_finishes_a_request_and_is_kept() -> None:
    trace = requests_from_prompts(
        [[1, 2, 3], [7], [40, 41, 42, 43]], max_new_tokens=10, arrive_every=1
    )
    baseline = _engine().run(trace).outputs
    end = baseline[0][3]
    result = _engine(end_token=end).run(trace)
    assert result.finished == {0, 1, 2}
    for rid, tokens in baseline.items():
        cut = tokens.index(end) + 1 if end in tokens else len(tokens)
        assert result.outputs[rid] == tokens[:cut]


def test_admission_waits_for_rows_and_kv_room() -> None:
    # Room for one full-length request only: the others must wait their turn.
    bundle = default_model(max_requests=1)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    runner.capture()
    trace = requests_from_prompts([[1] * 10, [2] * 10, [3] * 10], max_new_tokens=5)
    result = Engine(bundle, runner).run(trace)
    assert result.finished == {0, 1, 2} and result.stats.batch_sizes == {1: 12}


@pytest.mark.parametrize(
    "request_, match",
    [
        (Request(0, (1, 256), 4), "token id 256 outside the vocabulary"),
        (Request(0, (1,) * 250, 8), "257 tokens"),
    ],
)
def test_invalid_requests_fail_before_any_work(request_: Request, match: str) -> None:
    engine = _engine()
    with pytest.raises(ValueError, match=match):
        engine.run([Request(1, (5,), 3), request_])
    assert engine.runner.stats.replays == 0


class StrayWriter:
    """A runner that, after each replay, writes into a live KV slot it does not own."""

    def __init__(self, inner: Any, bundle: ModelBundle) -> None:
        self.inner, self.bundle = inner, bundle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def replay(self, batch: Any) -> Any:
        out = self.inner.replay(batch)
        first_slot = int(self.bundle.req_pool.req_to_token[batch.req_pool_indices_cpu[0], 0])
        self.bundle.kv_cache.k_buffers[0][first_slot] += 1.0
        return out


def test_check_catches_a_runner_that_corrupts_live_kv() -> None:
    engine = _engine(check=True)
    engine.runner = StrayWriter(engine.runner, engine.bundle)  # type: ignore[assignment]
    result: EngineResult = engine.run(_trace(n=4))
    assert result.stats.mismatches == result.stats.steps > 0
    assert result.stats.max_kv_diff >= 1.0


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs longer than ``seconds``."""

    def expire(*_: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    ("page_size", "held", "needs", "free"),
    [
        # 6 of 256 slots stay free; the request needs 3 + 8 - 1 = 10.
        (1, 250, "10 KV slots", "6 KV slots"),
        # 8 slots (2 pages) stay free; 10 slots take 3 pages.
        (PAGE, 248, "3 KV pages of 4 slots", "2 KV pages of 4 slots"),
    ],
)
def test_a_request_that_can_never_be_admitted_is_an_error_not_a_hang(
    page_size: int, held: int, needs: str, free: str
) -> None:
    engine = _engine(max_requests=1, page_size=page_size)
    b = engine.bundle
    held_slots = b.kv_alloc.alloc(held)  # KV held outside the run
    with _deadline(60), pytest.raises(AdmissionError) as err:
        engine.run([Request(0, (1, 2, 3), 8)], max_steps=5)
    assert str(err.value) == (
        f"request 0 can never be admitted: it needs 1 request row and {needs}, "
        f"nothing is running, and 1 request rows and {free} are free"
    )
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (256 - held, 1)
    assert engine.runner.stats.replays == 0
    b.kv_alloc.free(held_slots)


def test_a_request_too_big_for_the_kv_left_is_an_error_once_the_run_drains() -> None:
    engine = _engine(max_requests=2)
    b = engine.bundle
    held = b.kv_alloc.alloc(500)  # 12 of 512 KV slots stay free
    trace = requests_from_prompts([[1, 2], [3] * 15], max_new_tokens=6)  # 7 and 20 slots
    with _deadline(60), pytest.raises(AdmissionError) as err:
        engine.run(trace)
    assert str(err.value) == (
        "request 1 can never be admitted: it needs 1 request row and 20 KV slots, "
        "nothing is running, and 2 request rows and 12 KV slots are free"
    )
    # Request 0 ran to its end first (5 decode steps); nothing of it is left allocated.
    assert engine.runner.stats.replays == 5
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (12, 2)
    b.kv_alloc.free(held)


class FailingReplay:
    """A runner whose ``fail_at``-th replay raises (after its batch was prepared)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def replay(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("replay failed")
        return self.inner.replay(batch)


@pytest.mark.parametrize("check", [False, True])
def test_a_failed_run_frees_every_row_and_slot_it_allocated(check: bool) -> None:
    engine = _engine(check=check)
    b = engine.bundle
    full = (b.kv_alloc.available_size(), b.req_pool.available_size())
    engine.runner = FailingReplay(engine.runner, fail_at=6)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="replay failed"):
        engine.run(_trace())
    assert engine.runner.calls == 6  # type: ignore[attr-defined]
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == full
    assert b.kv_alloc.allocated() == frozenset() and b.req_pool.allocated() == frozenset()


def test_a_failed_prefill_frees_the_requests_admitted_with_it() -> None:
    engine = _engine()
    b = engine.bundle
    full = (b.kv_alloc.available_size(), b.req_pool.available_size())
    real, calls = b.model.forward_extend, []

    def extend(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("prefill failed")
        return real(*args, **kwargs)

    b.model.forward_extend = extend  # type: ignore[method-assign]
    trace = requests_from_prompts([[1, 2], [3, 4], [5]], max_new_tokens=3)  # all arrive at 0
    with pytest.raises(RuntimeError, match="prefill failed"):
        engine.run(trace)
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == full


# Paged KV (pages of 4 slots): prefill takes whole pages, decode continues in
# the last one and starts a fresh page at every 4th token.
def test_paged_outputs_equal_unpaged_outputs_on_the_same_trace() -> None:
    trace = _trace(n=12, seed=5)
    unpaged = _engine().run(trace)
    paged = _engine(check=True, page_size=PAGE).run(trace)
    assert paged.finished == unpaged.finished == {r.rid for r in trace}
    assert paged.outputs == unpaged.outputs
    assert paged.stats.mismatches == 0 and paged.stats.checked_steps == paged.stats.steps
    # The trace crosses page boundaries mid-decode, and prompts end mid-page.
    assert any(r.max_len > len(r.prompt) + PAGE for r in trace)
    assert any(len(r.prompt) % PAGE for r in trace)


def test_paged_pools_are_free_after_a_run_and_after_a_cut_run() -> None:
    engine = _engine(page_size=PAGE)
    b = engine.bundle
    assert b.page_size == PAGE and b.kv_alloc.size == MAX_BS * 256
    full = (b.kv_alloc.available_size(), b.req_pool.available_size())
    engine.run(_trace())
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == full
    cut = engine.run(_trace(seed=4), max_steps=7)
    assert cut.stats.steps == 7 and len(cut.finished) < 10
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == full
    assert b.kv_alloc.allocated() == frozenset() and b.req_pool.allocated() == frozenset()


class FailingPagedReplay(FailingReplay):
    """:class:`FailingReplay` that records, at the failing call, each row's length
    before the step (a multiple of the page size: the row got a fresh page)."""

    def replay(self, batch: Any) -> Any:
        if self.calls + 1 == self.fail_at:
            self.lens_before = (batch.seq_lens_cpu - 1).tolist()
        return super().replay(batch)


@pytest.mark.parametrize("check", [False, True])
def test_a_failed_paged_replay_frees_the_fresh_pages_and_every_owned_page(check: bool) -> None:
    engine = _engine(check=check, page_size=PAGE)
    b = engine.bundle
    full = (b.kv_alloc.available_size(), b.req_pool.available_size())
    failing = FailingPagedReplay(engine.runner, fail_at=6)
    engine.runner = failing  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="replay failed"):
        engine.run(_trace())
    # The failing step mixed rows that got a fresh page with rows writing inside
    # a page they own: only the fresh pages are the step's to free.
    assert {n % PAGE == 0 for n in failing.lens_before} == {True, False}
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == full
    assert b.kv_alloc.allocated() == frozenset() and b.req_pool.allocated() == frozenset()


def test_paged_admission_counts_whole_pages() -> None:
    # 12 KV slots (3 pages) free. Each request needs 2 + 4 - 1 = 5 tokens: 10
    # slots for both, but 2 pages each, so the second waits for the first.
    engine = _engine(max_requests=2, page_size=PAGE)
    b = engine.bundle
    held = b.kv_alloc.alloc(b.kv_alloc.size - 12)
    trace = requests_from_prompts([[1, 2], [3, 4]], max_new_tokens=4)
    result = engine.run(trace)
    assert result.finished == {0, 1} and result.stats.batch_sizes == {1: 6}
    assert result.outputs == _engine().run(trace).outputs
    assert b.kv_alloc.available_size() == 12
    b.kv_alloc.free(held)


def test_paged_admission_reserves_whole_pages_not_tokens() -> None:
    # 12 KV slots (3 pages) free. Request 0 needs 2 + 3 - 1 = 4 tokens: its
    # prompt's page holds them all, so while it runs nothing more is reserved
    # for it (2 more tokens, by a token count) and request 1 (5 tokens, 2
    # pages), arriving a step later, joins it at once; request 2 waits for a page.
    engine = _engine(max_requests=3, page_size=PAGE)
    b = engine.bundle
    held = b.kv_alloc.alloc(b.kv_alloc.size - 12)
    trace = [Request(0, (1, 2), 3), Request(1, (3, 4), 4, 1), Request(2, (5, 6), 4, 1)]
    result = engine.run(trace)
    assert result.finished == {0, 1, 2} and result.stats.batch_sizes == {1: 6, 2: 1}
    assert b.kv_alloc.available_size() == 12
    b.kv_alloc.free(held)


@pytest.mark.parametrize("page_size", [0, -2, True])
def test_build_rejects_a_bad_page_size(page_size: Any) -> None:
    with pytest.raises(ValueError, match=f"page_size={page_size!r}: expected an int >= 1"):
        default_model(max_requests=1, page_size=page_size)


def test_step_time_holds_the_replays_and_admission_apart() -> None:
    stats = _engine().run(_trace(4)).stats
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    # The replays and the admissions are parts of the steps, apart from each other.
    assert stats.step_seconds >= stats.prefill_seconds + stats.decode_seconds
    assert stats.decode_wall_seconds == stats.step_seconds - stats.prefill_seconds
    assert stats.decode_wall_seconds >= stats.decode_seconds

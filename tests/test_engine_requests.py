"""The engine's request API (``add_request``, ``abort``, ``step``,
``has_unfinished``, ``stats``) on the embedded model, eager runner: requests
added one at a time while others run get each request's own greedy tokens,
every schedule gives what ``run`` gives, each request ends once with its
reason, and aborts free every request row and KV page."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphrunner import DecodeBatch
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import Engine, RequestOutput
from graphrunner_ref.engine.serving import Hooks, build, open_engine
from graphrunner_ref.engine.workload import Request, synthetic_trace
from graphrunner_ref.model import ModelBundle

CONFIG = EngineConfig(runner="eager", capture_sizes=(1, 2, 4), quiet=True)
NEW = 9


def _bundle(max_requests: int) -> ModelBundle:
    built = build(CONFIG, max_requests=max_requests, context=128)
    assert isinstance(built, ModelBundle)
    return built


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return _bundle(4)


@pytest.fixture(scope="module")
def solo() -> ModelBundle:
    """The same model for the reference, pools of its own."""
    return _bundle(16)


def _alone(bundle: ModelBundle, prompt: tuple[int, ...], new: int) -> list[int]:
    """Greedy tokens of ``prompt`` on the model alone: no runner, no batch
    mates (its rows and pages are never freed: a bundle of its own)."""
    index = bundle.req_pool.alloc(1)[0]
    slots = bundle.kv_alloc.alloc(len(prompt))
    with torch.no_grad():
        logits = bundle.model.forward_extend(index, torch.tensor(prompt), torch.tensor(slots))
        tokens = [int(logits.argmax())]
        batch = DecodeBatch.from_requests(
            [index],
            [len(prompt)],
            torch.tensor(tokens),
            device="cpu",
            max_context_len=bundle.max_context_len,
        )
        while len(tokens) < new:
            batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, torch.tensor(tokens[-1:]))
            tokens.append(int(bundle.model.forward_decode(batch).argmax()))
    return tokens


def _drain(engine: Engine, limit: int = 500) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"still unfinished after {limit} steps")


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(1, 256, (_length(g),), generator=g).tolist()) for _ in range(n)]


def _length(g: torch.Generator) -> int:
    return int(torch.randint(1, 14, (1,), generator=g))


def _tokens_by_rid(outputs: list[RequestOutput]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        tokens.setdefault(out.rid, []).extend(out.tokens)
    return tokens


def _free_counts(bundle: ModelBundle) -> tuple[int, int]:
    return bundle.req_pool.available_size(), bundle.kv_alloc.available_size()


def test_requests_added_while_others_run_get_their_own_greedy_tokens(
    bundle: ModelBundle, solo: ModelBundle
) -> None:
    engine = open_engine(CONFIG, bundle)
    free = _free_counts(bundle)
    prompts = _prompts(6)
    rids = [engine.add_request(p, NEW) for p in prompts[:3]]
    outputs = engine.step() + engine.step()
    assert engine.has_unfinished() and engine.running() == 3
    rids += [engine.add_request(p, NEW) for p in prompts[3:]]
    outputs += _drain(engine)
    assert rids == list(range(6))
    got = _tokens_by_rid(outputs)
    assert got == {rid: _alone(solo, p, NEW) for rid, p in zip(rids, prompts, strict=True)}
    ends = [o for o in outputs if o.finished]
    assert sorted(o.rid for o in ends) == rids  # each request ends exactly once
    assert {o.finish_reason for o in ends} == {"length"}
    for end in ends:  # and its end is its last output
        assert outputs.index(end) == max(i for i, o in enumerate(outputs) if o.rid == end.rid)
    stats = engine.stats()
    assert stats.decode_tokens + stats.prefills == 6 * NEW
    assert not engine.has_unfinished() and _free_counts(bundle) == free
    engine.close()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"overlap": True},
        {"steps_per_launch": 3},
        {"steps_per_launch": 3, "overlap": True},
        {"max_num_batched_tokens": 8},
        {"chunked_prefill": False},
    ],
    ids=["plain", "overlap", "3-steps", "3-steps-overlap", "chunks-of-8", "whole-prompts"],
)
def test_every_schedule_steps_what_run_gives(
    bundle: ModelBundle, options: dict[str, object]
) -> None:
    config = dataclasses.replace(CONFIG, **options)  # type: ignore[arg-type]
    trace = synthetic_trace(
        num_requests=7,
        vocab_size=256,
        max_context_len=96,
        seed=5,
        prompt_len=(1, 20),
        new_tokens=(1, 10),
        mean_gap=0.0,
    )
    expected = open_engine(config, bundle, trace=trace).run(trace)
    engine = open_engine(config, bundle)
    for req in trace:
        engine.add_request(req.prompt, req.max_new_tokens, rid=req.rid)
    outputs = _drain(engine)
    assert _tokens_by_rid(outputs) == expected.outputs
    assert {o.rid for o in outputs if o.finished} == expected.finished


def test_the_end_token_ends_a_request_with_stop(bundle: ModelBundle, solo: ModelBundle) -> None:
    prompt = _prompts(1, seed=4)[0]
    alone = _alone(solo, prompt, NEW)
    end = alone[3]
    engine = open_engine(CONFIG, bundle, hooks=Hooks(end_token=end))
    rid = engine.add_request(prompt, NEW)
    outputs = _drain(engine)
    assert _tokens_by_rid(outputs)[rid] == alone[: alone.index(end) + 1]
    assert outputs[-1].finish_reason == "stop"


def test_a_requests_own_stop_check_ends_it_and_no_other(
    bundle: ModelBundle, solo: ModelBundle
) -> None:
    prompts = _prompts(2, seed=5)
    alone = [_alone(solo, p, NEW) for p in prompts]
    seen: list[list[int]] = []

    def third(tokens: list[int]) -> bool:
        seen.append(list(tokens))
        return len(tokens) == 3

    engine = open_engine(CONFIG, bundle)
    stopped = engine.add_request(prompts[0], NEW, stop=third)
    free = engine.add_request(prompts[1], NEW)
    outputs = _drain(engine)
    tokens = _tokens_by_rid(outputs)
    assert tokens[stopped] == alone[0][:3] and tokens[free] == alone[1]
    ends = {o.rid: o.finish_reason for o in outputs if o.finished}
    assert ends == {stopped: "stop", free: "length"}
    assert seen == [alone[0][:k] for k in (1, 2, 3)]  # asked after each of its tokens
    with pytest.raises(TypeError, match="stop is a str"):
        engine.add_request(prompts[0], NEW, stop="\n")  # type: ignore[arg-type]


def test_aborts_end_waiting_and_running_requests_and_free_their_pages(
    bundle: ModelBundle,
) -> None:
    engine = open_engine(CONFIG, bundle)
    free = _free_counts(bundle)
    prompts = _prompts(6, seed=2)
    rids = [engine.add_request(p, 40) for p in prompts]  # 4 rows: two wait
    engine.step()
    assert engine.running() == 4
    engine.abort(rids[5])  # waiting: ends at the next step, with nothing
    engine.abort(rids[0])  # running: cut after its next token
    engine.abort(12345)  # unknown: ignored
    outputs = engine.step()
    ends = {o.rid: o for o in outputs if o.finished}
    assert ends[rids[5]].finish_reason == "abort" and ends[rids[5]].tokens == []
    assert ends[rids[0]].finish_reason == "abort"
    for rid in rids[1:5]:
        engine.abort(rid)
    rest = _drain(engine)
    assert sorted(o.rid for o in rest if o.finished) == rids[1:5]
    assert all(o.finish_reason == "abort" for o in rest if o.finished)
    assert _free_counts(bundle) == free
    engine.abort(rids[1])  # finished already: ignored
    assert engine.step() == []


def test_close_frees_what_requests_in_flight_hold(bundle: ModelBundle) -> None:
    engine = open_engine(CONFIG, bundle)
    free = _free_counts(bundle)
    for p in _prompts(5, seed=3):
        engine.add_request(p, 30)
    engine.step()
    engine.step()
    assert _free_counts(bundle) != free
    engine.close()
    assert _free_counts(bundle) == free and not engine.has_unfinished()
    assert engine.stats().steps == 0


def test_bad_requests_are_refused_by_name_and_queue_nothing(bundle: ModelBundle) -> None:
    engine = open_engine(CONFIG, bundle)
    rid = engine.add_request((1, 2, 3), 4)
    with pytest.raises(ValueError, match=f"rid={rid} is still in the engine"):
        engine.add_request((5,), 4, rid=rid)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.add_request((5,), 0)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request((), 4)
    with pytest.raises(ValueError, match="context|fit"):
        engine.add_request(tuple(range(1, 200)), 4)
    trace = [Request(99, (1, 2), 3)]
    with pytest.raises(RuntimeError, match="1 requests added by add_request are open"):
        engine.run(trace)
    outputs = _drain(engine)
    assert [o.rid for o in outputs if o.finished] == [rid]
    assert sorted(engine.run(trace).outputs) == [99]  # closed once drained


def test_stop_tokens_and_ignore_eos_the_engine_cannot_honour_are_refused(
    bundle: ModelBundle,
) -> None:
    engine = open_engine(CONFIG, bundle)
    vocab = bundle.config.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids has {vocab} outside the vocabulary"):
        engine.add_request((1, 2), 4, stop_token_ids=(3, vocab))
    multistep = dataclasses.replace(CONFIG, steps_per_launch=3)
    launches = open_engine(multistep, bundle, hooks=Hooks(end_token=5))
    with pytest.raises(ValueError, match="ignore_eos=True with 3 steps per launch"):
        launches.add_request((1, 2), 4, ignore_eos=True)
    assert not engine.has_unfinished() and not launches.has_unfinished()
    plain = open_engine(CONFIG, bundle, hooks=Hooks(end_token=5))
    plain.add_request((1, 2), 4, ignore_eos=True)  # one step a launch: honoured
    plain.close()

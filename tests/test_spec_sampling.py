"""Sampling through the speculative engine: temperature 0 is the greedy
engine's output bit for bit (alone and beside sampling requests); a sampling
request's tokens depend on its seed alone, not on its company, the captured
sizes, arrivals or mechanism; the sampled MTP draft loop draws as its eager
forward; drafts drawn from the target itself always hold; and the
token a round emits follows the target's filtered distribution (chi-square
against an eager forward of the target)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_sampling_distribution import chi_square_critical

from graphrunner.core.runner import GraphRunner
from graphrunner.phases import FrozenKvMtpRunner, frozen_kv_sanitizer
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import SamplingParams, filtered_probs, sampling_tensors
from graphrunner_ref.engine.drafters import TargetDrafter
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.speculative import SpeculativeEngine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelBundle, default_model
from graphrunner_ref.model.draft import FrozenKvMtpHead, init_draft_weights
from spec_world import SpecWorld

SIZES = [1, 2, 4]
DRAFTS = [("eagle", "random"), ("mtp", "random"), ("mtp", "self")]
HOT = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9, seed=77),
    SamplingParams(temperature=1.0, min_p=0.05),
]


def _bundle(max_requests: int = 4) -> ModelBundle:
    return default_model(max_requests=max_requests, max_context_len=40, dtype=torch.float64)


def _trace(sampling: list[SamplingParams | None], arrive_every: int = 0) -> list[Request]:
    return [
        Request(i, tuple(range(3 + i, 8 + 2 * i)), 10, i * arrive_every, sampling=s)
        for i, s in enumerate(sampling)
    ]


def _spec(
    trace: list[Request], method: str, draft: str, sizes: list[int] = SIZES, **kw: object
) -> dict[int, list[int]]:
    bundle = _bundle()
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    engine = speculative_engine(
        bundle, "eager", method=method, draft=draft, k=3, capture_sizes=sizes, **kw
    )
    out = engine.run(trace).outputs
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free
    return out


@functools.cache
def _plain_greedy() -> dict[int, list[int]]:
    bundle = _bundle()
    runner = create_decode_runner(bundle, "eager", capture_sizes=SIZES)
    runner.capture()
    return Engine(bundle, runner).run(_trace([None] * 8, arrive_every=1)).outputs


@pytest.mark.parametrize(("method", "draft"), DRAFTS)
def test_temperature_0_is_greedy_alone_and_beside_sampling_requests(method: str, draft: str):
    greedy = _plain_greedy()
    zero = SamplingParams(temperature=0.0, top_k=3, seed=5)
    assert _spec(_trace([zero] * 8, arrive_every=1), method, draft) == greedy
    mixed = _spec(_trace([zero, HOT[0], None, HOT[1]] * 2, arrive_every=1), method, draft)
    for rid in (0, 2, 4, 6):
        assert mixed[rid] == greedy[rid]
    assert any(mixed[rid] != greedy[rid] for rid in (1, 3, 5, 7))


@pytest.mark.parametrize(("method", "draft"), DRAFTS)
def test_a_sampling_request_depends_on_its_seed_alone(method: str, draft: str):
    trace = _trace(HOT)
    together = _spec(trace, method, draft)
    staggered = _spec(_trace(HOT, arrive_every=2), method, draft, sizes=[4])
    assert staggered == together
    for i, r in enumerate(trace):
        alone = _spec([Request(r.rid, r.prompt, 10, sampling=r.sampling)], method, draft, [1])
        assert alone[r.rid] == together[i]
    # Without a seed of its own a request's seed comes from the run seed and its id.
    assert _spec(trace, method, draft, run_seed=1)[2] == together[2]  # seed 77: its own
    assert _spec(trace, method, draft, run_seed=1)[0] != together[0]


@pytest.mark.parametrize(("method", "draft"), [*DRAFTS, ("mtp", "wrong")])
def test_the_verify_graph_accepts_and_rejects_as_the_rule_outside_it(method: str, draft: str):
    """The factory's engine samples inside its captured verify; an engine
    over the same runners without it tests the drafts on the verify's logits
    (rejection_sample after the replay): the same tokens, bit for bit."""
    trace = _trace([*HOT, None, SamplingParams(temperature=0.9, top_k=4)], arrive_every=1)
    bundle = _bundle()
    engine = speculative_engine(
        bundle, "eager", method=method, draft=draft, k=3, capture_sizes=SIZES
    )
    inside = engine.run(trace)
    assert engine.verifier.sampled is not None  # the rounds went through it
    if draft != "self":
        assert inside.stats.accepted < inside.stats.proposed  # residual draws ran
    outside = SpeculativeEngine(bundle, engine.verify, engine.drafter).run(trace)
    assert outside.outputs == inside.outputs
    assert outside.stats.accepted == inside.stats.accepted


def test_drafts_drawn_from_the_target_itself_always_hold():
    bundle = _bundle()
    engine = speculative_engine(bundle, "eager", draft="self", k=3, capture_sizes=SIZES)
    stats = engine.run(_trace(HOT * 2, arrive_every=1)).stats
    assert stats.proposed > 0 and stats.accepted == stats.proposed


def _eager_logits(ids: torch.Tensor) -> torch.Tensor:
    """The target's next-token logits ``[V]`` after ``ids``: a prefill on a fresh bundle."""
    b = _bundle()
    slots = torch.tensor(b.kv_alloc.alloc(ids.numel()))
    return b.model.logits(b.model.extend_hidden(b.req_pool.alloc(1)[0], ids, slots)[-1])


class _Biased:
    """A draft decode runner whose logits are the target's plus a fixed bias:
    a draft that agrees with the target often, not always."""

    def __init__(self, runner: GraphRunner, bias: torch.Tensor) -> None:
        self.runner, self.bias = runner, bias

    def replay(self, inputs: object) -> torch.Tensor:
        return self.runner.replay(inputs) + self.bias


def test_the_round_token_follows_the_target_distribution():
    """The second token (the first a round emits: a draft that holds or the
    residual's draw), grouped by the first, against the target's filtered
    distribution given the prompt and that first token."""
    params = dict(temperature=1.5, top_k=3)
    n, prompt = 3000, (5, 9, 2)
    trace = [
        Request(i, prompt, 2, sampling=SamplingParams(**params, seed=i * 104729 + 1))  # type: ignore[arg-type]
        for i in range(n)
    ]
    bundle = _bundle(max_requests=32)
    engine = speculative_engine(bundle, "eager", draft="self", k=2, capture_sizes=[32])
    drafter = engine.drafter
    assert isinstance(drafter, TargetDrafter)
    bias = torch.randn(bundle.config.vocab_size, generator=torch.Generator().manual_seed(9))
    drafter.decode = _Biased(drafter.decode, bias * 0.6)  # type: ignore[assignment]
    result = engine.run(trace)
    stats = result.stats
    assert 0.2 * stats.proposed < stats.accepted < 0.9 * stats.proposed, stats
    outputs = torch.tensor([result.outputs[i] for i in range(n)])
    vocab = bundle.config.vocab_size
    t, k = torch.tensor([1.5], dtype=torch.float32), torch.tensor([3])
    one, zero = torch.ones(1), torch.zeros(1)
    for first in outputs[:, 0].unique().tolist():
        second = outputs[outputs[:, 0] == first, 1]
        ids = torch.tensor([*prompt, first])
        logits = _eager_logits(ids)
        p = filtered_probs(logits.view(1, -1), t, k, one, zero)[0].double()
        counts = torch.bincount(second, minlength=vocab).double()
        support = p > 0
        assert int(counts[~support].sum()) == 0
        expected = p[support] * second.numel()
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        assert chi2 < chi_square_critical(int(support.sum()) - 1), (first, chi2, counts[support])


def test_compiled_runners_draw_the_same_tokens():
    """The compiled CPU programs (the verify's rejection sampling inside its
    program, EAGLE's draft draws on its logits) give the eager runners' tokens."""
    trace = _trace(HOT)
    eager = _spec(trace, "eagle", "random", sizes=[2, 4])
    engine = speculative_engine(_bundle(), "cpu", method="eagle", k=3, capture_sizes=[2, 4])
    assert engine.run(trace).outputs == eager


def test_the_sampled_mtp_loop_draws_as_its_eager_forward_at_a_padded_size():
    world = SpecWorld("cpu")
    head = FrozenKvMtpHead(world.model, steps=3, topk=1)
    init_draft_weights(head, seed=2)
    b = world.bundle
    runner = FrozenKvMtpRunner(
        head,
        sampling=True,
        device=world.device,
        capture_sizes=[4],
        show_progress=False,
        kind="eager",
        sanitizer=frozen_kv_sanitizer(b.req_pool, b.kv_cache),
    )
    runner.capture()
    inputs = world.mtp_inputs(world.reset(3, seed=5), seed=5)
    params = [HOT[1], SamplingParams(), HOT[2]]  # a greedy row between two that sample
    rows = sampling_tensors(params, [11, 12, 13], world.device)
    out = runner.replay(with_sampling(inputs, rows))
    assert isinstance(out, dict)
    expected = head.forward_draft_sampled(with_sampling(inputs, rows))
    assert torch.equal(out["tokens"], expected["tokens"])
    assert torch.allclose(out["probs"], expected["probs"])
    greedy = head.forward_draft(inputs)["tokens"]
    assert torch.equal(out["tokens"][1], greedy[1])  # temperature 0: the argmax chain
    assert not torch.equal(out["tokens"][[0, 2]], greedy[[0, 2]])

"""Speculative decoding with a grammar (structured output): each request's
drafts are checked against its grammar, a draft the grammar refuses is
rejected at its position, and the greedy constrained output equals the plain
engine's constrained output token for token (fp64, so argmax ties stay out),
with requests without a grammar in the same rounds; a sampled constrained
answer follows its grammar; pools end as they began."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from graphrunner.sampling import SamplingParams
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelBundle, default_model

SIZES = [1, 2, 4]
VOCAB = 256
END = VOCAB - 1


class StepGrammar:
    """A grammar over token ids that keeps state: answer token ``n`` must be
    ``= (previous token + n) mod mod`` (the previous of the first is 0), not
    ``end``, for ``length`` tokens; then ``end`` alone, which completes it
    (``end`` None: the ``length``-th token completes it). A complete grammar
    allows nothing and has no next bitmask, as xgrammar's. ``rollback(n)``
    forgets the last ``n`` tokens."""

    def __init__(
        self, length: int, *, mod: int = 5, end: int | None = END, rollback: bool = True
    ) -> None:
        self.length, self.mod, self.end = length, mod, end
        self.tokens: list[int] = []
        if not rollback:
            self.rollback = None  # type: ignore[assignment]

    def allows(self, token: int) -> bool:
        n = len(self.tokens)
        if self.is_terminated():
            return False
        if n == self.length:
            return token == self.end
        last = self.tokens[-1] if self.tokens else 0
        return token != self.end and token % self.mod == (last + n) % self.mod

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.is_terminated():  # as xgrammar's: a complete grammar has no next token
            raise RuntimeError("the grammar is complete")
        words = [0] * bitmask.shape[1]
        for t in range(VOCAB):
            if self.allows(t):
                words[t // 32] |= 1 << (t % 32)
        signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
        bitmask[index] = torch.tensor(signed, dtype=torch.int32)

    def accept_token(self, token: int) -> bool:
        if not self.allows(token):
            return False
        self.tokens.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.tokens) == self.length + (self.end is not None)

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]


def _trace(sampled: bool = False) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    lens = [3, 9, 1, 14, 6, 2]
    arrivals = [0, 0, 1, 1, 2, 4]
    lengths = [4, None, 12, 7, None, 2]  # None: free; 12: cut by max_new_tokens first
    sampling = SamplingParams(temperature=1.0, seed=11) if sampled else None
    return [
        Request(
            i,
            tuple(torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist()),
            10,
            arrival,
            sampling=sampling if length is not None else None,
            grammar=None if length is None else functools.partial(StepGrammar, length),
        )
        for i, (n, arrival, length) in enumerate(zip(lens, arrivals, lengths, strict=True))
    ]


def _bundle() -> ModelBundle:
    return default_model(max_requests=4, max_context_len=40, dtype=torch.float64)


def _follows(request: Request, tokens: list[int]) -> bool:
    assert request.grammar is not None
    matcher = request.grammar()
    return all(matcher.accept_token(t) for t in tokens)


@functools.cache
def _plain() -> dict[int, list[int]]:
    bundle = _bundle()
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=SIZES, sampling=True, structured=True
    )
    runner.capture()
    return Engine(bundle, runner).run(_trace()).outputs  # the grammar's completion ends it


CASES = [("mtp", "random", 2), ("eagle", "random", 4), ("mtp", "self", 2), ("mtp", "wrong", 1)]


@pytest.mark.parametrize(("method", "draft", "k"), CASES)
def test_constrained_greedy_output_equals_the_plain_engines(
    method: str, draft: str, k: int
) -> None:
    bundle = _bundle()
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    engine = speculative_engine(
        bundle, "eager", method=method, draft=draft, k=k, capture_sizes=SIZES
    )
    trace = _trace()
    result = engine.run(trace)
    plain = _plain()
    assert result.outputs == plain
    for r in trace:
        if r.grammar is not None:
            assert _follows(r, plain[r.rid])
            length = r.grammar().length  # type: ignore[attr-defined]
            expected = [END] if length < r.max_new_tokens else []
            assert plain[r.rid][length : length + 1] == expected
    assert result.finished == set(result.outputs)
    stats = result.stats
    assert stats.proposed == k * stats.request_rounds
    # The self draft proposes the target's own unmasked choice: the grammar
    # refuses some, and the rest are accepted.
    assert stats.grammar_refused > 0
    if draft == "self":
        assert 0 < stats.accepted < stats.proposed
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free


def test_a_draft_that_completes_the_grammar_ends_the_request() -> None:
    # Every token allowed and the 5th completes the grammar: the self draft's
    # drafts all hold, and one of them completes it inside a round.
    grammar = functools.partial(StepGrammar, 5, mod=1, end=None)
    trace = [Request(0, (3, 1, 4), 9, grammar=grammar), Request(1, (2, 7), 9)]
    bundle = _bundle()
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=SIZES, sampling=True, structured=True
    )
    runner.capture()
    plain = Engine(bundle, runner).run(trace).outputs
    engine = speculative_engine(_bundle(), "eager", draft="self", k=4, capture_sizes=SIZES)
    result = engine.run(trace)
    assert result.outputs == plain and len(plain[0]) == 5 and len(plain[1]) == 9
    assert result.stats.accepted == result.stats.proposed


def test_a_sampled_constrained_answer_follows_its_grammar() -> None:
    engine = speculative_engine(
        _bundle(), "eager", method="mtp", draft="random", k=2, capture_sizes=SIZES, end_token=END
    )
    trace = _trace(sampled=True)
    result = engine.run(trace)
    for r in trace:
        if r.grammar is not None:
            assert _follows(r, result.outputs[r.rid])
    assert result.stats.grammar_refused > 0


def test_a_matcher_that_cannot_roll_back_is_refused_by_name() -> None:
    engine = speculative_engine(_bundle(), "eager", k=2, capture_sizes=SIZES)
    grammar = functools.partial(StepGrammar, 3, rollback=False)
    with pytest.raises(ValueError, match="request 0: .* no rollback"):
        engine.run([Request(0, (1, 2), 4, grammar=grammar)])


def test_an_xgrammar_regex_gives_the_plain_engines_tokens() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    vocab = [bytes([i]) for i in range(END)] + [b"</s>"]  # token i: byte i
    info = xgrammar.TokenizerInfo(
        vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[END]
    )
    compiled = xgrammar.GrammarCompiler(info).compile_regex(r"[a-d]{2,5}(,[a-z]{1,3}){1,2}")
    grammar = functools.partial(xgrammar.GrammarMatcher, compiled)
    trace = [
        Request(0, (3, 1, 4), 14, grammar=grammar),
        Request(1, (2, 7), 8),
        Request(2, (9, 9, 9, 9), 14, 1, grammar=grammar),
    ]
    bundle = _bundle()
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=SIZES, sampling=True, structured=True
    )
    runner.capture()
    plain = Engine(bundle, runner).run(trace).outputs
    for draft in ("self", "random"):
        engine = speculative_engine(_bundle(), "eager", draft=draft, k=3, capture_sizes=SIZES)
        result = engine.run(trace)
        assert result.outputs == plain, draft
        assert result.stats.grammar_refused > 0
    for rid in (0, 2):
        text = bytes(plain[rid][:-1]).decode()
        assert plain[rid][-1] == END and re.fullmatch(r"[a-d]{2,5}(,[a-z]{1,3}){1,2}", text)

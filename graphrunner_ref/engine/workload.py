"""Request traces: which prompts arrive at which engine step, and how much
each may generate; what an engine admits (:class:`Admits`), each request
checked against it as it is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.sampling import MAX_HOLD_TOKENS, SamplingParams

if TYPE_CHECKING:
    from graphrunner_ref.engine.grammar import GrammarFactory


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request.

    rid: its id (outputs are keyed by it). prompt: token ids, at least one.
    max_new_tokens: tokens to generate at most (the first comes from prefill).
    arrival_step: the engine step at which it may first be admitted.
    sampling: how it picks its tokens (:class:`~graphrunner.sampling.SamplingParams`);
    None is greedy. Anything but greedy needs a runner built with ``sampling=True``.
    ignore_eos: the engine's end token does not finish it (vLLM's ``ignore_eos``).
    stop_token_ids: tokens that finish it too, kept in its output (vLLM's
    ``stop_token_ids``).
    min_tokens: its end tokens (the engine's, unless ``ignore_eos``, and
    ``stop_token_ids``) are held back until it holds this many new tokens
    (vLLM's ``min_tokens``); at most ``max_new_tokens``. Needs a runner that
    applies penalties.
    grammar: structured output: a factory of its grammar's matchers
    (:mod:`~graphrunner_ref.engine.grammar`); only the tokens the grammar
    allows are drawn, and its completion finishes the request. Needs a
    runner built with ``structured=True``.
    stop: called with its tokens after each recorded token; True finishes
    it there (a served request's stop strings), before the engine's own
    ``stop`` hook is asked.
    """

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    sampling: SamplingParams | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    grammar: GrammarFactory | None = None
    stop: Callable[[list[int]], bool] | None = None
    #: Tokens it can hold in the KV cache (the last generated token is never
    #: fed back): ``len(prompt) + max_new_tokens - 1``, set at construction.
    max_len: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("rid", "max_new_tokens", "arrival_step", "min_tokens"):
            _check_int(f"request {self.rid!r}: {name}", getattr(self, name))
        _check_token_ids(f"request {self.rid}: prompt", self.prompt)
        if not self.prompt:
            raise ValueError(f"request {self.rid}: empty prompt; expected at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"request {self.rid}: max_new_tokens={self.max_new_tokens}; expected >= 1"
            )
        if self.arrival_step < 0:
            raise ValueError(f"request {self.rid}: arrival_step={self.arrival_step}; expected >= 0")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"request {self.rid}: min_tokens={self.min_tokens}; expected 0..max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"request {self.rid}: ignore_eos={self.ignore_eos!r}; expected a bool")
        _check_token_ids(f"request {self.rid}: stop_token_ids", self.stop_token_ids)
        if self.grammar is not None and not callable(self.grammar):
            raise TypeError(
                f"request {self.rid}: grammar is a {type(self.grammar).__name__}; expected a "
                "factory of grammar matchers (callable) or None"
            )
        if self.stop is not None and not callable(self.stop):
            raise TypeError(
                f"request {self.rid}: stop is a {type(self.stop).__name__}; expected a "
                "callable of its tokens, or None"
            )
        if self.grammar is not None and self.min_tokens:
            # A completed grammar allows only its end token, which min_tokens holds back:
            # no token would be left to draw.
            raise ValueError(
                f"request {self.rid}: min_tokens={self.min_tokens} with a grammar: the grammar "
                "decides where the answer ends; expected min_tokens=0"
            )
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                f"request {self.rid}: sampling is a {type(self.sampling).__name__}; expected "
                "a graphrunner.SamplingParams or None"
            )
        object.__setattr__(self, "max_len", len(self.prompt) + self.max_new_tokens - 1)

    @property
    def samples(self) -> bool:
        """True when it draws its tokens (temperature > 0) rather than taking the argmax."""
        return self.sampling is not None and not self.sampling.greedy


@dataclass(frozen=True, slots=True)
class Admits:
    """What an engine admits, as data (read from its runner and pools by
    :func:`~graphrunner_ref.engine.admission.admits_of`): token ids below
    ``vocab_size``; requests of at most ``max_context_len`` tokens and
    ``kv_slots`` KV slots; and what its step does: ``samples`` (temperature
    > 0), ``penalties`` (penalties, a logit bias and ``min_tokens``' hold),
    ``structured`` (a grammar's mask), and, with ``steps`` > 1 steps a
    launch, the end token at which the launch stops every row
    (``launch_end``; None: none), which ``ignore_eos`` cannot lift."""

    vocab_size: int
    max_context_len: int
    kv_slots: int
    samples: bool = True
    penalties: bool = True
    structured: bool = True
    launch_end: int | None = None
    steps: int = 1

    def request(
        self,
        rid: int,
        prompt: Sequence[int],
        max_new_tokens: int,
        arrival_step: int = 0,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> Request:
        """A :class:`Request` of these fields (``options``: its keyword
        fields), built and checked against what is admitted at once: a
        ``ValueError`` or ``TypeError`` naming the field, or the request."""
        request = Request(rid, tuple(prompt), max_new_tokens, arrival_step, sampling, **options)
        self.check([request])
        return request

    def check(self, trace: Sequence[Request]) -> None:
        """``trace`` checked before a run: unique ids, token ids in the
        vocabulary, each request fitting the context and the KV pool,
        greedy unless the step samples, penalties, holds and grammars only
        where the step applies them; a ``ValueError`` naming the request and
        the field."""
        check_trace(trace, self.vocab_size)
        if not self.samples:
            check_greedy(trace)
        check_penalties(trace, self.penalties, self.vocab_size)
        room = min(self.max_context_len, self.kv_slots)
        for r in trace:
            self._check_ignore_eos(r)
            if r.grammar is not None and not self.structured:
                raise ValueError(
                    f"request {r.rid}: a grammar (structured output) needs a runner whose step "
                    "masks the grammar's tokens; build it with create_decode_runner(..., "
                    "sampling=True, structured=True)"
                )
            if r.max_len > room:
                raise ValueError(
                    f"request {r.rid}: prompt {len(r.prompt)} + max_new_tokens "
                    f"{r.max_new_tokens} - 1 = {r.max_len} tokens; expected <= "
                    f"max_context_len {self.max_context_len} and <= KV slots {self.kv_slots}"
                )

    def _check_ignore_eos(self, r: Request) -> None:
        """``r``'s ``ignore_eos`` refused where the runner stops rows itself:
        several steps a launch end a row inside the launch at the engine's
        end token, for every request alike."""
        if r.ignore_eos and self.launch_end is not None:
            raise ValueError(
                f"request {r.rid}: ignore_eos=True with {self.steps} steps per "
                f"launch: the runner ends every row at token {self.launch_end} inside a launch; "
                "expected ignore_eos=False, or one step a launch"
            )


def check_trace(trace: Sequence[Request], vocab_size: int) -> None:
    """Request ids unique and every prompt and stop token in ``0..vocab_size
    - 1`` (ValueError naming the request and the token)."""
    if len({r.rid for r in trace}) != len(trace):
        raise ValueError("request ids must be unique")
    for r in trace:
        for what, ids in (("token id", r.prompt), ("stop_token_ids has", r.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"request {r.rid}: {what} {bad[0]} outside the vocabulary 0..{vocab_size - 1}"
                )


def check_greedy(trace: Sequence[Request]) -> None:
    """Every request of ``trace`` greedy (for a runner that does not sample),
    or a ValueError naming the first that is not."""
    for r in trace:
        if r.sampling is not None and not r.sampling.greedy:
            raise ValueError(
                f"request {r.rid}: temperature {r.sampling.temperature} needs a runner that "
                "samples; build it with create_decode_runner(..., sampling=True)"
            )


def check_penalties(trace: Sequence[Request], penalties: bool, vocab: int) -> None:
    """Every penalized request's logit bias within ``vocab`` and a runner that
    applies penalties (``penalties``), and every request with
    ``min_tokens`` on such a runner with at most ``MAX_HOLD_TOKENS`` end tokens
    (the end token and ``stop_token_ids``), or a ValueError naming the first
    request that fails."""
    for r in trace:
        if r.min_tokens and not penalties:
            raise ValueError(
                f"request {r.rid}: min_tokens={r.min_tokens} needs a runner that holds end "
                "tokens back in its step; build it with create_decode_runner(..., "
                "sampling=True, penalties=True), or expected min_tokens=0"
            )
        if r.min_tokens and len(set(r.stop_token_ids)) >= MAX_HOLD_TOKENS:
            raise ValueError(
                f"request {r.rid}: min_tokens={r.min_tokens} with {len(set(r.stop_token_ids))} "
                f"stop_token_ids; expected at most {MAX_HOLD_TOKENS - 1} (the end token "
                "besides)"
            )
        if r.sampling is None or not r.sampling.penalized:
            continue
        if not penalties:
            raise ValueError(
                f"request {r.rid}: repetition_penalty, presence_penalty, frequency_penalty or "
                "logit_bias needs a runner that applies them; build it with "
                "create_decode_runner(..., sampling=True, penalties=True)"
            )
        try:
            r.sampling.check_vocab(vocab)
        except ValueError as e:
            raise ValueError(f"request {r.rid}: {e}") from None


def _check_token_ids(what: str, ids: object) -> None:
    """``ids`` a tuple of ints (TypeError naming ``what`` and the first bad one)."""
    if not isinstance(ids, tuple):
        raise TypeError(f"{what} is a {type(ids).__name__}; expected a tuple of int token ids")
    for i, token in enumerate(ids):
        _check_int(f"{what}[{i}]", token)


def _check_int(what: str, value: object) -> None:
    # bool is an int to Python, and a float or a tensor would pass a comparison:
    # a request carries plain ints only.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}={value!r} ({type(value).__name__}); expected an int")


def requests_from_prompts(
    prompts: Sequence[Sequence[int]], *, max_new_tokens: int, arrive_every: int = 0
) -> list[Request]:
    """Prompt ``i`` becomes request ``i``, arriving at step ``i * arrive_every``."""
    return [Request(i, tuple(p), max_new_tokens, i * arrive_every) for i, p in enumerate(prompts)]


def synthetic_trace(
    *,
    num_requests: int,
    vocab_size: int,
    max_context_len: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (4, 64),
    new_tokens: tuple[int, int] = (8, 64),
    mean_gap: float = 1.0,
) -> list[Request]:
    """A seeded trace: uniform prompt lengths and budgets (inclusive ranges,
    clipped so every request fits ``max_context_len``), random token ids, and
    arrivals separated by gaps drawn uniformly from ``0..2 * mean_gap`` steps.
    """
    if num_requests < 1 or vocab_size < 1 or mean_gap < 0:
        raise ValueError(
            f"num_requests={num_requests}, vocab_size={vocab_size}, "
            f"mean_gap={mean_gap}: expected >= 1, >= 1, >= 0"
        )
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    requests, step = [], 0
    for rid in range(num_requests):
        n = min(draw(*prompt_len), max_context_len)
        budget = min(draw(*new_tokens), max_context_len - n + 1)
        prompt = tuple(torch.randint(vocab_size, (n,), generator=gen).tolist())
        requests.append(Request(rid, prompt, budget, step))
        step += draw(0, round(2 * mean_gap))
    return requests

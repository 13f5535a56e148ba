"""The EAGLE drafter's own logic against an unpadded per-request reference.

Lossless verify hides a wrong draft (it is only rejected), so this compares
what the drafter itself computes, round by round: the seed and feature each
draft extend leaves for the next round, the features fed to every draft
decode step, the drafted tokens, and the tokens and target features fed to
the draft extend. The reference runs the head eagerly on one request alone:
its rows ``p = 0 .. L - 1`` pair the committed token at ``p + 1`` (the bonus
last) with the target's feature at ``p`` (the target run eagerly over the
request's own tokens), then ``K - 1`` draft decode steps at positions
``L ..``. The target is made nearly a bigram model and the head nearly its
copy, so drafts are often accepted, and not always: every accept length
meets the drafter. fp64, so argmax ties stay out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from graphrunner.phases import SpecBatch
from graphrunner_ref.engine.drafters import EagleDrafter, RoundState, SpecRequest, Verified
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.speculative import SpeculativeEngine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelBundle, default_model
from graphrunner_ref.model.draft import EagleHead

K = 3
W = K + 1
NEW_TOKENS = 14


def _trace() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    lens, arrivals = [3, 9, 1, 14], [0, 0, 1, 2]
    return [
        Request(i, tuple(torch.randint(0, 256, (n,), generator=gen).tolist()), NEW_TOKENS, a)
        for i, (n, a) in enumerate(zip(lens, arrivals, strict=True))
    ]


@torch.no_grad()
def _near_bigram(bundle: ModelBundle, head: EagleHead, scale: float = 0.1) -> None:
    """Shrink the target's layers so its next token depends mostly on the
    current one, and make the head nearly that map: ``fc`` passes the token's
    embedding (plus a little of the feature), its layer is shrunk alike and
    its norm is the target's final norm."""
    for layer in [*bundle.model.model.layers, head.layer]:
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)
    h = bundle.config.hidden_size
    gen = torch.Generator().manual_seed(5)
    fc = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    fc += 2 * scale * torch.randn(h, 2 * h, generator=gen) / h**0.5
    head.fusion.fc.weight.copy_(fc)
    head.fusion.embed_norm.weight.fill_(1.0)
    head.norm.weight.copy_(bundle.model.model.norm.weight)


@dataclass
class _Round:
    """What the drafter saw and did for one round's live requests (in order)."""

    rids: list[int]
    lens: list[int]  # committed tokens L
    seeds: list[int]  # the first draft, from the previous draft extend
    features: torch.Tensor  # [bs, hidden]: fed to the first draft decode step
    decode_features: list[torch.Tensor] = field(default_factory=list)  # per step, [bs, hidden]
    drafts: list[list[int]] = field(default_factory=list)  # [bs][K]
    accepted: list[int] = field(default_factory=list)
    extend_ids: list[int] = field(default_factory=list)  # [bs * W]
    extend_hidden: torch.Tensor | None = None  # [bs * W, hidden]


class _RecordingDrafter:
    """An :class:`EagleDrafter` whose every round is recorded (its runners' inputs too)."""

    def __init__(self, inner: EagleDrafter) -> None:
        self.inner, self.k, self.rounds = inner, inner.k, list[_Round]()
        inner.extend = _Recording(inner.extend, self._on_extend)
        if inner.decode is not None:
            inner.decode = _Recording(inner.decode, self._on_decode)

    def prefill(self, req: SpecRequest, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        self.inner.prefill(req, prompt, hidden)

    def propose(self, state: RoundState) -> torch.Tensor:
        self.rounds.append(
            _Round(
                [r.request.rid for r in state.live],
                state.lens,
                [int(r.seed) for r in state.live],
                torch.stack([r.feature for r in state.live]).clone(),
            )
        )
        drafts = self.inner.propose(state)
        self.rounds[-1].drafts = drafts.tolist()
        return drafts

    def accept(self, state: RoundState, verified: Verified) -> None:
        self.rounds[-1].accepted = verified.accepted.tolist()
        self.inner.accept(state, verified)

    def _on_decode(self, inputs: SpecBatch) -> None:
        self.rounds[-1].decode_features.append(inputs.hidden_states.clone())

    def _on_extend(self, inputs: SpecBatch) -> None:
        self.rounds[-1].extend_ids = inputs.input_ids.tolist()
        self.rounds[-1].extend_hidden = inputs.hidden_states.clone()


class _Recording:
    """A runner whose replays first show their inputs to ``seen``."""

    def __init__(self, runner: Any, seen: Callable[[SpecBatch], None]) -> None:
        self.runner, self.seen = runner, seen

    def replay(self, inputs: SpecBatch) -> Any:
        self.seen(inputs)
        return self.runner.replay(inputs)


def _run(
    check_padding: bool,
) -> tuple[ModelBundle, EagleHead, _RecordingDrafter, dict[int, list[int]]]:
    bundle = default_model(max_requests=4, max_context_len=48, dtype=torch.float64)
    built = speculative_engine(
        bundle,
        "eager",
        method="eagle",
        k=K,
        capture_sizes=[1, 2, 4],
        check_padding=check_padding,
    )
    assert isinstance(built.drafter, EagleDrafter)
    _near_bigram(bundle, built.drafter.head)
    drafter = _RecordingDrafter(built.drafter)
    engine = SpeculativeEngine(bundle, built.verify, drafter)
    outputs = engine.run(_trace()).outputs
    return bundle, built.drafter.head, drafter, outputs


class _Reference:
    """One request alone, eagerly: the target's features over its final
    tokens, and the head's extend and draft decode from any committed length."""

    def __init__(self, bundle: ModelBundle, head: EagleHead, tokens: list[int]) -> None:
        self.bundle, self.head, self.tokens = bundle, head, tokens
        self.device = bundle.device
        (self.row,) = bundle.req_pool.alloc(1)
        self.slots = bundle.kv_alloc.alloc(len(tokens) + K)
        ids = self._ints(tokens[:-1])
        # Causal: the feature at p depends on tokens 0..p only, so one pass serves every round.
        self.features = bundle.model.extend_hidden(self.row, ids, self._ints(self.slots[: -K - 1]))
        bundle.req_pool.write(self.row, 0, self.slots)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _batch(self, seq_len: int, **tensors: torch.Tensor) -> SpecBatch:
        return SpecBatch(
            req_pool_indices_cpu=torch.tensor([self.row]),
            seq_lens_cpu=torch.tensor([seq_len]),
            req_pool_indices=self._ints([self.row]),
            seq_lens=self._ints([seq_len]),
            **tensors,
        )

    @torch.no_grad()
    def draft(self, n: int) -> tuple[list[int], list[torch.Tensor]]:
        """From ``n`` committed tokens: the ``K`` drafts and the feature fed
        to each draft decode step (``[hidden]``; the first is the extend's)."""
        extend = self._batch(
            n,
            input_ids=self._ints(self.tokens[1 : n + 1]),
            positions=torch.arange(n, device=self.device),
            out_cache_loc=self._ints(self.slots[:n]),
            hidden_states=self.features[:n],
            extend_lens=self._ints([n]),
            accept_lens=self._ints([n]),
        )
        out = self.head.forward_extend(extend)
        drafts, features = [int(out["topk_index"][0, 0])], [out["hidden"][0]]
        for j in range(1, K):
            step = self._batch(
                n + j,
                input_ids=self._ints(drafts[-1:]),
                positions=self._ints([n + j - 1]),
                out_cache_loc=self._ints([self.slots[n + j - 1]]),
                hidden_states=features[-1][None],
            )
            out = self.head.forward_decode(step)
            drafts.append(int(out["topk_index"][0, 0]))
            features.append(out["hidden"][0])
        return drafts, features

    def free(self) -> None:
        self.bundle.req_pool.free([self.row])
        self.bundle.kv_alloc.free(self.slots)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("check_padding", [False, True], ids=["plain", "sanitized"])
def test_each_round_drafts_what_the_request_alone_drafts(check_padding: bool) -> None:
    bundle, head, drafter, outputs = _run(check_padding)
    trace = {r.rid: r for r in _trace()}
    refs = {rid: _Reference(bundle, head, [*trace[rid].prompt, *outputs[rid]]) for rid in outputs}
    accepted: set[int] = set()
    for n, rnd in enumerate(drafter.rounds):
        assert rnd.extend_hidden is not None and len(rnd.decode_features) == K - 1
        for i, (rid, length) in enumerate(zip(rnd.rids, rnd.lens, strict=True)):
            where = f"round {n}, request {rid} (L={length})"
            ref, a = refs[rid], rnd.accepted[i]
            drafts, features = ref.draft(length)
            assert rnd.seeds[i] == drafts[0], f"{where}: seed"
            _close(rnd.features[i], features[0], f"{where}: feature from the draft extend")
            for j, fed in enumerate(rnd.decode_features):
                _close(fed[i], features[j], f"{where}: feature fed to draft decode step {j + 1}")
            assert rnd.drafts[i] == drafts, f"{where}: drafts"
            # The draft extend: the accepted rows (and the bonus's) pair the token
            # at p + 1 with the target's feature at p.
            # A request that ends in this round kept fewer tokens than it accepted.
            m = min(a + 1, len(ref.tokens) - length - 1)
            tokens = ref.tokens[length + 1 : length + m + 1]
            assert rnd.extend_ids[i * W : i * W + m] == tokens, f"{where}: extend tokens"
            fed_hidden = rnd.extend_hidden[i * W : i * W + m]
            _close(fed_hidden, ref.features[length : length + m], f"{where}: extend features")
            accepted.add(a)
    for ref in refs.values():
        ref.free()
    assert accepted == set(range(K + 1))  # every accept length, rejection and full acceptance
    assert 3 in {len(r.rids) for r in drafter.rounds}  # several requests, padded to 4

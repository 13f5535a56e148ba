"""A toy decode model with exactly the shape of the padding bug class, and a
world of pools around it. Used by graphrunner's tests and benchmarks; handy in
an engine's own tests too.

The toy forward gathers ``req_to_token[req_pool_indices, :]``, reads K/V at
those slots masked by ``seq_lens``, and writes K/V at ``out_cache_loc``: a
padded row with a stale index reads or writes another request's state.
K/V values are elementwise functions of the token and position, so the state a
step writes is bit-exact whatever the batch shape.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases.base import SpecBatch
from graphrunner.pools import KVCache, ReqToTokenPool, TokenToKVPoolAllocator

__all__ = ["ToyDecodeModel", "ToyWorld", "ToyWorldConfig", "torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore the previous count.

    Small models' ops are tiny: extra threads only add synchronisation, and on
    a busy 2-core machine their spin-waits make a step 10-40x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ToyDecodeModel:
    """One attention layer over a paged KV cache; returns logits ``[bs, vocab]`` float32.

    Args:
        req_pool: ``req_to_token`` int32 ``[num_reqs + 1, max_ctx]``.
        kv: one layer, ``[slots + 1, num_kv_heads, head_dim]``.
        vocab: vocabulary size of ``input_ids`` and of the logits.
    """

    def __init__(self, req_pool: ReqToTokenPool, kv: KVCache, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        dim = kv.num_kv_heads * kv.head_dim
        self.req_pool, self.kv, self.vocab = req_pool, kv, vocab
        self.embed = torch.randn(vocab, dim, generator=gen).to(kv.device)
        self.unembed = torch.randn(dim, vocab, generator=gen).to(kv.device)
        self.context = torch.arange(req_pool.max_context_len, device=kv.device)

    def kv_of(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """K (and V = -K) of tokens at positions: ``[n, heads, head_dim]``."""
        x = self.embed[input_ids] + 0.01 * positions[:, None].to(self.embed.dtype)
        return x.view(-1, self.kv.num_kv_heads, self.kv.head_dim)

    def forward(self, b: object) -> torch.Tensor:
        ids, pos = b.input_ids, b.positions  # type: ignore[attr-defined]
        q = self.kv_of(ids, pos)
        self.kv.set_kv(0, b.out_cache_loc, q, -q)  # type: ignore[attr-defined]
        k_cache, v_cache = self.kv.get_kv(0)
        slots = self.req_pool.req_to_token[b.req_pool_indices].long()  # type: ignore[attr-defined]
        k, v = k_cache[slots], v_cache[slots]  # [bs, ctx, H, D]
        scores = (k * q[:, None]).sum(-1) / q.shape[-1] ** 0.5  # [bs, ctx, H]
        valid = self.context[None, :] < b.seq_lens[:, None]  # type: ignore[attr-defined]
        scores = scores.masked_fill(~valid[..., None], float("-inf"))
        attn = (scores.softmax(dim=1)[..., None] * v).sum(1)  # [bs, H, D]
        return attn.flatten(1) @ self.unembed

    __call__ = forward

    def forward_token_batch(self, b: object) -> torch.Tensor:
        """A token batch (:mod:`graphrunner.phases.token_batch`): every token
        written, then attending as a decode row of its own request up to its
        position; logits ``[requests, vocab]`` of each request's last token."""
        rows = _TokenRows(b)
        return self.forward(rows)[b.last_token_index]  # type: ignore[attr-defined]


class _TokenRows:
    """A token batch seen as decode rows: a row per token, its request's row
    of ``req_to_token``, its length its position + 1."""

    def __init__(self, b: object) -> None:
        self.input_ids = b.input_ids  # type: ignore[attr-defined]
        self.positions = b.positions  # type: ignore[attr-defined]
        self.out_cache_loc = b.out_cache_loc  # type: ignore[attr-defined]
        self.req_pool_indices = b.token_req_pool_indices  # type: ignore[attr-defined]
        self.seq_lens = b.positions + 1  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class ToyWorldConfig:
    """Sizes of a toy world: request rows, KV slots, context, vocab, heads."""

    num_reqs: int = 24
    kv_slots: int = 2048
    max_context_len: int = 64
    vocab: int = 97
    num_kv_heads: int = 2
    head_dim: int = 8


class ToyWorld:
    """Pools plus a toy model, reset in place (stable addresses for graphs).

    :meth:`make_batch` fills the pools with live requests and bystanders (other
    requests with cached tokens that the batch must never touch) and returns a
    prepared :class:`DecodeBatch` of the live ones.
    """

    def __init__(self, device: torch.device | str = "cpu", cfg: ToyWorldConfig | None = None):
        self.cfg = cfg = cfg or ToyWorldConfig()
        self.device = torch.device(device)
        self.req_pool = ReqToTokenPool(cfg.num_reqs, cfg.max_context_len, device)
        self.kv_alloc = TokenToKVPoolAllocator(cfg.kv_slots, device)
        self.kv = KVCache(cfg.kv_slots, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
        self.model = ToyDecodeModel(self.req_pool, self.kv, cfg.vocab)
        #: KV slots each live request owns (host side, as a scheduler keeps them).
        self.slots_of: dict[int, list[int]] = {}

    def reset(self) -> None:
        self.slots_of.clear()
        self.req_pool.clear()
        self.kv_alloc.clear()
        for t in (*self.kv.k_buffers, *self.kv.v_buffers):
            t.zero_()

    def add_request(self, rng: random.Random, seq_len: int) -> int:
        """Allocate a request with ``seq_len`` cached tokens of random ids; its pool row."""
        (req,) = self.req_pool.alloc(1)
        slots = self.kv_alloc.alloc(seq_len)
        self.slots_of[req] = slots
        self.req_pool.write(req, 0, slots)
        loc = torch.tensor(slots, device=self.device)
        ids = torch.tensor([rng.randrange(self.cfg.vocab) for _ in slots], device=self.device)
        k = self.model.kv_of(ids, torch.arange(seq_len, device=self.device))
        self.kv.set_kv(0, loc, k, -k)
        return req

    def release(self, req: int) -> None:
        """Free a finished request's row and KV slots (they get reused)."""
        self.kv_alloc.free(self.slots_of.pop(req))
        self.req_pool.free([req])

    def record_step(self, batch: DecodeBatch) -> None:
        """Note the KV slots a prepared step gave each request (reads host values)."""
        for req, slot in zip(
            batch.req_pool_indices_cpu.tolist(), batch.out_cache_loc.tolist(), strict=True
        ):
            self.slots_of[req].append(slot)

    def make_batch(self, raw_bs: int, seed: int, bystanders: int = 4) -> DecodeBatch:
        """Reset, add ``bystanders`` idle requests and ``raw_bs`` live ones; prepare a step."""
        rng = random.Random(seed)
        self.reset()
        max_len = self.cfg.max_context_len - 1
        for _ in range(bystanders):
            self.add_request(rng, rng.randint(1, max_len))
        lens = [rng.randint(1, max_len) for _ in range(raw_bs)]
        reqs = [self.add_request(rng, n) for n in lens]
        ids = torch.tensor([rng.randrange(self.cfg.vocab) for _ in reqs], device=self.device)
        batch = DecodeBatch.from_requests(
            reqs, lens, ids, device=self.device, max_context_len=self.cfg.max_context_len
        )
        batch.prepare_decode(self.req_pool, self.kv_alloc)
        return batch

    def make_token_batch(
        self, chunks: list[tuple[int, int]], seed: int, bystanders: int = 4
    ) -> SpecBatch:
        """Reset, add ``bystanders`` idle requests and one live request per
        ``(cached, new)`` of ``chunks``: ``cached`` tokens already in the KV
        (0 for a fresh prompt), ``new`` tokens in this step (1: a decode
        row; more: a prompt chunk), their slots allocated and recorded.
        Returns the step's inputs (:func:`~graphrunner.phases.token_batch_inputs`)."""
        from graphrunner.phases.token_batch import token_batch_inputs

        rng = random.Random(seed)
        self.reset()
        max_len = self.cfg.max_context_len - 1
        for _ in range(bystanders):
            self.add_request(rng, rng.randint(1, max_len))
        reqs, ids, locs = [], [], []
        for cached, new in chunks:
            if cached:
                req = self.add_request(rng, cached)
            else:
                (req,) = self.req_pool.alloc(1)
                self.slots_of[req] = []
            slots = self.kv_alloc.alloc(new)
            self.req_pool.write(req, cached, slots)
            self.slots_of[req] += slots
            reqs.append(req)
            ids += [rng.randrange(self.cfg.vocab) for _ in range(new)]
            locs += slots
        return token_batch_inputs(
            input_ids=ids,
            out_cache_loc=locs,
            req_pool_indices=reqs,
            seq_lens=[c + n for c, n in chunks],
            extend_lens=[n for _, n in chunks],
            device=self.device,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """Clones of every pool tensor, for before/after comparisons."""
        return {
            "req_to_token": self.req_pool.req_to_token.clone(),
            "k": self.kv.k_buffers[0].clone(),
            "v": self.kv.v_buffers[0].clone(),
        }

    def eager_reference(
        self, batch: object, forward: Callable[[object], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The eager ``forward`` (default: the toy's decode) of the unpadded
        ``batch``: its logits and the pool state it leaves. The pools are put
        back as they were before it, so the runner under test sees the same state."""
        before = self.state()
        expected = (forward or self.model)(batch).clone()
        expected_state = self.state()
        self.restore(before)
        return expected, expected_state

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        self.req_pool.req_to_token.copy_(state["req_to_token"])
        self.kv.k_buffers[0].copy_(state["k"])
        self.kv.v_buffers[0].copy_(state["v"])

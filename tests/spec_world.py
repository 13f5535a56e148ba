"""A target model with prefilled requests, draft heads over it, and the
inputs of each speculative phase for any number of live requests."""

from __future__ import annotations

import torch

from graphrunner.phases import SpecBatch, token_batch_inputs
from graphrunner.pools import KVCache
from graphrunner_ref.model import default_model
from graphrunner_ref.model.draft import EagleHead, FrozenKvMtpHead, init_draft_weights

MAX_REQUESTS = 10
CONTEXT = 64


class SpecWorld:
    """Requests with ``L`` committed tokens in the target's KV (and a cached
    token at position ``L`` too, which a frozen-KV read must never see), plus
    bystanders whose state no step may touch."""

    def __init__(self, device: str = "cpu", *, eagle_topk: int = 2, mtp: tuple[int, int] = (2, 2)):
        self.bundle = b = default_model(
            max_requests=MAX_REQUESTS, max_context_len=CONTEXT, device=device
        )
        self.device = b.device
        self.model = b.model
        cfg = b.config
        self.draft_kv = KVCache(
            b.kv_alloc.size, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, device
        )
        self.eagle = EagleHead(self.model, self.draft_kv, topk=eagle_topk)
        init_draft_weights(self.eagle, seed=1)
        steps, topk = mtp
        self.mtp = FrozenKvMtpHead(self.model, steps=steps, topk=topk)
        init_draft_weights(self.mtp, seed=2)

    def reset(self, live: int, seed: int, bystanders: int = 2) -> list[tuple[int, int]]:
        """Fresh pools with ``bystanders`` and ``live`` prefilled requests; (row, L) of the live ones."""
        b, gen = self.bundle, torch.Generator().manual_seed(seed)
        b.req_pool.clear()
        b.kv_alloc.clear()
        for t in (
            *b.kv_cache.k_buffers,
            *b.kv_cache.v_buffers,
            *self.draft_kv.k_buffers,
            *self.draft_kv.v_buffers,
        ):
            t.zero_()
        requests = []
        for i in range(bystanders + live):
            committed = int(torch.randint(2, 20, (1,), generator=gen))
            (row,) = b.req_pool.alloc(1)
            ids = torch.randint(0, 256, (committed + 1,), generator=gen).to(self.device)
            slots = torch.tensor(b.kv_alloc.alloc(committed + 1), device=self.device)
            self.model.forward_extend(row, ids, slots)
            if i >= bystanders:
                requests.append((row, committed))
        return requests

    def state(self) -> dict[str, torch.Tensor]:
        """Clones of ``req_to_token``, every target KV layer and the draft KV."""
        return {n: t.clone() for n, t in self._live_tensors().items()}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in self._live_tensors().items():
            t.copy_(state[name])

    def _live_tensors(self) -> dict[str, torch.Tensor]:
        b = self.bundle
        named = {"req_to_token": b.req_pool.req_to_token}
        for i, (k, v) in enumerate(zip(b.kv_cache.k_buffers, b.kv_cache.v_buffers, strict=True)):
            named[f"k{i}"], named[f"v{i}"] = k, v
        named["draft_k"], named["draft_v"] = self.draft_kv.k_buffers[0], self.draft_kv.v_buffers[0]
        return named

    def _mirrors(self, requests: list[tuple[int, int]], lens: list[int]) -> dict[str, torch.Tensor]:
        rows = [r for r, _ in requests]
        return {
            "req_pool_indices_cpu": torch.tensor(rows),
            "seq_lens_cpu": torch.tensor(lens),
            "req_pool_indices": torch.tensor(rows, device=self.device),
            "seq_lens": torch.tensor(lens, device=self.device),
        }

    def tokens_step(
        self, requests: list[tuple[int, int]], width: int, seed: int
    ) -> dict[str, torch.Tensor]:
        """``width`` new tokens per request at positions ``L..L+W-1``, their
        fresh KV slots recorded in ``req_to_token`` (host values, then one write)."""
        b, gen = self.bundle, torch.Generator().manual_seed(seed)
        ids, positions, slots = [], [], []
        for row, committed in requests:
            fresh = b.kv_alloc.alloc(width)
            b.req_pool.write(row, committed, fresh)
            slots += fresh
            positions += list(range(committed, committed + width))
            ids += torch.randint(0, 256, (width,), generator=gen).tolist()
        dev = self.device
        return {
            "input_ids": torch.tensor(ids, device=dev),
            "positions": torch.tensor(positions, device=dev),
            "out_cache_loc": torch.tensor(slots, device=dev),
            **self._mirrors(requests, [c + width for _, c in requests]),
        }

    def token_batch(self, requests: list[tuple[int, int]], tokens: int, seed: int) -> SpecBatch:
        """A token batch of ``tokens`` new tokens split over ``requests`` (each
        at least one, a seeded split): each request's chunk at positions
        ``L..``, its fresh KV slots recorded in ``req_to_token``."""
        b, gen = self.bundle, torch.Generator().manual_seed(seed)
        cuts = torch.randperm(tokens - 1, generator=gen)[: len(requests) - 1] + 1
        bounds = [0, *sorted(cuts.tolist()), tokens]
        lens = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
        ids, slots = [], []
        for (row, committed), n in zip(requests, lens, strict=True):
            fresh = b.kv_alloc.alloc(n)
            b.req_pool.write(row, committed, fresh)
            slots += fresh
            ids += torch.randint(0, 256, (n,), generator=gen).tolist()
        return token_batch_inputs(
            input_ids=ids,
            out_cache_loc=slots,
            req_pool_indices=[row for row, _ in requests],
            seq_lens=[c + n for (_, c), n in zip(requests, lens, strict=True)],
            extend_lens=lens,
            device=self.device,
        )

    def verify_inputs(self, requests: list[tuple[int, int]], width: int, seed: int) -> SpecBatch:
        return SpecBatch(**self.tokens_step(requests, width, seed))

    def eagle_inputs(self, requests: list[tuple[int, int]], width: int, seed: int) -> SpecBatch:
        fields = self.tokens_step(requests, width, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        bs, hidden = len(requests), self.model.config.hidden_size
        accept = torch.randint(1, width + 1, (bs,), generator=gen)
        fields["hidden_states"] = torch.randn(bs * width, hidden, generator=gen).to(self.device)
        fields["extend_lens"] = torch.full((bs,), width, device=self.device)
        fields["accept_lens"] = accept.to(self.device)
        return SpecBatch(**fields)

    def mtp_inputs(self, requests: list[tuple[int, int]], seed: int) -> SpecBatch:
        gen = torch.Generator().manual_seed(seed)
        bs, hidden = len(requests), self.model.config.hidden_size
        lens = [c for _, c in requests]
        fields = self._mirrors(requests, lens)
        fields["positions"] = fields["seq_lens"] - 1
        fields["input_ids"] = torch.randint(0, 256, (bs,), generator=gen).to(self.device)
        fields["hidden_states"] = torch.randn(bs, hidden, generator=gen).to(self.device)
        return SpecBatch(**fields)

"""Plug in your own model: a decode step with its own per-request state,
captured at batch sizes 1, 2 and 4, replayed padded for 3 requests under the
padding sanitizer, and checked against the eager forward."""

import torch

import graphrunner as gr
from graphrunner import (
    DecodeBatch,
    GuardedTensor,
    PaddingSanitizer,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)


class BagOfTokens(torch.nn.Module):
    """Logits from the mean embedding of each request's tokens so far, kept in
    its own state row ``history[row]`` (row 0: the padded rows' sink)."""

    def __init__(self, vocab: int, hidden: int, rows: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.register_buffer("history", torch.zeros(rows, context, hidden))
        self.register_buffer("steps", torch.arange(context))

    def forward(self, b: gr.BufferView) -> torch.Tensor:
        rows, pos = b.req_pool_indices, b.positions  # [bs]; 0 on padded rows
        self.history[rows, pos] = self.embed(b.input_ids)  # each request's own row
        seen = (self.steps[None, :] < b.seq_lens[:, None]).unsqueeze(-1)  # [bs, context, 1]
        h = (self.history[rows] * seen).sum(1) / b.seq_lens[:, None]  # [bs, hidden]
        return self.head(h)  # [bs, vocab]


def main(kind: str | None = None) -> float:
    """Decode 4 steps of 3 requests; returns the largest |graph - eager| logit."""
    kind = kind or gr.best_runner_kind()  # "cuda" on a GPU, else "cpu"
    device = "cuda" if kind == "cuda" else "cpu"
    torch.manual_seed(0)
    req_pool = ReqToTokenPool(size=4, max_context_len=16, device=device)
    kv_alloc = TokenToKVPoolAllocator(size=64, device=device)
    model = BagOfTokens(vocab=32, hidden=8, rows=req_pool.size + 1, context=16).to(device)
    model.requires_grad_(False)
    sanitizer = PaddingSanitizer(  # a write outside the live rows' own rows (and 0) fails
        [GuardedTensor("history", model.history, writer="req_pool_indices")],
        req_pool=req_pool,
        kv_allocator=kv_alloc,
    )
    runner = gr.create_runner(
        model,
        gr.decode_buffer_specs(),
        device=device,
        capture_sizes=[1, 2, 4],
        sanitizer=sanitizer,
        kind=kind,
    )
    runner.capture()
    rows = req_pool.alloc(3)  # never row 0
    first = torch.tensor([1, 2, 3], device=device)  # each request's first token, none cached
    batch = DecodeBatch.from_requests(rows, [0] * 3, first, device=device, max_context_len=16)
    worst = 0.0
    for _ in range(4):
        batch.prepare_decode(req_pool, kv_alloc)  # positions, lengths, host mirrors
        # The eager forward (3 rows) and the graph of 4 (padded) from the same
        # state: the logits, and every row of the guarded state, compared.
        found = gr.sanitizer.check_against_eager(runner, batch, sanitizer.guarded)
        found.raise_if_any()
        worst = max(worst, found.outputs["output"])
        batch.input_ids = found.replayed["output"].argmax(-1)  # [3]
    print(f"{kind}: {runner.stats}, max |graph - eager| {worst:.1e}")
    return worst


if __name__ == "__main__":
    main()

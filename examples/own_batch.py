"""Replay a batch class of one's own (not DecodeBatch): one attention layer over graphrunner's
pools, captured at sizes 1, 2 and 4, replayed padded for 3 requests, each step checked against
the eager forward run from the same state (outputs, and every KV and request row).
CUDA graphs on a GPU, else eager ("cpu" argument: compiles)."""

import sys
from dataclasses import dataclass

import torch

import graphrunner as gr

kind = sys.argv[1] if sys.argv[1:] else "cuda" if gr.best_runner_kind() == "cuda" else "eager"
device = "cuda" if kind == "cuda" else "cpu"
embed = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(device)  # [vocab, 16]


@dataclass
class MyBatch:  # the declared decode fields (on the device), their host mirrors, batch_size
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    req_pool_indices_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    batch_size: int  # live rows, a host int


def forward(b: gr.BufferView, kv: gr.KVCache, req_to_token: torch.Tensor) -> torch.Tensor:
    q = embed[b.input_ids].view(-1, 2, 8)  # [bs, heads, head_dim]
    kv.set_kv(0, b.out_cache_loc, q, -q)  # padded rows write the sink slot 0
    k, v = kv.get_kv(0)
    slots = req_to_token[b.req_pool_indices].long()  # each row's KV slots; padded rows: row 0
    live = torch.arange(slots.shape[1], device=q.device) < b.seq_lens[:, None]
    p = (k[slots] * q[:, None]).sum(-1).masked_fill(~live[..., None], -torch.inf).softmax(1)
    return (p[..., None] * v[slots]).sum(1).flatten(1) @ embed.T  # [bs, vocab]: tied output


req_pool = gr.ReqToTokenPool(size=4, max_context_len=8, device=device)
kv_alloc = gr.TokenToKVPoolAllocator(size=32, device=device)
kv = gr.KVCache(32, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)
step = lambda b: forward(b, kv, req_pool.req_to_token)  # noqa: E731 (what the runner captures)
runner = gr.create_runner(step, gr.decode_buffer_specs(), capture_sizes=[1, 2, 4], kind=kind)
runner.capture()
rows, tokens, worst, ok = req_pool.alloc(3), [1, 2, 3], 0.0, True  # rows: never row 0
state = [*kv.get_kv(0), req_pool.req_to_token]  # all the step may write, by row
for n in range(4):  # each request has n tokens cached; the new one goes at position n
    slots = kv_alloc.alloc(3)  # never slot 0
    req_pool.write_tokens(rows, [n] * 3, slots)  # the scheduler records the new slots
    seq, idx = torch.full((3,), n + 1), torch.tensor(rows)  # host mirrors
    dev = [t.to(device) for t in (torch.tensor(tokens), idx, seq, torch.tensor(slots), seq - 1)]
    batch = MyBatch(*dev, req_pool_indices_cpu=idx, seq_lens_cpu=seq, batch_size=3)
    # Eager (3 rows) and the graph of 4 (padded) from the same state: outputs and rows compared.
    found = gr.sanitizer.check_against_eager(runner, batch, state)
    worst, ok = max(worst, *found.outputs.values()), ok and found.ok
    tokens = found.replayed["output"].argmax(-1).tolist()
print(f"{kind}: {runner.stats}; max |graph - eager| {worst:.1e}; state rows equal: {ok}")
sys.exit(0 if ok else 1)

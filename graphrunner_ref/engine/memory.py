"""How much memory a run of the reference model takes, estimated from shapes
before anything is allocated, and how much the device has free."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from graphrunner.pools import whole_pages
from graphrunner_ref.model.config import ModelConfig

__all__ = ["MAX_KV_SLOTS", "available_memory", "memory_estimate"]

#: What a run may assume is free when the OS does not say (no /proc/meminfo).
FALLBACK_MEMORY_BYTES = 8 << 30
#: req_to_token is int32: every KV slot index must fit one.
MAX_KV_SLOTS = 2**31 - 1
#: Host bytes per pool free-list entry (list pointer, int object, set entry).
HOST_BYTES_PER_ENTRY = 64
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


def memory_estimate(
    config: ModelConfig,
    *,
    capture_sizes: Sequence[int],
    context: int,
    page_size: int,
    max_prompt_len: int,
    pool_copies: int = 0,
    cuda_graphs: bool = False,
    dtype_bytes: int = 4,
) -> int:
    """Bytes a run of the CLI allocates, estimated from shapes alone (an upper bound).

    The pools are sized for ``capture_sizes[-1]`` requests of ``context`` tokens:
    ``req_to_token``, int32 ``[max_requests + 1, context]``, and the KV cache,
    ``(kv_slots + page_size) * layers * 2 * kv_heads * head_dim * dtype_bytes``
    with ``kv_slots = max_requests * whole_pages(context, page_size)``; each pool
    also keeps a host free list. ``pool_copies`` more copies of both pools (check
    mode snapshots the KV cache every step; so does the padding sanitizer). Then
    the weights and the RoPE table; the static decode inputs at the largest size;
    with ``cuda_graphs`` the float32 logits every captured size keeps and a decode
    workspace in the graphs' pool; and the largest transient of one forward: a
    decode step at the largest size (attention gathers ``[bs, context]`` keys and
    values and forms the query-key product) or a prefill of ``max_prompt_len``
    tokens (its ``[tokens, context]`` scores per head).
    """
    c = config
    max_requests = capture_sizes[-1]
    kv_slots = max_requests * whole_pages(context, page_size)
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    pools = (max_requests + 1) * context * 4
    pools += (kv_slots + page_size) * c.num_layers * 2 * kv_dim * dtype_bytes
    host_lists = (max_requests + kv_slots // page_size) * HOST_BYTES_PER_ENTRY
    layer = c.hidden_size * (2 * q_dim + 2 * kv_dim + 3 * c.intermediate_size + 2)
    heads = 1 if c.tie_word_embeddings else 2  # embedding, and lm_head unless tied
    weights = (c.num_layers * layer + (heads * c.vocab_size + 1) * c.hidden_size) * dtype_bytes
    rope = 2 * c.max_position_embeddings * c.head_dim * 4
    inputs = max_requests * 6 * 8
    outputs = sum(capture_sizes) * c.vocab_size * 4 if cuda_graphs else 0
    # Per row: hidden states, projections and the float32 logits; per (row, key
    # column): the slot ids (int32, then int64), the mask, the gathered K and V,
    # the query-key product, float32 scores and the probabilities.
    row = (2 * c.hidden_size + q_dim + 2 * kv_dim + 3 * c.intermediate_size) * dtype_bytes
    row += c.vocab_size * 4
    column = 13 + (2 * kv_dim + q_dim) * dtype_bytes + c.num_heads * (8 + dtype_bytes)
    decode = max_requests * (context * column + row)
    prefill = max_prompt_len * (context * c.num_heads * (8 + dtype_bytes) + row)
    prefill += context * 2 * kv_dim * dtype_bytes
    workspace = max(decode, prefill) + (decode if cuda_graphs else 0)
    return (1 + pool_copies) * pools + host_lists + weights + rope + inputs + outputs + workspace


def available_memory(device: str) -> tuple[int, str]:
    """Bytes free for a run on ``device``, and where the number comes from:
    ``torch.cuda.mem_get_info`` on CUDA; on the CPU /proc/meminfo's MemAvailable,
    lowered to the cgroup's room where a (v2) limit is set, else a fixed cap."""
    if device != "cpu":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"torch.cuda.mem_get_info({device})"
    found: tuple[int, str] = (FALLBACK_MEMORY_BYTES, "a fixed cap (no /proc/meminfo)")
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = (int(line.split()[1]) * 1024, "MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((_CGROUP / "memory.current").read_text())
            found = min(found, (max(room, 0), "cgroup memory.max"))
    except (OSError, ValueError):
        pass
    return found

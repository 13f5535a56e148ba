"""The embedded default model: a small seeded random Llama, built in memory.

The demo, tests and benchmarks run it without any file. Weights are scaled so
activations keep unit size through the layers and logits are spread wide
(std ~2): greedy tokens are then far from ties, and a graph and an eager
forward, which differ by float rounding, pick the same token.
"""

from __future__ import annotations

import math

import torch

from graphrunner.model.build import ModelBundle, build_model
from graphrunner.model.config import ModelConfig

DEFAULT_SEED = 0


def default_config() -> ModelConfig:
    """2 layers, hidden 64, 4 query / 2 KV heads, vocab 256, context 256."""
    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )


@torch.no_grad()
def init_random_weights(bundle: ModelBundle, seed: int = DEFAULT_SEED) -> None:
    """Fill the model's parameters from a generator seeded with ``seed`` (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in bundle.model.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(param.shape, generator=gen)
        else:
            scale = 2.0 if name == "lm_head.weight" else 1.0
            value = torch.randn(param.shape, generator=gen) * scale / math.sqrt(param.shape[1])
        param.copy_(value)


def default_model(
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    page_size: int = 1,
) -> ModelBundle:
    """The default config over fresh pools, weights from ``seed``.

    ``max_context_len`` (default: the config's 256) sizes the request rows and
    the KV pool, and ``page_size`` sets its KV pages, as in :func:`build_model`;
    the weights depend on neither.
    """
    bundle = build_model(
        default_config(),
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=device,
        dtype=dtype,
        page_size=page_size,
    )
    init_random_weights(bundle, seed)
    return bundle

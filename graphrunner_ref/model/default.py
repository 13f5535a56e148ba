"""The embedded default model: a small seeded random Llama, built in memory.

The demo, tests and benchmarks run it without any file. Weights are scaled so
activations keep unit size through the layers and logits are spread wide
(std ~2): greedy tokens are then far from ties, and a graph and an eager
forward, which differ by float rounding, pick the same token.

The "1.1B-shape" config (:func:`shape_1b_config`) is the GPU benchmark's
model: random weights of a real model's size, so a step moves real bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from graphrunner_ref.model.build import ModelBundle, build_model
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.parallel import SINGLE, TensorParallel, shard_weights

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


def shape_1b_config() -> ModelConfig:
    """The shape of a 1.1B-parameter Llama: 22 layers, hidden 2048, 32 query / 4 KV
    heads of 64, intermediate 5632, vocab 32000, context 1024."""
    return ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    )


#: The embedded configs by name (the CLI's ``--model``).
EMBEDDED_CONFIGS: dict[str, Callable[[], ModelConfig]] = {
    "default": default_config,
    "1.1b": shape_1b_config,
}


@torch.no_grad()
def init_random_weights(
    bundle: ModelBundle, seed: int = DEFAULT_SEED, *, on_device: bool = False
) -> None:
    """Fill the model's parameters from a generator seeded with ``seed`` (deterministic).

    The generator runs on the CPU (the same weights on every device) or, with
    ``on_device``, on the model's device (far faster for large models; a CUDA
    draw differs from a CPU one).
    """
    gen_device = bundle.device if on_device else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=gen_device)

    for name, param in bundle.model.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * randn(param.shape)
        elif name.endswith("embed_tokens.weight"):
            value = randn(param.shape)
        else:
            scale = 2.0 if name == "lm_head.weight" else 1.0
            value = randn(param.shape) * scale / math.sqrt(param.shape[1])
        param.copy_(value)


def default_model(
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    page_size: int = 1,
    config: ModelConfig | None = None,
    tp: TensorParallel = SINGLE,
    kv_dtype: torch.dtype | None = None,
) -> ModelBundle:
    """The default config (or ``config``) over fresh pools, weights from ``seed``.

    ``max_context_len`` (default: the config's context) sizes the request rows
    and the KV pool, and ``page_size`` sets its KV pages, as in
    :func:`build_model`; the weights depend on neither. The default config's
    weights are drawn on the CPU, the same on every device; another config's
    are drawn on ``device`` (see :func:`init_random_weights`).

    With ``tp.world > 1`` the bundle is rank ``tp.rank``'s shard of the same
    weights: the whole model is drawn (over one-slot pools), then sliced
    (:func:`~graphrunner_ref.model.parallel.shard_weights`). ``kv_dtype``:
    the KV cache's, as in :func:`build_model`.
    """
    cfg = default_config() if config is None else config
    bundle = build_model(
        cfg,
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=device,
        dtype=dtype,
        page_size=page_size,
        tp=tp,
        kv_dtype=kv_dtype,
    )
    if tp.world == 1:
        init_random_weights(bundle, seed, on_device=config is not None)
        return bundle
    whole = build_model(cfg, max_requests=1, max_context_len=1, device=device, dtype=dtype)
    init_random_weights(whole, seed, on_device=config is not None)
    bundle.model.load_weights(shard_weights(whole.model.state_dict(), cfg, tp))
    return bundle

"""A model kind of one module: a counting toy, registered by one call.

Its checkpoint is a directory whose ``config.json`` reads ``{"model_type":
"toy-counter", "vocab_size": V, "max_position_embeddings": C}``; its
"model" answers each token with the next one (``(t + 1) % V``), so a
served answer is known without an oracle. ``docs/reference-model.md`` shows
this module as the shape of a new kind; ``tests/test_model_registry.py``
registers it and serves it through ``graphrunner generate``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphrunner import PaddingSanitizer, ReqToTokenPool, TokenToKVPoolAllocator
from graphrunner.declare import NullBackend
from graphrunner.pools import whole_pages
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.registry import DecodeStep, ModelKind
from graphrunner_ref.model import ModelConfig
from graphrunner_ref.model.build import PooledBundle

MODEL_TYPE = "toy-counter"


def save_checkpoint(path: Path, *, vocab_size: int = 64, context: int = 128) -> Path:
    """A toy checkpoint directory at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    hf = {"model_type": MODEL_TYPE, "vocab_size": vocab_size, "max_position_embeddings": context}
    (path / "config.json").write_text(json.dumps(hf))
    return path


class Counter:
    """Logits that put all their mass on the token after each input token."""

    def __init__(self, vocab_size: int, req_pool: ReqToTokenPool) -> None:
        self.vocab_size, self.req_pool = vocab_size, req_pool

    def forward_decode(self, inputs: Any) -> torch.Tensor:
        """Logits float32 ``[bs, vocab]`` of the rows' ``input_ids``."""
        return self._logits(inputs.input_ids)

    def forward_extend(
        self, req_pool_index: int, token_ids: torch.Tensor, kv_slots: torch.Tensor
    ) -> torch.Tensor:
        """Prefill: the prompt's slots recorded, the last token's logits ``[vocab]``."""
        n = token_ids.shape[0]
        self.req_pool.req_to_token[req_pool_index, :n] = kv_slots.to(torch.int32)
        return self._logits(token_ids[-1:])[0]

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = (ids.to(torch.int64) + 1) % self.vocab_size
        return torch.nn.functional.one_hot(nxt, self.vocab_size).to(torch.float32)


@dataclass(frozen=True, slots=True)
class ToyBundle(PooledBundle):
    """The counter over its pools (no KV cache: it attends to nothing); the
    context, page size and device derive from the pools."""

    model: Counter
    req_pool: ReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator
    config: ModelConfig
    kv_cache: None = None


def _recognises(config: EngineConfig) -> bool:
    file = None if config.checkpoint is None else config.checkpoint / "config.json"
    return file is not None and json.loads(file.read_text()).get("model_type") == MODEL_TYPE


def _shape(config: EngineConfig) -> ModelConfig:
    hf = json.loads((config.checkpoint or Path()).joinpath("config.json").read_text())
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        max_position_embeddings=hf["max_position_embeddings"],
    )


def _load(config: EngineConfig, max_requests: int, context: int) -> ToyBundle:
    shape = _shape(config)
    page = config.page_size
    req_pool = ReqToTokenPool(max_requests, context, config.device)
    kv_alloc = TokenToKVPoolAllocator(
        max_requests * whole_pages(context, page) * page, config.device, page
    )
    return ToyBundle(Counter(shape.vocab_size, req_pool), req_pool, kv_alloc, shape)


def _step(bundle: ToyBundle) -> DecodeStep:
    return DecodeStep(
        forward=bundle.model.forward_decode,
        backend=NullBackend(),
        inputs=lambda batch: batch,
        sanitizer=lambda: PaddingSanitizer.for_pools(
            bundle.req_pool, kv_allocator=bundle.kv_alloc, vocab_size=bundle.config.vocab_size
        ),
    )


KIND = ModelKind(
    name=MODEL_TYPE,
    bundle_type=ToyBundle,
    recognises=_recognises,
    shape=_shape,
    load=_load,
    step=_step,
)

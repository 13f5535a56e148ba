"""An 8-bit KV cache: int8 values and a float32 scale per token per KV head
(llama.cpp's q8_0 cache, one block per head vector). Loaded on first use:
a bare ``import graphrunner`` never reads it."""

from __future__ import annotations

import torch

from graphrunner.pools.checks import DeviceLike, check_tensor
from graphrunner.pools.kv import KVCache

__all__ = ["Int8KVCache"]


class Int8KVCache(KVCache):
    """A :class:`KVCache` whose buffers hold int8, each head vector with its scale.

    Tensors (on ``device``, zero-initialised), per layer:
        k_buffers, v_buffers: int8 ``[size + page_size, num_kv_heads, head_dim]``.
        k_scales, v_scales: float32 ``[size + page_size, num_kv_heads]``.

    A vector ``x`` of ``head_dim`` values is held as ``q = round(x / d)`` with
    ``d = max|x| / 127`` (:meth:`quantize`; ``x ~ q * d``, :meth:`dequantize`).
    A scale lives at its values' KV slot, so whatever maps a slot (a request's
    row, a shared prefix page) maps its scales too; padded rows write slot 0
    of both. ``dtype`` is ``torch.int8``; ``set_kv`` takes any floating
    ``k``/``v`` and quantizes them.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: DeviceLike,
        page_size: int = 1,
    ) -> None:
        # The base checks the geometry; its buffers come from _zeros, int8 here.
        super().__init__(size, num_layers, num_kv_heads, head_dim, torch.float32, device, page_size)
        self.dtype = torch.int8
        shape = (self.size + self.page_size, self.num_kv_heads)
        self.k_scales = [self._scales(shape) for _ in range(self.num_layers)]
        self.v_scales = [self._scales(shape) for _ in range(self.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int8, device=self.device)

    def _scales(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., D]`` (floating) as int8 ``[..., D]`` and float32 scales
        ``[...]``: ``d = max|x| / 127``, ``q = round(x * (1 / d))`` (half to
        even; 0 where ``d`` is 0), in float32. The C++ writer
        (``graphrunner_attention::rope_store_q8``) equals it bit for bit."""
        x = x.float()
        scale = x.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return q, scale

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """int8 ``q [..., D]`` times its scales ``[...]``, in ``dtype``."""
        return q.to(dtype) * scale.to(dtype)[..., None]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and write ``k``/``v`` ``[n, num_kv_heads, head_dim]`` (floating)
        and their scales at slots ``loc`` (int64 ``[n]``); checked as
        :meth:`KVCache.set_kv` checks, before anything is written."""
        layer = self._check_layer("set_kv: layer", layer)
        check_tensor("set_kv: loc", loc, dtype=torch.int64, shape=(None,), devices=(self.device,))
        shape = (loc.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("set_kv: k", k), ("set_kv: v", v)):
            check_tensor(name, t, dtype="floating", shape=shape, devices=(self.device,))
        for x, values, scales in (
            (k, self.k_buffers, self.k_scales),
            (v, self.v_buffers, self.v_scales),
        ):
            q, d = self.quantize(x)
            values[layer].index_copy_(0, loc, q)
            scales[layer].index_copy_(0, loc, d)

    def get_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(k, v)`` scales of ``layer``, float32 ``[size + page_size, H]`` each."""
        layer = self._check_layer("get_scales: layer", layer)
        return self.k_scales[layer], self.v_scales[layer]

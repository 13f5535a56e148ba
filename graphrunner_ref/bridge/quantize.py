"""Compact weights for a transformers model run by the bridge (``--quantize``
with ``--model-impl transformers``).

:func:`quantize_linears` replaces every ``nn.Linear`` of the model (each
layer's projections, packed ones such as Phi3's ``qkv_proj`` included, and
the LM head) by the compact linear the native model uses for the same mode
(:func:`~graphrunner_ref.model.quantize.compact_linear`), as vLLM's
Transformers backend swaps the linears of the models it runs. A linear's
bias stays in the model's dtype and is added after the compact product
(:class:`BiasedLinear`). The LM head is the native model's for the mode
(:func:`~graphrunner_ref.model.quantize.compact_head`: float16 weights for
fp16; for int4 int8 groups where they hold the weight exactly, else float16;
int8 groups for int4-q8: :func:`~graphrunner_ref.model.quantize.int4_q8_head`), and
so is the attention's q/k/v projection
(:func:`~graphrunner_ref.model.quantize.qkv_linear`: int4-q8 keeps wider
activations than 8 bits), found by name (:data:`QKV_NAMES`). The embedding
stays as it is (a lookup reads one row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from graphrunner_ref.model.quantize import (
    check_quantization,
    compact_head,
    compact_linear,
    qkv_linear,
)

__all__ = ["QKV_NAMES", "BiasedLinear", "quantize_linears"]

#: The last names of the linears that make an attention's queries, keys and
#: values, each alone or packed (Llama and most decoders; Phi3, GPT-NeoX,
#: MPT and Baichuan packed).
QKV_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "Wqkv", "W_pack"}
)


class BiasedLinear(nn.Module):
    """``inner(x) + bias``: a bias-free compact linear ``[..., in] -> [..., out]``
    and its float bias ``[out]``."""

    bias: torch.Tensor

    def __init__(self, inner: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out + self.bias


def _replace(linear: nn.Linear, make: Callable[[torch.Tensor], nn.Module]) -> nn.Module:
    compact = make(linear.weight.detach())
    return compact if linear.bias is None else BiasedLinear(compact, linear.bias)


def quantize_linears(hf: nn.Module, mode: str) -> int:
    """Replace each ``nn.Linear`` of transformers model ``hf`` (weights loaded,
    on the CPU) with a compact one of ``mode`` (a
    :data:`~graphrunner_ref.model.quantize.QUANTIZATIONS` name); returns how
    many. The LM head is the model's output embedding (``get_output_embeddings``).

    Raises:
        ValueError: an unknown mode, a model off the CPU, a dtype the mode
            does not run (``fp16`` / ``int4`` need float32), or a model
            without a ``nn.Linear`` (already quantized, or none to replace).
    """
    param = next(hf.parameters())
    check_quantization(mode, param.dtype, param.device)
    make, make_qkv = compact_linear(mode, param.dtype), qkv_linear(mode, param.dtype)
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    targets = [(n, m) for n, m in hf.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        raise ValueError(
            f"quantize={mode!r}: {type(hf).__name__} has no nn.Linear to replace "
            "(quantized already?)"
        )
    with torch.no_grad():
        for name, linear in targets:
            # The LM head is the native model's for the mode (4-bit logits
            # drift from the float model's within a few tokens).
            parent_name, _, child = name.rpartition(".")
            if linear is head:
                build = compact_head(mode, param.dtype)
            else:
                build = make_qkv if child in QKV_NAMES else make
            parent = hf.get_submodule(parent_name) if parent_name else hf
            setattr(parent, child, _replace(linear, build))
    return len(targets)

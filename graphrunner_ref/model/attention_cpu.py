"""The CPU decode attention in C++ (``attention_cpu.cpp`` beside this file):
``graphrunner_attention::decode``, float32, AVX2/FMA.

It computes what :func:`~graphrunner_ref.model.attention_live.live_decode_attention`
does (the torch reference: a masked gather, softmax and matmul over the
batch's longest live row) with no gather and no per-op dispatch: each row
reads only its own live KV slots, one extern kernel a layer in the compiled
CPU program. Built once per machine on first use, alone
(:func:`~graphrunner_ref.model.cpu_kernels.build_extension`), into torch's
extension cache; where it cannot be built (no compiler, no AVX2,
``GRAPHRUNNER_INT4_KERNEL=torch``) or the model is not float32, the torch
reference runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from graphrunner_ref.model.cpu_kernels import build_extension

__all__ = [
    "ATTENTION_BUILD",
    "ATTENTION_SOURCE",
    "cpp_attention_runs",
    "cpp_attention_status",
    "cpp_decode_attention",
    "decode_attention_fake",
]

#: The kernel's C++ source.
ATTENTION_SOURCE = Path(__file__).with_name("attention_cpu.cpp")
#: Bump with any change to the source: it names the cached build (and keys
#: saved programs, ``engine.bundle.aot_key``).
ATTENTION_BUILD = "graphrunner_cpu_attention_v3"


@functools.cache
def cpp_attention_status() -> str | None:
    """None where the kernel runs here (built and its op registered on first
    call), else why not."""
    why = build_extension(ATTENTION_BUILD, ATTENTION_SOURCE)
    if why is None:
        torch.library.register_fake("graphrunner_attention::decode", decode_attention_fake)
    return why


def decode_attention_fake(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The output of a decode attention, for tracing: shaped as ``q``
    ``[B, H_kv, R, D]``, contiguous, no data (this op's and the torch
    reference's alike)."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.compiler.assume_constant_result
def _built() -> bool:
    """Whether the kernel runs here: a constant to a traced forward (dynamo
    would break the graph at every layer tracing into the build)."""
    return cpp_attention_status() is None


def cpp_attention_runs(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether the C++ kernel runs for queries ``q`` over ``k_buf``: float32
    CPU tensors on a machine where it builds."""
    cpu = q.device.type == "cpu" and k_buf.device.type == "cpu"
    f32 = q.dtype == torch.float32 and k_buf.dtype == torch.float32
    return cpu and f32 and _built()


def cpp_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of ``q [B, H_kv, R, D]`` over each row's first
    ``seq_lens [B]`` KV slots ``req_to_token[req_pool_indices]`` of ``k_buf`` /
    ``v_buf [slots, H_kv, D]``; a new ``[B, H_kv, R, D]`` (only where
    :func:`cpp_attention_runs`)."""
    return torch.ops.graphrunner_attention.decode(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale
    )

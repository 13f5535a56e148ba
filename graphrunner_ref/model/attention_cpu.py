"""The CPU attention step in C++ (``attention_cpu.cpp`` beside this file),
float32, AVX2/FMA: ``graphrunner_attention::decode``, the decode attention
(AVX-512 where the CPU has it: :func:`use_path`),
and ``graphrunner_attention::rope_store``, the rotary embedding and KV write
before it; the KV cache float32 or float16 (:data:`KV_DTYPES`). Their ``_q8``
twins read and write an int8 cache with a scale per slot and KV head
(:class:`graphrunner.pools.Int8KVCache`).

It computes what :func:`~graphrunner_ref.model.attention_live.live_decode_attention`
does (the torch reference: a masked gather, softmax and matmul over the
batch's longest live row) with no gather and no per-op dispatch: each row
reads only its own live KV slots, one extern kernel a layer in the compiled
CPU program. Built once per machine on first use, alone
(:func:`~graphrunner_ref.model.cpu_kernels.build_extension`), into torch's
extension cache; where it cannot be built (no compiler, no AVX2,
``GRAPHRUNNER_INT4_KERNEL=torch``) or the model is not float32, the torch
reference runs.

A prompt chunk's attention (:func:`cpp_prompt_attention`) runs here too:
float32 queries on AVX-512 (``prompt``, ``prompt_q8``), bfloat16 queries on
the AMX-BF16 tiles (``prompt_bf16``, over a bfloat16, float16 or float32
cache; where the CPU has every feature it uses, ``GRAPHRUNNER_CPU_DISABLE``
hides none of them and the OS grants the tiles).

The rotary + KV write (:func:`cpp_rope_store`) is the Triton kernel's
(:mod:`~graphrunner_ref.model.kernels.rope_store`) on the CPU, equal to the
model's torch ops bit for bit: one call a layer where inductor compiled a
gather, the rotation and two scatters into several kernels, each a call from
the program's wrapper.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from graphrunner_ref.model.cpu_features import KERNEL_PATHS, KernelPath, best_path, cpu_features
from graphrunner_ref.model.cpu_kernels import build_extension
from graphrunner_ref.model.kernels.rope_store import rope_store_fake

__all__ = [
    "ATTENTION_BUILD",
    "BF16_PROMPT_FEATURES",
    "BF16_PROMPT_KV_DTYPES",
    "ATTENTION_PATHS",
    "KV_DTYPES",
    "ATTENTION_SOURCE",
    "cpp_attention_runs",
    "cpp_attention_status",
    "cpp_decode_attention",
    "cpp_decode_attention_q8",
    "cpp_prompt_attention",
    "cpp_prompt_runs",
    "cpp_q8_runs",
    "cpp_rope_store",
    "cpp_rope_store_q8",
    "cpp_rope_store_runs",
    "decode_attention_fake",
    "decode_path",
    "prompt_paths",
    "runnable_paths",
    "use_path",
    "using_path",
]

#: The kernel's C++ source.
ATTENTION_SOURCE = Path(__file__).with_name("attention_cpu.cpp")
#: Bump with any change to the source: it names the cached build (and keys
#: saved programs, ``engine.bundle.aot_key``).
ATTENTION_BUILD = "graphrunner_cpu_attention_v31"


@functools.cache
def cpp_attention_status() -> str | None:
    """None where the kernel runs here (built and its op registered on first
    call), else why not."""
    why = build_extension(ATTENTION_BUILD, ATTENTION_SOURCE)
    if why is None:
        torch.library.register_fake("graphrunner_attention::decode", decode_attention_fake)
        torch.library.register_fake("graphrunner_attention::rope_store", rope_store_fake)
        torch.library.register_fake("graphrunner_attention::decode_q8", _decode_q8_fake)
        torch.library.register_fake("graphrunner_attention::rope_store_q8", _rope_store_q8_fake)
        torch.library.register_fake("graphrunner_attention::prompt", _prompt_fake)
        torch.library.register_fake("graphrunner_attention::prompt_q8", _prompt_q8_fake)
        torch.library.register_fake("graphrunner_attention::prompt_bf16", _prompt_fake)
        use_path(_table_path())
    return why


def _table_path() -> str:
    """The decode path ``cpu_features.KERNEL_PATHS`` names for this CPU (its
    features less those ``GRAPHRUNNER_CPU_DISABLE`` hides)."""
    path = best_path("attention")
    return "avx2" if path is None else path.name


def decode_path() -> KernelPath | None:
    """The decode attention's row of ``cpu_features.KERNEL_PATHS`` chosen on
    this CPU at the build (None where the C++ attention does not run here)."""
    if cpp_attention_status() is not None:
        return None
    return best_path("attention")


#: The decode attention's paths by name, as the C++ op numbers them (the
#: ``attention`` rows of ``cpu_features.KERNEL_PATHS``).
ATTENTION_PATHS = dict(
    sorted(((p.name, p.code) for p in KERNEL_PATHS if p.product == "attention"), key=lambda r: r[1])
)


def runnable_paths() -> list[str]:
    """The names of :data:`ATTENTION_PATHS` this CPU runs, AVX2 first (only
    where :func:`cpp_attention_status` is None)."""
    runnable = int(torch.ops.graphrunner_attention.paths())
    return [name for name, code in ATTENTION_PATHS.items() if runnable >> code & 1]


@contextlib.contextmanager
def using_path(name: str) -> Iterator[None]:
    """:func:`use_path` ``name`` within the block, the path the build chose
    for this CPU again after it."""
    use_path(name)
    try:
        yield
    finally:
        use_path(_table_path())


def use_path(name: str) -> None:
    """Run the decode attention (``decode`` and ``decode_q8``) on path ``name``
    (:data:`ATTENTION_PATHS`) from now on in this process: the build picks
    the best this CPU has; tests and benchmarks set another to compare them.
    ValueError for a name not in the table or a path this CPU cannot run."""
    if name not in ATTENTION_PATHS:
        raise ValueError(f"use_path: name = {name!r}, expected one of {sorted(ATTENTION_PATHS)}")
    if name not in runnable_paths():
        raise ValueError(
            f"use_path: name = {name!r}, which this CPU cannot run (it runs "
            f"{', '.join(runnable_paths())})"
        )
    torch.ops.graphrunner_attention.use_path(ATTENTION_PATHS[name])


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


def _decode_q8_fake(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, *rows: torch.Tensor | float,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rope_store_q8_fake(
    qkv: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, heads: int,
) -> torch.Tensor:  # fmt: skip
    return qkv.new_empty(qkv.shape[0], heads * k_cache.shape[2])


@torch.compiler.assume_constant_result
def _built() -> bool:
    """Whether the kernel runs here: a constant to a traced forward (dynamo
    would break the graph at every layer tracing into the build)."""
    return cpp_attention_status() is None


#: The KV cache dtypes the C++ ops read and write (float16 widened to float32 exactly).
KV_DTYPES = (torch.float32, torch.float16)


def cpp_attention_runs(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether the C++ kernel runs for queries ``q`` over ``k_buf``: CPU
    tensors, float32 queries over a float32 or float16 cache, on a machine
    where it builds."""
    cpu = q.device.type == "cpu" and k_buf.device.type == "cpu"
    return cpu and q.dtype == torch.float32 and k_buf.dtype in KV_DTYPES and _built()


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


def cpp_rope_store_runs(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`cpp_rope_store` runs for ``qkv`` into ``k_cache``: CPU
    tensors, float32 ``qkv`` into a float32 or float16 cache, on a machine
    where the kernels build."""
    return cpp_attention_runs(qkv, k_cache)


def cpp_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotate and write one step's keys and values; returns the rotated ``q [M, H D]``.

    qkv: float32 ``[M, (H + 2 H_kv) D]``, the stacked projection.
    positions, out_loc: int64 ``[M]``: each row's position and KV slot (a
        padded row: 0 and 0, the sink).
    cos, sin: float32 ``[max_positions, D]`` (a ``RotaryEmbedding``'s tables).
    k_cache, v_cache: float32 or float16 ``[slots, H_kv, D]``, written at
        ``out_loc`` in place (float16: rounded to nearest even, as ``.to()`` rounds).
    heads: ``H``, the query heads.

    Equal bit for bit to :func:`~graphrunner_ref.model.kernels.rope_store.reference`
    (only where :func:`cpp_rope_store_runs`); an out-of-range position or slot
    is refused by name before anything is written.
    """
    return torch.ops.graphrunner_attention.rope_store(
        qkv, positions, out_loc, cos, sin, k_cache, v_cache, heads
    )


def cpp_q8_runs(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether the ``_q8`` ops run for float32 ``q`` (queries, or the stacked
    projection) over the int8 cache ``k_buf``: CPU tensors, on a machine where
    the kernels build."""
    cpu = q.device.type == "cpu" and k_buf.device.type == "cpu"
    return cpu and q.dtype == torch.float32 and k_buf.dtype == torch.int8 and _built()


def cpp_decode_attention_q8(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`cpp_decode_attention` over an int8 cache ``k_buf`` / ``v_buf
    [slots, H_kv, D]`` whose head vectors are ``k_scale`` / ``v_scale``
    (float32 ``[slots, H_kv]``) times their values: each score times its key's
    scale, each probability times its value's (only where :func:`cpp_q8_runs`)."""
    return torch.ops.graphrunner_attention.decode_q8(
        q, k_buf, v_buf, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens, scale
    )


def cpp_rope_store_q8(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    heads: int,
) -> torch.Tensor:
    """:func:`cpp_rope_store` into an int8 cache ``kv = (k_cache, v_cache,
    k_scale, v_scale)``: each rotated key head and each value head quantized
    as :meth:`graphrunner.pools.Int8KVCache.quantize` does, bit for bit (only
    where :func:`cpp_q8_runs`); returns the rotated ``q [M, H D]``."""
    return torch.ops.graphrunner_attention.rope_store_q8(
        qkv, positions, out_loc, cos, sin, *kv, heads
    )


def _prompt_fake(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _prompt_q8_fake(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, slots: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.compiler.assume_constant_result
def _prompt_built() -> bool:
    """Whether the prompt attention runs here: the kernels built and the
    attention's ``avx512`` path this CPU's best (its features less those
    ``GRAPHRUNNER_CPU_DISABLE`` hides), a constant to a traced forward."""
    path = decode_path()
    return path is not None and path.name == "avx512"


#: The CPU features the bfloat16 prompt attention's code uses: hiding any of
#: them (``GRAPHRUNNER_CPU_DISABLE``) leaves bfloat16 queries to torch.
BF16_PROMPT_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")


@torch.compiler.assume_constant_result
def _prompt_bf16_built() -> bool:
    """Whether the bfloat16 prompt attention runs here: the kernels built,
    every one of :data:`BF16_PROMPT_FEATURES` present and not hidden, and the
    OS's grant of the tiles, a constant to a traced forward."""
    return (
        cpu_features().has(*BF16_PROMPT_FEATURES)
        and cpp_attention_status() is None
        and bool(torch.ops.graphrunner_attention.prompt_bf16_runs())
    )


#: The caches the bfloat16 prompt attention reads (a wider one rounded to bfloat16).
BF16_PROMPT_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cpp_prompt_runs(q: torch.Tensor, k_buf: torch.Tensor, scales: object = None) -> bool:
    """Whether :func:`cpp_prompt_attention` runs for queries ``q [n, H, D]``
    over ``k_buf``: CPU tensors; float32 queries of a head size a multiple of
    16 over a float32 or float16 cache (or int8 with its ``scales``), on a CPU
    with AVX-512 where the kernels build; or bfloat16 queries of a head size
    a multiple of 64 over a bfloat16, float16 or float32 cache, on a CPU with
    AMX-BF16."""
    if q.device.type != "cpu" or k_buf.device.type != "cpu" or q.dim() != 3:
        return False
    if q.dtype == torch.bfloat16:
        cache = scales is None and k_buf.dtype in BF16_PROMPT_KV_DTYPES
        return cache and q.shape[-1] % 64 == 0 and _prompt_bf16_built()
    cache = k_buf.dtype == torch.int8 if scales is not None else k_buf.dtype in KV_DTYPES
    return cache and q.shape[-1] % 16 == 0 and q.dtype == torch.float32 and _prompt_built()


def prompt_paths() -> str:
    """One line for results files: what a prompt chunk's attention runs here,
    for float32 and for bfloat16 queries."""
    f32 = "C++ avx512" if _prompt_built() else "torch's fused attention"
    bf16 = "C++ amx-bf16 tiles" if _prompt_bf16_built() else "torch's fused attention"
    return f"float32 queries: {f32}; bfloat16 queries: {bf16}"


def cpp_prompt_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One request's prompt chunk over its slots: returns ``[n, H D]`` in ``q``'s dtype.

    q: ``[n, H, D]``, the chunk's rotated queries: float32 (``D`` a multiple
        of 16), or bfloat16 (``D`` a multiple of 64: AMX-BF16 tiles).
    k_buf, v_buf: ``[slots, H_kv, D]``, float32 or float16, or int8 with
        ``scales`` (float32 ``[slots, H_kv]`` each, :class:`graphrunner.pools.Int8KVCache`);
        under bfloat16 queries bfloat16, float16 or float32 (rounded to bfloat16).
    slots: int64 ``[L]``, ``L >= n``: the request's slots in order, the
        chunk's own tokens the last ``n`` (their K/V written already).

    Token ``i`` reads slots ``0 .. L - n + i``, query head ``h`` its KV head
    ``h // (H // H_kv)``: torch's fused attention with that causal mask, within
    float32 rounding, or bfloat16's for bfloat16 queries (only where
    :func:`cpp_prompt_runs`)."""
    if q.dtype == torch.bfloat16:
        return torch.ops.graphrunner_attention.prompt_bf16(q, k_buf, v_buf, slots, scale)
    if scales is not None:
        return torch.ops.graphrunner_attention.prompt_q8(q, k_buf, v_buf, *scales, slots, scale)
    return torch.ops.graphrunner_attention.prompt(q, k_buf, v_buf, slots, scale)

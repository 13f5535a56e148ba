"""The project's C++ CPU kernels for compact weights (``cpu_kernels.cpp``
beside this file): ``graphrunner_int4::linear`` (4-bit groups,
:mod:`~graphrunner_ref.model.int4_linear`), ``graphrunner_int8::linear``
(int8 per output channel, :mod:`~graphrunner_ref.model.int8_linear`) and
``graphrunner_fp16::linear`` (float16, :mod:`~graphrunner_ref.model.fp16_linear`),
all with float32 activations, AVX2/FMA/F16C, and ``graphrunner_int4::linear_q8``
(4-bit weights times activations quantized to 8 bits per group,
:mod:`~graphrunner_ref.model.int4_q8`), whose path (AVX2, AVX-VNNI, AVX-512
VNNI, AVX-512 VNNI tiles, AMX-INT8 tiles for prompt chunks)
:func:`~graphrunner_ref.model.cpu_features.kernel_path` picks, and
``graphrunner_int4::linear_bf16`` (the same weights and activations rounded
to bfloat16, AVX-512 BF16 only: :mod:`~graphrunner_ref.model.int4_bf16`;
``graphrunner_int8::linear_grouped_bf16`` the same for the int8-group head). The CPU
decode attention (``attention_cpu.cpp``) is built the same way, alone
(:func:`build_extension`, :mod:`~graphrunner_ref.model.attention_cpu`).

Built once per machine on first use with
``torch.utils.cpp_extension.load_inline`` into torch's extension cache (a
later process loads the cached build), registered with the dispatcher by the
library's ``TORCH_LIBRARY`` blocks and given fake implementations here, so
``torch.compile`` (inductor) calls each as one extern kernel. Where they
cannot be built (no compiler, no AVX2, or ``GRAPHRUNNER_INT4_KERNEL=torch``)
each linear falls back to a torch path, said once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from graphrunner.util import warn_at_caller

__all__ = [
    "DISABLE_ENV",
    "KERNEL_BUILD",
    "KERNEL_ENV",
    "KERNEL_SOURCE",
    "build_extension",
    "kernel_status",
    "kernels_run",
]

#: Set to ``torch`` to skip the C++ kernels (the torch paths run).
KERNEL_ENV = "GRAPHRUNNER_INT4_KERNEL"
#: Features to treat as missing (``cpu_features.DISABLE_ENV``); hiding AVX2,
#: FMA or F16C skips the C++ kernels.
DISABLE_ENV = "GRAPHRUNNER_CPU_DISABLE"
#: The kernels' C++ source.
KERNEL_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
#: Bump with any change to the source (a layout included): it names the
#: cached build and keys saved programs (``engine.bundle.aot_key``).
KERNEL_BUILD = "graphrunner_cpu_kernels_v36"


def _build() -> str | None:
    """Build (or load the cached build of) the kernels; None on success, else
    why not. Called through :func:`kernel_status` (cached), so once per
    process: the ops' fakes are registered once."""
    why = build_extension(KERNEL_BUILD, KERNEL_SOURCE)
    if why is not None:
        return why
    torch.library.register_fake("graphrunner_int4::linear", _fake_int4_linear)
    torch.library.register_fake("graphrunner_int4::linear_q8", _fake_int4_q8_linear)
    torch.library.register_fake("graphrunner_int4::linear_q8_tiled", _fake_int4_q8_tiled)
    torch.library.register_fake("graphrunner_int4::linear_q8_amx", _fake_int4_q8_tiled)
    torch.library.register_fake("graphrunner_int4::linear_bf16", _fake_int4_linear)
    torch.library.register_fake("graphrunner_int8::linear", _fake_int8_linear)
    torch.library.register_fake("graphrunner_int8::linear_grouped", _fake_int8_linear)
    torch.library.register_fake("graphrunner_int8::linear_grouped_bf16", _fake_int8_linear)
    torch.library.register_fake("graphrunner_int8::linear_grouped_q8_tiled", _fake_int8_q8_tiled)
    torch.library.register_fake("graphrunner_fp16::linear", _fake_fp16_linear)
    return None


def build_extension(name: str, source: Path) -> str | None:
    """Build (or load torch's cached build of) the C++ file ``source`` as the
    extension ``name`` (AVX2/FMA/F16C; its ``TORCH_LIBRARY`` blocks register its
    ops); None on success, else why not: :data:`KERNEL_ENV` set to ``torch``,
    a feature hidden by :data:`DISABLE_ENV`, a CPU without AVX2, or a failed
    build (no compiler)."""
    if os.environ.get(KERNEL_ENV, "") == "torch":
        return f"{KERNEL_ENV}=torch"
    hidden = {f.strip() for f in os.environ.get(DISABLE_ENV, "").split(",")}
    if hidden & {"avx2", "fma", "f16c"}:
        return f"{DISABLE_ENV} hides {', '.join(sorted(hidden & {'avx2', 'fma', 'f16c'}))}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the C++ kernels need AVX2 and FMA; this CPU's capability is {capability}"
    try:
        from torch.utils import cpp_extension

        # is_python_module=False: the library's TORCH_LIBRARY blocks register the
        # ops with the dispatcher, so compiled code calls them without Python.
        cpp_extension.load_inline(
            name=name,
            cpp_sources=[source.read_text()],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
            is_python_module=False,
            no_implicit_headers=True,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch paths run
        return f"building the C++ kernels failed ({type(e).__name__}: {str(e).strip()[:300]})"
    return None


def _fake_int4_linear(
    x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """The int4 op's output for tracing: ``[rows, out]`` float32 (``out`` the
    scales' rows), no data."""
    return x.new_empty(x.shape[0], scales.shape[0])


def _fake_int4_q8_linear(
    x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, path: int
) -> torch.Tensor:
    """The int4 x q8 op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], scales.shape[0])


def _fake_int4_q8_tiled(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out: int
) -> torch.Tensor:
    """The tiled int4 x q8 op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], out)


def _fake_int8_q8_tiled(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, out: int
) -> torch.Tensor:
    """The tiled int8-group x q8 op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], out)


def _fake_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], weight.shape[0])


def _fake_fp16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The fp16 op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], out_features)


@functools.cache
def kernel_status() -> str | None:
    """None where the C++ kernels run here (building them on first call), else
    why not, warned once: the torch paths run instead."""
    why = _build()
    if why is not None:
        warn_at_caller(
            f"compact weights: {why}; int4 falls back to dequantize-then-matmul in torch, "
            "float32 int8 to torch's weight-only product (both correct but slower than "
            "float32) and fp16 to fbgemm"
        )
    return why


def kernels_run() -> bool:
    """Whether the C++ kernels run here (building them on first call)."""
    return kernel_status() is None

"""What the CPU's matrix units can do with half-precision weights.

bfloat16 (and float16) matmuls run on dedicated units only on some CPUs:
AMX tiles (Intel Sapphire Rapids and later) or AVX-512-bf16; elsewhere
they are emulated. Measured on an AVX2 CPU (SmolLM2-135M, one thread,
``bench/results/real-smollm2-cpu.md``): a bfloat16 model decoded 1.57x
float32's tokens/s at batch 1 (half the weight bytes) but 0.51x at batch 8
(the emulated arithmetic), while float16 weights with float32 arithmetic
(``--quantize fp16``, fbgemm) ran 1.77x and 2.14x. :func:`half_precision_note`
says so, once, where it applies. Torch's weight-only int8 product
(``--quantize int8``) ran 0.41x and 0.10x there; :func:`int8_weight_only_note`
says so.
"""

from __future__ import annotations

import torch

from graphrunner_ref.model.cpu_kernels import kernel_status

__all__ = ["half_precision_note", "half_precision_units", "int8_weight_only_note"]


def half_precision_units() -> list[str]:
    """The CPU's units that multiply bfloat16 natively: ``"AMX"``,
    ``"AVX-512-bf16"`` (both, one or none)."""
    cpu = torch.cpu
    units = []
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        units.append("AMX")
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        units.append("AVX-512-bf16")
    return units


def half_precision_note(dtype: torch.dtype, device: str) -> str | None:
    """A one-line note for a half-precision model on a CPU without native
    units (None where there is nothing to say)."""
    if dtype not in (torch.bfloat16, torch.float16) or not device.startswith("cpu"):
        return None
    if half_precision_units():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    return (
        f"note: this CPU ({capability}) has no AMX or AVX-512-bf16 units: {name} matmuls "
        f"are emulated here (slower than float32 from a few rows up); --dtype {name} saves "
        "memory, --dtype float32 --quantize fp16 (float16 weights, float32 arithmetic) is "
        "the fast path"
    )


def int8_weight_only_note(dtype: torch.dtype) -> str | None:
    """A one-line note where ``--quantize int8`` on a ``dtype`` model runs
    torch's weight-only int8 product slowly (None where there is nothing to
    say): float32 activations without the project's C++ kernel (torch's
    product measured 10-24x slower than float32 even with AVX-512), or
    half-precision ones on a CPU without AVX-512 or AMX."""
    fast = "--quantize fp16 (float16 weights, float32 activations) is the fast compact path"
    if dtype == torch.float32:
        why = kernel_status()
        if why is None:
            return None
        return (
            f"note: the C++ int8 kernel does not run here ({why}): torch's weight-only int8 "
            f"product with float32 activations runs slower than float32; {fast}"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") or half_precision_units():
        return None
    return (
        f"note: this CPU ({capability}) has no AVX-512 or AMX: weight-only int8 matmuls run "
        f"slower than float32 here; {fast}"
    )

"""What the CPU's matrix units can do with half-precision weights.

bfloat16 (and float16) matmuls run on dedicated units only on some CPUs:
AMX tiles (Intel Sapphire Rapids and later) or AVX-512-bf16; elsewhere
they are emulated (measured on an AVX2 CPU: a 576 x 1536 bfloat16 linear
2-4x slower than float32's), so a half-precision model saves memory, not
time. :func:`half_precision_note` says so, once, where it applies.
"""

from __future__ import annotations

import torch

__all__ = ["half_precision_note", "half_precision_units"]


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
        f"are emulated and run slower than float32 here; --dtype {name} saves memory, "
        "--dtype float32 is the fast path"
    )

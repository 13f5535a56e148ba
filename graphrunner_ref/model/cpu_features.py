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

It also holds what the compact-weight kernels dispatch on: :func:`cpu_features`
(the vector and matrix units, read once, AMX only where the OS grants its
tiles) and :data:`KERNEL_PATHS`, the one table of which kernel runs on which
features, best first. :func:`kernel_path` picks the first row the CPU has
and the build compiled, at first use; :data:`DISABLE_ENV` hides features to
force a fallback.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrunner_ref.model.cpu_kernels import DISABLE_ENV, kernel_status

__all__ = [
    "DISABLE_ENV",
    "FEATURES",
    "KERNEL_PATHS",
    "CpuFeatures",
    "KernelPath",
    "best_path",
    "cpu_features",
    "half_precision_note",
    "half_precision_units",
    "int8_weight_only_note",
    "kernel_note",
    "kernel_path",
    "kernel_summary",
]

# DISABLE_ENV: comma-separated features to treat as missing (``/proc/cpuinfo``
# names, or ``all`` for every one above AVX2/FMA/F16C): forces a fallback
# path; hiding avx2, fma or f16c skips the C++ kernels (torch's paths run).
#: The features the kernels care about, by their ``/proc/cpuinfo`` names.
FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
_BASE = frozenset({"avx2", "fma", "f16c"})
_AMX = ("amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The CPU's name and which of :data:`FEATURES` it has (those hidden by
    :data:`DISABLE_ENV` removed). ``amx_permitted``: None without AMX, else
    whether the OS granted this process the AMX tile state (Linux asks for it
    with ``arch_prctl``; AMX features are dropped from ``flags`` when not)."""

    model: str
    flags: frozenset[str]
    amx_permitted: bool | None
    disabled: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    def describe(self) -> str:
        """``AMD EPYC: avx2 fma f16c; no avx512f, ...``, AMX's OS permission said."""
        have = " ".join(f for f in FEATURES if f in self.flags) or "none"
        missing = [f for f in FEATURES if f not in self.flags]
        text = f"{self.model}: {have}" + (f"; no {' '.join(missing)}" if missing else "")
        if self.amx_permitted is False:
            text += " (AMX present but the OS refused its tiles)"
        if self.disabled:
            text += f" ({DISABLE_ENV} hides {' '.join(sorted(self.disabled))})"
        return text


def _cpuinfo() -> tuple[str, set[str]]:
    """The model name and flags of ``/proc/cpuinfo`` (Linux), else torch's view."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name, flags = platform.processor() or platform.machine(), set[str]()
    for line in lines:
        if line.startswith("model name") and ":" in line:
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and ":" in line:
            flags = set(line.split(":", 1)[1].split())
            break
    if not lines:  # not Linux: torch's cpuinfo answers the coarse questions
        cpu = torch.cpu
        probes = {
            "avx2": "_is_avx2_supported",
            "avx512f": "_is_avx512_supported",
            "avx512_vnni": "_is_vnni_supported",
            "avx512_bf16": "_is_avx512_bf16_supported",
            "amx_tile": "_is_amx_tile_supported",
        }
        flags = {f for f, probe in probes.items() if getattr(cpu, probe, lambda: False)()}
        if "avx2" in flags:
            flags |= {"fma", "f16c"}
        if "avx512f" in flags:
            flags |= {"avx512bw", "avx512vl"}
    return name, flags


def amx_permitted() -> bool:
    """Ask Linux for this process's AMX tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``); whether it was granted. Only called where the CPU
    lists ``amx_tile``; elsewhere than Linux on x86-64, False."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's :class:`CpuFeatures`, read once (AMX's permission asked once)."""
    name, flags = _cpuinfo()
    spec = os.environ.get(DISABLE_ENV, "")
    disabled = {f.strip() for f in spec.split(",") if f.strip()}
    if "all" in disabled:
        disabled = (disabled - {"all"}) | (set(FEATURES) - _BASE)
    have = {f for f in FEATURES if f in flags} - disabled
    permitted = None
    if "amx_tile" in have:
        permitted = amx_permitted()
        if not permitted:
            have -= set(_AMX)
    return CpuFeatures(name, frozenset(have), permitted, frozenset(disabled & set(FEATURES)))


@dataclass(frozen=True, slots=True)
class KernelPath:
    """One row of :data:`KERNEL_PATHS`: ``product`` (a ``--quantize`` mode)
    runs kernel ``name`` (the C++ op's path number ``code``) where the CPU has
    every feature of ``needs``; ``how`` says what it does."""

    product: str
    name: str
    needs: tuple[str, ...]
    code: int
    how: str


#: feature -> kernel, for each product best first (:func:`kernel_path` takes
#: the first the CPU has and the build compiled). int4, int8 and fp16 have
#: one path: an AVX-512 build of int4's loop was measured on a Zen 4 and not
#: kept (4% faster at 1 row, 25% slower at 8: ``cpu_kernels.cpp``); one of
#: the int8-group LM head's, 16 codes widened a register, neither (0.89x at 1
#: row, 1.03x at 8: ``bench/results/int8-groups-avx512-zen4-cpu.md``). The
#: VNNI rows are compiled where the compiler targets them and tested where a
#: CPU has them. On a Zen 4 (``bench/results/int4-q8-zmm-zen4-cpu.md``) the
#: AVX-512 VNNI path ran 1.13-1.14x the AVX2 one at 1 row, 1.35-1.43x at 8
#: (256-bit registers, one group at a time, ran between: replaced). AVX-VNNI
#: has not run on hardware here. The AMX row runs the tiles path's layout and
#: float order (equal bit for bit), with AMX for prompt chunks of 16 rows or
#: more; hiding ``amx_int8`` (:data:`DISABLE_ENV`) runs the tiles path alone
#: (``bench/bench_gemm_peak.py`` times one against the other in one run:
#: ``bench/results/gemm-peak-intel-r-xeon-r-processor-amx.md``, 1.2-1.5x at a
#: 512-row chunk of SmolLM2's projections, 1.00x at decode's 1 and 8 rows).
#: int4-bf16 has one path, AVX-512 BF16; without
#: it the mode runs its torch emulation (:mod:`~graphrunner_ref.model.int4_bf16`).
#: ``attention`` is the CPU decode attention (``attention_cpu.cpp``, every
#: mode): at 4,096 tokens of context, batch 8, its AVX-512 path ran 2.0-2.5x
#: the AVX2 one on a Xeon (``bench/results/decode-attention-avx512-xeon-cpu.md``).
KERNEL_PATHS = (
    KernelPath(
        "int4-q8",
        "amx-int8-tiles",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
        4,
        "avx512-vnni-tiles below 16 rows; a prompt chunk's rows 16 at a time on AMX: each "
        "tile's codes unpacked once, tdpbsud of 16 rows x 32 int8 activations by 32 x 16 "
        "codes a group, then avx512-vnni-tiles' FMAs",
    ),
    KernelPath(
        "int4-q8",
        "avx512-vnni-tiles",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        3,
        "tiles of 16 output rows, one a lane: vpdpbusd of 64 codes x 4 int8 activations "
        "broadcast, each group's dot whole in its lane, then one FMA a group for 16 outputs",
    ),
    KernelPath(
        "int4-q8",
        "avx512-vnni",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        2,
        "vpdpbusd on 512-bit registers, 2 groups (64 codes x 64 int8 activations) an instruction",
    ),
    KernelPath("int4-q8", "avx-vnni", ("avx_vnni",), 1, "vpdpbusd (VEX), 32 codes an instruction"),
    KernelPath(
        "int4-q8",
        "avx2",
        ("avx2", "fma"),
        0,
        "vpmaddubsw + vpmaddwd, 32 codes x 32 int8 activations",
    ),
    KernelPath(
        "int4-bf16",
        "avx512-bf16",
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
        0,
        "each group's 16 bfloat16 weights a table looked up by code (vpermw), vdpbf16ps "
        "against bfloat16 activations, 32 columns an instruction",
    ),
    KernelPath(
        "int4",
        "avx2",
        ("avx2", "fma"),
        0,
        "bytes and low codes widened to float32, FMA, up to 4 outputs a pass",
    ),
    KernelPath("int8", "avx2", ("avx2", "fma"), 0, "codes widened to float32, FMA"),
    KernelPath("fp16", "avx2", ("avx2", "fma", "f16c"), 0, "F16C widening, FMA"),
    KernelPath(
        "attention",
        "avx512",
        ("avx512f", "avx512bw", "avx512vl"),
        1,
        "a row's KV heads read together, a block of slots at a time, the next prefetched; "
        "each key and value widened once for the 4 query heads beside it, 16 floats a register",
    ),
    KernelPath(
        "attention",
        "avx2",
        ("avx2", "fma", "f16c"),
        0,
        "each query head over its keys and then its values, 8 floats a register",
    ),
)


def _compiled(path: KernelPath) -> bool:
    if path.product == "attention":
        return bool(int(torch.ops.graphrunner_attention.paths()) >> path.code & 1)
    if path.product == "int4-q8":
        return bool(int(torch.ops.graphrunner_int4.q8_paths()) >> path.code & 1)
    if path.product == "int4-bf16":
        return bool(int(torch.ops.graphrunner_int4.bf16_paths()) >> path.code & 1)
    return path.code == 0


@functools.cache
def kernel_path(product: str) -> KernelPath | None:
    """The path ``product``'s C++ kernel takes on this CPU (None where the
    kernels do not run here: the torch fallback runs). ValueError for a
    product the table does not name."""
    rows = [p for p in KERNEL_PATHS if p.product == product]
    if not rows:
        products = sorted({p.product for p in KERNEL_PATHS})
        raise ValueError(f"kernel_path({product!r}): expected one of {', '.join(products)}")
    if product == "attention":
        raise ValueError(
            "kernel_path('attention'): the decode attention is built apart; its path is "
            "graphrunner_ref.model.attention_cpu.decode_path()"
        )
    if kernel_status() is not None:
        return None
    return best_path(product)


def best_path(product: str) -> KernelPath | None:
    """:func:`kernel_path` once ``product``'s kernels are built: the first
    of its rows whose features this CPU has and the build compiled."""
    features = cpu_features()
    rows = (p for p in KERNEL_PATHS if p.product == product)
    return next((p for p in rows if features.has(*p.needs) and _compiled(p)), None)


def kernel_summary(products: Iterable[str | None]) -> str:
    """``int4: avx2 (how), int4-q8: avx2 (how)``: the path each product runs
    here (None entries and repeats skipped), for results files."""
    names = [p for p in dict.fromkeys(products) if p is not None]
    parts = []
    for product in names:
        path = kernel_path(product)
        parts.append(
            f"{product}: {'torch fallback' if path is None else f'{path.name} ({path.how})'}"
        )
    return ", ".join(parts) or "none"


def kernel_note(product: str) -> str:
    """One line: the kernel ``product`` runs here and the CPU's features."""
    path = kernel_path(product)
    how = (
        f"the C++ {path.name} kernel ({path.how})"
        if path is not None
        else f"the torch fallback ({kernel_status() or 'no path for these features'})"
    )
    return f"kernel: {how}; CPU {cpu_features().describe()}"


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

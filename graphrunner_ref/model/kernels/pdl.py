"""Programmatic dependent launch (PDL) for the model's Triton kernels.

On Hopper and later, a kernel launched with PDL may be scheduled while the
kernel before it on the stream is still running: once every program of the
predecessor has signalled (or exited), the dependent's programs start, and
each waits at ``griddepcontrol.wait`` until the predecessor has completed and
its writes are visible. Inside a CUDA graph the launches become programmatic
edges, so a step of a hundred small kernels stops paying a full launch gap
and prologue between each pair.

The contract every kernel here keeps when it takes ``PDL``: the wait comes
first, before any load or store, so a kernel started early neither reads what
its predecessor has not yet written nor overwrites what it still reads; and
since every kernel waits, completion stays transitive (a kernel that finished
had waited for its own predecessor). It then signals its dependents at once,
so the next kernel's launch and prologue overlap this one's work.

Off by default (the measured path): :func:`triton_launch` gives a launch's
keyword arguments. Between our kernels inductor's run with plain launches,
which wait for everything before them, so the chain stays ordered.
:data:`INDUCTOR_OPTIONS` (``create_decode_runner(..., inductor_options=...)``)
launches inductor's kernels programmatically too, with inductor's own
placement of the waits (before reading what the previous kernel wrote, or
after its first load): not this module's contract, since a kernel of its
that reads nothing waits for nothing; measured separately
(``bench/bench_gpu_model.py``'s ``+pdl-inductor``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INDUCTOR_OPTIONS", "check_device", "supported", "triton_launch"]

#: Inductor config patches that launch its generated Triton kernels
#: programmatically, with inductor's own waits (torch >= 2.9; see above).
INDUCTOR_OPTIONS: dict[str, Any] = {"triton.enable_pdl": True}


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch programmatically (CUDA, sm_90+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def check_device(device: torch.device, who: str) -> None:
    """Raise ``ValueError`` naming ``who`` unless ``device`` supports PDL."""
    if not supported(device):
        raise ValueError(
            f"{who}: programmatic dependent launch on {device}: expected a CUDA device "
            "of compute capability 9.0 or newer (Hopper)"
        )


def triton_launch(enabled: bool) -> dict[str, Any]:
    """Keyword arguments of a launch of a kernel taking the ``PDL`` constexpr:
    the kernel's wait-then-signal prologue and the launch attribute, together
    (one without the other would either wait for nothing or start a kernel
    that does not wait)."""
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}

"""CLI options of the model and how its step runs: ``--model`` (an embedded
config), ``--dtype``, ``--attention`` and ``--compile/--no-compile``.

The CUDA runner captures the inductor-compiled forward by default (with the
reference model's Triton decode attention inside); ``--no-compile`` captures
the eager forward. Other runners have no such choice: the CPU runner always
compiles, eager never does.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from graphrunner.cli.common import UsageError
from graphrunner.model import EMBEDDED_CONFIGS, ModelBundle, ModelConfig
from graphrunner.model.attention_backend import ATTENTIONS

__all__ = [
    "DTYPES",
    "add_arguments",
    "check_atol",
    "check_attention",
    "dtype",
    "embedded_config",
    "compile_option",
    "resolve_compile",
    "with_attention",
]

#: ``--dtype`` names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Logit / KV tolerance of ``--check`` per dtype: a 16-bit model's graph and
#: eager forwards round differently (fused vs separate ops) by far more than 1e-4.
_CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA runner only: run torch.compile'd programs (inductor, one per size) "
        "inside the CUDA graphs (the default for --runner cuda; --no-compile captures the "
        "eager forward)",
    )
    p.add_argument(
        "--model",
        choices=sorted(EMBEDDED_CONFIGS),
        default="default",
        help="embedded random model when no --checkpoint: default (2 layers, hidden 64) "
        "or 1.1b (the shape of a 1.1B Llama: 22 layers, hidden 2048, context 1024)",
    )
    p.add_argument(
        "--attention",
        choices=["auto", *ATTENTIONS],
        default="auto",
        help="decode attention of the model: auto (the Triton kernel on CUDA, torch on the "
        "CPU), torch (the reference everywhere), triton (CUDA only) or triton-all-heads "
        "(CUDA only: the kernel's other split launch, one program over every KV head)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights, activations and KV cache (float32); logits are always float32",
    )


def resolve_compile(args: argparse.Namespace, kind: str) -> bool:
    """``--compile`` for runner ``kind``: default on for ``cuda``, refused elsewhere."""
    if args.compile is None:
        return kind == "cuda"
    if args.compile and kind != "cuda":
        raise UsageError(
            "--compile needs --runner cuda (the cpu runner always compiles; eager never "
            f"does); the runner here is {kind}"
        )
    return bool(args.compile)


def compile_option(compile: bool) -> dict[str, Any]:
    """The mechanism options of a resolved ``--compile``."""
    # Passed only when asked for, so a plain run makes the call every engine accepts.
    return {"compile": True} if compile else {}


def embedded_config(args: argparse.Namespace) -> ModelConfig:
    return EMBEDDED_CONFIGS[args.model]()


def dtype(args: argparse.Namespace) -> torch.dtype:
    return DTYPES[args.dtype]


def check_atol(args: argparse.Namespace) -> float:
    return _CHECK_ATOL[dtype(args)]


def check_attention(args: argparse.Namespace) -> None:
    """``--attention triton*`` needs a CUDA device (``args.device`` resolved)."""
    triton = args.attention != "auto" and ATTENTIONS[args.attention][0] == "triton"
    if triton and not str(args.device).startswith("cuda"):
        raise UsageError(
            f"--attention {args.attention} needs a CUDA device; the device here is {args.device} "
            "(the CPU runs the torch attention)"
        )


def with_attention(args: argparse.Namespace, bundle: ModelBundle) -> ModelBundle:
    """``bundle`` with the decode attention ``--attention`` names (auto: the model's own)."""
    if args.attention != "auto":
        bundle.model.attn_backend.use(args.attention)
    return bundle

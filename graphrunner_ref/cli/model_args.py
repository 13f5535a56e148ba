"""The checks of the model's options and of how its step runs: ``--model`` (a
checkpoint directory, a ``.gguf`` file or an embedded random model;
``--checkpoint`` is another name for it), ``--dtype``, ``--quantize``,
``--attention`` and ``--compile/--no-compile``.

:func:`resolve_model` turns the two flags into what the rest of the CLI reads,
once, right after parsing: ``args.checkpoint`` the path (or None) and
``args.model`` the embedded model's name (None with a checkpoint).

The CUDA runner captures the inductor-compiled forward by default (with the
reference model's Triton decode attention inside); ``--no-compile`` captures
the eager forward. Other runners have no such choice: the CPU runner always
compiles, eager never does.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.engine.config import DTYPES
from graphrunner_ref.engine.kinds.llama import EMBEDDED_MODELS
from graphrunner_ref.model.attention_backend import ATTENTIONS
from graphrunner_ref.model.cpu_features import (
    half_precision_note,
    int8_weight_only_note,
    kernel_note,
)
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.quantize import INT4_MODES

__all__ = [
    "check_attention",
    "check_quantize",
    "dtype",
    "resolve_compile",
    "model_source",
    "note_half_precision",
    "resolve_model",
]

#: Loading the C++ kernels for longer than this means they were built: say so.
BUILD_NOTE_SECONDS = 2.0
#: Earlier names, still accepted (with a note on stderr).
_DEPRECATED = {"default": "embedded", "1.1b": "embedded-1.1b"}
#: ``org/name`` as the Hugging Face hub spells a model id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_DOWNLOAD = (
    "Hugging Face hub ids are not fetched; download a local copy first "
    "(huggingface-cli download {id} --local-dir DIR), then --model DIR"
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


def resolve_model(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve ``--model`` / ``--checkpoint`` in place (a no-op for commands
    without them); returns ``args``. An embedded name wins over a path of the
    same name (``./embedded`` is the path). Raises :class:`UsageError` for both
    flags naming different models, a missing path (a hub id gets how to
    download it), a directory without ``config.json`` or a file that is not a
    ``.gguf``."""
    if not hasattr(args, "model"):
        return args
    positional = getattr(args, "model_arg", None)  # serve MODEL
    if positional is not None:
        if args.model != "embedded" and args.model != positional:
            raise UsageError(
                f"MODEL {positional} and --model {args.model}: two different models; give one"
            )
        args.model, args.model_arg = positional, None
    name, path = args.model, args.checkpoint
    if name in _DEPRECATED:
        print(
            f"graphrunner: --model {name} is deprecated; use --model {_DEPRECATED[name]}",
            file=sys.stderr,
        )
        name = _DEPRECATED[name]
    if name in EMBEDDED_MODELS:
        if path is not None and name != "embedded":
            raise UsageError(
                f"--model {args.model}: an embedded model, not with --checkpoint {path} "
                "(--checkpoint is another name for --model: give one)"
            )
        args.model = None if path is not None else name
        if path is not None:
            _check_path("--checkpoint", path)
        return args
    if path is not None and Path(name) != path:
        raise UsageError(
            f"--model {name} and --checkpoint {path}: two different models "
            "(--checkpoint is another name for --model: give one)"
        )
    args.model, args.checkpoint, args.checkpoint_flag = None, Path(name), "--model"
    _check_path("--model", args.checkpoint)
    return args


def _check_path(flag: str, path: Path) -> None:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"{flag} {path}: missing {path / 'config.json'}; expected a Hugging Face-layout "
                f"checkpoint directory ({_DOWNLOAD.format(id='ORG/NAME')})"
            )
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UsageError(f"{flag} {path}: expected a checkpoint directory or a .gguf file")
    elif _HUB_ID.fullmatch(str(path)) and path.suffix.lower() != ".gguf":
        raise UsageError(f"{flag} {path}: no such file or directory; {_DOWNLOAD.format(id=path)}")
    else:
        raise UsageError(
            f"{flag} {path}: no such file or directory; expected a checkpoint directory, "
            f"a .gguf file or an embedded model ({', '.join(EMBEDDED_MODELS)})"
        )


def model_source(args: argparse.Namespace) -> str:
    """The checkpoint as the command line named it (``--model DIR``), for messages."""
    return f"{args.checkpoint_flag} {args.checkpoint}"


def dtype(args: argparse.Namespace) -> torch.dtype:
    return DTYPES[args.dtype]


def note_half_precision(args: argparse.Namespace) -> None:
    """One line on stderr when ``--dtype`` is half precision on a CPU whose
    matrix units cannot run it natively (``args.device`` resolved)."""
    note = half_precision_note(dtype(args), str(args.device))
    if note is not None and not getattr(args, "quiet", False):
        print(f"graphrunner: {note}", file=sys.stderr)


def check_quantize(args: argparse.Namespace) -> None:
    """``--quantize`` on the CPU, ``fp16`` and the int4 modes with ``--dtype
    float32`` (``args.device`` resolved); the C++ kernels loaded (built, the
    first time on a machine, saying how long it took); which kernel path runs
    on this CPU's features, and a note where the weight-only product is slow."""
    mode = getattr(args, "quantize", None)
    if mode is None:
        return
    if not str(args.device).startswith("cpu"):
        raise UsageError(f"--quantize {mode} runs on the CPU; the device here is {args.device}")
    if mode in ("fp16", *INT4_MODES) and dtype(args) != torch.float32:
        raise UsageError(
            f"--quantize {mode} runs float32 activations over compact weights; --dtype "
            f"{args.dtype}: expected float32 (use --quantize int8 with a half-precision model)"
        )
    start = time.perf_counter()
    kernel_status()  # cached: the model's linears find them loaded
    took = time.perf_counter() - start
    quiet = getattr(args, "quiet", False)
    if took > BUILD_NOTE_SECONDS and not quiet:
        print(
            f"graphrunner: --quantize {mode}: built the C++ CPU kernels in {took:.0f} s "
            "(once per machine: torch's extension cache keeps them)",
            file=sys.stderr,
        )
    note = int8_weight_only_note(dtype(args)) if mode == "int8" else None
    if note is not None and not quiet:
        print(f"graphrunner: {note}", file=sys.stderr)
    if not quiet and (mode != "int8" or dtype(args) == torch.float32):
        print(f"graphrunner: --quantize {mode}: {kernel_note(mode)}", file=sys.stderr)


def check_attention(args: argparse.Namespace) -> None:
    """``--attention triton*`` needs a CUDA device, ``live`` the CPU (``args.device`` resolved)."""
    kernel = "auto" if args.attention == "auto" else ATTENTIONS[args.attention][0]
    on_cuda = str(args.device).startswith("cuda")
    if kernel == "triton" and not on_cuda:
        raise UsageError(
            f"--attention {args.attention} needs a CUDA device; the device here is {args.device} "
            "(the CPU runs the live attention)"
        )
    if kernel == "live" and on_cuda:
        raise UsageError(
            f"--attention live runs on the CPU; the device here is {args.device} "
            "(on CUDA, triton reads only the live tokens)"
        )

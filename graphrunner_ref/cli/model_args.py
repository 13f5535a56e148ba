"""CLI options of the model and how its step runs: ``--model`` (a checkpoint
directory, a ``.gguf`` file or an embedded random model; ``--checkpoint`` is
another name for it), ``--dtype``, ``--quantize``, ``--attention`` and
``--compile/--no-compile``.

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
from typing import Any

import torch

from graphrunner_ref.cli import model_impl as cli_model_impl
from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.cli.groups import Groups
from graphrunner_ref.io.gguf_int4 import read_gguf_int4
from graphrunner_ref.model import EMBEDDED_CONFIGS, ModelBundle, ModelConfig
from graphrunner_ref.model.attention_backend import ATTENTIONS, LIVE_FROM_CAPACITY
from graphrunner_ref.model.cpu_features import half_precision_note, int8_weight_only_note
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.int4_linear import Int4Weight
from graphrunner_ref.model.quantize import QUANTIZATIONS, quantize_model
from graphrunner_ref.model.shapes import projection_shapes

__all__ = [
    "DTYPES",
    "EMBEDDED_MODELS",
    "add_arguments",
    "check_atol",
    "check_attention",
    "check_quantize",
    "dtype",
    "embedded_config",
    "compile_option",
    "resolve_compile",
    "model_source",
    "note_half_precision",
    "note_quantization",
    "resolve_model",
    "with_attention",
    "with_quantization",
]

#: Loading the C++ kernels for longer than this means they were built: say so.
BUILD_NOTE_SECONDS = 2.0
#: ``--dtype`` names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Logit / KV tolerance of ``--check`` per dtype: a 16-bit model's graph and
#: eager forwards round differently (fused vs separate ops) by far more than 1e-4.
_CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}
#: ``--model`` names of the embedded random models, and their configs' names.
EMBEDDED_MODELS = {"embedded": "default", "embedded-1.1b": "1.1b"}
#: Earlier names, still accepted (with a note on stderr).
_DEPRECATED = {"default": "embedded", "1.1b": "embedded-1.1b"}
#: ``org/name`` as the Hugging Face hub spells a model id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_DOWNLOAD = (
    "Hugging Face hub ids are not fetched; download a local copy first "
    "(huggingface-cli download {id} --local-dir DIR), then --model DIR"
)


def add_arguments(g: Groups) -> None:
    """``--compile`` in the runner group; ``--model``, ``--checkpoint``,
    ``--attention`` and ``--dtype`` in the model group."""
    p = g.runner
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA runner only: run torch.compile'd programs (inductor, one per size) "
        "inside the CUDA graphs (the default for --runner cuda; --no-compile captures the "
        "eager forward)",
    )
    p = g.model
    p.add_argument(
        "--model",
        default="embedded",
        metavar="DIR|FILE.gguf|NAME",
        help="a Hugging Face-layout checkpoint directory, a .gguf file (converted once into "
        "the cache) or an embedded random model: embedded (the default: 2 layers, hidden 64) "
        "or embedded-1.1b (the shape of a 1.1B Llama: 22 layers, hidden 2048, context 1024)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR|FILE.gguf",
        help="another name for --model PATH",
    )
    p.set_defaults(checkpoint_flag="--checkpoint")
    p.add_argument(
        "--attention",
        choices=["auto", *ATTENTIONS],
        default="auto",
        help="decode attention of the model: auto (the Triton kernel on CUDA; on the CPU "
        f"live from --max-context-len {LIVE_FROM_CAPACITY} up, torch below), torch (the "
        "reference everywhere: reads the whole --max-context-len of every row), live (CPU "
        "only: reads up to the batch's longest live row), triton (CUDA only) or "
        "triton-all-heads (CUDA only: the kernel's other split launch, one program over "
        "every KV head)",
    )
    cli_model_impl.add_argument(p)
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights, activations and KV cache (float32); logits are always float32",
    )
    p.add_argument(
        "--quantize",
        choices=list(QUANTIZATIONS),
        default=None,
        help="CPU: compact weights for every projection and the LM head (the native Llama, "
        "or any model's nn.Linear with --model-impl transformers), C++ AVX2 kernels built at "
        "first use. int8: int8 per output channel, activations in --dtype (half precision: "
        "torch's product, fast with AVX-512 or AMX); fp16: float16 weights, float32 "
        "activations and accumulation (--dtype float32; half the weight bytes); int4: 4-bit "
        "weights in groups of 32 columns with a scale and a min each, float32 activations "
        "(--dtype float32; a fifth of the weight bytes; a .gguf file's Q4 blocks as they are)",
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


def resolve_model(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve ``--model`` / ``--checkpoint`` in place (a no-op for commands
    without them); returns ``args``. An embedded name wins over a path of the
    same name (``./embedded`` is the path). Raises :class:`UsageError` for both
    flags naming different models, a missing path (a hub id gets how to
    download it), a directory without ``config.json`` or a file that is not a
    ``.gguf``."""
    if not hasattr(args, "model"):
        return args
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


def embedded_config(args: argparse.Namespace) -> ModelConfig:
    return EMBEDDED_CONFIGS[EMBEDDED_MODELS[args.model]]()


def dtype(args: argparse.Namespace) -> torch.dtype:
    return DTYPES[args.dtype]


def check_atol(args: argparse.Namespace) -> float:
    return _CHECK_ATOL[dtype(args)]


def note_half_precision(args: argparse.Namespace) -> None:
    """One line on stderr when ``--dtype`` is half precision on a CPU whose
    matrix units cannot run it natively (``args.device`` resolved)."""
    note = half_precision_note(dtype(args), str(args.device))
    if note is not None and not getattr(args, "quiet", False):
        print(f"graphrunner: {note}", file=sys.stderr)


def check_quantize(args: argparse.Namespace) -> None:
    """``--quantize`` on the CPU, ``fp16`` and ``int4`` with ``--dtype float32``
    (``args.device`` resolved); the C++ kernels loaded (built, the first time on
    a machine, saying how long it took); a note where the weight-only product
    is slow."""
    mode = getattr(args, "quantize", None)
    if mode is None:
        return
    if not str(args.device).startswith("cpu"):
        raise UsageError(f"--quantize {mode} runs on the CPU; the device here is {args.device}")
    if mode in ("fp16", "int4") and dtype(args) != torch.float32:
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


def with_quantization(args: argparse.Namespace, bundle: ModelBundle) -> ModelBundle:
    """``bundle`` with its model quantized as ``--quantize`` says (unchanged
    without it); int4 from a GGUF file takes the file's own Q4 codes."""
    mode = getattr(args, "quantize", None)
    if mode is None:
        return bundle
    codes = _gguf_codes(args) if mode == "int4" else None
    try:
        quantize_model(bundle.model, mode, codes=codes)
    except ValueError as e:
        raise UsageError(f"--quantize {mode}: {e}") from None
    source = None
    if mode == "int4":
        config = bundle.model.config
        total = config.num_layers * len(projection_shapes(config))
        source = (
            f"{len(codes)} of {total} projections keep the GGUF file's own 4-bit codes, "
            f"{total - len(codes)} quantized from floats"
            if codes is not None
            else f"{total} projections quantized from floats"
        )
    note_quantization(args, source)
    return bundle


def _gguf_codes(args: argparse.Namespace) -> dict[str, Int4Weight] | None:
    """The Q4 codes of ``--model FILE.gguf`` (None for any other checkpoint);
    ``args.gguf_file`` is set where the file is resolved to its converted directory."""
    path = getattr(args, "gguf_file", None)
    return None if path is None else read_gguf_int4(path)


def note_quantization(args: argparse.Namespace, source: str | None = None) -> None:
    """One line on stderr (unless ``--quiet``): where ``--quantize``'s weights
    came from (``source``, when there is something to say) and which product
    runs on this CPU."""
    if getattr(args, "quiet", False):
        return
    mode, why = args.quantize, kernel_status()
    if mode == "int8" and dtype(args) != torch.float32:
        product = "torch's weight-only int8 product (half-precision activations)"
    elif why is None:
        product = "the C++ AVX2 kernels" + ("" if mode == "int8" else ", fbgemm for the LM head")
    else:
        product = f"torch's and fbgemm's fallbacks ({why})"
    capability = torch.backends.cpu.get_cpu_capability()
    where = "" if source is None else f"{source}; "
    print(
        f"graphrunner: --quantize {mode}: {where}products: {product} (CPU capability {capability})",
        file=sys.stderr,
    )


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


def with_attention(args: argparse.Namespace, bundle: ModelBundle) -> ModelBundle:
    """``bundle`` with the decode attention ``--attention`` names (auto: the model's own)."""
    if args.attention != "auto":
        bundle.model.attn_backend.use(args.attention)
    return bundle

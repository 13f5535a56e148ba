"""The command line's argument checks: every number bounded by what the machine
can hold, before any work. Out of range, the CLI names the argument, the value
and the allowed range (a :class:`UsageError`, exit 2). Sizes that allocate are
checked against the available memory through :func:`memory_estimate`. The
model's kind comes from the registry (:func:`model_kind`), which refuses by
flag what that kind cannot run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from graphrunner.phases import MAX_STEPS_PER_LAUNCH
from graphrunner.pools import whole_pages
from graphrunner.sizing import default_capture_sizes
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli.common import UsageError, check_range, resolve_device
from graphrunner_ref.cli.options import MAX_DRAFT_TOKENS, config_of
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import MAX_BATCHED_TOKENS
from graphrunner_ref.engine.kinds.llama import native_refusal
from graphrunner_ref.engine.memory import MAX_KV_SLOTS, available_memory, memory_estimate
from graphrunner_ref.engine.registry import ModelKind
from graphrunner_ref.io import resolve_checkpoint
from graphrunner_ref.io.aot_folder import aot_folder
from graphrunner_ref.model import ModelConfig

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_SEED",
    "capture_sizes",
    "check_common",
    "check_fits",
    "model_config",
    "model_kind",
    "runner_kind",
]

#: --seed: torch.Generator.manual_seed takes -2**63..2**64-1, but a negative seed
#: aliases the top half (-1 seeds as 2**64-1); 0..2**63-1 is one range, each seed
#: its own generator state, that fits an int64 wherever it is stored.
MAX_SEED = 2**63 - 1
#: --max-bs and every --capture-sizes entry, before the memory check (which
#: needs the capture-size list, itself as long as the largest size / 32).
MAX_BATCH_SIZE = 1_000_000


def _cores() -> int:
    return os.cpu_count() or 1


def check_common(args: argparse.Namespace) -> str:
    """Validate the arguments every command shares; returns the runner kind.
    (``--page-size`` and the batch sizes are checked against the context and
    the memory once the run's context is known: :func:`check_fits`.)"""
    check_range("--threads", args.threads, 1, _cores(), "this machine's cores")
    args.seed_given = args.seed is not None
    if args.seed_given:
        check_range("--seed", args.seed, 0, MAX_SEED)
    else:
        args.seed = 0  # generate may draw one for sampling: cli_sampling.settle_seed
    _check_modes(args)
    try:
        args.aot_cache = aot_folder(args.aot_cache)
    except ValueError as e:
        raise UsageError(str(e)) from None
    kind = runner_kind(args)
    args.compile = cli_model.resolve_compile(args, kind)
    cli_model.check_attention(args)
    cli_model.note_half_precision(args)
    cli_model.check_quantize(args)
    return kind


def capture_sizes(args: argparse.Namespace, default_max_bs: int = 16) -> list[int]:
    if args.max_bs is not None:
        check_range("--max-bs", args.max_bs, 1, MAX_BATCH_SIZE)
    if args.capture_sizes is None:
        return default_capture_sizes(default_max_bs if args.max_bs is None else args.max_bs)
    try:
        sizes = sorted({int(s) for s in args.capture_sizes.split(",")})
    except ValueError:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected comma-separated ints"
        ) from None
    if not 1 <= sizes[0] <= sizes[-1] <= MAX_BATCH_SIZE:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes in 1..{MAX_BATCH_SIZE}"
        )
    if args.max_bs is not None and args.max_bs != sizes[-1]:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes whose "
            f"largest equals --max-bs {args.max_bs}"
        )
    return sizes


def runner_kind(args: argparse.Namespace) -> str:
    """Resolve ``args.device`` in place (the rest of the CLI reads it); returns the kind."""
    kind, args.device = resolve_device(args.runner, args.device, torch.cuda.is_available())
    # Read off the string: torch.device parses the index as int8 (cuda:128 is -128)
    # and raises on a longer one.
    _, _, index = args.device.partition(":")
    if index and int(index) >= (count := torch.cuda.device_count()):
        raise UsageError(f"--device {args.device}: expected cuda:N with N < {count} devices")
    return kind


def model_kind(args: argparse.Namespace) -> ModelKind:
    """The registered kind that serves ``args``' model, once it accepted every
    option (:func:`~graphrunner_ref.engine.serving.model_kind`). A ``.gguf``
    file is converted once into the cache first (the rest reads that
    directory, and ``--quantize int4`` the file's own 4-bit codes); ``auto``
    settles on the kind's ``--model-impl`` choice, saying on stderr when that
    is the transformers bridge."""
    if args.checkpoint is not None:
        if args.checkpoint.suffix.lower() == ".gguf" and not args.checkpoint.is_dir():
            args.gguf_file = args.checkpoint
        try:
            args.checkpoint = resolve_checkpoint(args.checkpoint)
        except ValueError as e:
            raise UsageError(str(e)) from None
    kind = serving.model_kind(config_of(args))
    if args.model_impl == "auto" and kind.impl == "transformers":
        print(
            f"graphrunner: {args.checkpoint_flag} {args.checkpoint}: not the native model "
            f"({native_refusal(args.checkpoint)}); running it through the transformers bridge "
            "(--model-impl transformers)",
            file=sys.stderr,
        )
    args.model_impl = kind.impl  # decided once: the note is said once
    return kind


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The shape of ``args``' model as its kind reads it, before anything is loaded."""
    return model_kind(args).shape(config_of(args))


def _check_modes(args: argparse.Namespace) -> None:
    """Refuse the speculative, overlap and multi-step options that cannot run
    (their range, or a combination), before any work."""
    if args.speculative is not None:
        check_range("--draft-tokens", args.draft_tokens, 1, MAX_DRAFT_TOKENS)
        if args.page_size != 1:
            raise UsageError(
                f"--page-size {args.page_size} with --speculative: expected 1 (speculative "
                f"decoding runs one KV slot per token)"
            )
    if args.overlap and args.speculative:
        raise UsageError("--overlap with --speculative: expected one of them (not combined yet)")
    n = args.steps_per_launch
    check_range("--steps-per-launch", n, 1, MAX_STEPS_PER_LAUNCH)
    if n > 1 and args.speculative is not None:
        raise UsageError(
            f"--steps-per-launch {n} with --speculative: not supported; expected one of them"
        )
    budget = getattr(args, "max_num_batched_tokens", None)
    if budget is not None:
        check_range("--max-num-batched-tokens", budget, 1, MAX_BATCHED_TOKENS)
        if not getattr(args, "chunked_prefill", True):
            raise UsageError(
                f"--max-num-batched-tokens {budget} with --no-chunked-prefill: expected one of them"
            )
    args.token_sizes = _token_sizes(args, budget)


def _token_sizes(args: argparse.Namespace, budget: int | None) -> list[int]:
    """``--token-capture-sizes`` as a sorted list (empty: the default),
    refused unless every size is in 1..MAX_BATCHED_TOKENS, the largest
    covers the step budget and chunked prefill is on."""
    given = getattr(args, "token_capture_sizes", None)
    if given is None:
        return []
    flag = f"--token-capture-sizes {given!r}"
    if not getattr(args, "chunked_prefill", True):
        raise UsageError(f"{flag} with --no-chunked-prefill: expected one of them")
    try:
        sizes = sorted({int(s) for s in given.split(",")})
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated ints") from None
    if not 1 <= sizes[0] <= sizes[-1] <= MAX_BATCHED_TOKENS:
        raise UsageError(f"{flag}: expected sizes in 1..{MAX_BATCHED_TOKENS}")
    if budget is not None and sizes[-1] < budget:
        raise UsageError(
            f"{flag}: expected the largest to cover --max-num-batched-tokens {budget} "
            f"(a step's chunks hold up to that many tokens)"
        )
    return sizes


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(
    args: argparse.Namespace,
    config: ModelConfig,
    sizes: list[int],
    context: int,
    *,
    max_prompt_len: int,
    kind: str,
    check: bool,
) -> None:
    """Refuse (UsageError) a --page-size past ``context``, or pools and graphs that
    would not fit the memory available on ``args.device`` or index KV slots past
    int32; the batch size gets the range that fits."""
    check_range("--page-size", args.page_size, 1, context, "the context of this run")
    options: dict[str, Any] = {
        "context": context,
        "page_size": args.page_size,
        "max_prompt_len": max_prompt_len,
        "pool_copies": int(check) + int(args.check_padding),
        "cuda_graphs": kind == "cuda",
        "dtype_bytes": cli_model.dtype(args).itemsize,
    }
    free, source = available_memory(args.device)

    def up_to(bs: int) -> list[int]:
        return [s for s in sizes if s < bs] + [bs]

    def fits(bs: int) -> bool:
        slots = bs * whole_pages(context, args.page_size) + args.page_size
        return (
            slots <= MAX_KV_SLOTS
            and memory_estimate(config, capture_sizes=up_to(bs), **options) <= free
        )

    if fits(sizes[-1]):
        return
    lo, hi = 0, sizes[-1]  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    need = memory_estimate(config, capture_sizes=sizes, **options)
    why = (
        f"memory: this run needs about {_gib(need)}, {_gib(free)} is free per {source}"
        if need > free
        else f"int32 KV slot indices allow {MAX_KV_SLOTS} slots"
    )
    if lo == 0:
        model = cli_model.model_source(args) if args.checkpoint else "the embedded model"
        raise UsageError(f"{model} at context {context}: no batch size fits ({why})")
    if args.capture_sizes is not None:
        raise UsageError(
            f"--capture-sizes {args.capture_sizes!r}: expected sizes in 1..{lo} ({why})"
        )
    raise UsageError(f"--max-bs {sizes[-1]}: expected 1..{lo} ({why})")

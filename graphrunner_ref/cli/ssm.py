"""``graphrunner generate --model DIR`` for a Mamba or Jamba checkpoint.

The Llama path's prompt reading, output, runner factory
(:func:`~graphrunner_ref.engine.bundle.create_decode_runner`) and engine apply; what
differs is the bundle :func:`graphrunner_ref.io.load_any` returns (a hybrid request
pool, Mamba state), whose decode step the runner and engine read from it.
Sampling works as on the Llama path (the sampled step over the Mamba decode);
``--logprobs`` too; ``--check`` (an eager rerun per step), ``--speculative``
and ``--overlap`` are refused here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from graphrunner_ref.cli import answers as cli_answers
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import sizes as cli_sizes
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.engine.bundle import create_decode_runner
from graphrunner_ref.engine.loop import Engine
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.io.checkpoint import load_any, read_any_config, state_space_kind
from graphrunner_ref.io.mamba_checkpoint import DEFAULT_CONTEXT, StateSpaceBundle
from graphrunner_ref.model.config import CheckpointError, ModelConfig
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.mamba import MambaConfig

__all__ = ["generate", "is_state_space_checkpoint"]


def is_state_space_checkpoint(path: Path | str | None) -> bool:
    """Whether ``path`` is a checkpoint directory of a Mamba or Jamba model
    (:func:`graphrunner_ref.io.state_space_kind`; an unreadable ``config.json`` is
    left to the Llama path to word)."""
    if path is None:
        return False
    try:
        return state_space_kind(path) is not None
    except CheckpointError:
        return False


def _prompt_config(config: ModelConfig | MambaConfig | HybridConfig) -> ModelConfig:
    """The fields the prompt checks read (vocabulary, context) as a ModelConfig."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, HybridConfig):
        return config.attention
    return ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.mixer.intermediate_size,
        num_layers=config.num_layers,
        num_heads=1,
        num_kv_heads=1,
        max_position_embeddings=DEFAULT_CONTEXT,
    )


def generate(
    args: argparse.Namespace,
    kind: str,
    capture_sizes: Callable[[argparse.Namespace, int], list[int]],
) -> int:
    """Serve ``args``' prompts on the checkpoint's model; print or write the outputs."""
    for flag in ("check", "speculative", "overlap", "quantize"):
        if getattr(args, flag, False):
            raise UsageError(f"--{flag} is not supported for a Mamba or Jamba checkpoint")
    try:
        config = _prompt_config(read_any_config(args.checkpoint))
    except ValueError as e:
        raise UsageError(str(e)) from None
    limit, inputs = cli_text.check_generate(args, config)
    sizes = capture_sizes(args, min(16, len(inputs.prompts)))
    trace = cli_sampling.apply(
        requests_from_prompts(
            inputs.prompts, max_new_tokens=args.max_new_tokens, arrive_every=args.arrive_every
        ),
        cli_sampling.flag_params(args),
        inputs.fields,
    )
    cli_sampling.settle_seed(args, trace, "generate")
    torch.set_num_threads(args.threads)
    try:
        bundle = load_any(
            args.checkpoint,
            max_requests=sizes[-1],
            max_context_len=cli_text.run_context(args, trace, 0, limit),
            device=args.device,
            dtype=cli_model.dtype(args),
            page_size=args.page_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(bundle, StateSpaceBundle):
        raise UsageError(f"{cli_model.model_source(args)}: expected a Mamba or Jamba model")
    options = cli_model.compile_option(args.compile)
    bars = cli_answers.progress(args)
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=sizes,
        check_padding=args.check_padding,
        show_progress=bars,
        **options,
        **cli_sampling.runner_options(args, trace),
    )
    engine = Engine(
        bundle,
        runner,
        end_token=inputs.end_token,
        on_finish=inputs.on_finish,
        on_token=inputs.on_token,
        stop=inputs.stop,
        seed=args.seed,
        logprobs=args.logprobs,
    )
    streaming = inputs.on_token is not None and sys.stdout.isatty()
    with cli_sizes.profiled(args, file=sys.stderr):  # stdout carries the answers
        capture = runner.capture()
        result = engine.run(trace, progress=bars and not streaming)
    cli_sizes.write_outputs(args, runner, file=sys.stderr)
    s = result.stats
    served = cli_answers.Served(
        result.outputs,
        logprobs=result.logprobs,
        tokens_per_second=s.tokens_per_second,
        padded_fraction=s.padded_fraction,
        capture=capture,
        stats=s,
    )
    return cli_answers.emit(args, inputs, served)

"""``graphrunner serve``: an OpenAI-compatible HTTP server over the one engine path.

The model and engine options are ``generate``'s (:mod:`graphrunner_ref.cli.options`,
mapped into the same :class:`~graphrunner_ref.engine.config.EngineConfig`);
the sampling flags are the defaults of a request that sets none. The server's
own: ``--host``, ``--port``, ``--served-model-name``, ``--api-key``,
``--max-waiting``, ``--request-timeout`` and ``--shutdown-timeout``. Every
check runs before the model loads; the server itself is
:mod:`graphrunner_ref.serve` (FastAPI, uvicorn: the ``[serve]`` extra,
imported only here, after the checks).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner.util import MissingExtraError
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import report as cli_report
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli.common import UsageError, check_range
from graphrunner_ref.cli.options import config_of
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.sampling import MAX_LOGPROBS
from graphrunner_ref.io.text import NoTokenizerError, TextCodec, TokenizerVocabError, has_tokenizer

__all__ = ["DEFAULT_CONTEXT", "SERVE_MODULES", "check_serve_extra", "run"]

#: The context the pools are sized for without ``--max-context-len``: the
#: model's, up to this (every request row holds a whole context of KV).
DEFAULT_CONTEXT = 4096
#: The modules the ``[serve]`` extra installs.
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
#: ``--max-waiting`` and ``--port`` bounds.
MAX_WAITING = 1_000_000
MAX_PORT = 65535
#: ``--shutdown-timeout`` and ``--request-timeout`` bound, in seconds (a day).
MAX_SECONDS = 86_400.0


def check_serve_extra() -> None:
    """A :class:`MissingExtraError` naming ``pip install 'graphrunner[serve]'``
    when a package of the server is missing."""
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            raise MissingExtraError(
                f"graphrunner serve needs the {name!r} package, which is not installed: "
                "pip install 'graphrunner[serve]'"
            ) from None


def run(args: argparse.Namespace) -> int:
    """Check every option, load the model, serve until a signal; the exit status."""
    check_serve_extra()
    _check_server(args)
    kind = cli_checks.check_common(args)
    if args.speculative is not None:
        raise UsageError(
            f"--speculative {args.speculative} with serve: not served online yet; expected none"
        )
    model = cli_checks.model_kind(args)
    shape = model.shape(config_of(args))
    defaults = cli_sampling.flag_params(args)
    check_range("--logprobs", args.logprobs, 0, MAX_LOGPROBS)
    limit = cli_text.context_limit(args, shape)
    context = limit if args.max_context_len is not None else min(limit, DEFAULT_CONTEXT)
    sizes = cli_checks.capture_sizes(args)
    config = config_of(args, kind, sizes)
    if model.memory_checked:
        cli_checks.check_fits(
            args, shape, sizes, context, max_prompt_len=context, kind=kind, check=False
        )
    codec = _codec(args, shape.vocab_size)
    cli_text.check_end_token(args, shape.vocab_size)
    end = cli_text.end_token_of(args, codec)
    name = args.served_model_name or _model_name(args)

    from graphrunner_ref.serve.protocol import Limits
    from graphrunner_ref.serve.server import ServerOptions, bind
    from graphrunner_ref.serve.server import run as serve_http

    # Several steps a launch end every row at the end token inside the launch.
    ignorable = end is None or config.steps_per_launch == 1
    # A checked step reruns eagerly and would count each token twice: no penalties then.
    penalties = not (config.check and not config.overlap)
    limits = Limits(context, shape.vocab_size, args.logprobs, defaults, codec, ignorable, penalties)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        model_name=name,
        api_key=args.api_key or os.environ.get("GRAPHRUNNER_API_KEY") or None,
        max_waiting=args.max_waiting,
        shutdown_timeout=args.shutdown_timeout,
        request_timeout=args.request_timeout,
        log_level="warning" if args.quiet else "info",
    )
    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    bundle = serving.build(config, sizes[-1], context)
    if not args.quiet:
        print(
            f"graphrunner serve: {name}, context {context}, {sizes[-1]} request rows, "
            f"runner {kind} on {args.device}",
            file=sys.stderr,
        )
    return serve_http(
        config,
        bundle,
        limits,
        options,
        end_token=end,
        on_capture=_capture_line(sizes, args),
        sock=sock,
        progress=not args.quiet,
    )


def _check_server(args: argparse.Namespace) -> None:
    check_range("--port", args.port, 0, MAX_PORT)
    check_range("--max-waiting", args.max_waiting, 1, MAX_WAITING)
    for flag, value in (
        ("--shutdown-timeout", args.shutdown_timeout),
        ("--request-timeout", args.request_timeout),
    ):
        if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
            raise UsageError(f"{flag} {value}: expected seconds in 0..{MAX_SECONDS:g}")
    if args.request_timeout == 0:
        raise UsageError("--request-timeout 0: expected seconds > 0 (or none: no deadline)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name '': expected a name")


def _codec(args: argparse.Namespace, vocab_size: int) -> TextCodec | None:
    """The checkpoint's tokenizer (None: token ids only)."""
    if not has_tokenizer(args.checkpoint):
        return None
    try:
        return TextCodec.load(
            args.checkpoint,
            what="serve",
            vocab_size=vocab_size,
            named=cli_model.model_source(args),
        )
    except (NoTokenizerError, TokenizerVocabError) as e:
        raise UsageError(str(e)) from None


def _model_name(args: argparse.Namespace) -> str:
    """The name clients ask for: the embedded model's, or the path as given."""
    if args.checkpoint is None:
        return str(args.model)
    return str(args.gguf_file or args.checkpoint).rstrip("/")


def _capture_line(sizes: list[int], args: argparse.Namespace) -> serving.OnCapture:
    def show(runner: GraphRunner, capture: CaptureReport) -> None:
        line = cli_report.capture_line(runner, sizes, capture, args.steps_per_launch)
        print(f"graphrunner serve: {line}", file=sys.stderr, flush=True)

    return show

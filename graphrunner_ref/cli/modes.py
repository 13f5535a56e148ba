"""``--speculative`` and ``--overlap`` runs of ``demo`` and ``generate``, and
the demo's comparison of them against plain decoding on the same pools."""

from __future__ import annotations

import argparse
from typing import Any

from graphrunner_ref.bridge import TransformersBundle
from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import overlap as cli_overlap
from graphrunner_ref.cli import spec as cli_spec
from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.engine.loop import EngineResult
from graphrunner_ref.engine.speculative import SpeculativeResult
from graphrunner_ref.model import ModelBundle

__all__ = ["demo_against_plain", "serve_mode"]


def demo_against_plain(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
) -> int:
    """Speculative or overlap serving, then plain decoding on the same pools
    (greedy, or overlap's sampling with the same seeds): the same tokens (a
    run cut by ``--steps`` holds a prefix of them)."""
    options = cli_model.compile_option(args.compile)
    result = serve_mode(args, bundle, trace, kind, sizes, options, max_steps=args.steps)
    plain, plain_tps = cli_spec.plain_run(
        bundle, trace, kind, sizes, options, seed=args.seed, max_steps=args.steps
    )
    diff = cli_spec.differing(result.outputs, plain)
    if isinstance(result, SpeculativeResult):
        cli_spec.report(args, result, plain_tps, diff)
    else:
        cli_overlap.report(args, result, plain_tps, diff, cli_spec.plain_name(trace))
    return 1 if diff else 0


def serve_mode(
    args: argparse.Namespace,
    bundle: ModelBundle | TransformersBundle,
    trace: list[Any],
    kind: str,
    sizes: list[int],
    options: dict[str, Any],
    **kwargs: Any,
) -> SpeculativeResult | EngineResult:
    """The run of ``--speculative`` or ``--overlap``."""
    if not args.speculative:
        return cli_overlap.run_overlap(args, bundle, trace, kind, sizes, options, **kwargs)
    if not isinstance(bundle, ModelBundle):
        raise UsageError(
            "--speculative: the draft heads are the native model's; expected --model-impl "
            "native (or a checkpoint the native model runs)"
        )
    return cli_spec.run_speculative(args, bundle, trace, kind, sizes, options, **kwargs)

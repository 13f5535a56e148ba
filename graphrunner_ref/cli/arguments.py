"""The arguments every command that serves (``demo``, ``generate``) shares."""

from __future__ import annotations

from graphrunner_ref.cli import model_args as cli_model
from graphrunner_ref.cli import multistep as cli_multistep
from graphrunner_ref.cli import overlap as cli_overlap
from graphrunner_ref.cli import sampling as cli_sampling
from graphrunner_ref.cli import spec as cli_spec
from graphrunner_ref.cli import text as cli_text
from graphrunner_ref.cli import tp as cli_tp
from graphrunner_ref.cli.groups import Groups

__all__ = ["add_common"]


def add_common(g: Groups) -> None:
    """The options of every serving command, each in its help group."""
    p = g.runner
    p.add_argument(
        "--device",
        help="cpu or cuda[:N] (default: the runner's: cuda for --runner cuda, cpu for "
        "--runner cpu or eager; with neither given, cuda when available, else cpu)",
    )
    p.add_argument(
        "--runner",
        choices=["cuda", "cpu", "eager"],
        help="default: the device's (cuda on a CUDA device, else cpu); eager runs on any device",
    )
    cli_model.add_arguments(g)  # --compile/--no-compile, --model/--checkpoint, --dtype
    cli_tp.add_argument(p)
    p.add_argument(
        "--max-bs",
        type=int,
        help="largest captured batch size (default 16; generate: at most the number of prompts); "
        "refused past what the pools and graphs can take in the free memory",
    )
    p.add_argument(
        "--capture-sizes",
        help="comma-separated, e.g. 1,2,4,8 (default: graphrunner's policy up to --max-bs)",
    )
    g.sampling.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the embedded model's weights, of the demo's synthetic trace and of "
        "sampling (each request's seed derives from it and the request id unless a prompt "
        "gives its own; no effect on a --checkpoint's weights); 0..2**63-1 (default 0; "
        "generate with sampling draws a fresh one and prints it)",
    )
    p.add_argument(
        "--check-padding",
        action="store_true",
        help="run the padding sanitizer around every replay (debug mode, slower)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="KV page size in token slots, 1..the run's context (1: one slot per token)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 1..this machine's cores (1: the small models here gain "
        "nothing from more)",
    )

    cli_sampling.add_arguments(g.sampling)  # --temperature, --top-k, --top-p, --min-p
    cli_text.add_context_argument(g.model)
    cli_spec.add_arguments(g.scheduling)
    cli_overlap.add_arguments(g.scheduling)
    cli_multistep.add_arguments(g.scheduling)

"""Every option of a serving command is either the engine's (a field of
:class:`EngineConfig`, which :func:`config_of` fills) or the command line's
own (what is asked, printed or written, and each request's sampling); and
every ``add_argument`` of the command line lives in one module."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import graphrunner_ref
import graphrunner_ref.cli.main as cli
from graphrunner_ref.cli.options import config_of
from graphrunner_ref.engine.config import EngineConfig

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
#: The command line's own options: the prompts, the answers and run outputs,
#: each request's budget, arrival and sampling (a request carries those).
CLI_ONLY = {
    "help",
    "prompt",
    "prompt_text",
    "prompts",
    "prompts_format",
    "chat",
    "stop",
    "ignore_eos",
    "output",
    "json",
    "no_stream",
    "max_new_tokens",
    "arrive_every",
    "end_token",
    "batch_sizes_out",
    "token_sizes_out",
    "capture_report_out",
    "trace_out",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
}
#: Options whose engine field has another name.
RENAMED = {"steps": "max_steps", "max_bs": "capture_sizes"}


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_every_serving_option_is_the_engines_or_the_command_lines(command: str) -> None:
    parser: argparse.ArgumentParser = cli._parser().commands[command]  # type: ignore[attr-defined]
    dests = {a.dest for a in parser._actions}
    unmapped = dests - ENGINE_FIELDS - CLI_ONLY - set(RENAMED)
    assert unmapped == set()
    assert {RENAMED.get(d, d) for d in dests - CLI_ONLY} <= ENGINE_FIELDS


def test_config_of_carries_the_flags() -> None:
    args = cli._parse(
        ["generate", "x", "--page-size", "4", "--overlap", "--steps-per-launch", "2"]
        + ["--logprobs", "3", "--check-padding", "--dtype", "bfloat16"]
    )
    config = config_of(args, "eager", [1, 2])
    assert (config.page_size, config.overlap, config.steps_per_launch) == (4, True, 2)
    assert (config.runner, config.capture_sizes, config.logprobs) == ("eager", (1, 2), 3)
    assert config.check_padding and config.dtype == "bfloat16"
    assert config.model == "embedded" and config.checkpoint is None and config.source == ""


def test_every_add_argument_is_in_the_options_module() -> None:
    root = Path(graphrunner_ref.__file__).parent
    found = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if "add_argument" in p.read_text()
    )
    assert found == ["cli/options.py"]

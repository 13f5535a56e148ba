"""``--help`` as users read it: the top level names every command in plain
text, each command has a summary, a description and examples that parse,
and every option of a serving command sits in a named group."""

from __future__ import annotations

import re
import shlex

import pytest

from graphrunner import __version__
from graphrunner_ref.cli import main as cli
from graphrunner_ref.cli.groups import COMMANDS

GROUPS = ["model", "runner and graphs", "scheduling", "sampling", "prompts", "output"]


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_the_top_level_help_names_every_command_in_plain_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(capsys)
    assert "``" not in text and ":mod:" not in text
    for name, (summary, _, _) in COMMANDS.items():
        assert name in text.split("options:")[0]
        assert " ".join(summary.split()[:4]) in " ".join(text.split())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"graphrunner {__version__}\n"


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_every_serving_option_is_in_a_named_group(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = _help(capsys, command)
    sections = re.split(r"\n(?=[a-z][a-z ]*:\n)", text)
    titled = {s.split(":\n", 1)[0]: s for s in sections if ":\n" in s}
    assert re.findall(r"^  (-[-\w]+)", titled["options"], re.M) == ["-h"]
    groups = [g if command == "generate" or g != "prompts" else "trace" for g in GROUPS]
    assert [t for t in titled if t not in ("options", "examples")] == groups
    for group in groups:
        assert re.search(r"^  --", titled[group], re.M), group


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_shows_its_description_and_examples_that_parse(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = _help(capsys, command)
    _, description, examples = COMMANDS[command]
    assert " ".join(description.split()[:6]) in " ".join(text.split())
    assert "examples:" in text
    for example in examples:
        assert example in text
        argv = shlex.split(example.split(" < ")[0])[1:]
        assert argv[0] == command
        args = cli._parser().parse_args(argv)  # exits 2 on an option that does not exist
        assert args.command == command

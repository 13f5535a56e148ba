"""What vLLM and llama.cpp users type works on ``generate``: a prompt as a
positional argument or ``-p``, ``-n`` / ``--max-tokens`` for
``--max-new-tokens``; an unknown option is reported with the subcommand's
usage; a checkpoint without a tokenizer is named as the user named it."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphrunner_ref.cli import main as cli
from hf_tiny import save_tiny_llama


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hello there", "-n", "3"],
        ["generate", "-p", "hello there", "--max-tokens", "3"],
        ["generate", "--prompt", "hello there", "--max-new-tokens", "3"],
    ],
)
def test_the_short_spellings_mean_the_long_ones(argv: list[str]) -> None:
    args = cli._parse_line(argv)
    assert args.max_new_tokens == 3
    assert [*args.prompt, *args.prompt_text] == ["hello there"]


def test_an_unknown_option_shows_the_subcommands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: graphrunner generate ")
    assert err.rstrip().endswith("graphrunner generate: error: unrecognized arguments: --bogus")


def test_a_text_prompt_without_a_tokenizer_names_the_model_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_llama(tmp_path / "ck")
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(tmp_path / "ck"), "hello", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert f"needs a tokenizer: --model {tmp_path / 'ck'} has none" in err
    assert "--checkpoint" not in err

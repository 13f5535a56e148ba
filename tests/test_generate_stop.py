"""``generate --stop TEXT``: an answer finishes at the first token after which
its text holds a stop string, its text ends before it (printed, streamed and
in the records), ``finish_reason`` is ``"stop"`` with the string in
``"stop_reason"``; bad uses exit 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import graphrunner_ref.cli.main as cli
from gguf_world import tiny_text_checkpoint
from graphrunner_ref.io.stop import StopStrings, cut_at_stop

PROMPT = "hello world, hello graphs"
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "hf"
    tiny_text_checkpoint(path)
    return path


def _argv(ckpt: Path, *extra: str) -> list[str]:
    return [
        "generate", "--checkpoint", str(ckpt), "--runner", "eager", "--ignore-eos",
        "--max-new-tokens", str(NEW), "--prompt", PROMPT, *extra,
    ]  # fmt: skip


def _record(ckpt: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert cli.main(_argv(ckpt, "--json", *extra)) == 0
    [line] = capsys.readouterr().out.splitlines()
    return dict(json.loads(line))


def test_a_stop_string_ends_the_answer_before_it(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    free = _record(ckpt, capsys)
    ids = free["token_ids"]
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    # A stop string that first appears after a few tokens: the end of the
    # text at token 5 (two characters of it, so it is not found sooner).
    n = next(n for n in range(5, len(ids)) if len(texts[n].strip()) >= 2)
    stop = texts[n].strip()[-2:]
    first = next(k for k in range(len(ids) + 1) if stop in texts[k])
    got = _record(ckpt, capsys, "--stop", stop)
    assert got["token_ids"] == ids[:first]  # the generation stopped at that token
    assert got["text"] == texts[first][: texts[first].find(stop)]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop)
    never = _record(ckpt, capsys, "--stop", "\u2603 never \u2603")
    assert never["token_ids"] == ids and never["finish_reason"] == "length"
    assert "stop_reason" not in never
    # The printed (and streamed) answer ends before the stop string too.
    assert cli.main(_argv(ckpt, "--stop", stop)) == 0
    printed = capsys.readouterr().out
    assert printed == f"[0] {got['text'].strip()}\n\n"


def test_stop_strings_cut_at_the_first_one() -> None:
    assert cut_at_stop("abc STOP def END", ["END", "STOP"]) == ("abc ", "STOP")
    assert cut_at_stop("abc", ["x"]) == ("abc", None)

    class Chars:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

    stops = StopStrings(Chars(), ["cd"])
    assert [stops(7, [ord(c) for c in "abc"[: k + 1]]) for k in range(3)] == [False] * 3
    assert stops(7, [ord(c) for c in "abcd"]) and stops.hits == {7: "cd"}
    with pytest.raises(ValueError, match=r"stops=\[''\]: expected non-empty texts"):
        StopStrings(Chars(), [""])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stop", ""], "--stop '': expected a non-empty text"),
        (["--stop", "x", "--speculative", "eagle"], "--stop 'x' with --speculative: expected one"),
    ],
)
def test_bad_stops_exit_2_naming_the_flag(
    ckpt: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert cli.main(_argv(ckpt, *extra)) == 2
    assert message in capsys.readouterr().err


def test_stop_without_a_tokenizer_names_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("[1, 2, 3]\n")
    argv = ["generate", "--runner", "eager", "--prompts", str(prompts), "--stop", "x"]
    assert cli.main(argv) == 2
    assert "--stop 'x': needs the checkpoint's tokenizer" in capsys.readouterr().err

"""``generate``'s output and prompt input: the JSON records of ``--json`` and
``--output`` (against the engine's greedy tokens), the finish reason, the
summary line, text streamed token by token, prompts from stdin and each
``--prompts-format``."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import graphrunner_ref.cli.main as cli
import graphrunner_ref.cli.options as cli_options
from gguf_world import tiny_text_checkpoint
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.postprocess import Postprocess
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.io.text import StreamPrinter, TextCodec
from graphrunner_ref.model import default_model

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4]]
EAGER = ["--runner", "eager", "--capture-sizes", "1,2,4"]
NEW = 6


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "hf"
    tiny_text_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def greedy() -> list[list[int]]:
    """The engine's greedy tokens of ``PROMPTS``, ``NEW`` each."""
    bundle = default_model(max_requests=4)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    outputs = Engine(bundle, runner).run(requests_from_prompts(PROMPTS, max_new_tokens=NEW))
    return [outputs.outputs[i] for i in range(len(PROMPTS))]


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    assert cli.main(["generate", *argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_json_and_output_give_one_exact_record_per_request(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], greedy: list[list[int]]
) -> None:
    argv = ["--prompts", str(prompts_file), "--max-new-tokens", str(NEW), *EAGER]
    expected = [
        {
            "index": i,
            "prompt_token_ids": list(p),
            "token_ids": greedy[i],
            "finish_reason": "length",
            "prompt_tokens": len(p),
            "completion_tokens": NEW,
        }
        for i, p in enumerate(PROMPTS)
    ]
    out, _ = _run(capsys, *argv, "--json")
    assert _lines(out) == expected
    out, _ = _run(capsys, *argv)  # no tokenizer: the records are the default
    assert _lines(out) == expected
    path = tmp_path / "out.jsonl"
    out, _ = _run(capsys, *argv, "--output", str(path))
    assert out == ""
    assert _lines(path.read_text()) == expected


def test_finish_reason_is_stop_at_the_end_token_and_length_at_the_budget(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], greedy: list[list[int]]
) -> None:
    end = greedy[0][2]
    argv = ["--prompts", str(prompts_file), "--max-new-tokens", str(NEW), *EAGER, "--json"]
    out, _ = _run(capsys, *argv, "--end-token", str(end))
    records = _lines(out)
    for record, free in zip(records, greedy, strict=True):
        cut = free[: free.index(end) + 1] if end in free else free
        assert record["token_ids"] == cut
        assert record["completion_tokens"] == len(cut)
        assert record["finish_reason"] == ("stop" if end in free else "length")
    assert records[0]["finish_reason"] == "stop" and len(records[0]["token_ids"]) <= 3
    assert any(r["finish_reason"] == "length" for r in records)


def test_summary_line_counts_the_run_and_quiet_drops_it(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    three = prompts_file.parent / "three.jsonl"
    three.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
    argv = ["--prompts", str(three), "--max-new-tokens", "4", "--runner", "cpu"]
    _, err = _run(capsys, *argv, "--capture-sizes", "4")
    # 3 live rows in a graph of 4 on each of the 3 decode steps: 1 padded row
    # in 4, and one launch and one read back a step for 9 decode tokens.
    match = re.fullmatch(
        r"generate: 3 requests, 12 prompt tokens, 12 generated tokens, "
        r"decode ([0-9,]+\.\d) tokens/s \(([0-9,]+\.\d) timing whole steps\), "
        r"padded rows 25\.0%, prefix cache hit rate 0\.0% \(0/12\), "
        r"capture \d+\.\d s \((cold|warm) start\), "
        r"0\.333 launches and 0\.333 syncs per token\n",
        err,
    )
    assert match is not None, err
    # Whole steps hold the replays and more: never faster.
    replays, whole = (float(match.group(i).replace(",", "")) for i in (1, 2))
    assert whole <= replays, err
    _, err = _run(capsys, *argv, "--capture-sizes", "4", "--quiet")
    assert err == ""


def _text_argv(ckpt: Path, *extra: str) -> list[str]:
    return ["--checkpoint", str(ckpt), "--runner", "eager", "--max-new-tokens", "8", *extra]


def test_text_streams_token_by_token_before_the_request_finishes(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, Any]] = []

    record_token = Postprocess.record_token

    def recorded(self: Postprocess, run: Any, req: Any, token: int) -> bool:
        events.append(("token", req.request.rid))
        return record_token(self, run, req, token)

    class Out(io.StringIO):
        def write(self, s: str) -> int:
            events.append(("write", s))
            return super().write(s)

    monkeypatch.setattr(Postprocess, "record_token", recorded)
    texts = ["hello world, hello graphs", "what is the capital of france?"]
    argv = _text_argv(ckpt, "--ignore-eos", "--prompt", texts[0], "--prompt", texts[1])
    outputs = {}
    for mode in ("stream", "no-stream"):
        events.clear()
        monkeypatch.setattr(sys, "stdout", Out())
        assert cli.main(["generate", *argv, *(["--no-stream"] if mode == "no-stream" else [])]) == 0
        outputs[mode] = sys.stdout.getvalue()
        tokens_of_0 = [i for i, e in enumerate(events) if e == ("token", 0)]
        writes = [i for i, e in enumerate(events) if e[0] == "write" and e[1]]
        early = [i for i in writes if i < tokens_of_0[-1]]
        if mode == "stream":  # text of request 0 out while it still generates
            assert len(early) >= 2
            assert "".join(events[i][1] for i in early).startswith("[0] ")
        else:
            assert early == []
    assert outputs["stream"] == outputs["no-stream"]
    assert outputs["stream"].startswith("[0] ") and "\n\n[1] " in outputs["stream"]


def test_text_records_carry_the_decoded_text(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    out, _ = _run(capsys, *_text_argv(ckpt, "--ignore-eos", "--json", "--prompt", "hello"))
    [record] = _lines(out)
    assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    assert record["prompt_tokens"] == len(tokenizer("hello")["input_ids"])
    assert record["prompt"] == "hello"  # vLLM's names: the text, its ids, the answer's
    assert record["prompt_token_ids"] == tokenizer("hello")["input_ids"]
    assert list(record) == [
        "index",
        "prompt",
        "prompt_token_ids",
        "text",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
    ]


def test_prompts_from_stdin(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--max-new-tokens", "3", *EAGER, "--json"]
    from_file, _ = _run(capsys, "--prompts", str(prompts_file), *argv)
    stdin = io.TextIOWrapper(io.BytesIO(prompts_file.read_bytes()))
    monkeypatch.setattr(sys, "stdin", stdin)
    from_stdin, _ = _run(capsys, "--prompts", "-", *argv)
    assert from_stdin == from_file
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"[1, 2]\n[3, 256]\n")))
    assert cli.main(["generate", "--prompts", "-", *argv]) == 2
    assert capsys.readouterr().err == (
        "graphrunner generate: error: <stdin>:2: token 1 = 256 is not a token id in 0..255\n"
    )


INST = "[INST] What is 2+2? [/INST]"


@pytest.mark.parametrize(
    "line, fmt",
    [
        (INST, "auto"),  # not JSON: text
        ('{"question": "hi"}', "auto"),  # JSON of another shape: text
        ("[1, 2]", "text"),
        (json.dumps({"prompt": "two\nlines", "max_new_tokens": 5}), "jsonl"),
    ],
)
def test_a_prompt_line_reads_as_the_text_it_is(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, fmt: str
) -> None:
    text = json.loads(line)["prompt"] if fmt == "jsonl" else line
    new = "5" if fmt == "jsonl" else "8"
    base = ["--checkpoint", str(ckpt), "--runner", "eager", "--max-new-tokens", new, "--json"]
    path = tmp_path / "prompts.txt"
    path.write_text(line + "\n")
    from_file, _ = _run(capsys, *base, "--prompts", str(path), "--prompts-format", fmt)
    by_flag, _ = _run(capsys, *base, "--prompt", text)
    assert from_file == by_flag
    assert _lines(from_file)[0]["prompt_tokens"] > 2


@pytest.mark.parametrize(
    "fmt, content, message",
    [
        ("ids", f"[1, 2]\n{INST}\n", "prompts.txt:2: not valid JSON"),
        ("ids", '[1, 2]\n{"prompt": [1]}\n', "prompts.txt:2: expected a non-empty JSON list"),
        ("jsonl", '{"prompt": [1]}\n[1, 2]\n', 'prompts.txt:2: expected a JSON object with a "p'),
        ("jsonl", '{"prompt": [1]}\n{"prompt": 3}\n', "prompts.txt:2: expected a non-empty"),
    ],
)
def test_ids_and_jsonl_refuse_a_bad_line_naming_it(
    ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    content: str,
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    path = tmp_path / "prompts.txt"
    path.write_text(content)
    argv = [*_text_argv(ckpt), "--prompts", str(path), "--prompts-format", fmt]
    assert cli.main(["generate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"graphrunner generate: error: {path.parent}/{message}")


def test_ids_format_reads_token_ids_as_auto_does(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--prompts", str(prompts_file), "--max-new-tokens", "3", *EAGER, "--json"]
    auto, _ = _run(capsys, *argv)
    ids, _ = _run(capsys, *argv, "--prompts-format", "ids")
    assert ids == auto


def test_the_default_budget_leaves_room_for_an_answer() -> None:
    args = cli._parser().parse_args(["generate", "--prompt", "hi"])
    assert args.max_new_tokens == cli_options.DEFAULT_NEW_TOKENS == 128


class _Letters(TextCodec):
    """A codec stand-in: token i decodes to letter i, token 0 to a space."""

    def __init__(self) -> None:
        super().__init__(None)

    def decode(self, ids: list[int]) -> str:
        return "".join(" " if i == 0 else chr(96 + i) for i in ids)


def test_stream_printer_prints_in_prompt_order_holding_back_trailing_spaces() -> None:
    out = io.StringIO()
    printer = StreamPrinter(_Letters(), [0, 1], out)
    seen = []
    for rid, token in [(0, 0), (0, 1), (1, 3), (0, 0), (1, 4)]:
        printer.token(rid, token)
        seen.append(out.getvalue())
    printer(1, [3, 4])  # request 1 finishes first: it waits for request 0
    seen.append(out.getvalue())
    printer.token(0, 2)
    printer(0, [0, 1, 0, 2])
    assert seen == ["", "[0] a", "[0] a", "[0] a", "[0] a", "[0] a"]
    assert out.getvalue() == "[0] a b\n\n[1] cd\n\n"
    printer.close({0: [0, 1, 0, 2], 1: [3, 4]})  # nothing left to print
    assert out.getvalue() == "[0] a b\n\n[1] cd\n\n"

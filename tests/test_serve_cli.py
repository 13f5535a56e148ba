"""``graphrunner serve`` as a command: the server stack stays unloaded by a
bare import, a missing extra stops with one line naming it, options are
refused before any model work; and ``generate`` interrupted while it streams
text ends its last line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.io.text import StreamPrinter

ROOT = Path(__file__).resolve().parents[1]
STACK = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client")


def test_imports_load_no_server_package() -> None:
    code = (
        "import json, sys, graphrunner, graphrunner_ref, graphrunner_ref.cli.main; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = {m.split(".")[0] for m in json.loads(done.stdout)}
    assert not loaded & set(STACK)
    assert "graphrunner_ref.serve" not in json.loads(done.stdout)


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "prometheus_client"])
def test_a_missing_extra_stops_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], missing: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ModuleNotFoundError
    assert cli.main(["serve", "--runner", "eager"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert missing in err[0] and "pip install 'graphrunner[serve]'" in err[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-waiting", "0"], ["--max-waiting 0", "1..1000000"]),
        (["--port", "70000"], ["--port 70000", "0..65535"]),
        (["--shutdown-timeout", "-1"], ["--shutdown-timeout -1", "seconds"]),
        (["--request-timeout", "0"], ["--request-timeout 0"]),
        (["--tp", "2"], ["--tp 2 with serve"]),
        (["--speculative", "eagle"], ["--speculative eagle with serve"]),
        (["embedded", "--model", "embedded-1.1b"], ["two different models"]),
        (["--logprobs", "99"], ["--logprobs 99"]),
    ],
)
def test_bad_options_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    assert cli.main(["serve", "--runner", "eager", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_a_taken_port_is_refused_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--runner", "eager", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen there" in err
    assert "capture" not in err


def test_the_positional_model_is_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli._parse(["serve", "embedded-1.1b"])
    assert args.model == "embedded-1.1b" and args.checkpoint is None


class _Codec:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_an_interrupted_stream_ends_its_line() -> None:
    import io

    out = io.StringIO()
    printer = StreamPrinter(_Codec(), [0, 1], out=out)  # type: ignore[arg-type]
    printer.end_line()
    assert out.getvalue() == ""  # nothing started: nothing to end
    printer.token(0, 1)
    printer.token(0, 2)
    printer.end_line()
    assert out.getvalue() == "[0] bc\n\n"  # the record whole: its blank line too
    printer.end_line()
    assert out.getvalue() == "[0] bc\n\n"  # ended once


class _Blank(_Codec):
    def decode(self, ids: list[int]) -> str:
        return " " * len(ids)  # text that strips to nothing


def test_a_header_waits_for_its_text_so_an_interrupt_never_leaves_one_alone() -> None:
    import io

    out = io.StringIO()
    printer = StreamPrinter(_Blank(), [0], out=out)  # type: ignore[arg-type]
    printer.token(0, 1)
    assert out.getvalue() == ""  # no text yet: no header either
    printer.end_line()
    assert out.getvalue() == ""
    printer(0, [1])
    assert out.getvalue() == "[0] \n\n"  # an empty answer is still one whole record


def test_generate_interrupted_mid_stream_ends_the_record_with_its_newline(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from gguf_world import tiny_text_checkpoint

    ckpt = tmp_path_factory.mktemp("interrupt") / "hf"
    tiny_text_checkpoint(ckpt)
    calls = []
    original = StreamPrinter.token

    def token(self: StreamPrinter, rid: int, tok: int) -> None:
        original(self, rid, tok)
        calls.append(tok)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C held to the step boundary

    monkeypatch.setattr(StreamPrinter, "token", token)
    argv = ["generate", "--model", str(ckpt), "--prompt", "hello world", "--ignore-eos"]
    assert cli.main([*argv, "--runner", "eager", "--max-new-tokens", "20"]) == 130
    out = capsys.readouterr().out
    assert out.startswith("[0] ") and out.endswith("\n\n"), repr(out)

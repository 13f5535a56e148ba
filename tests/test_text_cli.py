"""Text in, text out: ``generate --prompt/--prompts/--chat`` through the
checkpoint's own tokenizer, against its token-id twin and transformers'
``apply_chat_template``; stopping at the end-of-sequence token; answers
streamed as they are generated; text refused without a tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import graphrunner_ref.cli.main as cli
from gguf_world import tiny_text_checkpoint
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.model import default_model
from hf_tiny import save_tiny_llama

EAGER = ["--runner", "eager", "--max-new-tokens", "10"]
TEXTS = ["hello world, hello graphs", "what is the capital of france?"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "hf"
    tiny_text_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(ckpt)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def _tokens(out: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def _ids_file(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def test_text_prompts_give_the_tokens_of_their_token_id_twins(
    ckpt: Path, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["generate", "--checkpoint", str(ckpt), *EAGER, "--json", "--ignore-eos"]
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    twin = _tokens(_run([*base, "--prompts", str(_ids_file(tmp_path / "ids", ids))], capsys))
    by_flag = _run([*base, "--prompt", TEXTS[0], "--prompt", TEXTS[1]], capsys)
    assert _tokens(by_flag) == twin
    # A file mixing a text line and a token-id line reads each as what it is.
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(f"{TEXTS[0]}\n\n{json.dumps(ids[1])}\n")
    assert _tokens(_run([*base, "--prompts", str(mixed)], capsys)) == twin
    assert all(len(t) == 10 for t in twin)


def test_chat_applies_the_checkpoint_template_as_transformers_does(
    ckpt: Path, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = [[{"role": "user", "content": t}] for t in TEXTS]
    expected = [
        tokenizer.apply_chat_template(
            m, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for m in messages
    ]
    codec = TextCodec.load(ckpt, what="--chat")
    assert [codec.chat(t) for t in TEXTS] == expected
    assert expected[0] != tokenizer(TEXTS[0])["input_ids"]  # the template did something
    base = ["generate", "--checkpoint", str(ckpt), *EAGER, "--json", "--ignore-eos"]
    twin = _tokens(_run([*base, "--prompts", str(_ids_file(tmp_path / "ids", expected))], capsys))
    chat = _run([*base, "--chat", "--prompt", TEXTS[0], "--prompt", TEXTS[1]], capsys)
    assert _tokens(chat) == twin


def test_generation_stops_at_the_tokenizers_end_token(
    ckpt: Path, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    free = _tokens(
        _run(
            [
                "generate",
                "--checkpoint",
                str(ckpt),
                *EAGER,
                "--json",
                "--ignore-eos",
                "--prompt",
                TEXTS[1],
            ],
            capsys,
        )
    )[0]
    # Make the fourth greedy token the end token: a copy whose tokenizer names it EOS.
    end = free[3]
    first = free.index(end)
    copy = tmp_path / "eos"
    shutil.copytree(ckpt, copy)
    cfg_file = copy / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token"] = tokenizer.convert_ids_to_tokens(end)
    cfg_file.write_text(json.dumps(cfg))
    assert TextCodec.load(copy, what="test").eos_token_id == end
    stopped = _tokens(
        _run(
            ["generate", "--checkpoint", str(copy), *EAGER, "--json", "--prompt", TEXTS[1]], capsys
        )
    )
    assert stopped == [free[: first + 1]]
    assert first + 1 < len(free)
    # Text output: the answer decoded without the end token, prefixed by the request id.
    text = _run(["generate", "--checkpoint", str(copy), *EAGER, "--prompt", TEXTS[1]], capsys)
    answer = tokenizer.decode(free[:first], skip_special_tokens=True).strip()
    assert text == f"[0] {answer}\n\n"


def test_text_output_decodes_each_answer(
    ckpt: Path, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["generate", "--checkpoint", str(ckpt), *EAGER, "--ignore-eos"]
    tokens = _tokens(_run([*base, "--json", "--prompt", TEXTS[0], "--prompt", TEXTS[1]], capsys))
    text = _run([*base, "--prompt", TEXTS[0], "--prompt", TEXTS[1]], capsys)
    decoded = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    assert text == f"[0] {decoded[0]}\n\n[1] {decoded[1]}\n\n"
    out = tmp_path / "answers.jsonl"
    assert _run([*base, "--prompt", TEXTS[0], "--output", str(out)], capsys) == ""
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["token_ids"] == tokens[0]
    assert record["text"] == tokenizer.decode(tokens[0], skip_special_tokens=True)


def test_engine_reports_each_request_as_it_finishes() -> None:
    bundle = default_model(max_requests=2)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    runner.capture()
    seen: list[tuple[int, list[int]]] = []
    engine = Engine(bundle, runner, on_finish=lambda rid, toks: seen.append((rid, list(toks))))
    result = engine.run([Request(0, (1, 2, 3), 6, 0), Request(1, (4, 5), 2, 0)])
    assert [rid for rid, _ in seen] == [1, 0]  # the shorter budget finishes first
    assert dict(seen) == result.outputs


@pytest.mark.parametrize("model", ["embedded", "no-tokenizer"])
def test_text_without_a_tokenizer_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    argv = ["generate", *EAGER, "--output", str(tmp_path / "out.txt")]
    if model == "no-tokenizer":
        save_tiny_llama(tmp_path / "ck")
        capsys.readouterr()  # transformers' save progress bar
        argv += ["--checkpoint", str(tmp_path / "ck")]
        name = f"--checkpoint {tmp_path / 'ck'}"
    else:
        name = "the embedded random model"
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    for extra, what in [
        (["--prompt", "hi"], "--prompt"),
        (["--chat", "--prompts", str(_ids_file(tmp_path / "p", [[1]]))], "--chat"),
    ]:
        assert cli.main([*argv, *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (
            f"graphrunner generate: error: {what} needs a tokenizer: {name} has none (expected one "
            "of tokenizer.json, tokenizer.model, vocab.json); give token ids instead (a JSON list "
            "per line)\n"
        )
    assert not (tmp_path / "out.txt").exists()


def test_generate_without_prompts_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", *EAGER]) == 2
    assert capsys.readouterr().err == (
        "graphrunner generate: error: generate needs a prompt: PROMPT, --prompt TEXT or --prompts FILE\n"
    )

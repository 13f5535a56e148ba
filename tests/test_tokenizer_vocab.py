"""A tokenizer whose vocabulary is larger than its model's is refused when the
two are paired, before any model is built or any step runs: one
``TokenizerVocabError`` naming the tokenizer file, its size and the model's
``vocab_size``; exit 2 with one line on the CLI (``generate``, ``demo-real``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import graphrunner_ref.cli.demo_real as demo_real
import graphrunner_ref.cli.main as cli
from gguf_world import tiny_text_checkpoint
from graphrunner_ref.engine import serving
from graphrunner_ref.io import read_config
from graphrunner_ref.io.text import TextCodec, TokenizerVocabError
from hf_tiny import save_tiny_llama

EAGER = ["--runner", "eager", "--max-new-tokens", "2"]


def oversized_tokenizer_checkpoint(root: Path) -> tuple[Path, Path]:
    """``(text, oversized)``: a checkpoint whose tokenizer fits its model, and
    a loadable vocab-256 model carrying that same (larger) tokenizer."""
    text, oversized = root / "text", root / "oversized"
    tiny_text_checkpoint(text)
    save_tiny_llama(oversized)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (text / name).is_file():
            shutil.copy(text / name, oversized / name)
    return text, oversized


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return oversized_tokenizer_checkpoint(tmp_path_factory.mktemp("vocab"))


def _message(ckpt: Path) -> str:
    tokens = len(AutoTokenizer.from_pretrained(ckpt))  # transformers' own count
    model = read_config(ckpt).vocab_size
    return (
        f"tokenizer {ckpt / 'tokenizer.json'}: a vocabulary of {tokens} tokens (ids 0.."
        f"{tokens - 1}), more than the model's vocab_size {model}; expected at most {model}: "
        f"ids past {model - 1} have no embedding"
    )


def test_the_api_refuses_a_tokenizer_larger_than_the_model(ckpts: tuple[Path, Path]) -> None:
    text, oversized = ckpts
    assert read_config(oversized).vocab_size == 256
    with pytest.raises(TokenizerVocabError) as caught:
        TextCodec.load(oversized, what="--prompt", vocab_size=256)
    assert str(caught.value) == _message(oversized)
    # The boundary: a tokenizer exactly the model's size, or smaller, loads.
    size = len(AutoTokenizer.from_pretrained(text))
    assert read_config(text).vocab_size == size
    assert TextCodec.load(text, what="--prompt", vocab_size=size).vocab_size == size
    with pytest.raises(TokenizerVocabError, match=f"more than the model's vocab_size {size - 1}"):
        TextCodec.load(text, what="--prompt", vocab_size=size - 1)


@pytest.mark.parametrize("prompts", ["text", "token ids"])
def test_generate_exits_2_with_one_line_before_building_a_model(
    ckpts: tuple[Path, Path],
    prompts: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, oversized = ckpts
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    out = tmp_path / "out.txt"
    argv = ["generate", "--checkpoint", str(oversized), *EAGER, "--output", str(out)]
    if prompts == "text":
        argv += ["--prompt", "hello world"]
    else:  # ids inside the model's vocabulary: the tokenizer is still paired with it
        (tmp_path / "ids").write_text(json.dumps([1, 2, 3]) + "\n")
        argv += ["--prompts", str(tmp_path / "ids")]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"graphrunner generate: error: {_message(oversized)}\n"
    assert not out.exists()


def test_demo_real_exits_2_before_loading_the_model(
    ckpts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, oversized = ckpts
    monkeypatch.setattr(demo_real, "fetch_gguf", lambda root: oversized)

    def no_load(*args: Any, **kwargs: Any) -> None:
        pytest.fail("loaded the model")

    monkeypatch.setattr(demo_real, "load_model", no_load)
    assert demo_real.main(["--runner", "eager"]) == 2
    assert capsys.readouterr().err == f"demo-real: error: {_message(oversized)}\n"

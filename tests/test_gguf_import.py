"""GGUF import: a tiny GGUF written with the ``gguf`` package's writer converts
to the weights it was made from (exactly for F32 and F16, within the
quantisation's error otherwise), its tokenizer round-trips, it generates the
tokens of the safetensors checkpoint it was made from, and bad files fail
with one line, exit 2 and nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import graphrunner_ref.cli.main as cli
from gguf_world import CORPUS, tiny_text_checkpoint, write_gguf
from graphrunner_ref.io import (
    load_any,
    read_any_config,
    read_config,
    resolve_checkpoint,
    state_space_kind,
)
from graphrunner_ref.io.checkpoint import load_any_model, load_model, read_weights
from graphrunner_ref.io.gguf_cache import CACHE_ENV, converted_dir
from graphrunner_ref.io.gguf_import import (
    SUPPORTED_TYPES,
    open_gguf,
    read_gguf_weights,
    unpermute_qk,
)
from graphrunner_ref.model import ModelBundle


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_text_checkpoint(root / "hf")
    written = write_gguf(model, root / "hf", root / "tiny.gguf")
    lossless = {k: "F32" for k in ("attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    write_gguf(model, root / "hf", root / "lossless.gguf", types={**lossless, "ffn_up": "Q8_0"})
    assert (
        cli.main(["convert", "--gguf", str(root / "tiny.gguf"), "--out", str(root / "conv")]) == 0
    )
    return {"root": root, "model": model, "written": written}


def _block_absmax(w: np.ndarray) -> np.ndarray:
    """Per 32-wide block of each row, the largest |value|, broadcast back."""
    blocks = np.abs(w.reshape(w.shape[0], -1, 32)).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks, (w.shape[0], w.shape[1] // 32, 32)).reshape(w.shape)


def test_converted_weights_equal_the_originals_within_the_quantisation_error(
    world: dict[str, Any],
) -> None:
    weights = read_weights(world["root"] / "conv")
    assert set(weights) == set(world["written"])
    kinds = set()
    for name, (qtype, original) in world["written"].items():
        got = weights[name].numpy()
        assert got.dtype == np.float32 and got.shape == original.shape, name
        kinds.add(qtype)
        if qtype == "F32":
            np.testing.assert_array_equal(got, original, err_msg=name)
        elif qtype == "F16":
            np.testing.assert_array_equal(got, original.astype(np.float16).astype(np.float32))
        else:
            # Per 32-block of absmax a: Q8_0 rounds x / d, d = a / 127, to an int:
            # error d / 2; Q4_0 (d = a / 8) may clip the value opposite the absmax
            # by a step: error d; Q4_1 (d = (max - min) / 15 <= 2a / 15, offset
            # min) rounds: d / 2. Scales and offsets are stored as f16 (relative
            # error 2**-11), which the largest quant (127, 8, 15) multiplies.
            a = _block_absmax(original)
            d, rounding, qmax, offset = {
                "Q8_0": (a / 127, 0.5, 127, 0),
                "Q4_0": (a / 8, 1.0, 8, 0),
                "Q4_1": (2 * a / 15, 0.5, 15, 1),
            }[qtype]
            bound = d * rounding + (qmax * d + offset * a) * 2**-11 + 1e-7
            assert (np.abs(got - original) <= bound).all(), name
            assert not np.array_equal(got, original), f"{name}: {qtype} should be lossy"
    assert kinds == {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"}


def test_unpermute_inverts_llama_cpp_rotary_row_order() -> None:
    heads, head_dim = 3, 8
    w = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2)
    # GGUF row 2j + p of a head holds HF row p * head_dim / 2 + j.
    gguf_rows = [
        h * head_dim + p * head_dim // 2 + j for h in range(3) for j in range(4) for p in (0, 1)
    ]
    assert torch.equal(unpermute_qk(w[gguf_rows], heads), w)


def test_tokenizer_from_gguf_metadata_encodes_and_templates_as_the_original(
    world: dict[str, Any],
) -> None:
    original = AutoTokenizer.from_pretrained(world["root"] / "hf")
    converted = AutoTokenizer.from_pretrained(world["root"] / "conv")
    for text in [*CORPUS[:4], "unseen words: zebra 9876!", " leading space"]:
        assert converted(text)["input_ids"] == original(text)["input_ids"], text
        ids = converted(text)["input_ids"]
        assert converted.decode(ids) == original.decode(ids)
    chat = [{"role": "user", "content": "what is the capital of france?"}]
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    assert converted.apply_chat_template(chat, **kwargs) == original.apply_chat_template(
        chat, **kwargs
    )
    assert converted.eos_token_id == original.eos_token_id
    config = json.loads((world["root"] / "conv" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 2


def _generate(
    checkpoint: Path, prompts: Path, capsys: pytest.CaptureFixture[str], runner: str = "eager"
) -> list[Any]:
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--json"]
    assert cli.main([*argv, "--runner", runner, "--max-new-tokens", "12", "--ignore-eos"]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def test_gguf_checkpoint_generates_the_tokens_of_its_safetensors_source(
    world: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2, 3]\n[200, 17]\n[5, 6, 7, 8, 9, 10]\n")
    source = _generate(world["root"] / "hf", prompts, capsys)
    # --checkpoint FILE.gguf: converted into the cache once, then reused.
    gguf_file = world["root"] / "lossless.gguf"
    assert _generate(gguf_file, prompts, capsys) == source
    assert (converted_dir(gguf_file) / "config.json").is_file()
    assert converted_dir(gguf_file).parent.parent == tmp_path / "cache"
    assert _generate(gguf_file, prompts, capsys) == source
    # The library loader takes the .gguf too, from the same cache entry.
    bundle = load_model(gguf_file, max_requests=1, max_context_len=16)
    embed = read_weights(converted_dir(gguf_file))["model.embed_tokens.weight"]
    assert torch.equal(bundle.model.state_dict()["model.embed_tokens.weight"], embed)
    # So does the loader that dispatches on the architecture (GGUF: a Llama).
    bundle = load_any_model(gguf_file, max_requests=1, max_context_len=16)
    assert torch.equal(bundle.model.state_dict()["model.embed_tokens.weight"], embed)
    # One GGUF entry point and one dispatcher, shared by the CLI and the library.
    assert resolve_checkpoint(gguf_file) == converted_dir(gguf_file)
    assert state_space_kind(gguf_file) is None
    assert read_any_config(gguf_file) == read_config(converted_dir(gguf_file))
    bundle = load_any(gguf_file, max_requests=1, max_context_len=16)
    assert isinstance(bundle, ModelBundle)
    assert torch.equal(bundle.model.state_dict()["model.embed_tokens.weight"], embed)


@pytest.mark.cuda
def test_gguf_checkpoint_chat_through_the_cuda_runner_gives_the_eager_tokens(
    world: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    prompts = tmp_path / "chat.txt"
    prompts.write_text("what is the capital of france?\nhello world\n[5, 6, 7]\n")
    gguf_file = world["root"] / "tiny.gguf"
    eager = _generate(gguf_file, prompts, capsys)
    assert _generate(gguf_file, prompts, capsys, runner="cuda") == eager


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def test_bad_gguf_files_exit_2_with_one_line_and_write_nothing(
    world: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = (world["root"] / "tiny.gguf").read_bytes()
    cases = {
        "missing.gguf": (None, "not found"),
        "truncated.gguf": (good[: len(good) // 2], "cannot be read|not a readable GGUF"),
        "header.gguf": (good[:20], "not a readable GGUF"),
        "text.gguf": (b"hello, not a gguf file\n", "not a readable GGUF"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        out = tmp_path / f"out-{name}"
        err = _refused(["convert", "--gguf", str(path), "--out", str(out)], capsys)
        assert err.startswith(f"graphrunner convert: error: --gguf {path}: ")
        assert re.search(message, err), err
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n in cases if n != "missing.gguf"
    )
    # As --checkpoint: the same one line, and nothing in the cache.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    for name in ("truncated.gguf", "text.gguf"):
        argv = [
            "generate",
            "--checkpoint",
            str(tmp_path / name),
            "--prompt",
            "hi",
            "--runner",
            "eager",
        ]
        assert _refused(argv, capsys).startswith("graphrunner generate: error: ")
    assert not (tmp_path / "cache").exists()


def test_unsupported_architecture_and_tensor_type_are_named(
    world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, hf = world["model"], world["root"] / "hf"
    write_gguf(model, hf, tmp_path / "mamba.gguf", arch="mamba")
    err = _refused(
        ["convert", "--gguf", str(tmp_path / "mamba.gguf"), "--out", str(tmp_path / "a")], capsys
    )
    assert "GGUF architecture 'mamba' is not supported; expected 'llama'" in err
    write_gguf(model, hf, tmp_path / "i8.gguf", types={"ffn_up": "I8"})
    err = _refused(
        ["convert", "--gguf", str(tmp_path / "i8.gguf"), "--out", str(tmp_path / "b")], capsys
    )
    assert "GGUF tensor 'blk.0.ffn_up.weight' has type I8, which is not supported" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # The ternary and I-quant types gguf knows are refused the same way.
    assert gguf.GGMLQuantizationType.TQ2_0.name not in SUPPORTED_TYPES


def test_convert_refuses_a_non_empty_out_directory(
    world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err = _refused(
        ["convert", "--gguf", str(world["root"] / "tiny.gguf"), "--out", str(tmp_path / "out")],
        capsys,
    )
    assert "exists and is not an empty directory" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_k_quant_tensors_dequantise_to_their_ggml_shape(tmp_path: Path) -> None:
    """Q4_K and Q6_K (256-wide super-blocks; gguf has no quantiser for them):
    seeded block bytes with sane f16 scales, read back at the transformers
    shape with gguf's own dequantisation of the same bytes."""
    rng = np.random.default_rng(0)
    rows, cols = 8, 512
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    blocks: dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]] = {}
    for layer, (qtype, scale_at) in enumerate(
        [(gguf.GGMLQuantizationType.Q4_K, (0, 2)), (gguf.GGMLQuantizationType.Q6_K, (208,))]
    ):
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
        for at in scale_at:  # d (and dmin): f16 0.01, not random NaN/inf bit patterns
            raw[..., at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        raw = raw.reshape(rows, -1)
        name = f"blk.{layer}.ffn_down.weight"
        writer.add_tensor(name, raw, raw_dtype=qtype)
        blocks[name] = (qtype, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(tmp_path / "k.gguf")
    got = read_gguf_weights(reader, {"num_attention_heads": 4, "num_key_value_heads": 2})
    for layer, (name, (qtype, raw)) in enumerate(blocks.items()):
        weight = got[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert weight.shape == (rows, cols) and weight.dtype == torch.float32
        expected = gguf.quants.dequantize(raw, qtype)
        np.testing.assert_array_equal(weight.numpy(), expected)
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0, name

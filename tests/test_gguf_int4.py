"""GGUF's Q4_0 / Q4_1 / Q4_K blocks as int4 weights, codes kept: each
dequantizes to the ``gguf`` package's own dequantization bit for bit, a model
quantized with them runs the file's weights (the other types requantized from
floats), and ``generate --model FILE.gguf --quantize int4`` says which it did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

import graphrunner_ref.cli.main as cli
from gguf_world import tiny_text_checkpoint, write_gguf
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_import import open_gguf, read_gguf_weights
from graphrunner_ref.io.gguf_int4 import INT4_TYPES, blocks_as_int4, read_gguf_int4
from graphrunner_ref.model.int4_linear import Int4Linear, Int4Weight, dequantize_int4
from graphrunner_ref.model.quantize import quantize_model

ALL_Q4 = {k: "Q4_1" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate")} | {
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_0",
}
# Offsets of each type's float16 scale (and offset) inside a block.
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random code bytes with random but finite float16 scales, ``[rows, bytes]``."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        raw[..., at : at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", INT4_TYPES)
def test_blocks_dequantize_to_ggufs_own_weights_bit_for_bit(kind: str) -> None:
    rows, cols = 6, 512
    raw = _random_blocks(kind, rows, cols, seed=len(kind))
    weight = blocks_as_int4(raw, kind, rows)
    assert weight.packed.shape == (rows, cols // 2) and weight.packed.dtype == torch.uint8
    assert weight.scales.shape == weight.mins.shape == (rows, cols // 32)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got = dequantize_int4(*weight, cols).numpy()
    np.testing.assert_array_equal(got, expected)
    assert np.abs(expected).max() > 0


def test_an_unknown_block_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kind='Q8_0': expected one of Q4_0, Q4_1, Q4_K"):
        blocks_as_int4(np.zeros((1, 34), np.uint8), "Q8_0", 1)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gguf-int4")
    model = tiny_text_checkpoint(root / "hf")
    write_gguf(model, root / "hf", root / "q4.gguf", types=ALL_Q4)
    # The default mix: q F32, k F16, v / up Q8_0, o / down Q4_0, gate Q4_1.
    write_gguf(model, root / "hf", root / "mixed.gguf")
    return {"root": root, "layers": model.config.num_hidden_layers}


def test_read_codes_equal_the_float_import_of_the_same_file(files: dict[str, Any]) -> None:
    path = files["root"] / "q4.gguf"
    reader = open_gguf(path)
    floats = read_gguf_weights(reader, {"num_attention_heads": 4, "num_key_value_heads": 2})
    codes = read_gguf_int4(path, reader)
    assert len(codes) == 7 * files["layers"]
    for name, weight in codes.items():
        expected = floats[name]  # dequantized, Q and K rows unpermuted
        got = dequantize_int4(*weight, expected.shape[1])
        assert torch.equal(got, expected), name


def _stacked(bundle: Any, layer: int) -> dict[str, Int4Linear]:
    block = bundle.model.model.layers[layer]
    return {
        "qkv": block.self_attn.qkv_proj,
        "o": block.self_attn.o_proj,
        "gate_up": block.mlp.gate_up_proj,
        "down": block.mlp.down_proj,
    }


def test_a_model_takes_the_files_codes_and_requantizes_the_rest(files: dict[str, Any]) -> None:
    path = files["root"] / "mixed.gguf"
    floats = read_gguf_weights(
        open_gguf(path), {"num_attention_heads": 4, "num_key_value_heads": 2}
    )
    codes = read_gguf_int4(path)
    assert {n.split(".", 3)[3] for n in codes} == {
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.down_proj.weight",
    }
    bundle = load_model(path, max_requests=2, max_context_len=32)
    quantize_model(bundle.model, "int4", codes=codes)
    for layer in range(files["layers"]):
        p = f"model.layers.{layer}."
        linears = _stacked(bundle, layer)
        gate_up = linears["gate_up"].dequantized()
        inter = gate_up.shape[0] // 2
        # From the file: o (Q4_0), gate (Q4_1), down (Q4_0), exactly its weights.
        assert torch.equal(linears["o"].dequantized(), floats[p + "self_attn.o_proj.weight"])
        assert torch.equal(gate_up[:inter], floats[p + "mlp.gate_proj.weight"])
        assert torch.equal(linears["down"].dequantized(), floats[p + "mlp.down_proj.weight"])
        # Requantized from floats: up (Q8_0 in the file) and q / k / v.
        up = Int4Linear(floats[p + "mlp.up_proj.weight"])
        assert torch.equal(gate_up[inter:], up.dequantized())
        qkv = torch.cat([floats[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(linears["qkv"].dequantized(), Int4Linear(qkv).dequantized())


def test_every_projection_of_an_all_q4_file_runs_the_files_weights(
    files: dict[str, Any],
) -> None:
    path = files["root"] / "q4.gguf"
    floats = read_gguf_weights(
        open_gguf(path), {"num_attention_heads": 4, "num_key_value_heads": 2}
    )
    bundle = load_model(path, max_requests=2, max_context_len=32)
    quantize_model(bundle.model, "int4", codes=read_gguf_int4(path))
    for layer in range(files["layers"]):
        p = f"model.layers.{layer}."
        parts = {
            "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "o": ["self_attn.o_proj"],
            "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
            "down": ["mlp.down_proj"],
        }
        for key, linear in _stacked(bundle, layer).items():
            expected = torch.cat([floats[f"{p}{part}.weight"] for part in parts[key]])
            assert torch.equal(linear.dequantized(), expected), (layer, key)


def test_codes_that_do_not_fit_are_refused_by_name(files: dict[str, Any]) -> None:
    path = files["root"] / "q4.gguf"
    codes = read_gguf_int4(path)
    bundle = load_model(path, max_requests=2, max_context_len=32)
    with pytest.raises(
        ValueError,
        match=r"codes are 4-bit weights; expected a mode of \('int4', 'int4-q8', 'int4-bf16'\)",
    ):
        quantize_model(bundle.model, "fp16", codes=codes)
    assert bundle.model.quantization is None
    name = "model.layers.0.mlp.down_proj.weight"
    short = Int4Weight(*(x[:3] for x in codes[name]))
    wide = {name: Int4Weight(codes[name].packed[:, :8], *codes[name][1:])}
    for bad, match in (
        ({"model.layers.9.mlp.up_proj.weight": short}, r"1 name\(s\) match no projection"),
        (wide, r"codes\['model.layers.0.mlp.down_proj.weight'\]: .*expected uint8 \[rows, 64\]"),
    ):
        fresh = load_model(path, max_requests=2, max_context_len=32)
        with pytest.raises(ValueError, match=match):
            quantize_model(fresh.model, "int4", codes=bad)


@pytest.mark.parametrize(("file", "kept"), [("q4.gguf", 14), ("mixed.gguf", 6)])
def test_generate_says_how_many_projections_keep_the_files_codes(
    files: dict[str, Any], capsys: pytest.CaptureFixture[str], file: str, kept: int
) -> None:
    path = files["root"] / file
    args = ["generate", "--model", str(path), "--quantize", "int4", "--runner", "eager"]
    assert cli.main([*args, "--prompt", "the quick", "-n", "3", "--json"]) == 0
    err = capsys.readouterr().err
    assert f"{kept} of 14 projections keep the GGUF file's own 4-bit codes" in err
    assert f"{14 - kept} quantized from floats" in err
    assert "CPU capability" in err


def test_a_checkpoint_directory_is_quantized_from_floats(
    files: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(files["root"] / "hf"), "--quantize", "int4"]
    assert cli.main([*args, "--runner", "eager", "--prompt", "the", "-n", "2"]) == 0
    assert "14 projections quantized from floats" in capsys.readouterr().err


def test_rows_set_from_codes_leave_the_other_rows_alone() -> None:
    torch.manual_seed(0)
    linear = Int4Linear(torch.randn(6, 64), kernel=False)
    before = linear.dequantized().clone()
    part = Int4Linear(torch.randn(2, 64), kernel=False)
    linear.set_rows(3, Int4Weight(part.packed, part.scales, part.mins))
    after = linear.dequantized()
    assert torch.equal(after[3:5], part.dequantized())
    assert torch.equal(after[:3], before[:3]) and torch.equal(after[5:], before[5:])
    with pytest.raises(ValueError, match=r"start=5\): .* start \+ rows <= 6"):
        linear.set_rows(5, Int4Weight(part.packed, part.scales, part.mins))


def test_no_file_is_read_for_a_tensor_outside_the_layers(tmp_path: Path) -> None:
    # The LM head of int4 keeps float16 weights: a Q4 output.weight is not taken.
    model = tiny_text_checkpoint(tmp_path / "hf")
    write_gguf(model, tmp_path / "hf", tmp_path / "h.gguf", types={**ALL_Q4, "output": "Q4_0"})
    codes = read_gguf_int4(tmp_path / "h.gguf")
    assert all(name.startswith("model.layers.") for name in codes)

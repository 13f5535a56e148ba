"""The reference model: config parsing, checkpoint loading errors, and logits
equal to transformers' LlamaForCausalLM (eager decode and prefill)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.io import load_model, read_config, save_checkpoint
from graphrunner_ref.model import (
    CheckpointError,
    ModelBundle,
    ModelConfig,
    UnsupportedConfigError,
    WeightError,
    default_model,
)
from hf_tiny import save_tiny_llama

transformers = pytest.importorskip("transformers")

CTX = 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("hf_llama")
    return save_tiny_llama(path), path


def _copy_ckpt(
    src: Path,
    dst: Path,
    *,
    edit_tensors: Callable[[dict[str, torch.Tensor]], object] | None = None,
    edit_config: Callable[[dict[str, object]], object] | None = None,
) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "model.safetensors")
    return dst


def _hf_last_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def _prefill(bundle: ModelBundle, prompt: list[int]) -> tuple[int, torch.Tensor]:
    req = bundle.req_pool.alloc(1)[0]
    slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))
    return req, bundle.model.forward_extend(req, torch.tensor(prompt), slots)


# -- config ------------------------------------------------------------------


def test_config_reads_transformers_layout(hf_dir: tuple[torch.nn.Module, Path]) -> None:
    config = read_config(hf_dir[1])
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert config.rope_theta == 10000.0 and not config.tie_word_embeddings
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_config_accepts_transformers_4_rope_theta() -> None:
    hf = default_model(max_requests=1).config.to_hf_dict()
    del hf["rope_parameters"]
    hf["rope_theta"] = 500000.0
    assert ModelConfig.from_hf_dict(hf).rope_theta == 500000.0


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
        ({"model_type": "gemma"}, "gemma"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": "yes"}, "attention_bias=.yes.: expected true or false"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"type": "dynamic"}}, r"rope_scaling.type='dynamic'"),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, r"keys \['factor'\]"),
        ({"architectures": None, "model_type": "mistral"}, "mistral"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
    ],
)
def test_config_rejects_what_it_cannot_honour(edit: dict, named: str) -> None:
    hf = default_model(max_requests=1).config.to_hf_dict() | edit
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"rms_norm_eps": None},
            "config field rms_norm_eps=None: expected a positive finite number",
        ),
        (
            {"rms_norm_eps": "1e-6"},
            "config field rms_norm_eps='1e-6': expected a positive finite number",
        ),
        ({"rms_norm_eps": 0}, "config field rms_norm_eps=0: expected a positive finite number"),
        ({"head_dim": 16.0}, "config field head_dim=16.0: expected a positive int"),
        ({"hidden_size": 64.0}, "config field hidden_size=64.0: expected a positive int"),
        ({"vocab_size": None}, "config field vocab_size=None: expected a positive int"),
        ({"num_hidden_layers": "2"}, "config field num_hidden_layers='2': expected a positive int"),
        ({"num_key_value_heads": 0}, "config field num_key_value_heads=0: expected a positive int"),
        ({"intermediate_size": -1}, "config field intermediate_size=-1: expected a positive int"),
        (
            {"max_position_embeddings": True},
            "config field max_position_embeddings=True: expected a positive int",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
            "config field rope_parameters.rope_theta=None: expected a positive finite number",
        ),
        (
            {"rope_parameters": None, "rope_theta": float("inf")},
            "config field rope_theta=inf: expected a positive finite number",
        ),
        (
            {"tie_word_embeddings": "false"},
            "config field tie_word_embeddings='false': expected true or false",
        ),
        (
            {"num_key_value_heads": 3},
            "ModelConfig.num_heads=4 is not a multiple of num_kv_heads=3",
        ),
        (
            {"head_dim": 15},
            "ModelConfig.head_dim=15: expected an even int >= 2 (rotary embedding rotates pairs)",
        ),
    ],
)
def test_config_names_a_bad_field_value(edit: dict, message: str) -> None:
    hf = default_model(max_requests=1).config.to_hf_dict() | edit
    with pytest.raises(UnsupportedConfigError) as err:
        ModelConfig.from_hf_dict(hf)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)  # the CLI turns it into exit 2


@pytest.mark.parametrize(
    "edit, theta",
    [
        ({"rope_scaling": {"rope_type": "default"}}, 10000.0),
        ({"rope_scaling": {"type": "default"}}, 10000.0),
        ({"rope_scaling": None}, 10000.0),
        ({"rope_scaling": {"type": "default"}, "rope_parameters": None, "rope_theta": 5e5}, 5e5),
        ({"rope_scaling": {"rope_type": "default", "rope_theta": 2e4}}, 2e4),
        ({"architectures": None}, 10000.0),
        ({"architectures": []}, 10000.0),
        ({"head_dim": None, "num_key_value_heads": None}, 10000.0),
    ],
)
def test_config_accepts_what_transformers_loads_as_plain_llama(edit: dict, theta: float) -> None:
    base = default_model(max_requests=1).config.to_hf_dict()
    hf = base | edit
    config = ModelConfig.from_hf_dict(hf)
    hf_config = transformers.LlamaConfig.from_dict(hf)
    assert hf_config.rope_parameters["rope_type"] == "default"
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"] == theta
    assert (config.head_dim, config.num_kv_heads) == (
        hf_config.head_dim,
        hf_config.num_key_value_heads,
    )
    expected = ModelConfig.from_hf_dict(base)
    if "num_key_value_heads" in edit:
        expected = ModelConfig.from_hf_dict(base | {"num_key_value_heads": 4})
    assert config == dataclasses.replace(expected, rope_theta=theta)


def test_config_validation_names_the_field() -> None:
    shape = {"vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_layers": 1}
    heads = {"num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ModelConfig(**shape, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size=0"):
        ModelConfig(**(shape | {"vocab_size": 0}), **heads)
    with pytest.raises(ValueError) as err:
        ModelConfig(**shape, **heads, head_dim=16.0)  # type: ignore[arg-type]
    assert str(err.value) == (
        "ModelConfig.head_dim=16.0: expected an even int >= 2 (rotary embedding rotates pairs)"
    )
    with pytest.raises(ValueError) as err:
        ModelConfig(**shape, **heads, rms_norm_eps=None)  # type: ignore[arg-type]
    assert str(err.value) == "ModelConfig.rms_norm_eps=None: expected a finite number > 0"


# -- loader errors -------------------------------------------------------------


def test_loader_names_missing_tensor(hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy_ckpt(hf_dir[1], tmp_path / "c", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(WeightError, match=f"missing tensor '{name}'"):
        load_model(path, max_requests=2, max_context_len=CTX)


def test_loader_names_unexpected_tensor(
    hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    name = "model.layers.0.self_attn.q_norm.weight"
    path = _copy_ckpt(
        hf_dir[1], tmp_path / "c", edit_tensors=lambda t: t.__setitem__(name, torch.ones(16))
    )
    with pytest.raises(WeightError, match=f"unexpected tensor '{name}'"):
        load_model(path, max_requests=2, max_context_len=CTX)


def test_loader_names_shape_mismatch(hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _copy_ckpt(
        hf_dir[1], tmp_path / "c", edit_tensors=lambda t: t.__setitem__(name, torch.zeros(64, 64))
    )
    with pytest.raises(WeightError, match=rf"'{name}' has shape \(64, 64\): expected \(32, 64\)"):
        load_model(path, max_requests=2, max_context_len=CTX)


def test_loader_names_unsupported_architecture(
    hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    path = _copy_ckpt(
        hf_dir[1],
        tmp_path / "c",
        edit_config=lambda c: c.update(architectures=["Qwen2ForCausalLM"]),
    )
    with pytest.raises(UnsupportedConfigError, match="Qwen2ForCausalLM"):
        load_model(path, max_requests=2, max_context_len=CTX)


def test_loader_names_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, max_requests=2)
    (tmp_path / "config.json").write_text(
        json.dumps(default_model(max_requests=1).config.to_hf_dict())
    )
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path, max_requests=2)


def test_loader_names_a_corrupt_weights_file(
    hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    path = _copy_ckpt(hf_dir[1], tmp_path / "c")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:300])
    with pytest.raises(CheckpointError) as err:
        load_model(path, max_requests=2, max_context_len=CTX)
    assert str(err.value).startswith(f"{file} is not a valid safetensors file: ")
    # A shard the index lists is read the same way.
    file.rename(path / "a.safetensors")
    weight_map = {n: "a.safetensors" for n in load_file(hf_dir[1] / "model.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as err:
        load_model(path, max_requests=2, max_context_len=CTX)
    assert str(err.value).startswith(f"{path / 'a.safetensors'} is not a valid safetensors file: ")


def test_loader_reads_sharded_index(hf_dir: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    tensors = load_file(hf_dir[1] / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((hf_dir[1] / "config.json").read_text())
    bundle = load_model(tmp_path, max_requests=2, max_context_len=CTX)
    _, logits = _prefill(bundle, [3, 1, 4, 1, 5])
    torch.testing.assert_close(
        logits, _hf_last_logits(hf_dir[0], [3, 1, 4, 1, 5]), atol=1e-5, rtol=0
    )


def test_save_checkpoint_round_trips(tmp_path: Path) -> None:
    bundle = default_model(max_requests=2)
    save_checkpoint(bundle.model, tmp_path)
    loaded = load_model(tmp_path, max_requests=2)
    for (name, a), (_, b) in zip(
        bundle.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


# -- logits against transformers -------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12], [42]]


@pytest.mark.parametrize("tie", [False, True])
def test_eager_logits_equal_transformers(tmp_path: Path, tie: bool) -> None:
    hf = save_tiny_llama(tmp_path, tie=tie, seed=1)
    bundle = load_model(tmp_path, max_requests=8, max_context_len=CTX)
    seqs, reqs, firsts = [], [], []
    for prompt in PROMPTS:
        req, logits = _prefill(bundle, prompt)
        torch.testing.assert_close(logits, _hf_last_logits(hf, prompt), atol=1e-5, rtol=0)
        reqs.append(req)
        firsts.append(int(logits.argmax()))
        seqs.append(prompt + firsts[-1:])
    batch = DecodeBatch.from_requests(
        reqs, [len(p) for p in PROMPTS], torch.tensor(firsts), device="cpu", max_context_len=CTX
    )
    for _ in range(4):
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
        with torch.no_grad():
            logits = bundle.model.forward_decode(batch)
        assert logits.dtype == torch.float32 and logits.shape == (len(PROMPTS), 256)
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(logits[row], _hf_last_logits(hf, seq), atol=1e-5, rtol=0)
        tokens = logits.argmax(-1)
        for seq, tok in zip(seqs, tokens.tolist(), strict=True):
            seq.append(tok)
        batch.input_ids = tokens


def test_padded_rows_leave_live_rows_and_live_kv_alone() -> None:
    bundle = default_model(max_requests=4)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    reqs = [_prefill(bundle, p)[0] for p in prompts]
    batch = DecodeBatch.from_requests(
        reqs, [3, 5], torch.tensor([4, 4]), device="cpu", max_context_len=bundle.max_context_len
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    with torch.no_grad():
        live = bundle.model.forward_decode(batch).clone()
    kv_before = [t[1:].clone() for t in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers]
    pad = 3  # padded rows as populate writes them: all indices 0, seq_len fill value 1
    padded = SimpleNamespace(
        **{
            name: torch.cat([getattr(batch, name), torch.full((pad,), fill, dtype=torch.int64)])
            for name, fill in [
                ("input_ids", 0),
                ("req_pool_indices", 0),
                ("out_cache_loc", 0),
                ("positions", 0),
                ("seq_lens", bundle.model.attn_backend.seq_len_fill_value),
            ]
        }
    )
    with torch.no_grad():
        out = bundle.model.forward_decode(padded)
    torch.testing.assert_close(out[:2], live, atol=1e-5, rtol=0)  # bs changes BLAS blocking
    assert torch.isfinite(out[2:]).all()
    kv_after = [t[1:] for t in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers]
    for a, b in zip(kv_before, kv_after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_backend_hooks_guard_their_invariants() -> None:
    bundle = default_model(max_requests=2)
    backend = bundle.model.attn_backend
    assert backend.seq_len_fill_value == 1
    bundle.req_pool.req_to_token[0, 3] = 7
    with pytest.raises(ValueError, match="row 0"):
        backend.init_graph_state(4)
    bundle.req_pool.req_to_token[0].zero_()
    backend.init_graph_state(4)
    rows = torch.tensor([1, 2])
    too_long = SimpleNamespace(
        req_pool_indices_cpu=rows, seq_lens_cpu=torch.tensor([5, backend.max_context_len + 1])
    )
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[1\]=257: expected 1..256"):
        backend.validate_inputs(2, too_long)
    backend.validate_inputs(
        2, SimpleNamespace(req_pool_indices_cpu=rows, seq_lens_cpu=torch.tensor([1, 256]))
    )
    bad_row = SimpleNamespace(req_pool_indices_cpu=torch.tensor([1, 3]), seq_lens_cpu=rows)
    with pytest.raises(ValueError, match=r"req_pool_indices_cpu\[1\]=3: expected 1..2"):
        backend.validate_inputs(2, bad_row)
    with pytest.raises(ValueError, match="seq_lens_cpu is NoneType; this backend needs"):
        backend.validate_inputs(2, SimpleNamespace(req_pool_indices_cpu=rows))


def test_forward_extend_validates_arguments() -> None:
    bundle = default_model(max_requests=2)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="req_pool_index=0"):
        bundle.model.forward_extend(0, ids, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="kv_slots"):
        bundle.model.forward_extend(1, ids, torch.tensor([1, 2]))


def test_default_model_sizes_its_pools_to_a_given_context() -> None:
    small, full = default_model(max_requests=2, max_context_len=64), default_model(max_requests=2)
    assert (small.max_context_len, full.max_context_len) == (64, 256)
    assert tuple(small.req_pool.req_to_token.shape) == (3, 64)
    assert (small.kv_alloc.size, full.kv_alloc.size) == (128, 512)
    for (name, a), (_, b) in zip(
        small.model.state_dict().items(), full.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name

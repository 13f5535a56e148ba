"""An 8-bit KV cache under a float32 model on the CPU (``--kv-dtype int8``,
``kv_dtype=torch.int8``, :class:`graphrunner.pools.Int8KVCache`): each head
vector of a token held as int8 with a float32 scale ``max|x| / 127`` (llama.cpp's
q8_0 cache). The C++ write equals the torch quantization bit for bit, the C++
decode attention equals the torch reference within float32's tolerance, the
model stays within a measured distance of a float32 cache, the compiled CPU
runner equals eager with padded rows (which write only slot 0, values and
scales), shared prefix pages carry their scales, the command line runs it,
and every model, dtype or device that cannot read it refuses it by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner_ref.cli.main as cli
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.pools import Int8KVCache
from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.cli.options import config_of, parser
from graphrunner_ref.engine.bundle import aot_key
from graphrunner_ref.engine.config import TOKEN_BATCHES_ENV, EngineConfig, UsageError
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.model import ModelBundle, default_model
from graphrunner_ref.model.attention_cpu import (
    cpp_attention_status,
    cpp_decode_attention_q8,
    cpp_q8_runs,
    cpp_rope_store_q8,
)
from graphrunner_ref.model.attention_live import live_decode_attention, live_decode_attention_q8
from graphrunner_ref.model.attention_tokens import TokenLayout, token_batch_attention
from graphrunner_ref.model.attention_torch import read_kv
from graphrunner_ref.model.build import check_kv_dtype
from graphrunner_ref.model.kernels.rope_store import reference
from graphrunner_ref.model.layers import RotaryEmbedding

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
#: The largest logit distance from a float32 cache over the teacher-forced
#: steps of :func:`test_the_model_stays_close_to_a_float32_cache`: measured
#: 0.0354 (the logits span about +-7.9 there; a float16 cache's: 0.0014).
LOGIT_ATOL = 0.05


@pytest.fixture(scope="module")
def kernel() -> None:
    why = cpp_attention_status()
    if why is not None:
        pytest.skip(f"the C++ kernels cannot run here: {why}")


def test_quantize_holds_each_head_vector_as_int8_times_its_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[2, 1] = 0  # an all-zero vector: scale 0, values 0
    q, d = Int8KVCache.quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert d.dtype == torch.float32 and d.shape == (5, 3)
    assert torch.equal(d, x.abs().amax(-1) / 127)
    assert d[2, 1] == 0 and not q[2, 1].any()
    live = d > 0
    assert torch.equal(q.abs().amax(-1)[live], torch.full_like(d[live], 127, dtype=torch.int8))
    err = (Int8KVCache.dequantize(q, d, torch.float32) - x).abs()
    assert (err <= d[..., None] * (0.5 + 1e-6)).all()  # within half a step


SLOTS, POSITIONS = 16, 96
LOC = [3, 9, 4, 15, 0, 0]  # the last two rows padded: slot 0, position 0
POS = [1, 7, 95, 40, 0, 0]
#: (query heads, KV heads, head_dim): SmolLM2's; a head size not of 8s; one KV head.
SHAPES = [(9, 3, 64), (4, 2, 20), (2, 1, 8)]


def _write(heads: int, kv_heads: int, dim: int, kernel_write: bool) -> dict[str, torch.Tensor]:
    """One step's rotary + int8 KV write into caches filled with sentinels:
    by the C++ op, or by the model's torch ops then ``Int8KVCache.quantize``."""
    gen = torch.Generator().manual_seed(dim)
    rotary = RotaryEmbedding(dim, POSITIONS, 10000.0)
    qkv = torch.randn(len(LOC), (heads + 2 * kv_heads) * dim, generator=gen) * 100
    positions, out_loc = torch.tensor(POS), torch.tensor(LOC)
    k = torch.full((SLOTS, kv_heads, dim), 55, dtype=torch.int8)
    v, ks, vs = k.clone(), torch.full((SLOTS, kv_heads), -3.0), torch.full((SLOTS, kv_heads), -3.0)
    if kernel_write:
        cache = (k, v, ks, vs)
        q = cpp_rope_store_q8(qkv, positions, out_loc, rotary.cos, rotary.sin, cache, heads)
        return {"q": q, "k": k, "v": v, "ks": ks, "vs": vs}
    kf, vf = torch.zeros(SLOTS, kv_heads, dim), torch.zeros(SLOTS, kv_heads, dim)
    q = reference(qkv, positions, out_loc, rotary.cos, rotary.sin, kf, vf, heads=heads)
    written = torch.tensor(sorted(set(LOC)))
    for buf, scale, src in ((k, ks, kf), (v, vs, vf)):
        buf[written], scale[written] = Int8KVCache.quantize(src[written])
    return {"q": q, "k": k, "v": v, "ks": ks, "vs": vs}


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_the_kernels_write_equals_the_torch_quantization_bit_for_bit(
    kernel: None, heads: int, kv_heads: int, dim: int
) -> None:
    got, want = _write(heads, kv_heads, dim, True), _write(heads, kv_heads, dim, False)
    live = torch.tensor(LOC[:4])
    for name in ("k", "v", "ks", "vs"):
        assert torch.equal(got[name][live], want[name][live]), name
    assert torch.equal(got["q"][:4], want["q"][:4])
    for slot in range(1, SLOTS):  # every slot no row names keeps its sentinel
        kept = bool((got["k"][slot] == 55).all()) and bool((got["ks"][slot] == -3.0).all())
        assert kept == (slot not in LOC), slot
    assert bool((got["ks"][0] != -3.0).all())  # the padded rows wrote the sink, scales too


def _decode_world(kv_heads: int, group: int, dim: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(kv_heads * dim)
    slots, capacity = 300, 96
    k, ks = Int8KVCache.quantize(torch.randn(slots, kv_heads, dim, generator=gen) * 3)
    v, vs = Int8KVCache.quantize(torch.randn(slots, kv_heads, dim, generator=gen))
    table = torch.zeros(5, capacity, dtype=torch.int32)  # row 0: padding
    table[1:] = torch.randint(1, slots, (4, capacity), generator=gen, dtype=torch.int32)
    return {
        "q": torch.randn(5, kv_heads, group, dim, generator=gen),
        "k_buf": k,
        "v_buf": v,
        "k_scale": ks,
        "v_scale": vs,
        "req_to_token": table,
        "req_pool_indices": torch.tensor([1, 2, 3, 4, 0]),  # the last row padded
        "seq_lens": torch.tensor([96, 41, 8, 1, 1]),
    }


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (8, 4, 64), (2, 2, 20)])
def test_the_decode_kernel_equals_the_torch_reference(
    kernel: None, attention_path: str, kv_heads: int, group: int, dim: int
) -> None:
    """The kernel scales each score by its key's scale and each probability
    by its value's; the reference dequantizes first: float32 sums apart."""
    w = _decode_world(kv_heads, group, dim)
    got = cpp_decode_attention_q8(**w, scale=dim**-0.5)
    want = live_decode_attention_q8(**w, scale=dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the oracle in plain torch: the whole cache dequantized, the float attention
    k = Int8KVCache.dequantize(w.pop("k_buf"), w.pop("k_scale"), torch.float32)
    v = Int8KVCache.dequantize(w.pop("v_buf"), w.pop("v_scale"), torch.float32)
    plain = live_decode_attention(w.pop("q"), k, v, **w, scale=dim**-0.5)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_the_token_batch_reads_the_cache_dequantized() -> None:
    """A token batch of a prompt chunk after a cached prefix, a decode row and
    a padded request, over an int8 cache: what the same attention computes
    over the cache dequantized whole, in plain torch."""
    w = _decode_world(2, 3, 16)
    q = torch.randn(7, 6, 16, generator=torch.Generator().manual_seed(1))
    layout = TokenLayout(
        w["req_to_token"],
        torch.tensor([1, 2, 0]),
        torch.tensor([30, 9, 1]),
        torch.tensor([6, 1, 0]),
    )
    got = token_batch_attention(
        q, w["k_buf"], w["v_buf"], layout, 0.25, (w["k_scale"], w["v_scale"])
    )
    k = Int8KVCache.dequantize(w["k_buf"], w["k_scale"], torch.float32)
    v = Int8KVCache.dequantize(w["v_buf"], w["v_scale"], torch.float32)
    torch.testing.assert_close(got, token_batch_attention(q, k, v, layout, 0.25), rtol=0, atol=0)


def _prefilled(kv_dtype: torch.dtype | None) -> tuple[ModelBundle, DecodeBatch, torch.Tensor]:
    """PROMPTS[:3] prefilled eagerly, one by one; their decode batch, and the
    logits of each prompt's last token ``[3, vocab]``."""
    bundle = default_model(max_requests=4, max_context_len=32, kv_dtype=kv_dtype)
    reqs, lens, logits = [], [], []
    for prompt in PROMPTS[:3]:
        req = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)))
        logits.append(bundle.model.forward_extend(req, torch.tensor(prompt), slots))
        reqs.append(req)
        lens.append(len(prompt))
    batch = DecodeBatch.from_requests(
        reqs, lens, torch.tensor([5, 6, 7]), device="cpu", max_context_len=32
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return bundle, batch, torch.stack(logits)


def _decode(bundle: ModelBundle, batch: DecodeBatch) -> torch.Tensor:
    return bundle.model.forward_decode(batch)  # type: ignore[arg-type]


def test_the_model_stays_close_to_a_float32_cache(kernel: None) -> None:
    """The same prompts and tokens (teacher-forced: the float32 cache's greedy
    ones) through both caches: prefill and 12 decode steps' logits within
    :data:`LOGIT_ATOL`, and every greedy token the same (as measured)."""
    runs = {d: _prefilled(d) for d in (torch.float32, torch.int8)}
    assert isinstance(runs[torch.int8][0].kv_cache, Int8KVCache)
    assert runs[torch.int8][0].model.attn_backend.kernel == "live"
    worst = (runs[torch.int8][2] - runs[torch.float32][2]).abs().max().item()
    for _ in range(12):
        with torch.no_grad():
            out = {d: _decode(b, batch) for d, (b, batch, _) in runs.items()}
        worst = max(worst, (out[torch.int8] - out[torch.float32]).abs().max().item())
        greedy = out[torch.float32].argmax(-1)
        assert torch.equal(out[torch.int8].argmax(-1), greedy)
        for bundle, batch, _ in runs.values():
            batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, greedy)
    assert 0 < worst <= LOGIT_ATOL, worst


def _serve(runner: str, **options: object) -> tuple[dict[int, list[int]], ModelBundle]:
    """The greedy tokens of PROMPTS (8 new each) through ``runner`` captured at
    size 4 (3 of the 4 prompts' rows live at the end: padded rows)."""
    bundle = default_model(max_requests=4, max_context_len=32, kv_dtype=torch.int8)
    step = create_decode_runner(bundle, runner, capture_sizes=[4], **options)  # type: ignore[arg-type]
    step.capture()
    result = Engine(bundle, step).run(requests_from_prompts(PROMPTS, max_new_tokens=8))
    return {rid: list(t) for rid, t in result.outputs.items()}, bundle


def test_the_cpu_runner_equals_eager_on_an_int8_cache(kernel: None) -> None:
    eager, bundle = _serve("eager")
    assert all(b.dtype == torch.int8 for b in bundle.kv_cache.k_buffers)
    assert cpp_q8_runs(torch.zeros(1), bundle.kv_cache.k_buffers[0])
    compiled, _ = _serve("cpu", check_padding=True)
    assert compiled == eager


def test_padded_rows_write_only_slot_0_values_and_scales(kernel: None) -> None:
    """Three live rows replayed at captured size 4 with the static buffers'
    tails poisoned to point at a live request's cached slot: afterwards only
    the live rows' new slots and the sink (slot 0) differ, in values and
    scales, and the live logits equal eager's."""
    bundle, batch, _ = _prefilled(torch.int8)
    cache = bundle.kv_cache
    assert isinstance(cache, Int8KVCache)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[4])
    runner.capture()
    cached = int(bundle.req_pool.req_to_token[int(batch.req_pool_indices_cpu[0]), 0])
    stale = {"req_pool_indices": int(batch.req_pool_indices_cpu[0]), "out_cache_loc": cached}
    stale |= {"seq_lens": 32, "positions": 31, "input_ids": 1}
    bufs = runner.buffers
    for spec in bufs.specs:
        bufs.tensors[spec.name][bufs.rows(spec, 3) :].fill_(stale.get(spec.name, 1))
    pools = [*cache.k_buffers, *cache.v_buffers, *cache.k_scales, *cache.v_scales]
    before = [t.clone() for t in pools]
    with torch.no_grad():
        got = runner.replay(batch).clone()  # type: ignore[union-attr]
    written = set(batch.out_cache_loc.tolist())
    for t, old in zip(pools, before, strict=True):
        changed = set((t != old).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed - {0} == written, changed
    assert all(bool((s[0] != 0).all()) for s in cache.k_scales)  # the sink took the writes
    for t, old in zip(pools, before, strict=True):
        t.copy_(old)
    with torch.no_grad():
        want = bundle.model.forward_decode(batch)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_sanitizer_guards_the_scales() -> None:
    """``--check-padding``'s sanitizer watches an int8 cache's scales as it
    watches its values: a step that writes a live request's cached slot's
    scale (and no value) is caught by name."""
    from graphrunner import PaddingViolation
    from graphrunner_ref.engine.kinds.llama import pooled_step

    bundle, batch, _ = _prefilled(torch.int8)
    cache = bundle.kv_cache
    assert isinstance(cache, Int8KVCache)
    sanitizer = pooled_step(bundle).sanitizer()
    names = {g.name for g in sanitizer.guarded}
    assert {"k_scale[0]", "v_scale[1]"} <= names
    check = sanitizer.snapshot(batch)
    cached = int(bundle.req_pool.req_to_token[int(batch.req_pool_indices_cpu[0]), 0])
    cache.k_scales[1][cached] += 1  # the planted bug
    with pytest.raises(PaddingViolation, match=r"k_scale\[1\]"):
        check.after_launch(torch.zeros(3, 4))


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def test_generate_runs_it_checked_against_eager(
    kernel: None,
    prompts_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``generate --kv-dtype int8`` on the CPU runner, every step checked
    against eager: prompts eagerly (the tests' default) and as a captured
    token batch (``token_batch_attention_q8``), the same tokens both ways."""
    argv = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "6", "--runner"]
    argv += ["cpu", "--kv-dtype", "int8", "--check", "--max-bs", "4", "--aot-cache", "none"]
    answers = []
    for token_batches in ("0", "1"):
        monkeypatch.setenv(TOKEN_BATCHES_ENV, token_batches)
        assert cli.main(argv) == 0
        captured = capsys.readouterr()
        rows = [json.loads(line)["token_ids"] for line in captured.out.splitlines()]
        assert [len(r) for r in rows] == [6] * len(PROMPTS)
        assert "mismatches: 0" in captured.err
        answers.append(rows)
    assert answers[0] == answers[1]


def test_check_compares_an_int8_cache_dequantized() -> None:
    """A graph's value one float32 rounding off eager's may take the next
    integer: ``--check`` measures that change dequantized (its scale, about
    0.01 on the embedded model, under the 0.05 tolerance), not as 1."""
    from graphrunner_ref.engine import check

    cache = Int8KVCache(4, 1, 2, 8, "cpu")
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    cache.set_kv(0, torch.arange(1, 5), x, x)
    before = [t.clone() for t in check._kv_values(cache)]
    cache.k_buffers[0][2, 1, 3] += 1
    diff = check._kv_diff(cache, before)
    torch.testing.assert_close(diff, cache.k_scales[0][2, 1], rtol=1e-6, atol=0)
    assert 0 < diff < 0.05


def test_shared_prefix_pages_carry_their_scales(
    kernel: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts that share 12 tokens, one request at a time: the later ones
    read the first one's cached pages (their values and their scales) and
    answer as they do computing their own."""
    path = tmp_path / "shared.jsonl"
    shared = list(range(20, 32))
    path.write_text("".join(json.dumps(shared + [t]) + "\n" for t in (1, 2, 3)))
    answers = []
    for caching in ([], ["--no-prefix-caching"]):
        argv = ["generate", "--prompts", str(path), "--max-new-tokens", "4", "--runner"]
        argv += ["eager", "--kv-dtype", "int8", "--max-bs", "1", *caching]
        assert cli.main(argv) == 0
        captured = capsys.readouterr()
        answers.append([json.loads(line)["token_ids"] for line in captured.out.splitlines()])
        hits = "prefix cache hit rate 0.0%" not in captured.err
        assert hits == (not caching), captured.err
    assert answers[0] == answers[1]


def test_serve_builds_its_engine_over_an_int8_cache(kernel: None) -> None:
    """``graphrunner serve --kv-dtype int8``'s config, through the engine path
    serve drives (build, open_engine, add_request, step): an Int8KVCache, and
    a request's greedy tokens those of the eager runner over one."""
    from graphrunner_ref.engine.serving import build, open_engine

    args = parser().parse_args(["serve", "--kv-dtype", "int8"])
    config = dataclasses.replace(config_of(args, "eager", (1, 2)), quiet=True)
    assert config.kv_dtype == "int8" and config.torch_kv_dtype == torch.int8
    assert EngineConfig(kv_dtype="int8").atol == 0.05
    bundle = build(config, max_requests=2, context=32)
    assert isinstance(bundle, ModelBundle) and isinstance(bundle.kv_cache, Int8KVCache)
    assert aot_key(bundle)["kv dtype"] == "int8"
    engine = open_engine(config, bundle)
    rid = engine.add_request(PROMPTS[0], 8)
    tokens: list[int] = []
    for _ in range(50):
        if not engine.has_unfinished():
            break
        tokens += [t for out in engine.step() if out.rid == rid for t in out.tokens]
    assert tokens == _serve("eager")[0][0]


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "device", "message"),
    [
        (torch.int8, torch.bfloat16, "cpu", "kv_dtype=int8: a bfloat16 model's KV cache may be"),
        (torch.int8, torch.float32, "cuda", "kv_dtype=int8: .* runs on the CPU; the device"),
    ],
)
def test_a_model_or_device_that_cannot_read_it_refuses_it(
    kv_dtype: torch.dtype, dtype: torch.dtype, device: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_kv_dtype(kv_dtype, dtype, device)
    assert check_kv_dtype(kv_dtype, torch.float32, "cpu") == torch.int8


def test_the_other_kinds_and_options_refuse_it_by_name() -> None:
    from graphrunner_ref.engine.kinds import llama, state_space, transformers

    checkpoint: dict[str, Any] = {"checkpoint": Path("ckpt"), "source": "--model ckpt"}
    checkpoint["kv_dtype"] = "int8"
    with pytest.raises(UsageError, match="--kv-dtype int8: the native model's option"):
        transformers.KIND.check(EngineConfig(**checkpoint, model_impl="transformers"))
    with pytest.raises(UsageError, match="--kv-dtype int8: a Mamba or Jamba model's KV cache"):
        state_space.KIND.check(EngineConfig(**checkpoint))
    with pytest.raises(UsageError, match="--kv-dtype int8: not supported with --speculative"):
        llama.KIND.check(EngineConfig(kv_dtype="int8", speculative="eagle"))
    with pytest.raises(ValueError, match=r"kv_dtype='int4'; expected one of \[.*'int8'\]"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match=r"dtype='int8'; expected one of \['float32'"):
        EngineConfig(dtype="int8")
    k = torch.zeros(4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="an int8 KV cache read without its scales"):
        read_kv(k, torch.tensor([1]), torch.float32, None)


def test_the_cli_refuses_it_under_a_bfloat16_model(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), "--runner", "cpu", "--kv-dtype", "int8"]
    assert cli.main([*argv, "--dtype", "bfloat16"]) == 2
    assert "--kv-dtype int8: a bfloat16 model's KV cache may be bfloat16" in (
        capsys.readouterr().err
    )

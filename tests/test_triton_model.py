"""The reference model with the Triton decode attention: equal to the torch
attention eagerly (padded rows included) and through a compiled runner, where
the opaque op is called from the inductor program. Without a GPU the kernel
runs interpreted under the CPU runner; with one (``cuda``-marked tests) the
CUDA runner over the compiled forward gives transformers' greedy tokens, and
the 1.1B-shape model in bfloat16 matches the eager torch attention."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphrunner_ref.model.attention_op as attention_op
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from graphrunner_ref.model import ModelBundle, default_model, shape_1b_config
from hf_tiny import hf_greedy, save_tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: The compiled runner of this machine: inductor inside CUDA graphs, or called directly.
COMPILED: tuple[str, dict[str, Any]] = (
    ("cuda", {"compile": True}) if DEVICE == "cuda" else ("cpu", {})
)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(1, 40)), [7]]


def _prefilled(attention: str, **kwargs: Any) -> tuple[ModelBundle, DecodeBatch]:
    bundle = default_model(max_requests=4, max_context_len=64, device=DEVICE, **kwargs)
    bundle.model.attn_backend.use(attention)
    reqs, firsts = [], []
    for prompt in PROMPTS:
        req = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)), device=DEVICE)
        logits = bundle.model.forward_extend(req, torch.tensor(prompt, device=DEVICE), slots)
        reqs.append(req)
        firsts.append(logits.argmax())
    batch = DecodeBatch.from_requests(
        reqs, [len(p) for p in PROMPTS], torch.stack(firsts), device=DEVICE, max_context_len=64
    )
    return bundle, batch


def test_backend_kernel_is_checked_and_defaults_by_device() -> None:
    bundle = default_model(max_requests=1, device=DEVICE)
    assert bundle.model.attn_backend.kernel == ("triton" if DEVICE == "cuda" else "live")
    with pytest.raises(
        ValueError, match=r"kernel='cuda': expected one of \('torch', 'triton', 'live'\)"
    ):
        bundle.model.attn_backend.kernel = "cuda"
    with pytest.raises(
        ValueError, match=r"layout='rows': expected one of \('per_head', 'all_heads'\)"
    ):
        bundle.model.attn_backend.layout = "rows"
    with pytest.raises(
        ValueError,
        match=r"attention='flash': expected one of \('torch', 'live', 'triton', 'triton-all-heads'\)",
    ):
        bundle.model.attn_backend.use("flash")
    assert bundle.model.attn_backend.layout == "per_head"  # the measured default


@pytest.mark.parametrize("attention", ["triton", "triton-all-heads"])
def test_eager_triton_equals_torch_with_padded_rows(attention: str) -> None:
    (ref, ref_batch), (tri, batch) = _prefilled("torch"), _prefilled(attention)
    pad = 3  # as populate writes them: indices 0, seq_lens the fill value 1
    fills = {"input_ids": 0, "req_pool_indices": 0, "out_cache_loc": 0, "positions": 0}
    fills["seq_lens"] = tri.model.attn_backend.seq_len_fill_value
    for step in range(2):
        ref_batch.prepare_decode(ref.req_pool, ref.kv_alloc)
        batch.prepare_decode(tri.req_pool, tri.kv_alloc)
        padded = SimpleNamespace(
            **{
                name: torch.cat([getattr(batch, name), torch.full((pad,), v, device=DEVICE)])
                for name, v in fills.items()
            }
        )
        with torch.no_grad():
            expected = ref.model.forward_decode(ref_batch)
            got = tri.model.forward_decode(padded)
        torch.testing.assert_close(got[: len(PROMPTS)], expected, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(got[len(PROMPTS) :]).all(), step
        ref_batch.input_ids = batch.input_ids = expected.argmax(-1)


@pytest.mark.parametrize(
    ("attention", "layout"),
    [
        ("triton", "per_head"),
        ("triton-all-heads", "all_heads"),
    ],
)
def test_compiled_runner_calls_the_kernel_and_equals_eager_torch(
    monkeypatch: pytest.MonkeyPatch, attention: str, layout: str
) -> None:
    (ref, ref_batch), (tri, batch) = _prefilled("torch"), _prefilled(attention)
    kind, options = COMPILED
    runner = create_decode_runner(tri, kind, capture_sizes=[4], **options)
    runner.capture()
    calls = []
    launch = attention_op.decode_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((args[0].shape[0], kwargs["layout"]))
        return launch(*args, **kwargs)

    if DEVICE == "cpu":  # in a CUDA graph the op's Python never runs again
        monkeypatch.setattr(attention_op, "decode_attention", counted)
    for _ in range(2):
        ref_batch.prepare_decode(ref.req_pool, ref.kv_alloc)
        batch.prepare_decode(tri.req_pool, tri.kv_alloc)
        with torch.no_grad():
            expected = ref.model.forward_decode(ref_batch)
        got = runner.replay(batch)
        # Compiled and eager forwards round differently (fused reductions).
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        ref_batch.input_ids = batch.input_ids = expected.argmax(-1)
    assert runner.direct_fallbacks == 0
    if DEVICE == "cpu":  # every layer of every replay, at the captured size 4
        assert calls == [(4, layout)] * (2 * tri.config.num_layers)


def _oracle_trace() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, 9, 17, 30, 2, 12]
    return [
        Request(rid, tuple(torch.randint(256, (n,), generator=gen).tolist()), 10, rid // 2)
        for rid, n in enumerate(lengths)
    ]


@pytest.mark.cuda
def test_compiled_cuda_runner_with_triton_gives_transformers_tokens(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf = save_tiny_llama(tmp_path)
    hf.generation_config.eos_token_id = None
    trace = _oracle_trace()
    bundle = load_model(tmp_path, max_requests=8, max_context_len=64, device="cuda")
    assert bundle.model.attn_backend.kernel == "triton"
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[1, 2, 4, 8], compile=True)
    runner.capture()
    result = Engine(bundle, runner).run(trace)
    expected = hf_greedy(hf, trace)
    for req in trace:
        assert result.outputs[req.rid] == expected[req.rid], req.rid


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["triton", "triton-all-heads"])
def test_1b_shape_bf16_compiled_triton_matches_eager_torch(attention: str) -> None:
    bs, context = 8, 512
    bundle = default_model(
        max_requests=bs,
        max_context_len=context,
        device="cuda",
        dtype=torch.bfloat16,
        config=shape_1b_config(),
    )
    gen = torch.Generator().manual_seed(0)
    reqs, lens, firsts = [], [], []
    for n in (1, 63, 64, 65, 200, 311, 400, 500):
        req = bundle.req_pool.alloc(1)[0]
        prompt = torch.randint(32000, (n,), generator=gen).cuda()
        slots = torch.tensor(bundle.kv_alloc.alloc(n), device="cuda")
        firsts.append(bundle.model.forward_extend(req, prompt, slots).argmax())
        reqs.append(req)
        lens.append(n)
    batch = DecodeBatch.from_requests(
        reqs, lens, torch.stack(firsts), device="cuda", max_context_len=context
    )
    backend = bundle.model.attn_backend
    backend.use(attention)
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[8], compile=True)
    runner.capture()  # the Triton kernel (the default on CUDA), compiled
    for _ in range(4):
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
        backend.kernel = "torch"  # the eager reference; the graphs keep what they captured
        with torch.no_grad():
            expected = bundle.model.forward_decode(batch)
        backend.use(attention)
        got = runner.replay(batch)  # rewrites the step's K/V with its own rounding
        error = float((got - expected).abs().max() / expected.std())
        assert error < 0.1, error
        agree = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
        assert agree >= 0.75, agree
        batch.input_ids = got.argmax(-1)

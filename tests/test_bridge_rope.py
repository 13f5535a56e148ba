"""The transformers bridge on RoPE whose frequencies transformers decides on
the host from the sequence length: a tiny random Llama with ``dynamic`` (NTK)
RoPE, a Phi3 with ``longrope`` (short factors up to
``original_max_position_embeddings``, long past it) and a Gemma3 whose one
rotary module holds a RoPE per layer type (``dynamic`` on the full attention
layer only), saved with ``save_pretrained``. Decode looks cos/sin up by position in a table made at
build time, row by row; the prefill runs transformers' own module. Prompts
and new tokens cross each threshold, in padded batches that mix short and
long rows (transformers' own batch would pick every row's frequencies from
the batch's largest position, so each request's oracle is transformers run on
it alone, on a fresh copy: a dynamic module keeps the longest length it saw)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner_ref import Engine, Request, create_decode_runner
from graphrunner_ref.bridge import build_transformers_bundle, load_transformers
from graphrunner_ref.bridge.rope import RopeTable
from hf_tiny import TINY_DECODER, hf_greedy, save_decoders

transformers = pytest.importorskip("transformers")

#: Where each RoPE changes its frequencies: dynamic NTK past max_position_embeddings,
#: longrope past original_max_position_embeddings.
DYNAMIC_MAX_POSITIONS = 16
LONGROPE_ORIGINAL = 8
LONGROPE_MAX_POSITIONS = 32
#: Contexts: dynamic RoPE runs past its max_position_embeddings (its point).
CONTEXT = {"gemma3-dynamic-full": 40, "llama-dynamic": 40, "phi3-longrope": LONGROPE_MAX_POSITIONS}
#: The layer type whose RoPE is tabled (None: a module of one RoPE).
TABLED = {"gemma3-dynamic-full": "full_attention", "llama-dynamic": None, "phi3-longrope": None}


def _configs() -> dict[str, Any]:
    t = transformers
    half = 4  # rotary_dim / 2: head_dim 8 (hidden 32, 4 heads)
    # theta 10, not 10000: head_dim 8 has 4 frequencies, and at 10000 the
    # three NTK stretches are too slow to move a greedy token in 26 positions.
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10.0}
    return {
        "gemma3-dynamic-full": t.Gemma3TextConfig(
            **{**TINY_DECODER, "max_position_embeddings": DYNAMIC_MAX_POSITIONS},
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_scaling=dynamic,  # the full attention layers' (sliding: default)
        ),
        "llama-dynamic": t.LlamaConfig(
            **{**TINY_DECODER, "max_position_embeddings": DYNAMIC_MAX_POSITIONS},
            rope_scaling=dynamic,
        ),
        "phi3-longrope": t.Phi3Config(
            **{**TINY_DECODER, "max_position_embeddings": LONGROPE_MAX_POSITIONS},
            pad_token_id=0,
            # Phi3 reads its own field over rope_scaling's: both say 8.
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [2.0 + 0.5 * i for i in range(half)],
                "original_max_position_embeddings": LONGROPE_ORIGINAL,
            },
        ),
    }


ARCHS = sorted(_configs())

#: Per model, requests below and past its threshold decoding in the same
#: padded batches; in the dynamic ones, request 0 crosses it while decoding.
DYNAMIC_TRACE = [
    Request(0, (3, 17, 5, 9, 22, 7, 1, 2, 3, 4, 5), 8),  # positions 0..17: crosses 16
    Request(1, (11, 2), 5, arrival_step=1),  # always below
    Request(2, tuple(range(40, 60)), 6, arrival_step=2),  # a prompt past 16, decoding to 25
]
TRACES = {
    "gemma3-dynamic-full": DYNAMIC_TRACE,
    "llama-dynamic": DYNAMIC_TRACE,
    "phi3-longrope": [
        Request(0, (3, 17, 5, 9, 22, 7, 1, 2, 3, 4, 5), 6),  # a prompt past 8: long factors
        Request(1, (11, 2), 5, arrival_step=1),  # 7 tokens: short factors
        Request(2, tuple(range(40, 58)), 4, arrival_step=2),  # long
        Request(3, (30, 31, 32, 33), 4, arrival_step=3),  # 8 tokens: short
    ],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each model saved once: its directory and transformers' own model (only
    ever run as a copy, so its rotary module never carries state over)."""
    return save_decoders(tmp_path_factory, _configs())


def _generate_alone(model: Any, requests: list[Request]) -> dict[int, list[int]]:
    """transformers' greedy ``generate`` of each request alone, on a fresh copy."""
    return {r.rid: hf_greedy(copy.deepcopy(model), [r])[r.rid] for r in requests}


def _decode_alone(model: Any, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    """transformers' model decoding one prompt token by token over its cache
    (the forward ``generate`` runs, without Phi3's re-encode at the crossing)."""
    model = copy.deepcopy(model)
    ids, cache, out = torch.tensor([prompt]), transformers.DynamicCache(config=model.config), []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([out[-1:]])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_replay_equals_transformers_generate_alone(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=CONTEXT[arch])
    assert len(bundle.model.rope_tables) == 1
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(TRACES[arch])
    assert result.outputs == _generate_alone(reference, TRACES[arch])
    assert runner.stats.padded_rows > 0  # some steps ran padded
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0


#: Gemma3's compile takes ~40 s on two cores.
COMPILED_ARCHS = [arch for arch in ARCHS]


@pytest.mark.parametrize("arch", COMPILED_ARCHS)
def test_the_compiled_cpu_runner_captures_and_equals_transformers(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    """The decorated rotary forward is out of the decode step: one fullgraph
    program serves both sizes, called directly, never eager. (No size 1:
    Phi3's trace guards on a batch of one whatever its RoPE, so that size
    compiles a program of its own, beside the point here.)"""
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=CONTEXT[arch])
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[2, 4], check_padding=True)
    runner.capture()
    assert runner.compilations == 1
    result = Engine(bundle, runner).run(TRACES[arch])
    assert result.outputs == _generate_alone(reference, TRACES[arch])
    assert runner.stats.eager_fallbacks == 0 and runner.direct_fallbacks == 0


def test_longrope_crossing_its_threshold_in_decode_equals_transformers_token_by_token(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    """A prompt of 5 decoding to position 11: positions up to 7 on the short
    factors, the rest on the long ones, the cached keys kept, as transformers'
    model decodes over its cache. (Phi3's ``generate`` instead re-encodes the
    whole sequence on the long factors at the crossing; a decode step cannot.)"""
    path, reference = saved["phi3-longrope"]
    request = Request(0, (3, 17, 5, 9, 22), 7)
    bundle = load_transformers(path, max_requests=2, max_context_len=LONGROPE_MAX_POSITIONS)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2], check_padding=True)
    runner.capture()
    outputs = Engine(bundle, runner).run([request, Request(1, (11, 2), 3)]).outputs
    expected = _decode_alone(reference, request.prompt, request.max_new_tokens)
    assert outputs[0] == expected
    # The re-encode is real: this model's generate answers otherwise.
    assert _generate_alone(reference, [request])[0] != expected


@pytest.mark.parametrize("arch", ARCHS)
def test_each_table_row_is_transformers_cos_sin_at_that_largest_position(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    """Row ``p`` is what transformers' rotary module gives position ``p`` in
    a fresh call whose largest position is ``p``, bit for bit; a lookup of
    several positions gives each its own row (no batch-wide choice). A layer
    type whose RoPE is not decided on the host is transformers' own."""
    _, reference = saved[arch]
    context, layer = CONTEXT[arch], TABLED[arch]
    bundle = build_transformers_bundle(
        copy.deepcopy(reference), max_requests=1, max_context_len=context
    )
    (table,) = bundle.model.rope_tables
    assert table.layer_types == (layer,)
    kw = {} if layer is None else {"layer_type": layer}
    x = torch.zeros(1, 1, 1)  # the rotary modules read only its dtype and device
    rows = [table(x, torch.tensor([[p]]), **kw) for p in range(context)]
    for p in range(context):
        rotary = copy.deepcopy(reference.model.rotary_emb)
        cos, sin = rotary(x, torch.arange(p + 1)[None], **kw)
        assert torch.equal(rows[p][0][0, 0], cos[0, -1]), p
        assert torch.equal(rows[p][1][0, 0], sin[0, -1]), p
    positions = [2, context - 1, 0, 9]
    cos, sin = table(x, torch.tensor([positions]), **kw)
    for j, p in enumerate(positions):
        assert torch.equal(cos[0, j], rows[p][0][0, 0]) and torch.equal(sin[0, j], rows[p][1][0, 0])
    if layer is not None:  # the sliding layers' default RoPE
        many = torch.tensor([[3, context - 1]])
        expected = reference.model.rotary_emb(x, many, layer_type="sliding_attention")
        got = table(x, many, layer_type="sliding_attention")
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_past_the_threshold_equals_transformers_logits(
    arch: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    """The eager prefill runs transformers' own module: a prompt past the
    threshold gets its frequencies from its whole length, every position."""
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=1, max_context_len=CONTEXT[arch])
    prompt = torch.tensor(TRACES[arch][2].prompt)
    _assert_prefill_equals(bundle, reference, prompt)
    # Decode's tables are back in place after the prefill.
    assert isinstance(bundle.model.hf.model.rotary_emb, RopeTable)


def _assert_prefill_equals(bundle: Any, reference: Any, prompt: torch.Tensor) -> None:
    """The bridge's eager prefill of ``prompt`` gives the last logits of a
    fresh copy of transformers' ``reference`` on it."""
    row = bundle.req_pool.alloc(1)[0]
    logits = bundle.model.forward_extend(
        row, prompt, torch.tensor(bundle.kv_alloc.alloc(len(prompt)))
    )
    with torch.no_grad():
        expected = copy.deepcopy(reference)(prompt[None]).logits[0, -1].float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_dynamic_model_run_long_before_the_build_prefills_as_a_fresh_one(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    """transformers' dynamic module keeps the longest length it has seen (a
    20-token prompt after a 30-token one gets 30's frequencies); the bridge
    starts every prompt from the module as built."""
    _, reference = saved["llama-dynamic"]
    model = copy.deepcopy(reference)
    with torch.no_grad():
        model(torch.arange(30)[None])  # grows the module to length 30
    bundle = build_transformers_bundle(
        model, max_requests=1, max_context_len=CONTEXT["llama-dynamic"]
    )
    prompt = torch.tensor(TRACES["llama-dynamic"][2].prompt)  # 20 tokens
    _assert_prefill_equals(bundle, reference, prompt)


def test_dynamic_rope_runs_past_max_position_embeddings_and_longrope_does_not(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    _, llama = saved["llama-dynamic"]
    bundle = build_transformers_bundle(copy.deepcopy(llama), max_requests=1, max_context_len=64)
    assert bundle.req_pool.req_to_token.shape[1] == 64
    with pytest.raises(ValueError, match=r"max_context_len=0: expected >= 1 \(dynamic RoPE"):
        build_transformers_bundle(copy.deepcopy(llama), max_requests=1, max_context_len=0)
    _, phi3 = saved["phi3-longrope"]
    with pytest.raises(
        ValueError, match=r"max_context_len=33: expected 1\.\.max_position_embeddings=32"
    ):
        build_transformers_bundle(copy.deepcopy(phi3), max_requests=1, max_context_len=33)


def test_a_second_bundle_over_the_same_model_tables_the_original_again(
    saved: dict[str, tuple[Path, Any]],
) -> None:
    _, llama = saved["llama-dynamic"]
    model = copy.deepcopy(llama)
    first = build_transformers_bundle(model, max_requests=1, max_context_len=20)
    second = build_transformers_bundle(model, max_requests=1, max_context_len=30)
    (old,), (new,) = first.model.rope_tables, second.model.rope_tables
    assert new.original is old.original and not isinstance(new.original, RopeTable)
    assert model.model.rotary_emb is new and new.cos_0.shape[0] == 30
    torch.testing.assert_close(new.cos_0[:20], old.cos_0, rtol=0, atol=0)

"""The CPU decode attention whose cost follows the live context
(:mod:`graphrunner_ref.model.attention_live`): it equals the full-width torch
attention (the reference) for random lengths, groups, pages and padded rows,
never lets a NaN outside the live slots through, gathers no column past the
batch's longest live row (rounded up), and the model running it gives the
same greedy tokens whatever the pool's capacity, eagerly, compiled and with
several decode steps per launch (each step reads its own width)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import pytest
import torch
from test_decode_attention import CASES, World, make_world

import graphrunner_ref.model.attention_live as attention_live
from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.cli.model_args import check_attention
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model
from graphrunner_ref.model.attention_backend import LIVE_FROM_CAPACITY, TorchPagedBackend
from graphrunner_ref.model.attention_live import COLUMN_STEP, live_decode_attention
from graphrunner_ref.model.default import default_config


def _live(world: World) -> torch.Tensor:
    rows, heads, dim = world.q.shape
    q = world.q.view(rows, heads // world.group, world.group, dim).cpu()
    out = live_decode_attention(
        q,
        world.k.cpu(),
        world.v.cpu(),
        world.req_to_token.cpu(),
        world.req.cpu(),
        world.lens.cpu(),
        1 / math.sqrt(dim),
    )
    return out.reshape(rows, heads, dim)


@pytest.mark.parametrize(("lens", "kv_heads", "group", "head_dim", "ctx", "page", "splits"), CASES)
@pytest.mark.parametrize("pad", [0, 3])
def test_live_attention_equals_the_full_width_reference(
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    ctx: int,
    page: int,
    splits: int,
    pad: int,
) -> None:
    world = make_world(
        lens, kv_heads=kv_heads, group=group, head_dim=head_dim, ctx=ctx, page_size=page, pad=pad
    )
    got, expected = _live(world), world.reference().cpu()
    assert not got.isnan().any()  # NaN sits in every slot no live row reads
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("longest", [1, COLUMN_STEP, COLUMN_STEP + 1, 150])
def test_it_gathers_no_column_past_the_longest_live_row(
    monkeypatch: pytest.MonkeyPatch, longest: int
) -> None:
    ctx, widths = 1024, []
    gathered = attention_live.gathered_attention

    def counted(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, *a: Any
    ) -> torch.Tensor:
        widths.append(slots.shape[1])
        return gathered(q, k, v, slots, *a)

    monkeypatch.setattr(attention_live, "gathered_attention", counted)
    _live(make_world([longest, 1], ctx=ctx, pad=2))
    assert widths == [min(ctx, -(-longest // COLUMN_STEP) * COLUMN_STEP)]  # not 1024


def test_bfloat16_matches_the_reference_within_its_precision() -> None:
    world = make_world([5, 97, 33], dtype=torch.bfloat16, pad=1)
    got, expected = _live(world).float(), world.reference().cpu()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


CONFIG = dataclasses.replace(default_config(), max_position_embeddings=2048)


def _serve(attention: str, capacity: int, kind: str, steps: int = 1) -> EngineResult:
    bundle = default_model(max_requests=4, max_context_len=capacity, config=CONFIG)
    bundle.model.attn_backend.use(attention)
    multi = {"steps_per_launch": steps} if steps > 1 else {}
    runner = create_decode_runner(
        bundle, kind, capture_sizes=[4], show_progress=False, check_padding=True, **multi
    )
    runner.capture()
    trace = [
        Request(rid=i, prompt=tuple(range(3 + i, 3 + i + n)), max_new_tokens=m, arrival_step=i)
        for i, (n, m) in enumerate([(20, 12), (60, 9), (31, 14), (5, 10)])
    ]
    return Engine(bundle, runner, **multi).run(trace)


@pytest.mark.parametrize(("kind", "capacity"), [("eager", 128), ("eager", 2048), ("cpu", 2048)])
def test_the_model_gives_the_reference_tokens_at_any_capacity(kind: str, capacity: int) -> None:
    expected = _serve("torch", 128, "eager").outputs
    assert _serve("live", capacity, kind).outputs == expected


def test_each_step_of_a_multi_step_launch_reads_its_own_live_width() -> None:
    # The rows grow inside the launch: a width fixed at its first step would
    # drop the newest keys (the sanitizer is on in every run).
    expected = _serve("torch", 128, "eager").outputs
    assert _serve("live", 2048, "eager", steps=4).outputs == expected


def test_a_model_on_the_cpu_runs_the_live_attention_by_its_kv_dtype_and_capacity() -> None:
    """A float32 KV cache: the live attention (the C++ kernel) at every
    capacity; another dtype (the torch reference's live gather): from
    LIVE_FROM_CAPACITY up, the fused full width below."""

    def kernel(capacity: int, dtype: torch.dtype = torch.float32) -> str:
        bundle = default_model(max_requests=1, max_context_len=capacity, config=CONFIG, dtype=dtype)
        return bundle.model.attn_backend.kernel

    assert kernel(16) == kernel(LIVE_FROM_CAPACITY) == "live"
    assert kernel(LIVE_FROM_CAPACITY - 1, torch.bfloat16) == "torch"
    assert kernel(LIVE_FROM_CAPACITY, torch.bfloat16) == "live"
    backend = default_model(max_requests=1, max_context_len=2048, config=CONFIG).model.attn_backend
    backend.use("torch")  # the reference stays one call away
    assert backend.kernel == "torch"


@pytest.mark.cuda
def test_a_backend_on_cuda_refuses_the_live_attention_by_name() -> None:
    table = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"kernel='live' on a CUDA device: expected 'triton'"):
        TorchPagedBackend(table, kernel="live")


@pytest.mark.parametrize(
    ("attention", "device", "message"),
    [
        ("live", "cuda:0", "--attention live runs on the CPU; the device here is cuda:0"),
        ("triton", "cpu", "--attention triton needs a CUDA device; the device here is cpu"),
    ],
)
def test_the_cli_names_an_attention_its_device_cannot_run(
    attention: str, device: str, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        check_attention(argparse.Namespace(attention=attention, device=device))

"""The CPU decode attention in C++ (:mod:`graphrunner_ref.model.attention_cpu`):
it equals the torch reference (:func:`live_decode_attention`) for random
lengths, groups, head sizes, pages and padded rows, over a float32 or a
float16 cache (read as its exact float32 widening), reads no slot outside a
row's live tokens (every other slot holds NaN), gives a row the same output
bit for bit alone or in a batch, refuses out-of-range rows by name, and is
what the live attention runs in a float32 CPU model. Each of its paths
(AVX2; AVX-512 where the CPU has it) is held to the reference, the two to
each other, and hiding AVX-512 runs the AVX2 one."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_decode_attention import CASES, World, make_world

from graphrunner.testing import torch_threads
from graphrunner_ref.model.attention_cpu import (
    cpp_attention_runs,
    cpp_attention_status,
    cpp_decode_attention,
    decode_path,
    runnable_paths,
    use_path,
    using_path,
)
from graphrunner_ref.model.attention_live import LiveRows, live_attention, live_decode_attention
from graphrunner_ref.model.cpu_features import kernel_path


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    why = cpp_attention_status()
    if why is not None:
        pytest.skip(f"the C++ attention cannot run here: {why}")


def _grouped(world: World) -> tuple[torch.Tensor, ...]:
    rows, heads, dim = world.q.shape
    q = world.q.view(rows, heads // world.group, world.group, dim)
    return q, world.k, world.v, world.req_to_token, world.req, world.lens


@pytest.mark.parametrize(("lens", "kv_heads", "group", "head_dim", "ctx", "page", "splits"), CASES)
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_it_equals_the_torch_reference_and_reads_only_live_slots(
    attention_path: str,
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    ctx: int,
    page: int,
    splits: int,
    pad: int,
    kv_dtype: torch.dtype,
) -> None:
    world = make_world(
        lens, kv_heads=kv_heads, group=group, head_dim=head_dim, ctx=ctx, page_size=page, pad=pad
    )
    q, k, v, table, req, lens_t = _grouped(world)
    rows = (table, req, lens_t, 1 / math.sqrt(head_dim))
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = cpp_decode_attention(q, k, v, *rows)
    ref = live_decode_attention(q, k, v, *rows)
    assert out.shape == ref.shape and bool(torch.isfinite(out).all())  # NaN slots never read
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # A float16 cache is read as its exact float32 widening: the same sums.
    assert torch.equal(out, cpp_decode_attention(q, k.float(), v.float(), *rows))


def test_a_cache_of_another_dtype_is_refused_by_name() -> None:
    world = make_world([3, 4], kv_heads=1, group=2, head_dim=8, ctx=64)
    q, k, v, table, req, lens = _grouped(world)
    with pytest.raises(RuntimeError, match=r"float32 or float16 alike .* BFloat16"):
        cpp_decode_attention(q, k.bfloat16(), v.bfloat16(), table, req, lens, 1.0)
    with pytest.raises(RuntimeError, match=r"float32 or float16 alike .* Half and .* Float"):
        cpp_decode_attention(q, k.half(), v, table, req, lens, 1.0)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_is_the_same_alone_and_in_a_batch(attention_path: str, threads: int) -> None:
    # Two threads: a row alone is split by KV head over them, a batch by row.
    world = make_world([7, 90, 33, 1], kv_heads=3, group=3, head_dim=64, ctx=128)
    q, k, v, table, req, lens = _grouped(world)
    with torch_threads(threads):
        batch = cpp_decode_attention(q, k, v, table, req, lens, 0.125)
        for b in range(q.shape[0]):
            alone = cpp_decode_attention(
                q[b : b + 1], k, v, table, req[b : b + 1], lens[b : b + 1], 0.125
            )
            assert torch.equal(alone[0], batch[b]), b


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_paths_agree_within_float32_rounding_at_long_contexts(kv_dtype: torch.dtype) -> None:
    # Lengths off every block size (8 keys, 32 values, 16 ahead), 5 query
    # heads a KV head (a block of 4 and one of 1), pages scattered.
    paths = runnable_paths()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs one attention path ({paths[0]})")
    world = make_world([1000, 257, 31, 1], kv_heads=3, group=5, head_dim=64, ctx=1024, pad=1)
    q, k, v, table, req, lens = _grouped(world)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    ref = live_decode_attention(q, k, v, table, req, lens, 0.125)
    outs = {}
    for name in paths:
        with using_path(name):
            outs[name] = cpp_decode_attention(q, k, v, table, req, lens, 0.125)
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(outs["avx512"], outs["avx2"], rtol=1e-5, atol=1e-6)


def test_use_path_refuses_a_name_it_does_not_know_or_this_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"use_path: name = 'neon', expected one of"):
        use_path("neon")
    if "avx512" not in runnable_paths():
        with pytest.raises(ValueError, match=r"name = 'avx512', which this CPU cannot run"):
            use_path("avx512")
    with pytest.raises(RuntimeError, match=r"use_path: code = 7, expected 0 \(AVX2\)"):
        torch.ops.graphrunner_attention.use_path(7)


_HIDDEN_AVX512 = """
import sys, torch
from graphrunner_ref.model.attention_cpu import cpp_attention_status, cpp_decode_attention, decode_path
assert cpp_attention_status() is None
args = torch.load(sys.argv[1])
out = cpp_decode_attention(*args, 0.125)
torch.save(out, sys.argv[2])
print(decode_path().name)
"""


def test_hiding_avx512_runs_the_avx2_path(tmp_path: Path) -> None:
    world = make_world([300, 41], kv_heads=3, group=3, head_dim=64, ctx=320)
    args = _grouped(world)
    torch.save(args, tmp_path / "args.pt")
    env = {**os.environ, "GRAPHRUNNER_CPU_DISABLE": "avx512f"}
    proc = subprocess.run(
        [sys.executable, "-c", _HIDDEN_AVX512, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "avx2"
    with using_path("avx2"):
        want = cpp_decode_attention(*args, 0.125)
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lens", 0, r"seq_lens\[1\] = 0, expected 1\.\.64"),
        ("lens", 65, r"seq_lens\[1\] = 65, expected 1\.\.64"),
        ("req", 9, r"req_pool_indices\[1\] = 9 out of range \[0, 3\)"),
    ],
)
def test_an_out_of_range_row_is_refused_by_name(field: str, value: int, message: str) -> None:
    world = make_world([3, 4], kv_heads=1, group=2, head_dim=8, ctx=64)
    getattr(world, field)[1] = value
    with pytest.raises(RuntimeError, match=message):
        cpp_decode_attention(*_grouped(world), 1.0)


def test_the_live_attention_runs_it_for_float32_cpu_tensors_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = make_world([5, 9], kv_heads=2, group=2, head_dim=16, ctx=64)
    q, k, v, table, req, lens = _grouped(world)
    assert cpp_attention_runs(q, k) and not cpp_attention_runs(q.bfloat16(), k.bfloat16())
    calls: list[int] = []
    monkeypatch.setattr(
        "graphrunner_ref.model.attention_live.cpp_decode_attention",
        lambda *args: calls.append(1) or cpp_decode_attention(*args),
    )
    live_attention(q, k, v, LiveRows(table, req, lens), 0.25)
    live_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), LiveRows(table, req, lens), 0.25)
    assert calls == [1]


def test_compiled_it_is_one_extern_call_equal_to_eager() -> None:
    world = make_world([12, 40, 3], kv_heads=2, group=4, head_dim=32, ctx=96, pad=2)
    args = _grouped(world)

    def step(*a: torch.Tensor) -> torch.Tensor:
        return cpp_decode_attention(*a, 0.2) * 2.0

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(*args), step(*args), rtol=0, atol=0)


_SAVE_OR_LOAD = """
import dataclasses, json, sys
import torch
from graphrunner_ref import create_decode_runner
from graphrunner_ref.model import default_model
from graphrunner_ref.model.default import default_config
config = dataclasses.replace(default_config(), max_position_embeddings=1024)
bundle = default_model(max_requests=2, max_context_len=600, config=config)
runner = create_decode_runner(bundle, "cpu", capture_sizes=[2], aot_cache=sys.argv[1])
report = runner.capture()
print(json.dumps([bundle.model.attn_backend.kernel, report.cache_hits]))
"""


def test_a_saved_program_calling_it_loads_in_a_fresh_process(tmp_path: Path) -> None:
    # The saved program calls the C++ op; a process that loads it traces
    # nothing, so the op must be registered when the backend picks the kernel
    # (without that the program is refused and rebuilt: tried).
    def run() -> list[object]:
        proc = subprocess.run(
            [sys.executable, "-c", _SAVE_OR_LOAD, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return list(json.loads(proc.stdout.strip().splitlines()[-1]))

    assert run() == ["live", 0]  # built and saved
    assert run() == ["live", 1]  # loaded, not rebuilt


def test_the_compact_kernels_table_sends_the_attention_to_its_own_path() -> None:
    path = decode_path()
    assert path is not None and path.name in runnable_paths()
    with pytest.raises(ValueError, match=r"kernel_path\('attention'\).*decode_path\(\)"):
        kernel_path("attention")

"""A float16 KV cache under a float32 model on the CPU (``--kv-dtype float16``,
``kv_dtype=``): the cache holds float16, the C++ attention and rotary + KV
write run over it, the compiled CPU runner's steps equal the eager model's on
the same cache with padded rows in the batch (``--check``, the sanitizer),
its answers stay within a float16 rounding of a float32 cache's, saved
programs are keyed by it, and every dtype or device the attention cannot
read is refused by name before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import graphrunner_ref.cli.main as cli
from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.engine.bundle import aot_key
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.model import default_model
from graphrunner_ref.model.attention_cpu import cpp_attention_status
from graphrunner_ref.model.build import check_kv_dtype

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    why = cpp_attention_status()
    if why is not None:
        pytest.skip(f"the C++ kernels cannot run here: {why}")


def _serve(kv_dtype: torch.dtype, runner: str, **options: object) -> tuple[object, object]:
    """The greedy tokens of PROMPTS (8 new each) through ``runner`` captured at
    size 4 (3 of the 4 prompts' rows live at the end: padded rows), and the bundle."""
    bundle = default_model(max_requests=4, max_context_len=32, kv_dtype=kv_dtype)
    step = create_decode_runner(bundle, runner, capture_sizes=[4], **options)  # type: ignore[arg-type]
    step.capture()
    result = Engine(bundle, step).run(requests_from_prompts(PROMPTS, max_new_tokens=8))
    return {rid: list(t) for rid, t in result.outputs.items()}, bundle


def test_the_cache_is_float16_and_the_cpu_runner_equals_eager_on_it() -> None:
    eager, bundle = _serve(torch.float16, "eager")
    assert all(b.dtype == torch.float16 for b in bundle.kv_cache.k_buffers)  # type: ignore[attr-defined]
    assert bundle.model.attn_backend.kernel == "live"  # type: ignore[attr-defined]
    compiled, _ = _serve(torch.float16, "cpu", check_padding=True)
    assert compiled == eager


def test_the_cache_holds_float16_roundings_of_what_a_float32_cache_holds() -> None:
    """One prompt's prefill: the same forward up to the first write, so each
    key and value of layer 0 is the float32 cache's value rounded to float16."""
    caches = {}
    for kv_dtype in (torch.float32, torch.float16):
        bundle = default_model(max_requests=1, max_context_len=16, kv_dtype=kv_dtype)
        step = create_decode_runner(bundle, "eager", capture_sizes=[1])
        step.capture()
        Engine(bundle, step).run(requests_from_prompts([[5, 6, 7, 8]], max_new_tokens=1))
        caches[kv_dtype] = bundle.kv_cache.k_buffers[0]
    assert caches[torch.float16].abs().sum() > 0
    assert torch.equal(caches[torch.float16], caches[torch.float32].half())


def test_saved_programs_are_keyed_by_the_caches_dtype() -> None:
    keys = [
        aot_key(default_model(max_requests=1, max_context_len=8, kv_dtype=d))
        for d in (None, torch.float16)
    ]
    assert keys[0]["kv dtype"] == "float32" and keys[1]["kv dtype"] == "float16"
    assert {k: v for k, v in keys[0].items() if k != "kv dtype"} == {
        k: v for k, v in keys[1].items() if k != "kv dtype"
    }


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "device", "message"),
    [
        (
            torch.bfloat16,
            torch.float32,
            "cpu",
            "a float32 model's KV cache may be float32, float16",
        ),
        (torch.float16, torch.bfloat16, "cpu", "a bfloat16 model's KV cache may be bfloat16$"),
        (torch.float16, torch.float32, "cuda", "runs on the CPU; the device here is cuda"),
    ],
)
def test_a_cache_the_attention_cannot_read_is_refused_by_name(
    kv_dtype: torch.dtype, dtype: torch.dtype, device: str, message: str
) -> None:
    with pytest.raises(ValueError, match=f"kv_dtype={str(kv_dtype)[6:]}: .*{message}"):
        check_kv_dtype(kv_dtype, dtype, device)
    assert check_kv_dtype(None, dtype, device) == dtype
    assert check_kv_dtype(dtype, dtype, device) == dtype


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def test_the_cli_runs_it_checked_against_eager(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "6", "--runner"]
    argv += ["cpu", "--kv-dtype", "float16", "--check", "--max-bs", "4"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == len(PROMPTS)
    assert "mismatches: 0" in captured.err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-dtype", "bfloat16"], "--kv-dtype bfloat16: a float32 model's KV cache may be"),
        (["--kv-dtype", "float16", "--dtype", "bfloat16"], "a bfloat16 model's KV cache may be"),
        (["--kv-dtype", "half"], "argument --kv-dtype: invalid choice: 'half'"),
    ],
)
def test_the_cli_refuses_a_cache_it_cannot_read_before_any_work(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), "--runner", "cpu", *extra]
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's own refusals
        code = int(stop.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_demo_checks_a_float16_cache_within_float16s_tolerance(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A graph's key one float32 rounding off eager's may round to the
    neighbouring float16: the check's tolerance is the cache's, not float32's
    (which counted such steps as mismatches)."""
    assert cli.main(["demo", "--runner", "cpu", "--kv-dtype", "float16", "--steps", "120"]) == 0
    assert "mismatches: 0" in capsys.readouterr().out


def test_the_checks_tolerance_is_the_coarser_of_the_model_and_the_cache() -> None:
    from graphrunner_ref.engine.config import EngineConfig

    assert EngineConfig().atol == 1e-4
    assert EngineConfig(kv_dtype="float32").atol == 1e-4
    assert EngineConfig(kv_dtype="float16").atol == EngineConfig(dtype="float16").atol == 0.05
    assert EngineConfig(dtype="bfloat16", kv_dtype="bfloat16").atol == 0.25

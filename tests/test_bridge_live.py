"""The bridge's decode cost follows the live context: its CPU attention reads
each row only up to its own live slots (plain attention, through the native
model's live attention and its C++ kernel) or the batch's longest live row
(rounded up to the column step: a window, softcap or sinks), not the pool's
whole capacity, and still answers as transformers' greedy ``generate`` does,
padded and under the sanitizer, on the eager and the compiled CPU runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner_ref.bridge.attention as attention
from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.bridge import load_transformers
from graphrunner_ref.model.attention_live import COLUMN_STEP
from hf_tiny import TINY_DECODER, hf_greedy, mixed_trace, save_decoders

transformers = pytest.importorskip("transformers")

#: A pool four column steps wide: the live rows below stay within the first.
CAPACITY = 4 * COLUMN_STEP
_SMALL = {**TINY_DECODER, "max_position_embeddings": CAPACITY}
TRACE = mixed_trace()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    t = transformers
    return save_decoders(
        tmp_path_factory,
        {
            "qwen2": t.Qwen2Config(**_SMALL),
            "gemma2": t.Gemma2Config(
                **_SMALL,
                head_dim=8,
                sliding_window=4,
                query_pre_attn_scalar=16,
                attn_logit_softcapping=0.5,
                final_logit_softcapping=2.0,
            ),
        },
    )


def _answers_as_transformers(path: Path, reference: Any, kind: str) -> None:
    """The trace served through the bridge on runner ``kind`` (padded, under
    the sanitizer) gives transformers' greedy tokens."""
    bundle = load_transformers(path, max_requests=4, max_context_len=CAPACITY)
    runner = create_decode_runner(bundle, kind, capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(TRACE)
    assert result.outputs == hf_greedy(reference, TRACE)
    assert runner.stats.padded_rows > 0
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0


@pytest.fixture
def widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The column widths the bridge's attention read, call by call."""
    seen: list[int] = []
    real = attention.rows_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        width = args[10] if len(args) > 10 else kwargs.get("width")
        seen.append(args[3].shape[1] if width is None else width)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "rows_attention", spy)
    return seen


@pytest.mark.parametrize("kind", ["eager", "cpu"])
def test_plain_attention_answers_as_transformers_through_the_native_live_attention(
    kind: str,
    saved: dict[str, tuple[Path, Any]],
    widths: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, reference = saved["qwen2"]
    native: list[int] = []  # the token rows of each eager call (a compiled program calls the op)
    real = attention.live_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            native.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention, "live_attention", spy)
    _answers_as_transformers(path, reference, kind)
    assert not widths  # never the gathered columns
    assert native, "the eager prompts never took the native live attention"


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
def test_the_native_live_attention_equals_the_gathered_one(cache: torch.dtype) -> None:
    """Each token row over its own slots, grouped heads, a padded row on the
    sink slot 0: as :func:`~graphrunner_ref.bridge.attention.rows_attention`."""
    torch.manual_seed(0)
    slots, kv_heads, heads, dim = 400, 2, 6, 8
    k_all = torch.randn(slots, kv_heads, dim).to(cache)
    v_all = torch.randn(slots, kv_heads, dim).to(cache)
    req_to_token = torch.zeros(3, CAPACITY, dtype=torch.int32)
    req_to_token[1:] = torch.randint(1, slots, (2, CAPACITY), dtype=torch.int32)
    rows, lens = torch.tensor([1, 2, 2, 0]), torch.tensor([COLUMN_STEP + 1, 3, 4, 1])
    q = torch.randn(4, heads, dim)
    step = attention.StepKV(None, req_to_token, rows, lens, rows)  # type: ignore[arg-type]
    ours = attention._native_live(q, k_all, v_all, step, 0.3)
    full = attention.rows_attention(q, k_all, v_all, req_to_token, rows, lens, 0.3, None, None)
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kind", "arch"), [("eager", "gemma2"), ("cpu", "gemma2")])
def test_a_wide_pool_answers_as_transformers_reading_only_live_columns(
    kind: str, arch: str, saved: dict[str, tuple[Path, Any]], widths: list[int]
) -> None:
    path, reference = saved[arch]
    _answers_as_transformers(path, reference, kind)
    # Every step and prompt of the trace fits in the first column step.
    assert widths and set(widths) == {COLUMN_STEP}


def test_the_width_covers_the_longest_row_alone(widths: list[int]) -> None:
    """A batch whose longest row crosses a column step reads one step more,
    and the result equals the full-width attention's."""
    torch.manual_seed(0)
    slots, kv_heads, heads, dim = 400, 2, 4, 8
    k_all, v_all = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.zeros(3, CAPACITY, dtype=torch.int32)
    req_to_token[1:] = torch.randint(1, slots, (2, CAPACITY), dtype=torch.int32)
    rows, lens = torch.tensor([1, 2, 0]), torch.tensor([COLUMN_STEP + 1, 3, 1])
    q = torch.randn(3, heads, dim)
    live = attention.live_rows_attention(
        q, k_all, v_all, req_to_token, rows, lens, 0.3, None, 0.5, None
    )
    full = attention.rows_attention(q, k_all, v_all, req_to_token, rows, lens, 0.3, None, 0.5, None)
    torch.testing.assert_close(live, full, rtol=1e-6, atol=1e-6)
    assert widths == [2 * COLUMN_STEP, CAPACITY]

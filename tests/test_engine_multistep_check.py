"""``Engine(check=True, steps_per_launch=N)``: each launch against N single
eager decode steps of its running rows: no mismatch on a faithful runner
(greedy, sampled, end tokens, pages), and a planted wrong token or a stray
KV write is counted."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from test_engine_multistep_logprobs import CTX, _trace

from graphrunner_ref import Engine, create_decode_runner, default_model
from graphrunner_ref.engine.results import EngineResult


def _run(
    n: int,
    sampled: bool,
    *,
    end_token: int | None = None,
    page_size: int = 1,
    check: bool = True,
    plant: Callable[[Any, Any], None] | None = None,
    kind: str = "eager",
) -> EngineResult:
    bundle = default_model(max_requests=4, max_context_len=CTX, page_size=page_size)
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=[2, 4],
        sampling=sampled,
        steps_per_launch=n,
        end_token=end_token if n > 1 else None,
        check_padding=True,
    )
    runner.capture()
    if plant is not None:
        replay, launches = runner.replay, [0]

        def planted(inputs: Any) -> Any:
            out = replay(inputs)
            launches[0] += 1
            if launches[0] == 2:  # the second launch only
                plant(out, bundle)
            return out

        vars(runner)["replay"] = planted  # the instance's replay, the engine's calls go to it
    free = bundle.kv_alloc.available_size()
    engine = Engine(bundle, runner, check=check, end_token=end_token, steps_per_launch=n, seed=4)
    result = engine.run(_trace(sampled))
    assert bundle.kv_alloc.available_size() == free
    return result


@functools.cache
def _reference(sampled: bool, end_token: int | None) -> dict[int, list[int]]:
    return _run(1, sampled, end_token=end_token, check=False).outputs


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_faithful_launch_has_no_mismatch(n: int, sampled: bool, page_size: int) -> None:
    result = _run(n, sampled, page_size=page_size)
    s = result.stats
    assert result.outputs == _reference(sampled, None)
    assert s.mismatches == 0 and s.token_flips == 0
    assert s.checked_steps == s.steps == n * s.launches > 0
    assert s.max_logit_diff <= 1e-4 and s.max_kv_diff <= 1e-4


@pytest.mark.parametrize("n", [2, 4])
def test_rows_stopping_at_the_end_token_are_checked_too(n: int) -> None:
    end = _reference(False, None)[8][3]
    result = _run(n, False, end_token=end)
    assert result.outputs == _reference(False, end)
    assert any(out[-1] == end and len(out) > 1 for out in result.outputs.values())
    assert result.stats.mismatches == 0


def test_a_compiled_launch_has_no_mismatch() -> None:
    result = _run(2, True, kind="cpu")
    assert result.outputs == _reference(True, None)
    assert result.stats.mismatches == 0 and result.stats.checked_steps > 0


def _wrong_token(out: Any, bundle: Any) -> None:
    out["tokens"][0, 0] = (out["tokens"][0, 0] + 1) % 256


def _stray_kv_write(out: Any, bundle: Any) -> None:
    bundle.kv_cache.k_buffers[0][-1] += 1.0  # a slot no row reserved


@pytest.mark.parametrize("plant", [_wrong_token, _stray_kv_write], ids=["token", "kv"])
@pytest.mark.parametrize("n", [2, 4])
def test_a_planted_discrepancy_is_counted(n: int, plant: Callable[[Any, Any], None]) -> None:
    result = _run(n, False, plant=plant)
    assert result.stats.mismatches == 1
    if plant is _wrong_token:
        assert result.stats.token_flips == 1
    else:
        assert result.stats.max_kv_diff >= 1.0


def test_check_mode_still_refuses_overlap() -> None:
    bundle = default_model(max_requests=2, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], steps_per_launch=2)
    assert Engine(bundle, runner, check=True, steps_per_launch=2).check
    with pytest.raises(ValueError, match="check=True with overlap=True"):
        Engine(bundle, runner, check=True, overlap=True, steps_per_launch=2)

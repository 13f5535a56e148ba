"""``bench.bench_structured`` without vLLM and over stand-in servers: the
schema check takes what the schema allows and nothing else; without
``GRAPHRUNNER_VLLM_PYTHON`` graphrunner's server runs alone and vLLM is never
started; with it, ``bench.bench_vllm_serve``'s vLLM contender (bfloat16, one
thread, 127.0.0.1) serves the same checkpoint and its ratio goes beside
graphrunner's in one table."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import bench.bench_structured as b
from bench.bench_vllm_serve import Contender

GOOD = {"color": "red", "count": 12, "ok": True, "sizes": [1, 2]}


@pytest.mark.parametrize(
    "answer",
    [
        {"color": "pink", "count": 12, "ok": True, "sizes": []},  # not in the enum
        {"color": "red", "count": 1000, "ok": True, "sizes": []},  # above the maximum
        {"color": "red", "count": True, "ok": True, "sizes": []},  # a boolean is no integer
        {"color": "red", "count": 1, "ok": 1, "sizes": []},  # an integer is no boolean
        {"color": "red", "count": 1, "ok": True, "sizes": [1, 2, 3, 4]},  # over maxItems
        {"color": "red", "count": 1, "ok": True, "sizes": [100]},  # an item above its maximum
        {"color": "red", "count": 1, "ok": True},  # a required key missing
        {**GOOD, "extra": 1},  # additionalProperties false
        [GOOD],  # not an object
    ],
)
def test_the_schema_check_refuses_what_the_schema_does(answer: Any) -> None:
    assert b.parses_and_validates(json.dumps(GOOD))
    assert not b.parses_and_validates(json.dumps(answer))


def test_an_answer_cut_short_does_not_parse() -> None:
    assert not b.parses_and_validates(json.dumps(GOOD)[:-3])


def _row(ratio: float) -> dict[str, Any]:
    return {
        "requests": 4,
        "concurrency": 2,
        "prompt_len": 16,
        "mean_answer_tokens": 40.0,
        "json_answers": 6,
        "json_valid": 6,
        "json_valid_from_first_brace": 6,
        "json_cut_at_max_tokens": 0,
        "json_invalid_examples": [],
        "json_example": json.dumps(GOOD),
        "structured_tok_s": 50.0 * ratio,
        "free_tok_s": 50.0,
        "ratio": ratio,
        "load_average": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]],
    }


class _Proc:
    def terminate(self) -> None:
        pass

    def wait(self, timeout: float) -> int:
        return 0


def _stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Contender]:
    """Servers and measures stood in for; the contenders vLLM would start."""
    started: list[Contender] = []
    cut = '{"color": "red", "count": 1'
    rows = iter([_row(1.13), _row(0.8) | {"json_valid": 5, "json_invalid_examples": [cut]}])

    @contextmanager
    def serving(contender: Contender, port: int, logs: Path) -> Iterator[None]:
        started.append(contender)
        yield

    monkeypatch.setattr(b, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(b, "start_server", lambda model, extra: (_Proc(), "http://x"))
    monkeypatch.setattr(b, "_measure", lambda url, model, args: next(rows))
    monkeypatch.setattr(b, "serving", serving)
    monkeypatch.setattr(b, "vllm_system", lambda: "vLLM 9.9 (torch 9.9)")
    return started


def test_without_vllm_graphrunner_runs_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GRAPHRUNNER_VLLM_PYTHON", raising=False)
    started = _stand_ins(monkeypatch, tmp_path)
    assert b.main(["--model", "ckpt", "--name", "t"]) == 0
    assert started == []
    text = next(tmp_path.glob("structured-t-*.md")).read_text()
    assert "| graphrunner | 50.0 | 56.5 | 1.13x | 40.0 | 6/6 (6) | 0 |" in text
    assert "failed the schema check" not in text
    assert "not measured (GRAPHRUNNER_VLLM_PYTHON unset)" in text
    result = json.loads(next(tmp_path.glob("structured-t-*.json")).read_text())
    assert list(result["servers"]) == ["graphrunner"] and "vllm" not in result


def test_with_vllm_its_ratio_goes_beside_graphrunners(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GRAPHRUNNER_VLLM_PYTHON", sys.executable)
    started = _stand_ins(monkeypatch, tmp_path)
    assert b.main(["--model", "ckpt", "--name", "t", "--context", "256"]) == 0
    [vllm] = started
    assert vllm.label.startswith("vLLM") and vllm.command[1:3] == ("serve", "ckpt")
    for pair in (("--dtype", "bfloat16"), ("--host", "127.0.0.1"), ("--max-model-len", "256")):
        i = vllm.command.index(pair[0])
        assert vllm.command[i : i + 2] == pair
    assert ("OMP_NUM_THREADS", "1") in vllm.env
    assert tuple(c.format(port=1) for c in vllm.command[-2:]) == b.VLLM_NO_FREE_WHITESPACE
    text = next(tmp_path.glob("structured-t-*.md")).read_text()
    assert "| graphrunner | 50.0 | 56.5 | 1.13x |" in text
    assert f"| {vllm.label} | 50.0 | 40.0 | 0.80x | 40.0 | 5/6 (6) |" in text
    assert f"{vllm.label}'s answers that failed the schema check" in text
    assert "graphrunner's answers that failed" not in text
    assert "0.80x (vLLM CPU, bfloat16, vLLM 9.9 (torch 9.9)), measured in this run" in text
    result = json.loads(next(tmp_path.glob("structured-t-*.json")).read_text())
    assert list(result["servers"]) == ["graphrunner", vllm.label]
    assert result["vllm"] == "vLLM 9.9 (torch 9.9)"

"""``generate --tp N`` / ``demo --tp N``: the command starts its ranks itself
(two gloo processes here), rank 0 alone prints and writes; a failing rank
ends the run naming it; what does not combine is refused before any rank."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
from test_tensor_parallel_alone import count_collectives

import graphrunner_ref.cli.main as cli
from graphrunner_ref.cli.tp import FAIL_RANK_ENV
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.ranks import rank0_admits
from graphrunner_ref.engine.workload import Request, requests_from_prompts
from graphrunner_ref.model import default_model
from hf_ssm import save_tiny_mamba
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

#: Five prompts at once over capture sizes 1 and 8: every batch of 2..5 rows is padded to 8.
PROMPTS = [[5, 17, 200], [9], [30, 31, 32, 33, 34], [0, 0, 1], [255, 128, 64]]
NEW_TOKENS = 6
STDIN = "".join(json.dumps(p) + "\n" for p in PROMPTS).encode()
SUMMARY = "generate: 5 requests"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny Llama checkpoint and transformers' greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("tp") / "llama"
    requests = [Request(i, tuple(p), NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens = hf_greedy(save_tiny_llama(path), requests)
    return path, [tokens[i] for i in range(len(PROMPTS))]


def _generate(model: Path, output: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(model), "--prompts", "-", "--prompts-format", "ids",
        "--max-new-tokens", str(NEW_TOKENS), "--capture-sizes", "1,8", "--check-padding",
        "--check", "--output", str(output), *extra,
    ]  # fmt: skip


def _stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(STDIN)))


def _tokens(output: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in output.read_text().splitlines()]


def test_two_ranks_answer_as_one_and_as_transformers(
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Padded batches under the sanitizer and the eager check, prompts from
    stdin (rank 0's, broadcast), --output written by rank 0 alone, the
    summary printed once; no worker outlives the run."""
    model, expected = checkpoint
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _stdin(monkeypatch)
    assert cli.main(_generate(model, one / "out.jsonl", "--runner", "eager")) == 0
    _stdin(monkeypatch)
    capfd.readouterr()
    assert cli.main(_generate(model, two / "out.jsonl", "--runner", "eager", "--tp", "2")) == 0
    err = capfd.readouterr().err
    assert _tokens(one / "out.jsonl") == _tokens(two / "out.jsonl") == expected
    assert sorted(p.name for p in two.iterdir()) == ["out.jsonl"]
    assert err.count(SUMMARY) == 1, err
    assert err.count("mismatches: 0") == 1, err
    assert "padded rows 0.0%" not in err  # the batches were padded
    assert multiprocessing.active_children() == []


def test_a_failing_rank_ends_the_run_naming_it(
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(FAIL_RANK_ENV, "1")  # rank 1 raises once it joined; rank 0 waits on it
    _stdin(monkeypatch)
    capfd.readouterr()
    rc = cli.main(
        _generate(checkpoint[0], tmp_path / "out.jsonl", "--runner", "eager", "--tp", "2")
    )
    err = capfd.readouterr().err
    assert rc == 1
    assert err.strip().splitlines() == [
        f"graphrunner generate: rank 1: RuntimeError: {FAIL_RANK_ENV}=1: a planted failure"
    ]
    assert not (tmp_path / "out.jsonl").exists()
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--tp", "0"], "--tp 0: expected 1..8"),
        (["--tp", "-2"], "--tp -2: expected 1..8"),
        (["--tp", "9"], "--tp 9: expected 1..8"),
        (["--tp", "3"], "--tp 3: ModelConfig.num_heads=4: expected a multiple of the "),
        (["--tp", "2", "--overlap"], "--tp 2 with --overlap: not combined yet"),
        (["--tp", "2", "--steps-per-launch", "2"], "--tp 2 with --steps-per-launch 2: not"),
        (["--tp", "2", "--speculative", "eagle"], "--tp 2 with --speculative: not"),
    ],
)
def test_what_tp_cannot_run_exits_2_naming_it(
    extra: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    rc = cli.main(["demo", "--runner", "eager", "--steps", "5", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"graphrunner demo: error: {expected}" in err


def test_a_mamba_checkpoint_is_refused_with_tp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_mamba(tmp_path / "mamba")
    rc = cli.main(["generate", "--model", str(tmp_path / "mamba"), "--prompt", "1", "--tp", "2"])
    assert rc == 2
    assert "--tp 2: --model" in capsys.readouterr().err


def test_tp_one_runs_the_collectives_in_a_group_of_its_own(
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """--tp 1: no worker spawned, this process joins a group of one and the
    sharded model's all-reduces and all-gather run (counted), with the
    tokens of the run without --tp and transformers'; combinations --tp N
    refuses run alone (--overlap here); the group is left afterwards."""
    model, expected = checkpoint
    calls = count_collectives(monkeypatch)
    for extra in ([], ["--overlap"]):
        _stdin(monkeypatch)
        out, before = tmp_path / f"out{len(extra)}.jsonl", calls["all_reduce"]
        assert cli.main(_generate(model, out, "--runner", "eager", "--tp", "1", *extra)) == 0
        assert _tokens(out) == expected, extra
        assert calls["all_reduce"] > before, extra  # this run's collectives
        assert not torch.distributed.is_initialized()
    assert multiprocessing.active_children() == []
    err = capfd.readouterr().err
    assert err.count("mismatches: 0") == 2, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_under_torchrun_the_process_is_its_rank(
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torchrun's environment (one rank here): no spawn, the env:// group
    joined and left; --tp other than WORLD_SIZE refused."""
    model, expected = checkpoint
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    _stdin(monkeypatch)
    assert cli.main(_generate(model, tmp_path / "out.jsonl", "--runner", "eager")) == 0
    assert _tokens(tmp_path / "out.jsonl") == expected
    assert not torch.distributed.is_initialized()
    assert cli.main(_generate(model, tmp_path / "out.jsonl", "--tp", "2")) == 2
    assert "--tp 2: torchrun started WORLD_SIZE=1 ranks" in capsys.readouterr().err


def test_an_admission_hook_decides_each_steps_admissions() -> None:
    """The seam rank 0's decision goes through (alone: no hook, no cost)."""
    bundle = default_model(max_requests=4)
    assert rank0_admits(bundle) is None
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    trace = requests_from_prompts(PROMPTS[:4], max_new_tokens=NEW_TOKENS)
    alone = Engine(bundle, runner).run(trace)
    engine = Engine(bundle, runner)
    assert engine.admission is None
    engine.admission = lambda fits: min(fits, 1)  # one request a step
    one_by_one = engine.run(trace)
    assert one_by_one.outputs == alone.outputs
    assert one_by_one.stats.batch_sizes != alone.stats.batch_sizes
    assert max(alone.stats.batch_sizes) == 4
    assert 1 in one_by_one.stats.batch_sizes


def test_two_ranks_on_the_cpu_runner_answer_as_transformers(
    checkpoint: tuple[Path, list[list[int]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, expected = checkpoint
    _stdin(monkeypatch)
    args = _generate(model, tmp_path / "out.jsonl", "--runner", "cpu", "--tp", "2")
    assert cli.main(args) == 0
    assert _tokens(tmp_path / "out.jsonl") == expected

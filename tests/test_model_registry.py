"""The model registry: a kind is one module and one registration, served by
``graphrunner generate`` as the built-in kinds are; the built-in kinds
claim the checkpoints they did before the registry existed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import toy_kind

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.kinds import BUILT_IN
from graphrunner_ref.engine.registry import kind_for, kind_of, kinds, register, unregister
from graphrunner_ref.model import default_model


@pytest.fixture
def toy() -> Iterator[None]:
    register(toy_kind.KIND)  # the one registration a new kind makes
    try:
        yield
    finally:
        unregister(toy_kind.KIND.name)


def _generate(checkpoint: Path, prompts: Path, *extra: str) -> int:
    argv = ["generate", "--model", str(checkpoint), "--prompts", str(prompts), "--json"]
    return cli.main([*argv, "--runner", "eager", "--max-new-tokens", "4", *extra])


@pytest.mark.parametrize("extra", [[], ["--check-padding"], ["--max-bs", "1"]])
def test_a_registered_toy_kind_serves_generate(
    toy: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    checkpoint = toy_kind.save_checkpoint(tmp_path / "toy", vocab_size=64)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n[62]\n[40, 7]\n")
    assert _generate(checkpoint, prompts, *extra) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records] == [[4, 5, 6, 7], [63, 0, 1, 2], [8, 9, 10, 11]]


def test_an_unregistered_kind_is_left_to_the_built_in_ones(tmp_path: Path) -> None:
    checkpoint = toy_kind.save_checkpoint(tmp_path / "toy")
    assert kind_for(EngineConfig(model=None, checkpoint=checkpoint)).name == "transformers"
    assert toy_kind.KIND not in kinds()


def test_the_newest_registration_is_asked_first(toy: None, tmp_path: Path) -> None:
    checkpoint = toy_kind.save_checkpoint(tmp_path / "toy")
    assert kinds()[0] is toy_kind.KIND
    assert kind_for(EngineConfig(model=None, checkpoint=checkpoint)) is toy_kind.KIND
    assert kind_for(EngineConfig()).name == "llama"  # the embedded model


def test_a_second_kind_of_one_name_is_refused(toy: None) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register(toy_kind.KIND)


def test_a_bundle_finds_its_kind_and_an_unknown_one_is_refused() -> None:
    assert kind_of(default_model(max_requests=1, max_context_len=8)).name == "llama"
    with pytest.raises(TypeError, match="expected a bundle of a registered model kind"):
        kind_of(object())


def test_the_built_in_kinds_are_asked_state_space_first_and_the_bridge_last() -> None:
    names = [k.name for k in kinds()]
    assert names == [k.name for k in reversed(BUILT_IN)]
    assert names == ["state-space", "llama", "transformers"]


def test_a_kind_refuses_what_it_cannot_run_by_its_flag() -> None:
    bridge = kinds()[-1]
    with pytest.raises(UsageError, match="--attention torch: the native model's option"):
        bridge.check(EngineConfig(model=None, checkpoint=Path("x"), attention="torch"))


def test_the_engine_path_sets_the_threads_it_is_given(
    toy: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    checkpoint = toy_kind.save_checkpoint(tmp_path / "toy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1]\n")
    assert _generate(checkpoint, prompts, "--threads", "1") == 0
    assert threads == [1]

"""``graphrunner serve`` in the engine's other schedules (overlap, several
decode steps a launch): the same greedy answers as ``generate``, and a
client that goes away frees its KV slots and request row."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import graphrunner_ref.cli.main as cli
from serve_world import Server

NEW = 10


@pytest.mark.parametrize(
    "mode", [["--overlap"], ["--steps-per-launch", "4"]], ids=["overlap", "multistep"]
)
def test_each_schedule_serves_generates_tokens_and_frees_what_it_cut(
    mode: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    path = tmp_path / "prompts.txt"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["generate", "--prompts", str(path), "--json", "--runner", "eager", "--quiet"]
    assert cli.main([*argv, "--max-new-tokens", str(NEW)]) == 0
    expected = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    with Server("--runner", "eager", "--max-bs", "4", *mode) as server:

        def ask(prompt: list[int]) -> list[int]:
            status, _, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": NEW})
            assert status == 200, body
            return list(body["choices"][0]["token_ids"])

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, prompts)) == expected
        for _ in range(3):
            events = server.stream(
                "/v1/completions", {"prompt": [1, 2], "max_tokens": 200, "stream": True}
            )
            next(events)
            events.close()
        m = server.idle_metrics()
        assert m["graphrunner_kv_slots_used"] == 0 and m["graphrunner_request_rows_used"] == 0
        assert ask(prompts[0]) == expected[0]
        assert server.stop() == 0, "".join(server.log)

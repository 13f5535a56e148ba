"""Prefix caching as ``graphrunner serve``'s users see it (the embedded model):
a prompt sent again reports all of it but its last token in
``usage.prompt_tokens_details.cached_tokens`` and gets the same tokens,
``/metrics`` counts the hits, and ``--no-prefix-caching`` turns it off."""

from __future__ import annotations

import random
from typing import Any

from serve_world import Server

NEW = 8


def _complete(server: Server, prompt: list[int]) -> dict[str, Any]:
    status, _, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": NEW})
    assert status == 200, body
    return dict(body)


def _metric(server: Server, name: str) -> float:
    status, _, text = server.request("GET", "/metrics")
    assert status == 200
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"{name} not in /metrics"
    return float(lines[0].split()[1])


def test_a_prompt_sent_again_reports_its_cached_tokens_and_metrics_count_them() -> None:
    rng = random.Random(11)
    system = [rng.randrange(1, 256) for _ in range(30)]
    first, second = system + [7, 8, 9], system + [10, 11]
    answers: dict[bool, list[dict[str, Any]]] = {}
    for caching in (True, False):
        flags = () if caching else ("--no-prefix-caching",)
        with Server("--runner", "eager", "--max-bs", "2", "--page-size", "4", *flags) as s:
            answers[caching] = [_complete(s, p) for p in (first, first, second)]
            if caching:
                assert _metric(s, "graphrunner_prefix_cache_hits_total") == 32 + 28
                assert _metric(s, "graphrunner_prefix_cache_queries_total") == 33 + 33 + 32
                assert _metric(s, "graphrunner_prefix_cache_pages") >= 8
                assert 0 < _metric(s, "graphrunner_prefix_cache_hit_rate") < 1
            assert s.stop() == 0, "".join(s.log)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers[True]]
    # Pages of 4: nothing, then the first prompt's 8 full pages (never its last
    # token), then the system prompt's 7 full pages.
    assert cached == [0, 32, 28]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers[False]] == [
        0,
        0,
        0,
    ]
    tokens = {c: [a["choices"][0]["token_ids"] for a in answers[c]] for c in answers}
    assert tokens[True] == tokens[False]

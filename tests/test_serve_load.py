"""``graphrunner serve`` under load: a full waiting queue answers 503 with
``Retry-After`` and serves the rest; a request past ``--request-timeout``
is aborted and freed; SIGTERM during a load finishes or cleanly aborts every
request (an error event, then ``[DONE]``) and exits 0."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from serve_world import Server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    args = ["--runner", "eager", "--max-bs", "2", "--max-waiting", "2", "--request-timeout", "5"]
    with Server(*args) as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def test_a_burst_past_max_waiting_gets_503s_and_the_rest_are_served(server: Server) -> None:
    barrier = threading.Barrier(20)

    def ask(i: int) -> tuple[int, dict[str, str], Any]:
        barrier.wait()
        return server.post("/v1/completions", {"prompt": [1 + i, 2, 3], "max_tokens": 24})

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    refused = [a for a in answers if a[0] == 503]
    served = [a for a in answers if a[0] == 200]
    assert len(refused) + len(served) == 20, [a[0] for a in answers]
    assert refused and served
    for _, headers, body in refused:
        assert headers["retry-after"] == "1"
        assert "--max-waiting 2" in body["error"]["message"]
    assert all(len(body["choices"][0]["token_ids"]) == 24 for _, _, body in served)
    m = server.idle_metrics()
    assert m["graphrunner_kv_slots_used"] == 0 and m["graphrunner_request_rows_used"] == 0


def test_a_request_past_its_deadline_is_aborted_and_freed() -> None:
    with Server("--runner", "eager", "--max-bs", "1", "--request-timeout", "0.2") as server:
        status, _, body = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 250})
        assert status == 408, body
        assert "--request-timeout" in body["error"]["message"]
        m = server.idle_metrics()
        assert m["graphrunner_kv_slots_used"] == 0 and m["graphrunner_request_rows_used"] == 0
        assert m["graphrunner_generation_tokens_total"] < 250  # cut, not run to its end
        assert server.stop() == 0


def _stream_all(server: Server, body: dict[str, Any], out: list[Any]) -> None:
    try:
        out.extend(server.stream("/v1/completions", body))
    except (OSError, http.client.HTTPException, AssertionError) as e:
        out.append(e)


def _held(server: Server) -> int:
    """Requests the server has taken: those waiting for their first token
    and those past it."""
    m = server.metrics()
    return int(
        m["graphrunner_requests_waiting"] + m["graphrunner_time_to_first_token_seconds_count"]
    )


@pytest.mark.parametrize(
    ("sig", "timeout", "tokens"),
    [(signal.SIGTERM, 30, 8), (signal.SIGTERM, 0.5, 250), (signal.SIGINT, 0.5, 250)],
    ids=["sigterm-finishes", "sigterm-aborts", "ctrl-c-aborts"],
)
def test_sigterm_during_a_load_answers_every_request_and_exits_0(
    sig: int, timeout: float, tokens: int
) -> None:
    args = ["--runner", "eager", "--max-bs", "2", "--shutdown-timeout", str(timeout)]
    with Server(*args) as server:
        results: list[list[Any]] = [[] for _ in range(6)]
        body = {"prompt": [4, 5, 6], "max_tokens": tokens, "stream": True}
        threads = [
            threading.Thread(target=_stream_all, args=(server, body, out)) for out in results
        ]
        for t in threads:
            t.start()
        # Signal once the server holds all six (waiting, or past their first
        # token), whatever the machine's speed: a request that arrives after
        # the signal is refused, and this test is about the ones it holds.
        deadline = time.monotonic() + 60
        while _held(server) < len(threads):
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.02)
        server.proc.send_signal(sig)
        for t in threads:
            t.join(60)
        assert server.wait() == 0, "".join(server.log)
    finished = aborted = 0
    for events in results:
        assert events and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        if "error" in last:
            assert "shut down" in last["error"]["message"]
            aborted += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    if tokens == 8:
        assert finished == 6  # short answers all finish within 30 s
    else:
        assert aborted >= 1  # long ones are cut at 0.5 s
    assert "stopped" in "".join(server.log)

"""A real ``graphrunner serve`` for the tests: a subprocess on 127.0.0.1 at a
free port, polled until it listens, spoken to with the standard library's
HTTP client (and the ``openai`` client where a test asks for it), stopped
with SIGTERM, its exit status returned."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a server may take to start (import, load, capture) on a busy CI core.
START_SECONDS = 300.0


class Server:
    """``graphrunner serve --port 0 ARGS`` running until :meth:`stop`."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "graphrunner", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        self.port = self._wait_listening()
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _wait_listening(self) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if "listening on http://" in line:
                return int(line.rsplit(":", 1)[1])
        self.proc.kill()
        raise RuntimeError("graphrunner serve did not start:\n" + "".join(self.log))

    def _read_rest(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connection(self, timeout: float = 120.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """One request; the status, the headers and the JSON body (or the text)."""
        conn = self.connection()
        try:
            data = raw if raw is not None else None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=dict(headers or {}))
            response = conn.getresponse()
            text = response.read().decode()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
        return self.request("POST", path, body, **kw)

    def stream(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> Iterator[Any]:
        """The data of each server-sent event (parsed JSON, or ``"[DONE]"``);
        closing the iterator early closes the connection."""
        conn = self.connection()
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=dict(headers or {}))
            response = conn.getresponse()
            assert response.status == 200, response.read()
            for line in response:
                text = line.decode().strip()
                if text.startswith("data: "):
                    data = text[len("data: ") :]
                    yield data if data == "[DONE]" else json.loads(data)
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of ``/metrics`` by name."""
        status, _, text = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        return out

    def idle_metrics(self, seconds: float = 30.0) -> dict[str, float]:
        """``/metrics`` once nothing runs or waits (or after ``seconds``)."""
        deadline = time.monotonic() + seconds
        while True:
            m = self.metrics()
            idle = m["graphrunner_requests_running"] == 0 and m["graphrunner_requests_waiting"] == 0
            if (idle and m["graphrunner_kv_slots_used"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Signal the server and wait; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the server to exit by itself (killed past ``timeout``); its status.

        After a test has signalled the server, it waits here: a second signal
        while the server drains is a forced quit (status 143), not a drain.
        """
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

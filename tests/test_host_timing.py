"""bench/host_timing.py times host calls with the device idle and busy, on no
device at all; bench/replay_host_report.py writes the GPU table from rows."""

from __future__ import annotations

import time

import pytest

from bench.host_timing import DeviceWentIdle, summarize, time_busy, time_idle
from bench.replay_host_report import COMMAND, STEPS_COMMAND, write_results

WAIT_US = 200
#: The counts the GPU bench names in its method paragraph (fabricated).
PARAMS = {"warmup": 30, "idle_blocks": 10, "idle_calls_per_block": 40}
PARAMS |= {"busy_blocks": 50, "busy_calls": 8, "traced": 20}


def _spin(us: float) -> None:
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


class Log:
    """Records every fn / sync / occupy / still_busy call, in order."""

    def __init__(self, busy: bool = True) -> None:
        self.events: list[str] = []
        self.busy = busy

    def fn(self) -> None:
        self.events.append("fn")
        _spin(WAIT_US)

    def sync(self) -> None:
        self.events.append("sync")

    def occupy(self) -> None:
        self.events.append("occupy")

    def still_busy(self) -> bool:
        self.events.append("still_busy")
        return self.busy


def _busy(log: Log, **kw: int):
    counts = {"calls": 5, "warmup": 2, "blocks": 3, **kw}
    return time_busy(log.fn, sync=log.sync, occupy=log.occupy, still_busy=log.still_busy, **counts)


def test_idle_times_a_known_wait_and_drains_before_every_call() -> None:
    log = Log()
    times = time_idle(log.fn, sync=log.sync, blocks=3, calls_per_block=4, warmup=2)
    assert times.mode == "idle" and times.calls == 12 == len(times.samples_us)
    assert WAIT_US <= times.median_us < 50 * WAIT_US
    assert times.p10_us <= times.median_us <= times.p90_us
    assert log.events.count("fn") == 2 + 12
    assert log.events.count("sync") == 2 + 3 * (1 + 4)
    # Every timed call starts right after a sync: never two calls in a row.
    timed = log.events[4:]
    assert all(timed[i - 1] == "sync" for i, e in enumerate(timed) if e == "fn")


def test_busy_times_a_known_wait_with_no_sync_between_the_calls() -> None:
    log = Log()
    times = _busy(log)
    assert times.mode == "busy" and times.calls == 15
    assert WAIT_US <= times.median_us < 50 * WAIT_US
    assert times.p10_us <= times.median_us <= times.p90_us
    assert log.events.count("fn") == 2 + 15
    block = ["occupy", *["fn"] * 5, "still_busy", "sync"]
    assert log.events == ["fn", "fn", "sync", *block * 3]


def test_warmup_calls_are_not_timed() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        _spin(20_000 if len(calls) <= 3 else 0)  # only the warm-up calls are slow

    idle = time_idle(fn, sync=lambda: None, blocks=2, calls_per_block=5, warmup=3)
    assert len(calls) == 3 + 10 and idle.calls == 10 and idle.p90_us < 10_000
    calls.clear()
    busy = time_busy(
        fn, sync=lambda: None, occupy=lambda: None, still_busy=lambda: True, calls=10, warmup=3
    )
    assert len(calls) == 3 + 10 and busy.calls == 10 and busy.p90_us < 10_000


def test_busy_refuses_when_the_device_went_idle() -> None:
    log = Log(busy=False)
    with pytest.raises(DeviceWentIdle, match="raise the occupy length"):
        _busy(log)
    assert log.events[-1] == "sync"  # the device is drained before the error


def test_summary_percentiles_and_bad_counts() -> None:
    times = summarize([float(v) for v in range(100, 0, -1)], "idle")
    assert (times.p10_us, times.median_us, times.p90_us) == (11.0, 50.5, 90.0)
    assert times.spread() == "11.0-90.0"
    assert times.summary() == {
        "median_us": 50.5,
        "p10_us": 11.0,
        "p90_us": 90.0,
        "calls": 100,
        "mode": "idle",
    }
    with pytest.raises(ValueError, match="no timed calls"):
        summarize([], "idle")
    with pytest.raises(ValueError, match="calls_per_block=0"):
        time_idle(lambda: None, sync=lambda: None, blocks=1, calls_per_block=0, warmup=0)


def _row(bs: int, variant: str, idle: float, busy: float) -> dict:
    def t(median: float, mode: str) -> dict:
        return {
            "median_us": median,
            "p10_us": median - 1,
            "p90_us": median + 2,
            "calls": 400,
            "mode": mode,
        }

    return {
        "raw_bs": max(1, bs - 1),
        "bs": bs,
        "variant": variant,
        "idle": t(idle, "idle"),
        "busy": t(busy, "busy"),
        "occupy_us": 2000,
        "device_calls_per_step": 2.0,
        "besides_graph": 1.0,
    }


def test_gpu_results_name_command_device_driver_and_both_modes(tmp_path) -> None:
    rows = [
        _row(1, "bare", 4.0, 2.0),
        _row(1, "per-field", 40.0, 30.0),
        _row(1, "torch", 12.0, 9.0),
        _row(8, "bare", 5.0, 2.5),
        _row(8, "per-field", 60.0, 45.0),
        _row(8, "graph", 20.0, 10.0),
    ]
    info = {
        "device": "Fake GPU 9000",
        "torch": "9.9.9",
        "date": "2099-01-01",
        "cuda (torch built with)": "12.8",
        "driver": "570.1.2",
    }
    path = write_results(rows, info, PARAMS, tmp_path)
    assert path == tmp_path / "replay-host-fake-gpu-9000.md"
    assert path.with_suffix(".json").exists()
    text = path.read_text()
    for fact in (COMMAND, STEPS_COMMAND, "Fake GPU 9000", "570.1.2", "12.8", "9.9.9", "2099-01-01"):
        assert fact in text
    assert "Method" in text and "torch.cuda._sleep" in text
    header = next(line for line in text.splitlines() if line.startswith("| raw"))
    for column in (
        "idle median µs",
        "idle p10-p90",
        "idle x bare",
        "busy median µs",
        "busy x bare",
    ):
        assert column in header
    # Each mode against the bare launch of its own mode: 12 / 4 idle, 9 / 2 busy.
    assert "| 1 -> 1 | torch | 12.0 | 11.0-14.0 | 3.0 | 9.0 | 8.0-11.0 | 4.5 | 3.33 |" in text
    assert "(torch) 12.0 µs idle: met" in text
    assert "(graph) 20.0 µs idle: NOT met" in text


def test_gpu_info_names_the_driver_or_unknown(monkeypatch) -> None:
    from bench import replay_host_report

    monkeypatch.setattr(replay_host_report.shutil, "which", lambda name: None)
    info = replay_host_report.gpu_info()
    assert info["driver"] == "unknown"
    assert {"device", "torch", "date", "cuda (torch built with)", "invoked as"} <= set(info)

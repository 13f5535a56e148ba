"""The CUDA side of :mod:`bench.host_timing`: drain with
``torch.cuda.synchronize``, occupy the GPU with ``torch.cuda._sleep`` (its
length calibrated with events), busy while an event recorded after the sleep
is not complete. Needs a CUDA device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.host_timing import DeviceWentIdle, HostTimes, time_busy, time_idle

__all__ = ["Sleeper", "cuda_host_times", "sleep_cycles_per_us"]

_CALIBRATION_CYCLES = 10_000_000


def sleep_cycles_per_us() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per microsecond (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return _CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e3)


class Sleeper:
    """The busy mode's occupying work: ``torch.cuda._sleep`` for about ``us``
    microseconds on the current stream, then an event; busy while that event
    is not complete."""

    def __init__(self, cycles_per_us: float, us: float) -> None:
        self.cycles = max(1, int(cycles_per_us * us))
        self.event = torch.cuda.Event()

    def occupy(self) -> None:
        torch.cuda._sleep(self.cycles)
        self.event.record()

    def still_busy(self) -> bool:
        return not self.event.query()


def cuda_host_times(
    fn: Callable[[], Any],
    cycles_per_us: float,
    *,
    warmup: int,
    idle_blocks: int,
    idle_calls: int,
    busy_blocks: int,
    busy_calls: int,
    occupy_min_us: float,
    tries: int,
) -> tuple[HostTimes, HostTimes, float]:
    """(idle, busy, the busy mode's sleep per block in µs) of ``fn`` on the
    current CUDA stream. The sleep starts at 4x what a block's calls took at
    the idle p90 (at least ``occupy_min_us``) and doubles, up to ``tries``
    times, while the GPU finishes it before the calls do."""
    sync = torch.cuda.synchronize
    idle = time_idle(fn, sync=sync, blocks=idle_blocks, calls_per_block=idle_calls, warmup=warmup)
    occupy_us = max(occupy_min_us, 4 * busy_calls * idle.p90_us)
    for _ in range(tries):
        sleeper = Sleeper(cycles_per_us, occupy_us)
        try:
            busy = time_busy(
                fn,
                sync=sync,
                occupy=sleeper.occupy,
                still_busy=sleeper.still_busy,
                calls=busy_calls,
                warmup=warmup,
                blocks=busy_blocks,
            )
        except DeviceWentIdle as err:
            print(f"{err} (sleep was {occupy_us:.0f} µs; doubling it)", flush=True)
            occupy_us *= 2
            continue
        return idle, busy, occupy_us
    raise DeviceWentIdle(
        f"the GPU went idle under the busy calls {tries} times (last sleep "
        f"{occupy_us / 2:.0f} µs): raise occupy_min_us or the number of tries"
    )

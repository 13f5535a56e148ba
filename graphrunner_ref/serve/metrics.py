"""``GET /metrics``: the server's state in Prometheus' text format.

Requests running and waiting, KV slots and request rows used and total,
prompt and generated token totals, time to first token and inter-token
latency histograms, requests finished and aborted, the runner's graph
replays, eager fallbacks, live and padded rows, and the prefix cache's
lookups, hits (tokens), hit rate, indexed pages and evictions. The engine's
state is read when ``/metrics`` is asked (:attr:`Metrics.state`: counts
only, nothing the engine thread does per step); the event loop records the
latencies as tokens reach it (:attr:`Metrics.pending`, folded into the
histograms when ``/metrics`` is read: nothing per step). Each server has a
registry of its own (two in one process never mix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from graphrunner import GraphRunner
from graphrunner.pools import CachedKVAllocator
from graphrunner_ref.engine.registry import ServingBundle

__all__ = ["CONTENT_TYPE", "FOLD_EVERY", "Delivery", "EngineState", "Metrics"]

#: The ``/metrics`` content type (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds: a CPU decode step is milliseconds, a first
#: token behind a queue can be seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PREFIX = "graphrunner"
#: Deliveries queued in :attr:`Metrics.pending` before they are folded
#: without a ``/metrics`` read (bounds the queue of a server nobody scrapes).
FOLD_EVERY = 4096


@dataclass(frozen=True, slots=True)
class EngineState:
    """What ``/metrics`` reads of the engine: its pools and runner (None
    before the capture), the requests it runs (admitted: prefilling or
    decoding) and those waiting for their first token."""

    bundle: ServingBundle
    runner: GraphRunner | None
    running: int
    waiting: int


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delta reaching the event loop: its ``tokens``; the request's time
    to first token (its first) or the gap since its previous tokens, in
    seconds; its prompt's tokens (with its first); how it ``ended``
    (``"finished"``, ``"aborted"``, or None while it runs)."""

    tokens: int
    ttft: float | None = None
    gap: float | None = None
    prompt_tokens: int = 0
    ended: str | None = None


class _RunnerCounts(Collector):
    """The runner's own counters, as last read on the engine thread."""

    def __init__(self) -> None:
        self.values = {"graph_replays": 0, "eager_fallbacks": 0, "live_rows": 0, "padded_rows": 0}

    def collect(self) -> Iterator[Metric]:
        helps = {
            "graph_replays": "decode steps replayed from a captured graph",
            "eager_fallbacks": "decode steps run eagerly (no graph for their batch size)",
            "live_rows": "request rows of the replayed steps",
            "padded_rows": "padding rows of the replayed steps",
        }
        for name, value in dict(self.values).items():
            yield CounterMetricFamily(f"{_PREFIX}_{name}", helps[name], value=value)


class _PrefixCacheCounts(Collector):
    """The prefix cache's counters (in tokens and pages, as vLLM's), as last
    read on the engine thread."""

    def __init__(self) -> None:
        self.values = {"queries": 0, "hits": 0, "evictions": 0}

    def collect(self) -> Iterator[Metric]:
        helps = {
            "queries": "prompt tokens looked up in the prefix cache",
            "hits": "prompt tokens whose KV the prefix cache held",
            "evictions": "cached KV pages evicted for new ones",
        }
        for name, value in dict(self.values).items():
            yield CounterMetricFamily(f"{_PREFIX}_prefix_cache_{name}", helps[name], value=value)


class Metrics:
    """The server's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(f"{_PREFIX}_{name}", text, registry=r)

        self.running = gauge("requests_running", "requests admitted by the engine")
        self.waiting = gauge("requests_waiting", "requests queued, no token yet")
        self.kv_used = gauge("kv_slots_used", "KV cache slots held by requests")
        self.kv_total = gauge("kv_slots_total", "KV cache slots in the pool")
        self.rows_used = gauge("request_rows_used", "request-pool rows held by requests")
        self.rows_total = gauge("request_rows_total", "request-pool rows in the pool")
        self.prompt_tokens = Counter(
            f"{_PREFIX}_prompt_tokens", "prompt tokens prefilled", registry=r
        )
        self.generation_tokens = Counter(
            f"{_PREFIX}_generation_tokens", "tokens generated", registry=r
        )
        self.requests = Counter(
            f"{_PREFIX}_requests", "requests answered, by outcome", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds",
            "seconds from a request's arrival to its first token",
            buckets=_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{_PREFIX}_inter_token_latency_seconds",
            "seconds between a request's tokens",
            buckets=_BUCKETS,
            registry=r,
        )
        self.runner_counts = _RunnerCounts()
        r.register(self.runner_counts)
        self.cache_counts = _PrefixCacheCounts()
        r.register(self.cache_counts)
        self.cache_hit_rate = gauge(
            "prefix_cache_hit_rate", "share of looked-up prompt tokens the prefix cache held"
        )
        self.cache_pages = gauge("prefix_cache_pages", "KV pages indexed by the prefix cache")
        #: Where :meth:`text` reads the engine's state (None: nothing to read).
        self.state: Callable[[], EngineState] | None = None
        #: Deliveries the event loop queued, not yet in the histograms.
        self.pending: list[Delivery] = []

    def text(self) -> bytes:
        """The exposition (:data:`CONTENT_TYPE`), the engine's state read now."""
        if self.state is not None:
            self._engine_state(self.state())
        self.fold()
        return bytes(generate_latest(self.registry))

    def _engine_state(self, state: EngineState) -> None:
        """The pools' and the runner's state, the requests running and waiting."""
        bundle, runner = state.bundle, state.runner
        kv, rows = bundle.kv_alloc, bundle.req_pool
        self.running.set(state.running)
        self.waiting.set(state.waiting)
        self.kv_total.set(kv.size)
        self.kv_used.set(kv.size - kv.available_size())
        self.rows_total.set(rows.size)
        self.rows_used.set(rows.size - rows.available_size())
        if isinstance(kv, CachedKVAllocator):
            cache = kv.stats
            self.cache_counts.values = {
                "queries": cache.query_tokens,
                "hits": cache.cached_tokens,
                "evictions": cache.evictions,
            }
            self.cache_hit_rate.set(cache.hit_rate)
            self.cache_pages.set(cache.cached_pages)
        if runner is not None:
            s = runner.stats
            self.runner_counts.values = {
                "graph_replays": s.replays,
                "eager_fallbacks": s.eager_fallbacks,
                "live_rows": s.live_rows,
                "padded_rows": s.padded_rows,
            }

    # The event loop.
    def fold(self) -> None:
        """The :attr:`pending` deliveries into the counters and histograms:
        tokens, latencies, endings."""
        deliveries, self.pending = self.pending, []
        for d in deliveries:
            if d.ttft is not None:
                self.ttft.observe(d.ttft)
                self.prompt_tokens.inc(d.prompt_tokens)
            if d.gap is not None:
                for _ in range(d.tokens):
                    self.itl.observe(d.gap / d.tokens)
            if d.tokens:
                self.generation_tokens.inc(d.tokens)
            if d.ended is not None:
                self.requests.labels(outcome=d.ended).inc()

"""Prometheus metrics (prometheus-client), observed off the per-token path.

Every family is ``smg_servicer_*`` with labels ``model`` and ``rank``.
Observations happen at request boundaries (admission, first output, a
choice's end, a call's end), never per token: inter-token latency is the
choice's mean gap, observed once when it ends. Gauges that mirror state
(in-flight requests, journal sizes) are read at scrape time.

The endpoint is a tiny trio HTTP responder (GET /metrics only) rather than
prometheus-client's ``start_http_server``, which would run a daemon thread
outside every nursery.
"""

from __future__ import annotations

import logging
import time

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from enginelink.machines.link import LinkState

log = logging.getLogger("enginelink.metrics")

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Engine frame → its tokens on the client's socket: tens of microseconds when the servicer keeps up.
OUTPUT_DELAY_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                          0.5, 1, 2.5)
# An engine timestamp further from this host's monotonic clock than this is another host's: not observed.
ENGINE_CLOCK_SKEW_MAX_S = 60.0
# A scrape request larger than this is refused; a client slower than the timeout is dropped.
HTTP_REQUEST_BYTES_MAX = 8192
HTTP_TIMEOUT_S = 5.0


class Metrics:
    def __init__(self, model: str, rank: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model", "rank"]
        self._labels = {"model": model, "rank": str(rank)}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        self.requests = counter("smg_servicer_requests", "Choices ended, by finish reason", ["finish_reason"])
        self.refusals = counter("smg_servicer_refusals", "Generate calls refused before admission", ["reason"])
        self.errors = counter("smg_servicer_errors", "Generate calls that ended with a non-OK status", ["code"])
        self.internal_errors = counter("smg_servicer_internal_errors",
                                       "Unexpected exceptions (servicer bugs) answered INTERNAL, by RPC", ["rpc"])
        self.prompt_tokens = counter("smg_servicer_prompt_tokens", "Prompt tokens of admitted calls")
        self.cached_tokens = counter("smg_servicer_cached_tokens", "Prompt tokens served from the prefix cache")
        self.generated_tokens = counter("smg_servicer_generated_tokens", "Output tokens sent to clients")
        self.ttft = Histogram("smg_servicer_time_to_first_token_seconds", "Admission to first engine output",
                              labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("smg_servicer_inter_token_latency_seconds", "Mean gap between a choice's tokens",
                             labels, buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("smg_servicer_e2e_request_latency_seconds", "Admission to the call's end",
                             labels, buckets=LATENCY_BUCKETS_S, registry=r)
        # Why a histogram and not the journal's clock: the journal has each frame's receive time but no
        # record of the write (one per write would double its records); this is one observation per
        # engine frame, off the per-token path.
        self.output_delay = Histogram(
            "smg_servicer_output_delay_seconds",
            "Engine output frame to its tokens written to the client's socket, on the direct write path "
            "(stage=received: from the servicer reading the frame; stage=engine: from the engine's own "
            "timestamp, so the time the frame waited to be read is in it)",
            labels + ["stage"], buckets=OUTPUT_DELAY_BUCKETS_S, registry=r)
        self._delay_received = self.output_delay.labels(**self._labels, stage="received")
        self._delay_engine = self.output_delay.labels(**self._labels, stage="engine")
        self.in_flight = Gauge("smg_servicer_in_flight_requests", "Generate calls in flight", labels, registry=r)
        self.start_time = Gauge("smg_servicer_start_time_seconds", "Unix time the servicer started", labels,
                                registry=r)
        self.start_time.labels(**self._labels).set(time.time())

    # -- lifecycle -------------------------------------------------------------------

    def watch_state(self, read_state) -> None:
        """``smg_servicer_state{state}``: 1 for ``read_state()``'s value, 0 for the others, at scrape time."""
        self.registry.register(_StateCollector(read_state, self._labels))

    def watch_in_flight(self, count) -> None:
        self.in_flight.labels(**self._labels).set_function(count)

    def add_gauges(self, prefix: str, read_stats) -> None:
        """Export every numeric field of ``read_stats()`` as ``smg_servicer_<prefix>_<field>`` at scrape time."""
        self.registry.register(_StatsCollector(prefix, read_stats, self._labels))

    def add_collector(self, make) -> None:
        """Register ``make(labels)``, a prometheus-client collector read at scrape time (e.g. the KV relay's)."""
        self.registry.register(make(dict(self._labels)))

    # -- request boundaries (called by the hub) --------------------------------------

    def refused(self, reason: str, code: str) -> None:
        self.refusals.labels(**self._labels, reason=reason).inc()
        self.errors.labels(**self._labels, code=code).inc()

    def internal_error(self, rpc: str) -> None:
        self.internal_errors.labels(**self._labels, rpc=rpc).inc()
        if rpc == "Generate":
            self.errors.labels(**self._labels, code="INTERNAL").inc()

    def admitted(self, prompt_tokens: int, choices: int) -> None:
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens * choices)

    def first_output(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def choice_done(self, finish_reason: str, tokens_sent: int, cached_tokens: int, mean_gap_s: float | None) -> None:
        self.requests.labels(**self._labels, finish_reason=finish_reason).inc()
        self.generated_tokens.labels(**self._labels).inc(tokens_sent)
        self.cached_tokens.labels(**self._labels).inc(cached_tokens)
        if mean_gap_s is not None:
            self.itl.labels(**self._labels).observe(mean_gap_s)

    def frames_written(self, marks: list[tuple[float, float]]) -> None:
        """The direct path wrote what these engine frames carried: each frame's (trio time it was read,
        the engine's timestamp on ``time.monotonic``, 0 if none) → now."""
        now, mono = trio.current_time(), time.monotonic()
        for received, stamped in marks:
            self._delay_received.observe(now - received)
            if stamped and 0.0 <= mono - stamped < ENGINE_CLOCK_SKEW_MAX_S:
                self._delay_engine.observe(mono - stamped)

    def call_ended(self, seconds: float, error_code: str | None) -> None:
        self.e2e.labels(**self._labels).observe(seconds)
        if error_code is not None:
            self.errors.labels(**self._labels, code=error_code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, read_state, labels: dict[str, str]) -> None:
        self.read_state = read_state
        self.labels = labels

    def collect(self):
        current = str(self.read_state())
        family = GaugeMetricFamily("smg_servicer_state", "Lifecycle state (1 = current)",
                                   labels=[*self.labels, "state"])
        for state in LinkState:
            family.add_metric([*self.labels.values(), state.value], 1 if state.value == current else 0)
        yield family

    def describe(self):
        return []


class _StatsCollector:
    def __init__(self, prefix: str, read_stats, labels: dict[str, str]) -> None:
        self.prefix = prefix
        self.read_stats = read_stats
        self.labels = labels

    def collect(self):
        stats = self.read_stats()
        fields = stats.__struct_fields__ if hasattr(stats, "__struct_fields__") else vars(stats)
        for name in fields:
            value = getattr(stats, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            family = GaugeMetricFamily(f"smg_servicer_{self.prefix}_{name}", f"{self.prefix} {name}",
                                       labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family

    def describe(self):
        return []


async def serve_metrics(metrics: Metrics, host: str, port: int, task_status=trio.TASK_STATUS_IGNORED, *,
                        listeners: list[trio.SocketListener] | None = None) -> None:
    """Answer ``GET /metrics`` on host:port (or the ``listeners`` bound for it) until cancelled."""
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started()
    log.info("metrics on http://%s:%d/metrics", host, port)
    await trio.serve_listeners(lambda stream: _answer(metrics, stream), listeners)


async def _answer(metrics: Metrics, stream: trio.SocketStream) -> None:
    async with stream:
        with trio.move_on_after(HTTP_TIMEOUT_S):
            request = b""
            while b"\r\n\r\n" not in request and len(request) < HTTP_REQUEST_BYTES_MAX:
                data = await stream.receive_some(4096)
                if not data:
                    return
                request += data
            line = request.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body = metrics.exposition()
                head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            else:
                body = b"only GET /metrics is served here\n"
                head = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
            await stream.send_all(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)


class TaskCounts(msgspec.Struct, frozen=True):
    """Tasks alive at scrape time: trio's (every nursery's children, from the root) and the asyncio
    loop's (grpclib's handlers); a soak reads them for leaks (``enginelink bench --soak``)."""

    trio: int
    asyncio: int


def task_counts(loop) -> TaskCounts:
    """Walk trio's task tree and count the asyncio loop's tasks; called from a trio task (the scrape)."""
    import asyncio

    trio_tasks, todo = 0, [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None:
            continue
        trio_tasks += 1
        for nursery in task.child_nurseries:
            todo += nursery.child_tasks
    return TaskCounts(trio_tasks, len(asyncio.all_tasks(loop)))

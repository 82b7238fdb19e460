"""Load records on the KV event stream: ``EngineLoad`` per DP rank, and when to send one alone.

Every ``KvEventBatch`` a subscriber gets carries its rank's ``EngineLoad``,
built from the newest scheduler stats (``runtime/context/loads.py``, which the engine
link feeds from every engine step). Between batches, ``load_only`` batches
keep the router's view fresh (smg contract §12.5), decided per stream and
rank by ``Beat``:

- checked every ``CHECK_S`` (100 ms): a record that *changed* goes out at
  once — any request count, KV usage by ``USAGE_STEP`` (0.5 %), the
  generation rate by 5 % or 50 tok/s (and at least 1 tok/s), or the engine's
  silence crossing a whole second while requests are in flight on it (an
  idle engine is silent by nature: that is no news, and no record carries
  ``engine_silence_ms`` then);
- otherwise a heartbeat after ``HEARTBEAT_S`` (1 s) without any batch of
  that rank on the stream, backing off to ``HEARTBEAT_BACKOFF_S`` (5 s) after
  ``UNCHANGED_BEFORE_BACKOFF`` (2) heartbeats in a row that changed nothing;
- the stream's first record, and every ``load_only`` one, also carry the
  telemetry fields (hit rate, used and total tokens, memory, queues).

``Beat`` is pure (time is an argument); ``LoadSource`` reads the runtime's
live numbers. ``sample`` numbers the records of one stream. A record is a
``LoadRecord``, ``common.proto``'s ``EngineLoad`` without protobuf (``None``:
unset); the SubscribeKvEvents handler encodes it
(``runtime/contracts/shared/kv_messages.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Final

from enginelink.runtime.context.loads import Loads
from enginelink.wire.engine import SchedulerStats

CHECK_S: Final = 0.1
HEARTBEAT_S: Final = 1.0
HEARTBEAT_BACKOFF_S: Final = 5.0
UNCHANGED_BEFORE_BACKOFF: Final = 2
USAGE_STEP: Final = 0.005
RATE_STEP_TOKENS_S: Final = 50.0
RATE_STEP_SHARE: Final = 0.05
RATE_STEP_MIN_TOKENS_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """An ``EngineLoad`` as the relay sends it: the routing core on every record, telemetry when asked."""

    running_requests: int
    waiting_requests: int
    token_usage: float
    gen_throughput: float
    max_running_requests: int
    age_ms: int
    sample: int
    load_only: bool
    engine_reports_steps: bool
    prefill_pending_tokens: int
    engine_silence_ms: int | None = None  # unset while nothing is in flight, or before the engine is up
    # The telemetry (a stream's first record and every load_only one); None: unset.
    cache_hit_rate: float | None = None
    num_used_tokens: int | None = None
    max_total_num_tokens: int | None = None
    memory_token_capacity: int | None = None  # EngineLoad.memory.token_capacity
    queues_waiting: int | None = None  # EngineLoad.queues.waiting


@dataclass(frozen=True)
class LoadView:
    """The part of a load record whose change is news."""

    running: int
    waiting: int
    usage: float
    rate: float
    silence_s: int | None  # whole seconds of engine silence while it has requests; None when idle


def changed(old: LoadView, new: LoadView) -> bool:
    d_rate = abs(new.rate - old.rate)
    return (
        old.running != new.running
        or old.waiting != new.waiting
        or abs(new.usage - old.usage) >= USAGE_STEP
        or (d_rate >= RATE_STEP_MIN_TOKENS_S and (d_rate >= RATE_STEP_TOKENS_S or d_rate >= RATE_STEP_SHARE * old.rate))
        or old.silence_s != new.silence_s
    )


class Beat:
    """One rank on one stream: what was last sent, and whether a ``load_only`` is due."""

    __slots__ = ("last_view", "last_sent_at", "unchanged")

    def __init__(self) -> None:
        self.last_view: LoadView | None = None  # None: nothing of this rank sent yet
        self.last_sent_at = 0.0
        self.unchanged = 0

    def due(self, view: LoadView, now: float) -> bool:
        if self.last_view is None or changed(self.last_view, view):
            return True
        interval = HEARTBEAT_BACKOFF_S if self.unchanged >= UNCHANGED_BEFORE_BACKOFF else HEARTBEAT_S
        return now - self.last_sent_at >= interval

    def sent(self, view: LoadView, now: float, *, load_only: bool) -> None:
        if load_only and self.last_view is not None and not changed(self.last_view, view):
            self.unchanged += 1
        else:
            self.unchanged = 0
        self.last_view = view
        self.last_sent_at = now


class LoadSource:
    """The runtime's load numbers per rank, as ``LoadView`` and ``EngineLoad``.

    ``limits()`` gives (max running requests, KV capacity in tokens), known
    once the engine is up; ``last_frame_at()`` the trio time of the engine's
    last output frame (None before the engine is up); ``in_flight_since()``
    the trio time the oldest request now in flight on the engine (a client's
    or warm-up's) was admitted, None when none is; ``prefill_pending()`` the
    prompt tokens admitted but not yet answered.

    ``engine_silence_ms`` follows the proto's comment (common.proto, field
    19): the time since the engine last produced output *while* requests
    were in flight on it, so it counts from the later of the last frame and
    the oldest in-flight request's admission, and it is unset while nothing
    is in flight (an idle engine is silent by nature) or before the engine is
    up (we cannot tell). Every request enginelink sends streams deltas, so
    the engine reports each of them on every step.
    """

    def __init__(self, loads: Loads, *, limits: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 last_frame_at: Callable[[], float | None] = lambda: None,
                 in_flight_since: Callable[[], float | None] = lambda: None,
                 prefill_pending: Callable[[], int] = lambda: 0) -> None:  # fmt: skip
        self.loads = loads
        self.limits = limits
        self.last_frame_at = last_frame_at
        self.in_flight_since = in_flight_since
        self.prefill_pending = prefill_pending

    def _stats(self, rank: int) -> tuple[SchedulerStats, float | None]:
        """The rank's newest stats and when they arrived (None: none yet)."""
        stats = self.loads.stats.get(rank)
        if stats is None:
            return SchedulerStats(), None
        return stats, self.loads.stats_at.get(rank)

    def _silence_s(self, now: float) -> float | None:
        """The engine's silence while requests are in flight; None when none is, or before it is up."""
        last, since = self.last_frame_at(), self.in_flight_since()
        if last is None or since is None:
            return None
        return max(0.0, now - max(last, since))

    def view(self, rank: int, now: float) -> LoadView:
        stats, _ = self._stats(rank)
        silence = self._silence_s(now)
        return LoadView(
            stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage, self.loads.gen_throughput(rank),
            None if silence is None else math.floor(silence),
        )  # fmt: skip

    def record(self, rank: int, now: float, *, sample: int, load_only: bool, telemetry: bool) -> LoadRecord:
        stats, seen_at = self._stats(rank)
        max_running, capacity = self.limits()
        silence = self._silence_s(now)
        queries = stats.prefix_cache_queries
        return LoadRecord(
            running_requests=stats.num_running_reqs,
            waiting_requests=stats.num_waiting_reqs,
            token_usage=stats.kv_cache_usage,
            gen_throughput=self.loads.gen_throughput(rank),
            max_running_requests=max_running,
            age_ms=0 if seen_at is None else round((now - seen_at) * 1000),
            sample=sample,
            load_only=load_only,
            engine_reports_steps=True,
            prefill_pending_tokens=self.prefill_pending(),
            engine_silence_ms=None if silence is None else min(round(silence * 1000), 0xFFFFFFFF),
            **({} if not telemetry else {
                "cache_hit_rate": stats.prefix_cache_hits / queries if queries else 0.0,
                "num_used_tokens": round(stats.kv_cache_usage * capacity),
                "max_total_num_tokens": capacity,
                "memory_token_capacity": capacity,
                "queues_waiting": stats.num_waiting_reqs,
            }),
        )

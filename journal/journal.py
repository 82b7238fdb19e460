"""The journal: one ordered log of everything the servicer saw and decided.

Theory of operation: ``Journal.append`` is called synchronously on the
servicer's hot path (one call per engine output frame and per request
lifecycle event). It encodes the payload once, gives the record the next
seq, pushes the row into the in-memory ``Ring`` (what ``inspect`` and the
live fold read) and into a bounded pending-write buffer. ``Journal.run`` is
the flusher task: every ``flush_interval_s`` it hands pending rows, in
batches of at most ``flush_batch_max``, to ``Store.write_batch`` in a worker
thread; when cancelled it does one last, shielded, time-bounded flush and
closes the file.

Rules:
- the hot path never waits on the disk: when the pending buffer is over its
  budget (``pending_records_max`` rows or ``pending_bytes_max`` bytes), the
  oldest pending rows leave the disk path and are counted in
  ``store_dropped``; they stay in the ring;
- seq is contiguous from 1 per journal; one journal file holds one run, so
  opening a path that already holds a journal first sets the old file aside
  as ``<stem>.prev<suffix>`` (kept for post-mortem);
- a failed batch write (disk full, I/O error) is counted in ``store_errors``
  and its rows in ``store_dropped``; the servicer keeps serving;
- every bound is a named default below and shows in ``stats()``;
- trio thread only: ``append`` is not thread-safe, and ``flush_sync`` must not
  run while ``run`` does (both would write to the one connection).
"""

from __future__ import annotations

import os
import sqlite3
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import platformdirs
import trio

from .records import Record, Row, encode_payload
from .ring import RING_BYTES_MAX, RING_RECORDS_MAX, Ring
from .store import STORE_BYTES_MAX, STORE_RECORDS_MAX, Store, StoreStats, open_store, set_aside

__all__ = [
    "FINAL_FLUSH_TIMEOUT_S",
    "FLUSH_BATCH_MAX",
    "FLUSH_INTERVAL_S",
    "Journal",
    "JournalStats",
    "PENDING_BYTES_MAX",
    "PENDING_RECORDS_MAX",
    "RING_BYTES_MAX",
    "RING_RECORDS_MAX",
    "STORE_BYTES_MAX",
    "STORE_RECORDS_MAX",
    "default_journal_path",
]

FLUSH_INTERVAL_S: Final = 0.05
# 100k records/s over a 50 ms tick is 5k rows; a batch of up to 10k rows is a
# few milliseconds of SQLite and keeps up with bursts.
FLUSH_BATCH_MAX: Final = 10_000
# How far the disk may lag the hot path before rows are dropped from the disk
# path: about two seconds at 100k records/s.
PENDING_RECORDS_MAX: Final = 200_000
PENDING_BYTES_MAX: Final = 64 * 1024 * 1024
# The flush on shutdown may not hold the exit longer than this (trio time;
# a batch already in its worker thread still finishes).
FINAL_FLUSH_TIMEOUT_S: Final = 5.0

ToThread = Callable[..., Awaitable[Any]]


class JournalStats(msgspec.Struct, frozen=True):
    records: int  # rows in the ring now
    bytes: int  # payload bytes in the ring now
    pruned: int  # rows the ring dropped by its budgets
    store_dropped: int  # rows that never reached the disk (overflow, errors, close)
    pending: int  # rows waiting for the flusher
    last_seq: int  # newest seq appended, 0 when none
    last_flushed_seq: int  # newest seq committed to the store, 0 when none
    pending_bytes: int = 0
    store_records: int = 0  # rows in the file now
    store_bytes: int = 0  # payload bytes in the file now
    store_pruned: int = 0  # rows the store deleted by its budgets
    store_errors: int = 0  # batch writes that failed


def default_journal_path(port: int) -> Path:
    """Where the servicer on ``port`` keeps its journal unless told otherwise."""
    return Path(platformdirs.user_state_dir("enginelink")) / f"journal-{port}.sqlite"


class Journal:
    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        ring_records_max: int = RING_RECORDS_MAX,
        ring_bytes_max: int = RING_BYTES_MAX,
        store_records_max: int = STORE_RECORDS_MAX,
        store_bytes_max: int = STORE_BYTES_MAX,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_batch_max: int = FLUSH_BATCH_MAX,
        pending_records_max: int = PENDING_RECORDS_MAX,
        pending_bytes_max: int = PENDING_BYTES_MAX,
        final_flush_timeout_s: float = FINAL_FLUSH_TIMEOUT_S,
        to_thread: ToThread = trio.to_thread.run_sync,
    ) -> None:
        """``path=None`` keeps the journal in memory only (the ring).

        ``to_thread`` runs the blocking store writes; deterministic tests
        pass an inline runner so writes take no virtual time.
        """
        if flush_interval_s <= 0 or flush_batch_max < 1 or pending_records_max < 1:
            raise ValueError("flush_interval_s, flush_batch_max and pending_records_max must be positive")
        self.path = None if path is None else Path(path)
        self.flush_interval_s = flush_interval_s
        self.flush_batch_max = flush_batch_max
        self.pending_records_max = pending_records_max
        self.pending_bytes_max = pending_bytes_max
        self.final_flush_timeout_s = final_flush_timeout_s
        self._to_thread = to_thread
        self._ring = Ring(ring_records_max, ring_bytes_max)
        self._pending: deque[Row] = deque()
        self._pending_bytes = 0
        self._last_seq = 0
        self._last_flushed_seq = 0
        self._store_dropped = 0
        self._store_errors = 0
        self.last_store_error: str | None = None
        self._running = False
        self._store: Store | None = None
        self._closed_store_stats: StoreStats | None = None
        if self.path is not None:
            # Blocking file work, once, at start-up, before any task runs.
            set_aside(self.path)
            self._store = open_store(
                self.path, records_max=store_records_max, bytes_max=store_bytes_max
            )

    # -- hot path -----------------------------------------------------------

    def append(self, now: float, stream: str, kind: str, payload: Any) -> int:
        """Journal one record; returns its seq. O(1), no I/O, never blocks."""
        blob = encode_payload(kind, payload)
        seq = self._last_seq = self._last_seq + 1
        row = (seq, now, stream, kind, blob)
        self._ring.push(row)
        if self._store is not None:
            pending = self._pending
            pending.append(row)
            self._pending_bytes += len(blob)
            if len(pending) > self.pending_records_max or self._pending_bytes > self.pending_bytes_max:
                self._drop_oldest_pending()
        return seq

    def _drop_oldest_pending(self) -> None:
        pending = self._pending
        while len(pending) > 1 and (
            len(pending) > self.pending_records_max or self._pending_bytes > self.pending_bytes_max
        ):
            self._pending_bytes -= len(pending.popleft()[4])
            self._store_dropped += 1

    # -- reading ------------------------------------------------------------

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def records(self, after_seq: int = 0, limit: int | None = None) -> list[Record]:
        """Decoded records still in the ring with ``seq > after_seq``."""
        return self._ring.records(after_seq, limit)

    def stats(self) -> JournalStats:
        ring = self._ring.stats()
        store = self._closed_store_stats if self._store is None else self._store.stats()
        return JournalStats(
            records=ring.records,
            bytes=ring.bytes,
            pruned=ring.pruned,
            store_dropped=self._store_dropped,
            pending=len(self._pending),
            last_seq=self._last_seq,
            last_flushed_seq=self._last_flushed_seq,
            pending_bytes=self._pending_bytes,
            store_records=0 if store is None else store.records,
            store_bytes=0 if store is None else store.bytes,
            store_pruned=0 if store is None else store.pruned,
            store_errors=self._store_errors,
        )

    # -- the disk path ------------------------------------------------------

    def _take_batch(self) -> list[Row]:
        pending = self._pending
        batch = [pending.popleft() for _ in range(min(len(pending), self.flush_batch_max))]
        self._pending_bytes -= sum(len(r[4]) for r in batch)
        return batch

    def _written(self, batch: list[Row], error: Exception | None) -> None:
        if error is None:
            self._last_flushed_seq = batch[-1][0]
        else:
            self._store_errors += 1
            self._store_dropped += len(batch)
            self.last_store_error = f"{type(error).__name__}: {error}"

    async def _flush(self, *, until_empty: bool) -> None:
        """Write one batch, then more while full batches wait (or until empty)."""
        while self._pending and self._store is not None:
            batch = self._take_batch()
            error = None
            finished = False
            try:
                await self._to_thread(self._store.write_batch, batch)
                finished = True
            except (sqlite3.Error, OSError) as exc:
                error = exc
                finished = True
            finally:
                if finished:
                    self._written(batch, error)
                else:
                    # Cancelled mid-write: only a cancellable ``to_thread``
                    # gets here (trio's default waits for the thread), and
                    # the batch's fate is unknown; count it as lost.
                    self._store_dropped += len(batch)
            if not until_empty and len(self._pending) < self.flush_batch_max:
                return

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The flusher. Start it in the servicer's nursery; cancel it to stop.

        On cancellation (or any exit) it flushes what is pending, shielded
        and bounded by ``final_flush_timeout_s``, then closes the file.
        Without a path there is nothing to flush and it returns at once.
        """
        if self._running:
            raise RuntimeError("Journal.run is already running")
        self._running = True
        task_status.started()
        if self._store is None:
            return
        try:
            while True:
                await trio.sleep(self.flush_interval_s)
                await self._flush(until_empty=False)
        finally:
            deadline = trio.current_time() + self.final_flush_timeout_s
            with trio.CancelScope(deadline=deadline, shield=True):
                await self._flush(until_empty=True)
            self.close()
            self._running = False

    def flush_sync(self) -> None:
        """Write everything pending now, in this thread (tools, tests, no trio)."""
        if self._running:
            raise RuntimeError("flush_sync while Journal.run is running")
        while self._pending and self._store is not None:
            batch = self._take_batch()
            error = None
            try:
                self._store.write_batch(batch)
            except (sqlite3.Error, OSError) as exc:
                error = exc
            self._written(batch, error)

    def close(self) -> None:
        """Close the file; rows still pending are counted as dropped.

        Idempotent. Appends after this still reach the ring.
        """
        if self._store is None:
            return
        self._store_dropped += len(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        store, self._store = self._store, None
        self._closed_store_stats = store.stats()
        store.close()

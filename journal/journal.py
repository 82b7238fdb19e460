"""The journal: one ordered log of everything the servicer saw and decided.

Theory of operation: ``Journal.append`` is called synchronously on the
servicer's hot path (one call per engine output frame and per request
lifecycle event). It encodes the payload once, gives the record the next
seq, pushes the row into the in-memory ``Ring`` (what ``inspect`` and the
live fold read) and into a bounded pending-write buffer. ``Journal.run`` is
the flusher task: every ``flush_interval_s`` it hands pending rows, in
batches of at most ``flush_batch_max``, to ``Store.write_batch`` in a worker
thread, and does not wait for that write: it accounts it (``last_flushed_seq``,
a failure's counters and health) at its next tick, or after
``WRITE_ACCOUNT_IDLE_S`` with no append. One write is under way at a time.
Not waiting saves the worker's wake-up of the trio thread after every write,
which at a real engine's pace (a flush every 50 ms holding a few dozen
records) was most of a flush's cost on the trio thread. When cancelled it
waits, shielded, for the write under way, then does one last flush (bounded
by the pending budgets) and closes the file.

Rules:
- the hot path never waits on the disk: when the pending buffer is over its
  budget (``pending_records_max`` rows or ``pending_bytes_max`` bytes), the
  oldest pending rows leave the disk path and are counted in
  ``store_dropped``; they stay in the ring;
- seq is contiguous from 1 per journal; one journal file holds one run, so
  opening a path that already holds a journal first sets the old file aside
  as ``<stem>.prev<suffix>``, keeping ``keep`` previous runs (``files.rotate``);
- a journal file belongs to one live process: the journal holds the path's
  ``JournalLock`` (its own, or the one its caller took earlier) from before
  it touches any file until ``close``; a path another process holds raises
  ``JournalBusy`` and changes nothing;
- a failed batch write (disk full, I/O error) is counted in ``store_errors``
  and its rows in ``store_dropped``; the servicer keeps serving, and the
  episode is logged, exported and written where ``inspect`` reads it
  (``store_health.py``);
- every bound is a named default below and shows in ``stats()``;
- trio thread only: ``append`` is not thread-safe, and ``flush_sync`` must not
  run while ``run`` does (both would write to the one connection).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from .fold import FoldState, fold, fold_record
from .records import KIND_ENGINE_FRAME, Record, Row, encode_payload, row_to_record
from .files import JOURNAL_KEEP_DEFAULT, JournalLock, default_journal_path, rotate
from .ring import RING_BYTES_MAX, RING_RECORDS_MAX, Ring
from .store_health import StoreHealth, describe_error
from .store import STORE_BYTES_MAX, STORE_RECORDS_MAX, Store, StoreStats, open_store

__all__ = [
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
# The flusher accounts the write it started (``last_flushed_seq``, a failure's counters and health) at
# its next tick; with no append to start one, after this long. One timer wake-up per idle spell.
WRITE_ACCOUNT_IDLE_S: Final = 1.0
# 100k records/s over a 50 ms tick is 5k rows; a batch of up to 10k rows is a
# few milliseconds of SQLite and keeps up with bursts.
FLUSH_BATCH_MAX: Final = 10_000
# How far the disk may lag the hot path before rows are dropped from the disk
# path (about two seconds at 100k records/s); also what bounds the last flush.
PENDING_RECORDS_MAX: Final = 200_000
PENDING_BYTES_MAX: Final = 64 * 1024 * 1024
# Records the live fold lets wait for the end of a wake-up (``Journal.catch_up``): a wake-up of 64
# frames of 128 calls ending is about 600; past this the append folds them itself.
UNFOLDED_MAX: Final = 4096

ToThread = Callable[..., Awaitable[Any]]
# Starts fn in a worker thread and calls deliver(outcome) there when it ends (trio's start_thread_soon).
StartWrite = Callable[[Callable[[], Any], Callable[[Any], None]], None]


class _Write:
    """One store write under way in a worker thread, which the flusher does not wait for.

    ``deliver`` runs in the worker thread; it wakes the trio thread only when the flusher waits (``wait``).
    """

    __slots__ = ("batches", "outcome", "_lock", "_waiter", "_token")

    def __init__(self, batches: list[list[Row]]) -> None:
        self.batches = batches
        self.outcome: Any = None  # an ``outcome.Outcome`` of ``Journal._write_batches`` once it ended
        self._lock = threading.Lock()
        self._waiter: trio.Event | None = None
        self._token = trio.lowlevel.current_trio_token()

    def deliver(self, outcome: Any) -> None:
        with self._lock:
            self.outcome = outcome
            waiter = self._waiter
        if waiter is not None:
            self._token.run_sync_soon(waiter.set)

    async def wait(self) -> Any:
        with self._lock:
            if self.outcome is not None:
                return self.outcome
            waiter = self._waiter = trio.Event()
        await waiter.wait()
        return self.outcome


class LiveFoldUnavailable(RuntimeError):
    """The live fold cannot start: the ring pruned records it would have to fold first."""


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
    store_bytes: int = 0  # bytes the file's blocks take now (journal/store.py stored_bytes)
    store_pruned: int = 0  # rows the store deleted by its budgets
    store_errors: int = 0  # batch writes that failed
    store_failing: int = 0  # 1 while batch writes fail (disk full, I/O error): journal/store_health.py
    store_failing_episodes: int = 0  # times writing started failing
    live_fold_frames_decoded: int = 0  # engine frames the live fold decoded itself (no decode of the link's)


class Journal:
    """One run's journal: the ring, the pending buffer and (with a path) the file."""

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
        to_thread: ToThread = trio.to_thread.run_sync,
        start_write: StartWrite = trio.lowlevel.start_thread_soon,
        lock: JournalLock | None = None,
        keep: int = JOURNAL_KEEP_DEFAULT,
    ) -> None:
        """``path=None`` keeps the journal in memory only (the ring).

        ``start_write`` starts the flusher's store writes (not waited for) and
        ``to_thread`` runs the final flush's; deterministic tests pass inline
        runners so writes take no virtual time. ``lock``: the
        path's lock, already held by the caller (who releases it); without
        it the journal takes its own and releases it on ``close``. ``keep``:
        previous runs' files kept beside this one.
        """
        if flush_interval_s <= 0 or flush_batch_max < 1 or pending_records_max < 1:
            raise ValueError("flush_interval_s, flush_batch_max and pending_records_max must be positive")
        self.path = None if path is None else Path(path)
        self.flush_interval_s = flush_interval_s
        self.flush_batch_max = flush_batch_max
        self.pending_records_max = pending_records_max
        self.pending_bytes_max = pending_bytes_max
        self._to_thread = to_thread
        self._start_write = start_write
        self._write: _Write | None = None  # the flusher's write under way, accounted when it is next looked at
        self._ring = Ring(ring_records_max, ring_bytes_max)
        self._pending: deque[Row] = deque()
        self._pending_bytes = 0
        # Set by the append that finds nothing pending: the flusher sleeps on it while there is
        # nothing to write, so an idle servicer's journal costs no timer wake-ups.
        self._appended = trio.Event()
        self._last_seq = 0
        self._last_flushed_seq = 0
        self._store_dropped = 0
        self._store_errors = 0
        self.last_store_error: str | None = None
        self._running = False
        # The live fold (``fold_live``): None until one starts, so a journal without one pays nothing.
        self._live: FoldState | None = None
        # Records the live fold has not taken yet, in order, each with the link's decode of it when
        # it is an engine frame the link decoded (``note_decoded``): folded by ``catch_up``.
        self._unfolded: list[list] = []
        self._live_frames_decoded = 0
        # A reader of every record as it is appended (tracing's: runtime/lifetime/trace_fold.py), with
        # ``record(seq, now, stream, kind, payload)`` and ``decoded(seq, batch)``; None: none, one test per append.
        self.tap: Any = None
        self._store: Store | None = None
        self._closed_store_stats: StoreStats | None = None
        self._own_lock: JournalLock | None = None
        if self.path is not None:
            # Blocking file work, once, at start-up, before any task runs.
            if lock is None:
                lock = self._own_lock = JournalLock(self.path).acquire()
            elif not lock.held or lock.path != self.path:
                raise RuntimeError(f"the lock given for {self.path} is not held for it")
            try:
                rotate(lock, keep)
                self._store = open_store(
                    self.path, records_max=store_records_max, bytes_max=store_bytes_max
                )
            except BaseException:
                self._release_own_lock()
                raise
        self.health = StoreHealth(self.path)  # failing writes said in the log, /metrics and inspect

    # -- hot path -----------------------------------------------------------

    def append(self, now: float, stream: str, kind: str, payload: Any) -> int:
        """Journal one record; returns its seq. O(1), no I/O, never blocks."""
        blob = encode_payload(kind, payload)
        seq = self._last_seq = self._last_seq + 1
        row = (seq, now, stream, kind, blob)
        self._ring.push(row)
        if self._live is not None:
            self._fold_live_row(row)
        if self.tap is not None:
            self.tap.record(seq, now, stream, kind, payload)
        if self._store is not None:
            pending = self._pending
            if not pending:
                self._appended.set()
            pending.append(row)
            self._pending_bytes += len(blob)
            if len(pending) > self.pending_records_max or self._pending_bytes > self.pending_bytes_max:
                self._drop_oldest_pending()
        return seq

    def note_decoded(self, seq: int, decoded: Any) -> None:
        """The link's decode (its ``OutputBatch``) of exactly the bytes of the engine frame it just
        journaled as ``seq``: the live fold (and a tap) take it instead of decoding those bytes again. Ignored
        without a live fold, or when another record came in between (the fold decodes the frame)."""
        unfolded = self._unfolded
        if unfolded and unfolded[-1][0][0] == seq:
            unfolded[-1][1] = decoded
        if self.tap is not None:
            self.tap.decoded(seq, decoded)

    def fold_live(self) -> FoldState:
        """Start the live fold: the returned state is ``fold`` of every record so far, and each append
        advances it (read it through ``live_state``). Called once, by the snapshot task.

        Folded at the end of the receive loop's wake-up that appended them (``catch_up``, after the
        wake-up's writes), not periodically: the records and the frames' decodes are still hot, and
        nothing is kept for long (a periodic fold held every frame's decode for half a second and then
        freed it cold, and stalled the loop for its whole batch). Not at each append either: folded
        there, a frame and the records its calls made sat between the frame's arrival and its tokens'
        write. Non-frame payloads are folded as decoded from the bytes just encoded, exactly what replay
        reads; a frame as the link's decode of it (``note_decoded``), or from its bytes when no decode
        came (a multi-part frame, one the link could not read). At most ``UNFOLDED_MAX`` records wait:
        appends with no wake-up to end them (admissions on an engine that sends nothing) fold there.
        """
        if self._live is not None:
            raise RuntimeError("the journal's live fold is already running")
        rows = self._ring.rows(after_seq=0)
        if rows and rows[0][0] != 1:
            raise LiveFoldUnavailable(f"the journal's ring no longer holds records 1..{rows[0][0] - 1}")
        state = fold(row_to_record(row) for row in rows)
        self._live = state
        return state

    def end_live_fold(self) -> None:
        """Stop the live fold (its task ended); ``fold_live`` may start a new one."""
        self._live = None
        self._unfolded = []

    def live_state(self) -> FoldState:
        """The live fold's state through the newest record (``fold_live`` first)."""
        if self._live is None:
            raise RuntimeError("no live fold: call fold_live first")
        self.catch_up()
        return self._live

    def catch_up(self) -> None:
        """Fold the records appended since the last catch-up (the end of each receive wake-up, after
        its writes: ``runtime/lifetime/core.connect``; and before the live state is read)."""
        unfolded = self._unfolded
        if not unfolded:
            return
        self._unfolded = []
        live = self._live
        for row, decoded in unfolded:
            if decoded is not None:
                fold_record(live, Record(row[0], row[1], row[2], row[3], decoded))
                continue
            if row[3] == KIND_ENGINE_FRAME:
                self._live_frames_decoded += 1
            fold_record(live, row_to_record(row))

    def _fold_live_row(self, row: Row) -> None:
        unfolded = self._unfolded
        unfolded.append([row, None])
        if len(unfolded) >= UNFOLDED_MAX:
            self.catch_up()

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
            store_failing=int(self.health.failing),
            store_failing_episodes=self.health.episodes,
            live_fold_frames_decoded=self._live_frames_decoded,
        )

    # -- the disk path ------------------------------------------------------

    def _take_batch(self) -> list[Row]:
        pending = self._pending
        batch = [pending.popleft() for _ in range(min(len(pending), self.flush_batch_max))]
        self._pending_bytes -= sum(len(r[4]) for r in batch)
        return batch

    def _take_all(self) -> list[list[Row]]:
        batches = []
        while self._pending:
            batches.append(self._take_batch())
        return batches

    def _write_batches(self, batches: list[list[Row]]) -> list[Exception | None]:
        """Blocking; runs in a worker thread. Touches only the store, so the
        trio thread may keep appending meanwhile; results are accounted
        back in the trio thread."""
        store = self._store
        assert store is not None
        errors: list[Exception | None] = []
        for batch in batches:
            try:
                store.write_batch(batch)
                errors.append(None)
            except (sqlite3.Error, OSError) as exc:
                errors.append(exc)
        return errors

    def _account(self, batches: list[list[Row]], errors: list[Exception | None]) -> None:
        for batch, error in zip(batches, errors, strict=True):
            if error is None:
                self._last_flushed_seq = batch[-1][0]
            else:
                self._store_errors += 1
                self._store_dropped += len(batch)
                self.last_store_error = describe_error(error)
                self.health.failed(error, len(batch), (batch[0][0], batch[-1][0]))
                continue
            self.health.written()

    async def _flush(self, batches: list[list[Row]]) -> None:
        """The final flush: written in a worker thread and waited for (the caller shields it)."""
        self._account(batches, await self._to_thread(self._write_batches, batches))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The flusher. Start it in the servicer's nursery; cancel it to stop.

        Each tick starts one batch's write, then more, one after the other,
        while full batches wait; a write is accounted when the flusher next
        looks at it (``_finish_write``). On cancellation (or any exit) it waits
        for the write under way, writes everything pending in one shielded
        worker-thread call, then closes the file. That last flush
        is bounded by the pending budgets, not by a timer: under a MockClock
        virtual time jumps while a thread works, so a timer would cut it
        short in tests for no reason, and a write in a thread cannot be
        interrupted anyway. Append ``run.stop`` before cancelling this, or
        it stays in the ring only.
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
                if not self._pending:  # after every tick at a steady pace: it took all there was
                    self._appended = trio.Event()  # a set from before is stale: its rows were taken
                    if self._write is not None:
                        # Not waiting for the write itself (that wake-up is what is saved): it is
                        # accounted at the next tick, or after WRITE_ACCOUNT_IDLE_S of no appends.
                        with trio.move_on_after(WRITE_ACCOUNT_IDLE_S):
                            await self._appended.wait()
                        if not self._pending:  # idle that long: account it now (it ended long ago)
                            await self._finish_write()
                    if not self._pending:
                        await self._appended.wait()  # idle: nothing to write, no timer
                await trio.sleep(self.flush_interval_s)  # the records of one interval go as one batch
                while self._pending:
                    await self._finish_write()  # one at a time; at a steady pace it ended long ago
                    self._begin_write([self._take_batch()])
                    if len(self._pending) < self.flush_batch_max:
                        break
        finally:
            with trio.CancelScope(shield=True):
                await self._finish_write()
                if self._pending and self._store is not None:
                    await self._flush(self._take_all())
            self.close()
            self._running = False

    def _begin_write(self, batches: list[list[Row]]) -> None:
        write = self._write = _Write(batches)
        self._start_write(functools.partial(self._write_batches, batches), write.deliver)

    async def _finish_write(self) -> None:
        """Account the write under way, waiting for it only if it has not ended (no checkpoint then)."""
        write = self._write
        if write is None:
            return
        outcome = await write.wait()
        self._write = None
        self._account(write.batches, outcome.unwrap())

    def flush_sync(self) -> None:
        """Write everything pending now, in this thread (tools, tests, no trio)."""
        if self._running:
            raise RuntimeError("flush_sync while Journal.run is running")
        if self._pending and self._store is not None:
            batches = self._take_all()
            self._account(batches, self._write_batches(batches))

    def close(self) -> None:
        """Close the file; rows still pending are counted as dropped.

        Idempotent. Appends after this still reach the ring.
        """
        if self._store is None:
            self._release_own_lock()
            return
        self._store_dropped += len(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        store, self._store = self._store, None
        self._closed_store_stats = store.stats()
        store.close()
        self.health.close()
        self._release_own_lock()

    def _release_own_lock(self) -> None:
        if self._own_lock is not None:
            lock, self._own_lock = self._own_lock, None
            lock.release()

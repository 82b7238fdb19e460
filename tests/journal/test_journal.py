"""The journal: seq, the pending buffer, the flusher under a mock clock.

Deterministic flusher tests pass inline writers (``InlineWriter``: the flusher's
``start_write``, which it does not wait for, and the final flush's ``to_thread``)
so a store write takes no virtual time, or exactly ``write_s`` of it, and the
exact virtual times of batches can be asserted. One test keeps trio's real
worker threads, where only the end result (everything flushed on cancel) is
deterministic.
"""

from __future__ import annotations

import time

import outcome
import pytest
import trio

from enginelink.journal import records as r
from enginelink.journal.journal import WRITE_ACCOUNT_IDLE_S, Journal, _Write, default_journal_path
from enginelink.journal.store import open_reader


def frame(seq: int) -> bytes:
    return seq.to_bytes(4, "big") * 4


class InlineWriter:
    """Runs the journal's store writes in the trio thread and logs them: as ``to_thread`` (the final flush,
    waited for) and as ``start_write`` (the flusher's, not waited for: ``start``)."""

    def __init__(self, write_s: float = 0.0) -> None:
        self.write_s = write_s
        self.log: list[tuple[float, list[tuple[int, int]]]] = []  # (time, [(first, last) per batch])

    async def __call__(self, fn, batches):
        if self.write_s:
            await trio.sleep(self.write_s)  # a slow disk
        return self._write(fn, batches)

    def start(self, fn, deliver) -> None:
        """Like ``trio.lowlevel.start_thread_soon`` (``fn`` is the journal's ``partial(_write_batches,
        batches)``): at once, or after ``write_s`` in a task no cancel scope of the test reaches, as a
        worker thread cannot be interrupted either."""

        def write():
            return self._write(fn.func, *fn.args)

        if not self.write_s:
            deliver(outcome.capture(write))
            return

        async def slow() -> None:
            await trio.sleep(self.write_s)
            deliver(outcome.capture(write))

        trio.lowlevel.spawn_system_task(slow)

    def _write(self, fn, batches):
        result = fn(batches)
        self.log.append((trio.current_time(), [(b[0][0], b[-1][0]) for b in batches]))
        return result


def inline_journal(writer: InlineWriter, path, **settings) -> Journal:
    """A journal whose store writes, the flusher's and the final flush's, all go through ``writer``."""
    return Journal(path, to_thread=writer, start_write=writer.start, **settings)


def append_frames(journal: Journal, count: int, now: float = 0.0) -> None:
    for _ in range(count):
        journal.append(now, "engine/0", r.KIND_ENGINE_FRAME, frame(journal.last_seq + 1))


def stored_seqs(path) -> list[int]:
    with open_reader(path) as reader:
        return [x.seq for x in reader.records()]


def test_seq_is_contiguous_from_one(scenario):
    journal = Journal(None)
    seqs = [journal.append(t, s, k, p) for t, s, k, p in scenario(seed=3)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [x.seq for x in journal.records()] == seqs
    stats = journal.stats()
    assert (stats.last_seq, stats.pending, stats.store_dropped) == (len(seqs), 0, 0)


def test_memory_only_journal_prunes_its_ring():
    journal = Journal(None, ring_records_max=5)
    append_frames(journal, 12)
    stats = journal.stats()
    assert (stats.records, stats.pruned, stats.last_seq) == (5, 7, 12)
    assert [x.seq for x in journal.records()] == [8, 9, 10, 11, 12]
    assert [x.seq for x in journal.records(after_seq=10)] == [11, 12]


def test_bad_payload_does_not_take_a_seq():
    journal = Journal(None)
    with pytest.raises(r.PayloadError):
        journal.append(0.0, "run", "no.such.kind", {})
    assert journal.append(0.0, "engine/0", r.KIND_ENGINE_FRAME, b"x") == 1


def test_full_pending_buffer_drops_oldest_from_the_disk_path_only(tmp_path):
    path = tmp_path / "j.sqlite"
    journal = Journal(path, pending_records_max=5)
    append_frames(journal, 8)
    stats = journal.stats()
    assert (stats.pending, stats.store_dropped, stats.records) == (5, 3, 8)
    journal.flush_sync()
    journal.close()
    assert stored_seqs(path) == [4, 5, 6, 7, 8]
    assert journal.stats().last_flushed_seq == 8


def test_pending_byte_budget(tmp_path):
    journal = Journal(tmp_path / "j.sqlite", pending_bytes_max=40)
    append_frames(journal, 5)  # 16 bytes each
    stats = journal.stats()
    assert (stats.pending, stats.pending_bytes, stats.store_dropped) == (2, 32, 3)
    journal.close()
    assert journal.stats().store_dropped == 5  # close drops what was pending


async def test_flusher_writes_batches_on_its_interval(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter()
    journal = inline_journal(writer, path, flush_interval_s=0.05, flush_batch_max=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 3)
        await trio.sleep(0.01)
        append_frames(journal, 7)  # 10 pending at the first tick
        await trio.sleep(0.06)  # t = 0.07
        # Full batches go at once; the short rest waits for the next tick.
        assert writer.log == [(0.05, [(1, 4)]), (0.05, [(5, 8)])]
        # A write is accounted when the flusher next looks at it: the first before the second began,
        # the second at the next tick (the flusher does not wait for a write).
        assert journal.stats().last_flushed_seq == 4
        await trio.sleep(0.05)  # t = 0.12
        assert writer.log[2:] == [(0.1, [(9, 10)])]
        assert journal.stats().last_flushed_seq == 8  # 9-10: at the next tick, or a second into idling
        append_frames(journal, 9)
        await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    # The final flush ran on cancellation, at once, all of it in one call.
    assert writer.log[3:] == [(pytest.approx(0.125), [(11, 14), (15, 18), (19, 19)])]
    assert stored_seqs(path) == list(range(1, 20))
    stats = journal.stats()
    assert (stats.pending, stats.store_dropped, stats.last_flushed_seq, stats.store_records) == (0, 0, 19, 19)


class FlusherSteps(trio.abc.Instrument):
    """Counts the steps of the journal's flusher task (its wake-ups)."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task) -> None:
        if task.name.endswith("Journal.run"):
            self.steps += 1


async def test_an_idle_flusher_sleeps_until_the_next_append(tmp_path, autojump_clock):
    # An idle servicer's journal used to wake every flush interval (20 times a second) to find
    # nothing to write; now nothing pending means no timer, and the next append is written one
    # interval after it.
    path = tmp_path / "j.sqlite"
    writer = InlineWriter()
    journal = inline_journal(writer, path, flush_interval_s=0.05)
    steps = FlusherSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await trio.sleep(10.0)
            assert steps.steps <= 1  # its start; 200 at one wake-up per interval
            append_frames(journal, 2)
            await trio.sleep(0.049)
            assert writer.log == []
            await trio.sleep(0.002)
            assert writer.log == [(pytest.approx(10.05), [(1, 2)])]
            idle_from = steps.steps
            await trio.sleep(10.0)
            assert steps.steps - idle_from <= 2  # back to sleep once it had written
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert stored_seqs(path) == [1, 2]


async def test_the_end_of_a_write_wakes_the_trio_thread_only_for_a_waiter():
    # The flusher does not wait for its writes: a worker thread that ends one while nobody waits does
    # not touch trio. Waiting for each write cost the trio thread a second wake-up per flush, most of
    # a flush's cost there at a real engine's pace (docs/benchmarks-history.md, "Stop 22").
    woken = []

    class Token:  # stands in for the trio token the write wakes the flusher through
        def run_sync_soon(self, fn):
            woken.append(fn)

    unwaited = _Write([])
    unwaited._token = Token()
    await trio.to_thread.run_sync(unwaited.deliver, outcome.Value([None]))
    assert woken == [] and (await unwaited.wait()).unwrap() == [None]  # ended: no wait, no wake

    waited = _Write([])
    trio_token = waited._token

    class Forward:
        def run_sync_soon(self, fn):
            woken.append(fn)
            trio_token.run_sync_soon(fn)

    waited._token = Forward()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, lambda: (time.sleep(0.05), waited.deliver(outcome.Value([]))))
        assert (await waited.wait()).unwrap() == []
    assert len(woken) == 1  # the one waiter, once


async def test_the_flusher_keeps_its_pace_while_a_write_is_under_way(tmp_path, autojump_clock):
    # Each write takes 20 ms, longer than the gap between appends: the flusher starts the next tick's
    # sleep at the next append, not at the write's end, and accounts each write at the tick after it.
    path = tmp_path / "j.sqlite"
    writer = InlineWriter(write_s=0.02)
    journal = inline_journal(writer, path, flush_interval_s=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for _ in range(100):  # a steady second: a record every 10 ms
            append_frames(journal, 1)
            await trio.sleep(0.01)
        ticks = [t for t, _ in writer.log]
        nursery.cancel_scope.cancel()
    assert len(ticks) >= 16 and all(0.0495 <= b - a <= 0.0605 for a, b in zip(ticks, ticks[1:]))  # 50-60 ms, not 70
    assert stored_seqs(path) == list(range(1, 101))
    stats = journal.stats()
    assert (stats.last_flushed_seq, stats.store_dropped, stats.store_errors) == (100, 0, 0)


async def test_no_write_when_nothing_is_pending(tmp_path, autojump_clock):
    writer = InlineWriter()
    journal = inline_journal(writer, tmp_path / "j.sqlite")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert writer.log == []


async def test_final_flush_is_shielded(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter(write_s=1.0)  # a very slow disk
    journal = inline_journal(writer, path, flush_interval_s=100.0, flush_batch_max=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 5)
        nursery.cancel_scope.cancel()
    assert writer.log == [(1.0, [(1, 2), (3, 4), (5, 5)])]
    assert stored_seqs(path) == [1, 2, 3, 4, 5]
    assert journal.stats().store_dropped == 0


async def test_a_write_under_way_at_cancellation_ends_before_the_final_flush(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter(write_s=1.0)
    journal = inline_journal(writer, path, flush_interval_s=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 3)
        await trio.sleep(0.5)  # the tick's write (from 0.05) is under way
        append_frames(journal, 2)
        nursery.cancel_scope.cancel()
    stats = journal.stats()
    assert (stats.store_dropped, stats.last_flushed_seq, stats.store_errors) == (0, 5, 0)
    # The write ends as it would have (a worker thread cannot be interrupted), is accounted, and only
    # then does the final flush write the rest: one write to the file at a time.
    assert writer.log == [(1.05, [(1, 3)]), (2.05, [(4, 5)])]
    assert stored_seqs(path) == [1, 2, 3, 4, 5]


async def test_real_threads_flush_everything_on_cancel(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    journal = Journal(path, flush_batch_max=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for _ in range(10):
            append_frames(journal, 500)
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    stats = journal.stats()
    assert (stats.last_flushed_seq, stats.store_dropped, stats.store_errors) == (5000, 0, 0)
    assert stored_seqs(path) == list(range(1, 5001))


async def test_failed_write_is_counted_and_serving_goes_on(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter()
    journal = inline_journal(writer, path)
    append_frames(journal, 3)
    journal.flush_sync()
    journal._last_seq = 2  # force a duplicate seq: the next batch cannot commit
    append_frames(journal, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.sleep(0.06)  # written at 0.05; accounted at the next append, or idle for a second
        assert journal.stats().store_errors == 0
        await trio.sleep(WRITE_ACCOUNT_IDLE_S)
        stats = journal.stats()
        assert (stats.store_errors, stats.store_dropped) == (1, 2)
        assert "IntegrityError" in journal.last_store_error
        nursery.cancel_scope.cancel()
    assert stored_seqs(path) == [1, 2, 3]


def test_new_journal_on_a_used_path_sets_the_old_run_aside(tmp_path):
    path = tmp_path / "journal-7.sqlite"
    first = Journal(path)
    append_frames(first, 4)
    first.flush_sync()
    first.close()
    second = Journal(path)
    append_frames(second, 2)
    second.flush_sync()
    second.close()
    assert stored_seqs(path) == [1, 2]
    assert stored_seqs(tmp_path / "journal-7.prev.sqlite") == [1, 2, 3, 4]


def test_default_path_is_per_port():
    path = default_journal_path(50051)
    assert path.name == "journal-50051.sqlite"
    assert "enginelink" in path.parts

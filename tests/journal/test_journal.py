"""The journal: seq, the pending buffer, the flusher under a mock clock.

Deterministic flusher tests pass an inline ``to_thread`` so a store write
takes no virtual time and the exact virtual times of batches can be
asserted. One test keeps trio's real worker threads, where only the end
result (everything flushed on cancel) is deterministic.
"""

from __future__ import annotations

import pytest
import trio

from enginelink.journal import records as r
from enginelink.journal.journal import Journal, default_journal_path
from enginelink.journal.store import open_reader


def frame(seq: int) -> bytes:
    return seq.to_bytes(4, "big") * 4


class InlineWriter:
    """A ``to_thread`` that runs the write in the trio thread and logs it."""

    def __init__(self, write_s: float = 0.0) -> None:
        self.write_s = write_s
        self.log: list[tuple[float, list[tuple[int, int]]]] = []  # (time, [(first, last) per batch])

    async def __call__(self, fn, batches):
        if self.write_s:
            await trio.sleep(self.write_s)  # a slow disk; cancellable, unlike a thread
        result = fn(batches)
        self.log.append((trio.current_time(), [(b[0][0], b[-1][0]) for b in batches]))
        return result


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
    journal = Journal(path, flush_interval_s=0.05, flush_batch_max=4, to_thread=writer)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 3)
        await trio.sleep(0.01)
        append_frames(journal, 7)  # 10 pending at the first tick
        await trio.sleep(0.06)  # t = 0.07
        # Full batches go at once; the short rest waits for the next tick.
        assert writer.log == [(0.05, [(1, 4)]), (0.05, [(5, 8)])]
        assert journal.stats().last_flushed_seq == 8
        await trio.sleep(0.05)  # t = 0.12
        assert writer.log[2:] == [(0.1, [(9, 10)])]
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
    journal = Journal(path, flush_interval_s=0.05, to_thread=writer)
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


async def test_no_write_when_nothing_is_pending(tmp_path, autojump_clock):
    writer = InlineWriter()
    journal = Journal(tmp_path / "j.sqlite", to_thread=writer)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert writer.log == []


async def test_final_flush_is_shielded(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter(write_s=1.0)  # a very slow disk
    journal = Journal(path, flush_interval_s=100.0, flush_batch_max=2, to_thread=writer)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 5)
        nursery.cancel_scope.cancel()
    assert writer.log == [(1.0, [(1, 2), (3, 4), (5, 5)])]
    assert stored_seqs(path) == [1, 2, 3, 4, 5]
    assert journal.stats().store_dropped == 0


async def test_write_cut_off_by_cancellation_is_left_to_the_final_flush(tmp_path, autojump_clock):
    path = tmp_path / "j.sqlite"
    writer = InlineWriter(write_s=1.0)
    journal = Journal(path, flush_interval_s=0.05, to_thread=writer)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        append_frames(journal, 3)
        await trio.sleep(0.5)  # the tick's write is under way
        append_frames(journal, 2)
        nursery.cancel_scope.cancel()
    stats = journal.stats()
    assert (stats.store_dropped, stats.last_flushed_seq) == (0, 5)
    assert writer.log == [(1.5, [(1, 5)])]  # 0.5 + the final flush's 1.0, one batch
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
    journal = Journal(path, to_thread=InlineWriter())
    append_frames(journal, 3)
    journal.flush_sync()
    journal._last_seq = 2  # force a duplicate seq: the next batch cannot commit
    append_frames(journal, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.sleep(0.06)
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

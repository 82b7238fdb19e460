"""The SQLite store: round trips through a real file, budgets, readers.

Cross-process cases run a real writer process (``writer_proc.py``): one kept
alive while this process reads, one that SIGKILLs itself mid-run.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from enginelink.journal import records as r
from enginelink.journal import store as store_module
from enginelink.journal.store import (
    PAGE_SIZE,
    SCHEMA_VERSION,
    StoreError,
    encode_block,
    open_reader,
    open_store,
    stored_bytes,
)

WRITER = Path(__file__).with_name("writer_proc.py")


def rows_from(events) -> list[r.Row]:
    return [
        (seq, t, stream, kind, r.encode_payload(kind, payload))
        for seq, (t, stream, kind, payload) in enumerate(events, start=1)
    ]


def frame_rows(first: int, last: int, size: int = 100) -> list[r.Row]:
    return [(s, float(s), "engine/0", r.KIND_ENGINE_FRAME, bytes(size)) for s in range(first, last + 1)]


def test_round_trip_through_a_file(tmp_path, scenario):
    path = tmp_path / "j.sqlite"
    rows = rows_from(scenario(seed=1))
    store = open_store(path)
    store.write_batch(rows[:100])
    store.write_batch(rows[100:])
    assert store.stats().records == len(rows)
    store.close()
    with open_reader(path) as reader:
        assert reader.records() == [r.row_to_record(x) for x in rows]
        assert reader.last_seq() == len(rows)
        assert reader.first_seq() == 1
        assert reader.meta()["schema_version"] == SCHEMA_VERSION
        counts = reader.counts()
        assert counts.records == len(rows)
        # The byte budget's measure: what the blocks take in the file, their framing and pages included.
        bodies = [len(body) for (body,) in reader._conn.execute("SELECT body FROM blocks")]
        assert counts.bytes == sum(stored_bytes(n) for n in bodies) > sum(len(x[4]) for x in rows)
        assert sum(counts.by_kind.values()) == len(rows)
        assert list(reader.iter_records(page=7)) == reader.records()


def test_reader_filters(tmp_path):
    def payload(rid):
        return {"request_id": rid, "n": 1, "prompt_tokens": 1, "stream": False, "max_tokens": 1}

    rows = [
        (1, 0.0, "req/a", r.KIND_CLIENT_GENERATE, r.encode_payload(r.KIND_CLIENT_GENERATE, payload("a"))),
        (2, 1.0, "req0x", r.KIND_CLIENT_GENERATE, r.encode_payload(r.KIND_CLIENT_GENERATE, payload("0x"))),
        (3, 2.0, "engine/0", r.KIND_ENGINE_FRAME, b"f1"),
        (4, 3.0, "req/b", r.KIND_SNAPSHOT, r.encode_payload(r.KIND_SNAPSHOT, {"state": {}})),
        (5, 4.0, "engine/0", r.KIND_ENGINE_FRAME, b"f2"),
        (6, 5.0, "run", r.KIND_SNAPSHOT, r.encode_payload(r.KIND_SNAPSHOT, {"state": {"x": 1}})),
    ]
    path = tmp_path / "j.sqlite"
    store = open_store(path)
    store.write_batch(rows)
    store.close()

    def seqs(**filters):
        return [rec.seq for rec in reader.records(**filters)]

    with open_reader(path) as reader:
        # The prefix is a range, so "req0x" (after "req/" in byte order) stays out.
        assert seqs(stream_prefix="req/") == [1, 4]
        assert seqs(streams=["engine/0", "run"]) == [3, 5, 6]
        assert seqs(kinds=[r.KIND_ENGINE_FRAME]) == [3, 5]
        assert seqs(time_min=1.0, time_max=4.0) == [2, 3, 4, 5]
        assert seqs(after_seq=2, until_seq=4) == [3, 4]
        assert seqs(after_seq=1, limit=2) == [2, 3]
        assert seqs(stream_prefix="engine/", kinds=[r.KIND_ENGINE_FRAME], time_min=3.0) == [5]
        assert reader.last_snapshot().seq == 6
        assert reader.last_snapshot(until_seq=5).seq == 4
        assert reader.last_snapshot(until_seq=3) is None
        assert reader.records(kinds=[r.KIND_ENGINE_FRAME])[0].payload == b"f1"


def snapshot_row(seq: int) -> r.Row:
    return (seq, float(seq), "run", r.KIND_SNAPSHOT, r.encode_payload(r.KIND_SNAPSHOT, {"state": {"at": seq}}))


def test_a_flush_is_one_block_and_the_newest_snapshot_is_found_without_a_scan(tmp_path):
    """Schema 3: 16 KiB pages, a block row per batch (not a row per record: each was an insert, and a
    GIL hand-off in the writer thread), no secondary index, and each snapshot's seq in a table of its
    own with its block, pruned with it."""
    path = tmp_path / "j.sqlite"
    store = open_store(path, records_max=12)
    store.write_batch(frame_rows(1, 4))
    store.write_batch([snapshot_row(5)] + frame_rows(6, 9))
    store.write_batch([snapshot_row(10)])
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA page_size").fetchone()[0] == 16_384
    assert conn.execute("PRAGMA index_list(blocks)").fetchall() == []
    assert conn.execute("SELECT first_seq, last_seq, count, bytes FROM blocks ORDER BY first_seq").fetchall() == [
        (1, 4, 4, encode_block(frame_rows(1, 4))[3]), (5, 9, 5, encode_block([snapshot_row(5)] + frame_rows(6, 9))[3]),
        (10, 10, 1, encode_block([snapshot_row(10)])[3])]
    assert conn.execute("SELECT seq, block FROM snapshots ORDER BY seq").fetchall() == [(5, 5), (10, 10)]
    plan = " ".join(row[3] for row in conn.execute(
        "EXPLAIN QUERY PLAN SELECT snapshots.seq, body FROM snapshots JOIN blocks ON blocks.first_seq = snapshots.block"
        " WHERE snapshots.seq <= 9 ORDER BY snapshots.seq DESC LIMIT 1"))
    assert plan == ("SEARCH snapshots USING INTEGER PRIMARY KEY (rowid<?) "
                    "SEARCH blocks USING INTEGER PRIMARY KEY (rowid=?)")  # b-tree searches, no scan
    with open_reader(path) as reader:
        assert reader.last_snapshot().payload == {"state": {"at": 10}}
        assert reader.last_snapshot(until_seq=9).seq == 5
        assert [x.seq for x in reader.records(after_seq=6, until_seq=10)] == [7, 8, 9, 10]
    store.write_batch(frame_rows(11, 16))  # 16 records over a budget of 12: the block 1..4 goes, 5..9 stays
    assert conn.execute("SELECT seq FROM snapshots ORDER BY seq").fetchall() == [(5,), (10,)]
    store.write_batch(frame_rows(17, 18))  # now the block 5..9 goes too, and its snapshot's row with it
    assert conn.execute("SELECT seq FROM snapshots ORDER BY seq").fetchall() == [(10,)]
    assert store.stats().records == 9
    conn.close()
    store.close()
    with open_reader(path) as reader:
        assert reader.last_snapshot(until_seq=9) is None
        assert reader.last_snapshot().seq == 10
        assert reader.first_seq() == 10 and reader.last_seq() == 18


def test_a_large_batch_is_split_into_bounded_blocks(tmp_path, monkeypatch):
    """A reader decodes a block to find one record in it: a batch goes in blocks of at most
    BLOCK_BYTES_MAX payload bytes; a record larger than that is a block of its own."""
    monkeypatch.setattr(store_module, "BLOCK_BYTES_MAX", 1000)
    path = tmp_path / "j.sqlite"
    store = open_store(path)
    rows = frame_rows(1, 25, size=100) + [(26, 26.0, "engine/0", r.KIND_ENGINE_FRAME, bytes(5000))] + [
        snapshot_row(27)] + frame_rows(28, 30)
    store.write_batch(rows)
    conn = sqlite3.connect(path)
    blocks = conn.execute("SELECT first_seq, last_seq, count FROM blocks ORDER BY first_seq").fetchall()
    assert blocks == [(1, 10, 10), (11, 20, 10), (21, 25, 5), (26, 26, 1), (27, 30, 4)]
    assert conn.execute("SELECT seq, block FROM snapshots").fetchall() == [(27, 27)]
    conn.close()
    store.close()
    with open_reader(path) as reader:
        assert reader.records() == [r.row_to_record(x) for x in rows]
        assert [x.seq for x in reader.records(after_seq=9, limit=3)] == [10, 11, 12]
        assert [x.seq for x in reader.records(after_seq=24, until_seq=27)] == [25, 26, 27]
        assert reader.counts().records == 30
        assert reader.counts().bytes == sum(encode_block(rows[a:b])[3] for a, b in ((0, 10), (10, 20), (20, 25),
                                                                                  (25, 26), (26, 30)))


def test_a_seq_that_does_not_increase_is_refused(tmp_path):
    store = open_store(tmp_path / "j.sqlite")
    store.write_batch(frame_rows(1, 3))
    with pytest.raises(sqlite3.IntegrityError, match="journal seq 3 is not after 3"):
        store.write_batch(frame_rows(3, 4))
    with pytest.raises(sqlite3.IntegrityError, match="journal seq 5 is not after 6"):
        store.write_batch(frame_rows(6, 6) + frame_rows(5, 5))
    store.write_batch(frame_rows(4, 4))
    assert store.stats().records == 4
    store.close()


def write_rows_journal(path: Path, schema: int, rows: list[r.Row]) -> None:
    """A journal as schemas 1 and 2 wrote it, a row per record: schema 1 with indexes on stream and
    kind, schema 2 with none and a snapshots table."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE records (seq INTEGER PRIMARY KEY, time FLOAT NOT NULL, stream TEXT NOT NULL,"
                 " kind TEXT NOT NULL, payload BLOB NOT NULL)")
    if schema == 1:
        conn.execute("CREATE INDEX idx_records_stream ON records (stream)")
        conn.execute("CREATE INDEX idx_records_kind ON records (kind)")
    else:
        conn.execute("CREATE TABLE snapshots (seq INTEGER PRIMARY KEY)")
        conn.executemany("INSERT INTO snapshots VALUES (?)", [(row[0],) for row in rows if row[3] == r.KIND_SNAPSHOT])
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(schema),))
    conn.executemany("INSERT INTO records VALUES (?, ?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()


def test_a_schema_2_file_from_an_earlier_version_is_still_read(tmp_path, monkeypatch):
    """A previous run's journal written before schema 3: a row per record, no index, a snapshots table."""
    path = tmp_path / "old.sqlite"
    rows = frame_rows(1, 3) + [snapshot_row(4)] + frame_rows(5, 6)
    write_rows_journal(path, 2, rows)
    monkeypatch.setattr(store_module, "READ_PAGE_RECORDS", 2)  # its rows are read in pages
    with open_reader(path) as reader:
        assert reader.schema == 2
        assert reader.records() == [r.row_to_record(x) for x in rows]
        assert [x.seq for x in reader.records(kinds=[r.KIND_SNAPSHOT])] == [4]
        assert [x.seq for x in reader.records(after_seq=1, until_seq=5, stream_prefix="engine/")] == [2, 3, 5]
        assert reader.last_snapshot().seq == 4
        assert reader.last_snapshot(until_seq=3) is None
        assert (reader.first_seq(), reader.last_seq()) == (1, 6)
        assert reader.counts().by_kind == {r.KIND_ENGINE_FRAME: 5, r.KIND_SNAPSHOT: 1}
    with pytest.raises(StoreError, match="schema 2"):
        open_store(path)  # never written by this code: a writer starts a new file


def test_a_schema_1_file_from_an_earlier_version_is_still_read(tmp_path):
    """A previous run's journal (set aside by rotation) written before schema 2: indexes on stream
    and kind, no snapshots table. The tools still read it, its newest snapshot included."""
    path = tmp_path / "old.sqlite"
    rows = frame_rows(1, 3) + [snapshot_row(4)] + frame_rows(5, 6)
    write_rows_journal(path, 1, rows)
    with open_reader(path) as reader:
        assert reader.records() == [r.row_to_record(x) for x in rows]
        assert reader.last_snapshot().seq == 4
        assert reader.last_snapshot(until_seq=3) is None
        assert reader.counts().by_kind == {r.KIND_ENGINE_FRAME: 5, r.KIND_SNAPSHOT: 1}
    with pytest.raises(StoreError, match="schema 1"):
        open_store(path)  # never written by this code: a writer starts a new file


def test_record_budget_deletes_the_oldest_blocks_whole(tmp_path):
    """A block is one flush (50 ms of a servicer's records): the budget is kept by whole blocks, so a
    full file holds up to one block less than it allows."""
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    for first in (1, 7):
        store.write_batch(frame_rows(first, first + 5))
    assert (store.stats().records, store.stats().pruned) == (6, 6)  # 12 > 10: the block 1..6 went
    store.write_batch(frame_rows(13, 16))
    assert (store.stats().records, store.stats().pruned) == (10, 6)  # 10 fit
    store.write_batch(frame_rows(17, 17))
    stats = store.stats()
    assert (stats.records, stats.pruned, stats.last_seq) == (5, 12, 17)
    store.close()
    with open_reader(tmp_path / "j.sqlite") as reader:
        assert [x.seq for x in reader.records()] == list(range(13, 18))
        assert reader.counts().records == 5


def test_byte_budget_cuts_a_newest_block_that_alone_is_over_and_keeps_the_newest_record(tmp_path):
    store = open_store(tmp_path / "j.sqlite", bytes_max=550)
    rows = frame_rows(1, 8, size=100)
    store.write_batch(rows)
    stats = store.stats()
    # As many of the newest records as fit in 550 bytes of the file (each ~135 with its framing), no fewer.
    assert (stats.records, stats.pruned) == (3, 5)
    assert stats.bytes == encode_block(rows[-3:])[3] <= 550 < encode_block(rows[-4:])[3]
    store.write_batch([(9, 9.0, "engine/0", r.KIND_ENGINE_FRAME, bytes(2000))])
    assert (store.stats().records, store.stats().bytes) == (1, encode_block([(9, 9.0, "engine/0", r.KIND_ENGINE_FRAME,
                                                                              bytes(2000))])[3])
    store.close()
    with open_reader(tmp_path / "j.sqlite") as reader:
        assert [x.seq for x in reader.records()] == [9]


def test_a_full_journals_file_stays_at_its_byte_budget(tmp_path):
    """The byte budget bounds the file, not only the payloads in it: flushes of every size (a quiet
    servicer's few records, a busy one's 1 MiB blocks) written until the budget has been filled six
    times over leave the file's used pages within one batch of the budget, and the file (its pages,
    reused, not grown) and WAL within a few MiB more. Counted by payload bytes, the hour-long soak's
    1 GiB journal settled at 1.18 GiB (docs/benchmarks.md)."""
    import random

    path = tmp_path / "j.sqlite"
    budget = 8 << 20
    store = open_store(path, bytes_max=budget)
    rng = random.Random(7)
    seq = 0
    written = 0
    largest_batch = 0
    while written < 6 * budget:
        # One flush (50 ms): a few records of ~40 bytes (transitions) to a busy servicer's 400 KB.
        count = rng.choice([1, 3, 20, 200])
        size = rng.choice([40, 300, 2_000])
        batch = [(seq + i, float(seq + i), f"req/{seq % 97}", r.KIND_ENGINE_FRAME, rng.randbytes(size))
                 for i in range(1, count + 1)]
        seq += count
        store.write_batch(batch)
        written += count * size
        largest_batch = max(largest_batch, count * (size + 64))
    stats = store.stats()
    assert stats.pruned > 0 and stats.bytes <= budget
    used = store._conn.execute("PRAGMA page_count").fetchone()[0] - store._conn.execute(
        "PRAGMA freelist_count").fetchone()[0]
    # The estimate is the file: the pages in use are the blocks' bytes and a few interior pages, and the
    # budget is not kept by leaving the file emptier than allowed.
    assert stats.bytes - budget // 10 <= used * PAGE_SIZE <= stats.bytes + 8 * PAGE_SIZE, (used * PAGE_SIZE, stats)
    files = path.stat().st_size + Path(f"{path}-wal").stat().st_size  # while the writer is open, as a servicer
    store.close()
    # The budget, a batch inserted before the oldest blocks go, the pages freed by the last pruning (reused
    # by the next batch) and the WAL, cut back to the autocheckpoint's size.
    wal_max = store_module.WAL_AUTOCHECKPOINT_PAGES * PAGE_SIZE
    assert files <= budget + 2 * largest_batch + wal_max + 8 * PAGE_SIZE, (files, budget, largest_batch)


def test_reopen_continues_the_counts(tmp_path):
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    store.write_batch(frame_rows(1, 6))
    store.close()
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    assert (store.stats().records, store.stats().last_seq) == (6, 6)
    store.write_batch(frame_rows(7, 12))
    assert (store.stats().records, store.stats().pruned) == (6, 6)  # the reopened block 1..6 counted, and went
    store.close()


def test_failed_batch_rolls_back(tmp_path):
    store = open_store(tmp_path / "j.sqlite")
    store.write_batch(frame_rows(1, 3))
    with pytest.raises(sqlite3.IntegrityError):
        store.write_batch(frame_rows(4, 5) + frame_rows(3, 3))  # seq 3 again
    store.records_max = 4

    def disk_full(*args):
        raise sqlite3.OperationalError("database or disk is full")

    store._prune = disk_full  # fails after the batch's blocks are inserted: the transaction is rolled back
    with pytest.raises(sqlite3.OperationalError):
        store.write_batch(frame_rows(4, 5))
    del store._prune
    store.records_max = 100
    assert store.stats().records == 3
    store.write_batch(frame_rows(4, 5))  # the connection is usable again
    store.close()
    with open_reader(tmp_path / "j.sqlite") as reader:
        assert reader.last_seq() == 5 and reader.counts().records == 5


def test_not_a_journal(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_reader(tmp_path / "missing.sqlite")
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(StoreError):
        open_reader(other)
    with pytest.raises(StoreError):
        open_store(other)
    text = tmp_path / "text.sqlite"
    text.write_text("not a database at all, not even close to one" * 20)
    with pytest.raises(StoreError):
        open_reader(text)


@pytest.mark.process
def test_reader_sees_a_live_writer_in_another_process(tmp_path):
    path = tmp_path / "j.sqlite"
    writer = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), "live"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        def append(count: int) -> int:
            writer.stdin.write(f"append {count}\n")
            writer.stdin.flush()
            return int(writer.stdout.readline())

        assert append(10) == 10
        reader = open_reader(path)
        assert reader.last_seq() == 10
        # The same reader connection sees the writer's later commits.
        assert append(25) == 35
        assert reader.last_seq() == 35
        records = reader.records(after_seq=10)
        assert [x.seq for x in records] == list(range(11, 36))
        assert all(isinstance(x.payload, bytes if x.kind in r.RAW_KINDS else dict) for x in records)
        writer.stdin.write("exit\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == 0
        assert reader.last_seq() == 35
        reader.close()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


@pytest.mark.process
def test_reader_opens_a_journal_left_by_a_killed_writer(tmp_path):
    path = tmp_path / "j.sqlite"
    done = subprocess.run(
        [sys.executable, str(WRITER), str(path), "kill", "300"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    last = int(done.stdout)
    assert last == 600
    # The crash left the WAL behind, un-checkpointed: the reader must use it.
    assert Path(f"{path}-wal").stat().st_size > 0
    with open_reader(path) as reader:
        records = reader.records()
        assert [x.seq for x in records] == list(range(1, last + 1))
        assert records[-1].payload == (600).to_bytes(4, "big") * 8
        assert records[0].payload["request_id"] == "q1"
        assert reader.counts().by_kind == {r.KIND_CLIENT_GENERATE: 300, r.KIND_ENGINE_FRAME: 300}

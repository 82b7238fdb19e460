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
from enginelink.journal.store import (
    SCHEMA_VERSION,
    StoreError,
    open_reader,
    open_store,
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
        assert counts.bytes == sum(len(x[4]) for x in rows)
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


def test_rows_are_appends_and_the_newest_snapshot_is_found_without_a_scan(tmp_path):
    """Schema 2: 16 KiB pages, no secondary index on records (each was a random page write per row),
    and the snapshots' seqs in a table of their own, pruned with their rows."""
    path = tmp_path / "j.sqlite"
    store = open_store(path, records_max=12)
    store.write_batch(frame_rows(1, 4) + [snapshot_row(5)] + frame_rows(6, 9) + [snapshot_row(10)])
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA page_size").fetchone()[0] == 16_384
    assert conn.execute("PRAGMA index_list(records)").fetchall() == []
    assert conn.execute("SELECT seq FROM snapshots ORDER BY seq").fetchall() == [(5,), (10,)]
    plan = " ".join(row[3] for row in conn.execute(
        "EXPLAIN QUERY PLAN SELECT seq FROM snapshots WHERE seq <= 9 ORDER BY seq DESC LIMIT 1"))
    assert plan == "SEARCH snapshots USING INTEGER PRIMARY KEY (rowid<?)"  # a b-tree search, no scan
    with open_reader(path) as reader:
        assert reader.last_snapshot().payload == {"state": {"at": 10}}
        assert reader.last_snapshot(until_seq=9).seq == 5
    store.write_batch(frame_rows(11, 16))  # 16 rows over a budget of 12: seqs 1..4 go, the snapshot 5 stays
    assert conn.execute("SELECT seq FROM snapshots ORDER BY seq").fetchall() == [(5,), (10,)]
    store.write_batch(frame_rows(17, 18))  # now 5 goes too, and its snapshots row with it
    assert conn.execute("SELECT seq FROM snapshots ORDER BY seq").fetchall() == [(10,)]
    conn.close()
    store.close()
    with open_reader(path) as reader:
        assert reader.last_snapshot(until_seq=9) is None
        assert reader.last_snapshot().seq == 10


def test_a_schema_1_file_from_an_earlier_version_is_still_read(tmp_path):
    """A previous run's journal (set aside by rotation) written before schema 2: indexes on stream
    and kind, no snapshots table. The tools still read it, its newest snapshot included."""
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE records (seq INTEGER PRIMARY KEY, time FLOAT NOT NULL, stream TEXT NOT NULL,"
        " kind TEXT NOT NULL, payload BLOB NOT NULL);"
        "CREATE INDEX idx_records_stream ON records (stream);"
        "CREATE INDEX idx_records_kind ON records (kind);"
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);"
        "INSERT INTO meta VALUES ('schema_version', '1');"
    )
    rows = frame_rows(1, 3) + [snapshot_row(4)] + frame_rows(5, 6)
    conn.executemany("INSERT INTO records VALUES (?, ?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()
    with open_reader(path) as reader:
        assert reader.records() == [r.row_to_record(x) for x in rows]
        assert reader.last_snapshot().seq == 4
        assert reader.last_snapshot(until_seq=3) is None
        assert reader.counts().by_kind == {r.KIND_ENGINE_FRAME: 5, r.KIND_SNAPSHOT: 1}
    with pytest.raises(StoreError, match="schema 1"):
        open_store(path)  # never written by this code: a writer starts a new file


def test_record_budget_deletes_oldest(tmp_path):
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    for first in (1, 7, 13):
        store.write_batch(frame_rows(first, first + 5))
    stats = store.stats()
    assert (stats.records, stats.pruned, stats.last_seq) == (10, 8, 18)
    store.close()
    with open_reader(tmp_path / "j.sqlite") as reader:
        assert [x.seq for x in reader.records()] == list(range(9, 19))
        assert reader.counts().records == 10


def test_byte_budget_deletes_oldest_and_keeps_the_newest(tmp_path):
    store = open_store(tmp_path / "j.sqlite", bytes_max=550)
    store.write_batch(frame_rows(1, 8, size=100))
    assert (store.stats().records, store.stats().bytes, store.stats().pruned) == (5, 500, 3)
    store.write_batch([(9, 9.0, "engine/0", r.KIND_ENGINE_FRAME, bytes(2000))])
    assert (store.stats().records, store.stats().bytes) == (1, 2000)
    store.close()
    with open_reader(tmp_path / "j.sqlite") as reader:
        assert [x.seq for x in reader.records()] == [9]


def test_reopen_continues_the_counts(tmp_path):
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    store.write_batch(frame_rows(1, 6))
    store.close()
    store = open_store(tmp_path / "j.sqlite", records_max=10)
    assert (store.stats().records, store.stats().last_seq) == (6, 6)
    store.write_batch(frame_rows(7, 12))
    assert store.stats().records == 10
    store.close()


def test_failed_batch_rolls_back(tmp_path):
    store = open_store(tmp_path / "j.sqlite")
    store.write_batch(frame_rows(1, 3))
    with pytest.raises(sqlite3.IntegrityError):
        store.write_batch(frame_rows(4, 5) + frame_rows(3, 3))  # seq 3 again
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

"""The journal on disk: one SQLite file per run, written in batches, read by tools.

Theory of operation: the servicer never touches the disk on its hot path. The
journal's flusher hands batches of encoded rows (``records.Row``) to
``Store.write_batch`` in a worker thread; each batch is one transaction. Tools
(``inspect``, ``journal``) open the same file with ``open_reader`` in SQLite's
read-only URI mode, from another process, while the writer is live or after it
died: WAL mode lets readers see every committed batch without blocking the
writer, and a killed writer loses at most the batch it was writing.

Schema (``SCHEMA_VERSION``), in 16 KiB pages (``PAGE_SIZE``):
    records(seq INTEGER PRIMARY KEY, time REAL, stream TEXT, kind TEXT, payload BLOB)
        no secondary index: every row is an append at the end of the table
    snapshots(seq INTEGER PRIMARY KEY)       the seq of each ``snapshot`` row
    meta(key TEXT PRIMARY KEY, value TEXT)   values are JSON

Why no index on ``stream`` or ``kind`` (schema 1 had both): they were about
half of SQLite's cost per row, and request streams (``req/<random id>``)
land all over an index, dirtying a page per row. The one lookup that must stay
cheap, the newest snapshot, reads the ``snapshots`` table (a row per snapshot,
every 30 s); the tools' other filters (a stream, a kind) scan by seq, which
is what their selections mostly read anyway. 16 KiB pages (SQLite's default is
4 KiB) hold the ~1.5 KB engine frames of a busy servicer 10 to a page, not 2:
fewer page splits and WAL frames per row. Larger pages save a little more in
bulk but cost more per small commit (each commit writes its last page whole,
checksummed), which is a slow servicer's every flush: 16 KiB is as cheap as
4 KiB there. Together they cut the writer
thread's CPU by about 40% (docs/benchmarks.md, "Stop 20"). Files of schema 1
(a previous run's, set aside by rotation) are still read.

Rules:
- one writer per file, one thread at a time (the flusher serialises calls);
- the store's budgets (``records_max`` rows, ``bytes_max`` payload bytes) are
  enforced inside each batch's transaction by deleting the oldest rows,
  counted in ``pruned``; the newest row is always kept. The file itself is
  larger than ``bytes_max`` by per-row and index overhead, and SQLite reuses
  freed pages rather than shrinking the file;
- ``synchronous=NORMAL``: a committed batch survives the process being
  killed; a power cut may lose the last batches (a journal, not a ledger);
- readers never write, not even meta; a reader never needs the writer alive.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import sqlite_utils

from .records import KIND_SNAPSHOT, Record, Row, row_to_record

SCHEMA_VERSION: Final = 2
# The schemas a reader opens: 1 had indexes on stream and kind and no snapshots table.
READABLE_SCHEMAS: Final = frozenset({1, 2})
PAGE_SIZE: Final = 16_384
# WAL pages before an automatic checkpoint: 4 MiB of WAL, as SQLite's default 1000 pages of 4 KiB.
WAL_AUTOCHECKPOINT_PAGES: Final = 256
STORE_RECORDS_MAX: Final = 5_000_000
STORE_BYTES_MAX: Final = 1024 * 1024 * 1024
# How long a connection waits on a lock held by the other side (a WAL
# checkpoint or recovery) before failing; never reached in normal running.
BUSY_TIMEOUT_MS: Final = 2_000
READ_PAGE_RECORDS: Final = 10_000

_INSERT = "INSERT INTO records (seq, time, stream, kind, payload) VALUES (?, ?, ?, ?, ?)"
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq) VALUES (?)"


class StoreError(Exception):
    """The file is not a journal this code can use (wrong schema, not ours)."""


class StoreStats(msgspec.Struct, frozen=True):
    records: int  # rows in the file now
    bytes: int  # payload bytes in the file now
    pruned: int  # rows deleted by the budgets by this writer
    last_seq: int  # newest seq written, 0 when none
    batches: int  # transactions committed by this writer
    records_max: int
    bytes_max: int


class StoreCounts(msgspec.Struct, frozen=True):
    records: int
    bytes: int
    first_seq: int  # 0 when empty
    last_seq: int  # 0 when empty
    by_kind: dict[str, int]


class Store:
    """The writing side. Make it with ``open_store``; call from one thread at a time."""

    def __init__(self, db: sqlite_utils.Database, records_max: int, bytes_max: int) -> None:
        self._db = db
        self._conn = db.conn
        self.records_max = records_max
        self.bytes_max = bytes_max
        row = self._conn.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0), coalesce(max(seq), 0) FROM records"
        ).fetchone()
        self._records, self._bytes, self._last_seq = row
        self._pruned = 0
        self._batches = 0

    def write_batch(self, rows: Sequence[Row]) -> None:
        """Insert ``rows`` (increasing seq) in one transaction, then prune to budget.

        Blocking: call it from a worker thread (``trio.to_thread.run_sync``).
        On error the transaction is rolled back, counters are unchanged and
        the exception propagates (the flusher counts and drops the batch).
        """
        if not rows:
            return
        conn = self._conn
        records = self._records + len(rows)
        nbytes = self._bytes + sum(len(r[4]) for r in rows)
        pruned = 0
        committed = False
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Raw executemany, not sqlite-utils' insert_all: no per-row dicts
            # or column checks, so a batch of 10k rows costs milliseconds.
            conn.executemany(_INSERT, rows)
            snapshots = [(row[0],) for row in rows if row[3] == KIND_SNAPSHOT]
            if snapshots:
                conn.executemany(_INSERT_SNAPSHOT, snapshots)
            if records > self.records_max or nbytes > self.bytes_max:
                pruned, pruned_bytes = self._prune(records, nbytes)
                records -= pruned
                nbytes -= pruned_bytes
            conn.execute("COMMIT")
            committed = True
        finally:
            if not committed:
                conn.execute("ROLLBACK")
        self._records = records
        self._bytes = nbytes
        self._pruned += pruned
        self._batches += 1
        self._last_seq = max(self._last_seq, rows[-1][0])

    def _prune(self, records: int, nbytes: int) -> tuple[int, int]:
        """Delete the oldest rows until both budgets hold; keep the newest row."""
        rows_over = records - self.records_max
        bytes_over = nbytes - self.bytes_max
        count = 0
        size = 0
        cutoff = None
        cursor = self._conn.execute(
            "SELECT seq, length(payload) FROM records ORDER BY seq LIMIT ?", (records - 1,)
        )
        for seq, length in cursor:
            if count >= rows_over and size >= bytes_over:
                break
            count += 1
            size += length
            cutoff = seq
        cursor.close()
        if cutoff is None:
            return 0, 0
        self._conn.execute("DELETE FROM records WHERE seq <= ?", (cutoff,))
        self._conn.execute("DELETE FROM snapshots WHERE seq <= ?", (cutoff,))
        return count, size

    def stats(self) -> StoreStats:
        return StoreStats(
            records=self._records,
            bytes=self._bytes,
            pruned=self._pruned,
            last_seq=self._last_seq,
            batches=self._batches,
            records_max=self.records_max,
            bytes_max=self.bytes_max,
        )

    def close(self) -> None:
        self._conn.close()


def open_store(
    path: str | os.PathLike[str],
    *,
    records_max: int = STORE_RECORDS_MAX,
    bytes_max: int = STORE_BYTES_MAX,
) -> Store:
    """Create (or reopen) the journal file at ``path`` for writing."""
    if records_max < 1 or bytes_max < 0:
        raise ValueError(f"bad store budgets: records_max={records_max}, bytes_max={bytes_max}")
    path = Path(path)
    # The journal holds prompts' token ids: a directory made for it is
    # private, and the file is created 0600 before SQLite opens it (SQLite
    # gives its -wal and -shm files the database file's mode).
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _create_private(path)
    # Autocommit mode: write_batch opens its own transactions explicitly.
    # check_same_thread off: trio's worker threads differ from call to call,
    # and the flusher guarantees one call at a time.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    store = None
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # a new file's; set before WAL, which fixes it
        db = sqlite_utils.Database(conn)
        db.enable_wal()
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
        _ensure_schema(db, path, records_max, bytes_max)
        store = Store(db, records_max, bytes_max)
        return store
    finally:
        if store is None:
            conn.close()


def _create_private(path: Path) -> None:
    """Create ``path`` with mode 0600 if it does not exist; an existing file of ours is made 0600.

    Never through a symlink (O_NOFOLLOW): a link planted where the journal
    goes would have SQLite write prompts to wherever it points.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link; the journal is never written through one") from None
        raise
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm"):  # left by an earlier writer of this very file
        side = Path(f"{path}{suffix}")
        if side.exists() and not side.is_symlink():
            side.chmod(0o600)


def _ensure_schema(db: sqlite_utils.Database, path: Path, records_max: int, bytes_max: int) -> None:
    if db["meta"].exists():
        meta = {r["key"]: json.loads(r["value"]) for r in db["meta"].rows}
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(
                f"{path}: journal schema {meta.get('schema_version')!r}, this code reads {SCHEMA_VERSION}"
            )
    elif db.table_names():
        raise StoreError(f"{path} holds tables {db.table_names()} but no journal meta")
    db["records"].create(
        {"seq": int, "time": float, "stream": str, "kind": str, "payload": bytes},
        pk="seq",
        not_null={"time", "stream", "kind", "payload"},
        if_not_exists=True,
    )
    db["snapshots"].create({"seq": int}, pk="seq", if_not_exists=True)
    meta = {"schema_version": SCHEMA_VERSION, "records_max": records_max, "bytes_max": bytes_max}
    db["meta"].insert_all(
        [{"key": k, "value": json.dumps(v)} for k, v in meta.items()], pk="key", replace=True
    )


class Reader:
    """Read-only queries on a journal file. Make it with ``open_reader``."""

    def __init__(self, conn: sqlite3.Connection, schema: int = SCHEMA_VERSION) -> None:
        self._conn = conn
        self.schema = schema

    def records(
        self,
        *,
        after_seq: int = 0,
        until_seq: int | None = None,
        stream_prefix: str | None = None,
        streams: Collection[str] | None = None,
        kinds: Collection[str] | None = None,
        time_min: float | None = None,
        time_max: float | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Decoded records, oldest first: ``after_seq < seq <= until_seq``,
        ``time_min <= time <= time_max``, stream starting with
        ``stream_prefix`` and/or in ``streams``, kind in ``kinds``."""
        where = ["seq > ?"]
        args: list[Any] = [after_seq]
        if until_seq is not None:
            where.append("seq <= ?")
            args.append(until_seq)
        if stream_prefix:
            # A range, not LIKE: case-exact (and used the stream index of schema 1's files).
            where.append("stream >= ?")
            args.append(stream_prefix)
            last = ord(stream_prefix[-1])
            if last < 0x10FFFF:
                where.append("stream < ?")
                args.append(stream_prefix[:-1] + chr(last + 1))
        if streams is not None:
            where.append(f"stream IN ({','.join('?' * len(streams))})")
            args.extend(streams)
        if kinds is not None:
            where.append(f"kind IN ({','.join('?' * len(kinds))})")
            args.extend(kinds)
        if time_min is not None:
            where.append("time >= ?")
            args.append(time_min)
        if time_max is not None:
            where.append("time <= ?")
            args.append(time_max)
        sql = f"SELECT seq, time, stream, kind, payload FROM records WHERE {' AND '.join(where)} ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [row_to_record(r) for r in self._conn.execute(sql, args)]

    def iter_records(self, *, page: int = READ_PAGE_RECORDS, **filters: Any) -> Iterator[Record]:
        """All matching records, fetched ``page`` at a time (no long read
        transaction, so a live writer's checkpoints are not held back)."""
        after_seq = filters.pop("after_seq", 0)
        if "limit" in filters:
            raise TypeError("iter_records pages by itself; use records(limit=...)")
        while True:
            batch = self.records(after_seq=after_seq, limit=page, **filters)
            yield from batch
            if len(batch) < page:
                return
            after_seq = batch[-1].seq

    def last_seq(self) -> int:
        return self._conn.execute("SELECT coalesce(max(seq), 0) FROM records").fetchone()[0]

    def first_seq(self) -> int:
        return self._conn.execute("SELECT coalesce(min(seq), 0) FROM records").fetchone()[0]

    def last_snapshot(self, until_seq: int | None = None) -> Record | None:
        """The newest ``snapshot`` record at or before ``until_seq``."""
        # Schema 1 had no snapshots table, and an index on kind instead.
        newest = ("SELECT max(seq) FROM snapshots WHERE seq <= ?" if self.schema != 1 else
                  f"SELECT max(seq) FROM records WHERE kind = '{KIND_SNAPSHOT}' AND seq <= ?")
        row = self._conn.execute(
            f"SELECT seq, time, stream, kind, payload FROM records WHERE seq = ({newest})",
            (self.last_seq() if until_seq is None else until_seq,),
        ).fetchone()
        return None if row is None else row_to_record(row)

    def counts(self) -> StoreCounts:
        records, nbytes, first, last = self._conn.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0),"
            " coalesce(min(seq), 0), coalesce(max(seq), 0) FROM records"
        ).fetchone()
        by_kind = dict(
            self._conn.execute("SELECT kind, count(*) FROM records GROUP BY kind ORDER BY kind")
        )
        return StoreCounts(records=records, bytes=nbytes, first_seq=first, last_seq=last, by_kind=by_kind)

    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._conn.execute("SELECT key, value FROM meta")}

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_reader(path: str | os.PathLike[str]) -> Reader:
    """Open a journal file read-only (live, cleanly closed, or left by a killed writer)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no journal at {path}")
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise StoreError(f"{path} is not a journal: {exc}") from exc
    schema = None if version is None else json.loads(version[0])
    if schema not in READABLE_SCHEMAS:
        conn.close()
        raise StoreError(f"{path}: journal schema {schema!r}, this code reads {sorted(READABLE_SCHEMAS)}")
    return Reader(conn, schema)

"""The journal on disk: one SQLite file per run, written in blocks, read by tools.

Theory of operation: the servicer never touches the disk on its hot path. The
journal's flusher hands batches of encoded rows (``records.Row``) to
``Store.write_batch`` in a worker thread; each batch is one transaction. Tools
(``inspect``, ``journal``) open the same file with ``open_reader`` in SQLite's
read-only URI mode, from another process, while the writer is live or after it
died: WAL mode lets readers see every committed batch without blocking the
writer, and a killed writer loses at most the batch it was writing.

Schema (``SCHEMA_VERSION`` 3), in 16 KiB pages (``PAGE_SIZE``):
    blocks(first_seq INTEGER PRIMARY KEY, last_seq INTEGER, count INTEGER, bytes INTEGER, body BLOB)
        ``body``: the block's rows, ``[[seq, time, stream, kind, payload], ...]`` in msgpack
        (``encode_block``); ``bytes``: what the row takes in the file (``stored_bytes``, the budget's
        measure)
    snapshots(seq INTEGER PRIMARY KEY, block INTEGER)   each ``snapshot`` row's seq and its block
    meta(key TEXT PRIMARY KEY, value TEXT)              values are JSON

Why blocks, not a row per record (schemas 1 and 2): a flush is one block of
up to ``BLOCK_BYTES_MAX`` payload bytes, so SQLite does one insert per flush
instead of one per record (and Python's sqlite3, which gives the GIL up
around each step, one GIL round trip instead of one per record). The same
10 s of a busy servicer's records cost SQLite alone 0.53 s of CPU as rows and
0.24 s as blocks; in the servicer the writer thread went from 9-11% of its
CPU to about 5% (docs/benchmarks-history.md, "Stop 21"). A record is still a record: the
journal's seq, ring, fold and readers are unchanged, and ``Reader`` gives the
same ``Record`` objects. No secondary index (schema 1 had two): filters on a
stream or a kind scan the blocks in seq order, which is what their
selections mostly read anyway; the one lookup that must stay cheap, the
newest snapshot, reads the ``snapshots`` table. Files of schemas 1 and 2 (a
previous run's, set aside by rotation) are still read.

Rules:
- one writer per file, one thread at a time (the flusher serialises calls);
- seqs increase across batches (``write_batch`` refuses one that does not);
- the store's budgets (``records_max`` records, ``bytes_max`` bytes of the
  file) hold after each batch's transaction: the oldest blocks are deleted
  whole, counted in ``pruned``, so a full file holds up to one block less
  than its budgets; the newest block is never deleted, only cut to its newest
  records when it alone is over (the newest record is always kept). A block
  is counted at what it takes in the file (``stored_bytes``: its encoded body
  in SQLite's pages), not at its payloads' bytes: those left out the records'
  framing and the pages' unused ends, and a full 1 GiB journal's files
  settled at 1.18 GiB (the hour-long soak, docs/benchmarks.md). SQLite reuses
  freed pages rather than shrinking the file, so the file stays at the budget
  plus one batch (inserted before the oldest are deleted), the b-tree's
  interior pages and the WAL (``WAL_AUTOCHECKPOINT_PAGES``);
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

SCHEMA_VERSION: Final = 3
# The schemas a reader opens: 1 and 2 kept a row per record (1 with indexes on stream and kind and
# no snapshots table); 3 keeps blocks of records.
READABLE_SCHEMAS: Final = frozenset({1, 2, 3})
# Payload bytes per block at most (a record larger than this is a block of its own): a flush of a busy
# servicer (50 ms, ~400 KB) is one block; the bound keeps what a reader decodes to find one record small.
BLOCK_BYTES_MAX: Final = 1024 * 1024
PAGE_SIZE: Final = 16_384
# WAL pages before an automatic checkpoint: 4 MiB of WAL, as SQLite's default 1000 pages of 4 KiB.
WAL_AUTOCHECKPOINT_PAGES: Final = 256
STORE_RECORDS_MAX: Final = 5_000_000
STORE_BYTES_MAX: Final = 1024 * 1024 * 1024
# How long a connection waits on a lock held by the other side (a WAL
# checkpoint or recovery) before failing; never reached in normal running.
BUSY_TIMEOUT_MS: Final = 2_000
READ_PAGE_RECORDS: Final = 10_000

_INSERT_BLOCK = "INSERT INTO blocks (first_seq, last_seq, count, bytes, body) VALUES (?, ?, ?, ?, ?)"
_INSERT_SNAPSHOT = "INSERT INTO snapshots (seq, block) VALUES (?, ?)"

_BLOCK_ENCODER = msgspec.msgpack.Encoder()
_BLOCK_DECODER = msgspec.msgpack.Decoder(list[tuple[int, float, str, str, bytes]])
# For scans that read every record's head but not every payload (filters, ``Reader.counts``): those left encoded.
_BLOCK_HEADS_DECODER = msgspec.msgpack.Decoder(list[tuple[int, float, str, str, msgspec.Raw]])
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(bytes)

BlockRow = tuple[int, int, int, int, bytes]  # (first_seq, last_seq, count, bytes, body): a row of ``blocks``
# A row's bytes beside its body: its record header, four integers and its cell's pointer (SQLite's file format).
ROW_OVERHEAD_BYTES: Final = 64
# The most of a row a table's leaf page holds itself (SQLite: usable size - 35); the rest goes to overflow
# pages of their own, PAGE_SIZE - 4 bytes of it each.
_LEAF_LOCAL_MAX: Final = PAGE_SIZE - 35


def stored_bytes(body_bytes: int) -> int:
    """What a block whose body is ``body_bytes`` long takes in the file: a small one shares a leaf page with
    its neighbours; a larger one spills into overflow pages, the last of them partly unused, so it is counted
    in whole pages (its leaf cell's few bytes included)."""
    row = body_bytes + ROW_OVERHEAD_BYTES
    if row <= _LEAF_LOCAL_MAX:
        return row
    return -(-row // (PAGE_SIZE - 4)) * PAGE_SIZE


def encode_block(rows: Sequence[Row]) -> BlockRow:
    """``rows`` (a run of increasing seqs) as one row of ``blocks``, counted at what it takes in the file."""
    body = _BLOCK_ENCODER.encode(rows)
    return (rows[0][0], rows[-1][0], len(rows), stored_bytes(len(body)), body)


def decode_block(body: bytes) -> list[Row]:
    """A block's rows, oldest first."""
    return _BLOCK_DECODER.decode(body)


class StoreError(Exception):
    """The file is not a journal this code can use (wrong schema, not ours)."""


class StoreStats(msgspec.Struct, frozen=True):
    records: int  # rows in the file now
    bytes: int  # bytes the file's blocks take (stored_bytes), the byte budget's measure
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
            "SELECT coalesce(sum(count), 0), coalesce(sum(bytes), 0), coalesce(max(last_seq), 0) FROM blocks"
        ).fetchone()
        self._records, self._bytes, self._last_seq = row
        self._pruned = 0
        self._batches = 0

    def write_batch(self, rows: Sequence[Row]) -> None:
        """Insert ``rows`` (increasing seqs, after every seq already written) in one transaction, as
        blocks of up to ``BLOCK_BYTES_MAX`` payload bytes, then prune to budget.

        Blocking: call it from a worker thread (``trio.to_thread.run_sync``).
        On error the transaction is rolled back, counters are unchanged and
        the exception propagates (the flusher counts and drops the batch): a
        seq that does not increase is ``sqlite3.IntegrityError``, as a
        duplicate key was when each record was a row. The error that
        propagates is the write's own: on a full disk (``SQLITE_FULL``) or an
        I/O error SQLite has already rolled the transaction back itself, and
        a second ROLLBACK would fail with "no transaction is active" and hide
        the cause.
        """
        if not rows:
            return
        blocks, snapshots, nbytes, newest_rows = self._blocks(rows)
        conn = self._conn
        records = self._records + len(rows)
        nbytes += self._bytes
        pruned = 0
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_INSERT_BLOCK, blocks)
            if snapshots:
                conn.executemany(_INSERT_SNAPSHOT, snapshots)
            if records > self.records_max or nbytes > self.bytes_max:
                pruned, pruned_bytes = self._prune(records, nbytes, newest_rows)
                records -= pruned
                nbytes -= pruned_bytes
            conn.execute("COMMIT")
        except BaseException:  # re-raised: the write's own error is the one the caller sees
            if conn.in_transaction:  # not after SQLITE_FULL or an I/O error: SQLite rolled it back
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the error being raised says why the write failed; this one would hide it
            raise
        self._records = records
        self._bytes = nbytes
        self._pruned += pruned
        self._batches += 1
        self._last_seq = rows[-1][0]

    def _blocks(self, rows: Sequence[Row]) -> tuple[list[BlockRow], list[tuple[int, int]], int, Sequence[Row]]:
        """The batch's blocks, its snapshots' (seq, block) rows, the bytes its blocks take in the file and
        the rows of its last block (the newest in the file); checks the seqs."""
        blocks: list[BlockRow] = []
        snapshots: list[tuple[int, int]] = []
        previous = self._last_seq
        start = 0
        size = 0
        for index, row in enumerate(rows):
            seq = row[0]
            if seq <= previous:
                raise sqlite3.IntegrityError(f"journal seq {seq} is not after {previous}, the seq before it")
            previous = seq
            length = len(row[4])
            if size and size + length > BLOCK_BYTES_MAX:
                blocks.append(encode_block(rows[start:index]))
                start = index
                size = 0
            size += length
            if row[3] == KIND_SNAPSHOT:
                snapshots.append((seq, rows[start][0]))
        newest_rows = rows[start:]
        blocks.append(encode_block(newest_rows))
        return blocks, snapshots, sum(block[3] for block in blocks), newest_rows

    def _prune(self, records: int, nbytes: int, newest_rows: Sequence[Row]) -> tuple[int, int]:
        """Delete the oldest blocks until both budgets hold; the newest block (``newest_rows``, this
        batch's last) only loses its oldest records."""
        rows_over = records - self.records_max
        bytes_over = nbytes - self.bytes_max
        conn = self._conn
        count = 0
        size = 0
        cutoff = None  # the first seq kept
        newest = newest_rows[0][0]
        cursor = conn.execute("SELECT first_seq, last_seq, count, bytes FROM blocks ORDER BY first_seq")
        for first_seq, last_seq, block_count, block_bytes in cursor:
            if count >= rows_over and size >= bytes_over:
                break
            if first_seq == newest:
                cursor.close()
                cut_count, cut_bytes, cutoff = self._cut_newest(newest_rows, rows_over - count, bytes_over - size)
                count += cut_count
                size += cut_bytes
                break
            count += block_count
            size += block_bytes
            cutoff = last_seq + 1
        cursor.close()
        if cutoff is None:
            return 0, 0
        conn.execute("DELETE FROM blocks WHERE first_seq < ?", (cutoff,))
        conn.execute("DELETE FROM snapshots WHERE seq < ?", (cutoff,))
        return count, size

    def _cut_newest(self, rows: Sequence[Row], rows_over: int, bytes_over: int) -> tuple[int, int, int]:
        """The newest block (its ``rows``) without its oldest records, as many as the budgets need and never
        its last: rewritten under its new first seq. Returns (records cut, bytes cut, the first seq kept).
        The bytes cut are what the block took in the file less what the rewritten one takes."""
        conn = self._conn
        first_seq = rows[0][0]
        (before,) = conn.execute("SELECT bytes FROM blocks WHERE first_seq = ?", (first_seq,)).fetchone()
        # A record's share of the block: its payload and an even share of the rest (its framing, the pages).
        framing = (before - sum(len(row[4]) for row in rows)) / len(rows)
        count = 0
        size = 0.0
        while count < len(rows) - 1 and (count < rows_over or size < bytes_over):
            size += len(rows[count][4]) + framing
            count += 1
        if not count:
            return 0, 0, first_seq
        kept = rows[count:]
        block = encode_block(kept)
        conn.execute("DELETE FROM blocks WHERE first_seq = ?", (first_seq,))
        conn.execute(_INSERT_BLOCK, block)
        conn.execute("UPDATE snapshots SET block = ? WHERE block = ?", (kept[0][0], first_seq))
        return count, before - block[3], kept[0][0]

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
        # A checkpoint rewinds the WAL but keeps its file as large as it ever grew (a burst's batch, a
        # reader that held a checkpoint back); this cuts it back to the autocheckpoint's size after one.
        conn.execute(f"PRAGMA journal_size_limit = {WAL_AUTOCHECKPOINT_PAGES * PAGE_SIZE}")
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
    db["blocks"].create(
        {"first_seq": int, "last_seq": int, "count": int, "bytes": int, "body": bytes},
        pk="first_seq",
        not_null={"last_seq", "count", "bytes", "body"},
        if_not_exists=True,
    )
    db["snapshots"].create({"seq": int, "block": int}, pk="seq", not_null={"block"}, if_not_exists=True)
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
        streams = None if streams is None else frozenset(streams)
        kinds = None if kinds is None else frozenset(kinds)
        found: list[Record] = []
        if limit is not None and limit <= 0:
            return found
        # A filtered scan leaves the payloads it skips encoded (msgspec.Raw), and decodes those it keeps.
        selective = bool(stream_prefix) or streams is not None or kinds is not None or time_min is not None \
            or time_max is not None
        for rows in self._blocks(after_seq, until_seq, _BLOCK_HEADS_DECODER if selective else _BLOCK_DECODER):
            for row in rows:
                seq, time, stream, kind, payload = row
                if seq <= after_seq:
                    continue
                if until_seq is not None and seq > until_seq:
                    return found
                if ((stream_prefix and not stream.startswith(stream_prefix))
                        or (streams is not None and stream not in streams)
                        or (kinds is not None and kind not in kinds)
                        or (time_min is not None and time < time_min)
                        or (time_max is not None and time > time_max)):
                    continue
                if isinstance(payload, msgspec.Raw):  # left encoded by a selective scan
                    row = (seq, time, stream, kind, _PAYLOAD_DECODER.decode(payload))
                found.append(row_to_record(row))
                if limit is not None and len(found) >= limit:
                    return found
        return found

    def _blocks(self, after_seq: int, until_seq: int | None, decoder: msgspec.msgpack.Decoder) -> Iterator[list]:
        """The blocks that may hold seqs after ``after_seq`` (up to ``until_seq``), decoded one at a time
        (``decoder``: the payloads as bytes, or left encoded)."""
        start = self._conn.execute("SELECT coalesce(max(first_seq), 0) FROM blocks WHERE first_seq <= ?",
                                   (after_seq + 1,)).fetchone()[0]
        sql = "SELECT body FROM blocks WHERE first_seq >= ?"
        args: list[Any] = [start]
        if until_seq is not None:
            sql += " AND first_seq <= ?"
            args.append(until_seq)
        cursor = self._conn.execute(sql + " ORDER BY first_seq", args)
        try:
            for (body,) in cursor:
                yield decoder.decode(body)
        finally:
            cursor.close()

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
        row = self._conn.execute("SELECT last_seq FROM blocks ORDER BY first_seq DESC LIMIT 1").fetchone()
        return 0 if row is None else row[0]

    def first_seq(self) -> int:
        return self._conn.execute("SELECT coalesce(min(first_seq), 0) FROM blocks").fetchone()[0]

    def last_snapshot(self, until_seq: int | None = None) -> Record | None:
        """The newest ``snapshot`` record at or before ``until_seq``."""
        found = self._conn.execute(
            "SELECT snapshots.seq, body FROM snapshots JOIN blocks ON blocks.first_seq = snapshots.block"
            " WHERE snapshots.seq <= ? ORDER BY snapshots.seq DESC LIMIT 1",
            (self.last_seq() if until_seq is None else until_seq,),
        ).fetchone()
        if found is None:
            return None
        seq, body = found
        return next(row_to_record(row) for row in decode_block(body) if row[0] == seq)

    def counts(self) -> StoreCounts:
        records, nbytes, first, last = self._conn.execute(
            "SELECT coalesce(sum(count), 0), coalesce(sum(bytes), 0),"
            " coalesce(min(first_seq), 0), coalesce(max(last_seq), 0) FROM blocks"
        ).fetchone()
        by_kind: dict[str, int] = {}
        for (body,) in self._conn.execute("SELECT body FROM blocks ORDER BY first_seq"):
            for _, _, _, kind, _ in _BLOCK_HEADS_DECODER.decode(body):
                by_kind[kind] = by_kind.get(kind, 0) + 1
        return StoreCounts(records=records, bytes=nbytes, first_seq=first, last_seq=last,
                           by_kind=dict(sorted(by_kind.items())))

    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._conn.execute("SELECT key, value FROM meta")}

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RowsReader(Reader):
    """A journal of schema 1 or 2, a row per record (a previous run's file, set aside by rotation):
    ``Reader``'s filters over its rows, read in pages."""

    def _blocks(self, after_seq: int, until_seq: int | None, decoder: msgspec.msgpack.Decoder) -> Iterator[list]:
        sql = "SELECT seq, time, stream, kind, payload FROM records WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?"
        last = self.last_seq() if until_seq is None else until_seq
        while rows := self._conn.execute(sql, (after_seq, last, READ_PAGE_RECORDS)).fetchall():
            yield rows
            after_seq = rows[-1][0]

    def last_seq(self) -> int:
        return self._conn.execute("SELECT coalesce(max(seq), 0) FROM records").fetchone()[0]

    def first_seq(self) -> int:
        return self._conn.execute("SELECT coalesce(min(seq), 0) FROM records").fetchone()[0]

    def last_snapshot(self, until_seq: int | None = None) -> Record | None:
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
    return Reader(conn, schema) if schema == SCHEMA_VERSION else RowsReader(conn, schema)

"""The bounded in-memory ring: the newest journal rows, oldest pruned first.

The servicer appends one row per engine output frame and per request
lifecycle event on its hot path, so ``push`` is O(1) amortised, does no I/O
and allocates nothing beyond the deque slot. Readers (``inspect``, the live
fold, KV-event history) copy rows out; they never hold references into the
ring's internals.

Rules:
- two budgets, both enforced after every push: ``records_max`` rows and
  ``bytes_max`` payload bytes (the encoded payload; see ``records.py``);
- pruning drops the oldest rows and counts them in ``pruned``;
- the newest row is always kept, even when its payload alone exceeds
  ``bytes_max`` (so ``last_seq`` stays readable); ``bytes`` may then exceed
  the budget by that one row until the next push;
- rows arrive with contiguous, increasing ``seq``; the ring relies on it to
  find ``after_seq`` by arithmetic instead of a search;
- single-threaded: called from the trio thread only.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Final

import msgspec

from .records import Record, Row, row_to_record

RING_RECORDS_MAX: Final = 100_000
RING_BYTES_MAX: Final = 64 * 1024 * 1024


class RingStats(msgspec.Struct, frozen=True):
    records: int  # rows held now
    bytes: int  # payload bytes held now
    pruned: int  # rows dropped by the budgets since the ring was made
    first_seq: int  # 0 when empty
    last_seq: int  # 0 when empty
    records_max: int
    bytes_max: int


class Ring:
    """Newest rows of one journal under a record budget and a byte budget."""

    __slots__ = ("records_max", "bytes_max", "_rows", "_bytes", "_pruned")

    def __init__(
        self,
        records_max: int = RING_RECORDS_MAX,
        bytes_max: int = RING_BYTES_MAX,
    ) -> None:
        if records_max < 1:
            raise ValueError(f"records_max must be >= 1, got {records_max}")
        if bytes_max < 0:
            raise ValueError(f"bytes_max must be >= 0, got {bytes_max}")
        self.records_max = records_max
        self.bytes_max = bytes_max
        self._rows: deque[Row] = deque()
        self._bytes = 0
        self._pruned = 0

    def push(self, row: Row) -> None:
        rows = self._rows
        rows.append(row)
        self._bytes += len(row[4])
        # Usually zero or one iteration: each push prunes at most what it
        # added, except when one large payload evicts several small ones.
        while (len(rows) > self.records_max or self._bytes > self.bytes_max) and len(rows) > 1:
            old = rows.popleft()
            self._bytes -= len(old[4])
            self._pruned += 1

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def first_seq(self) -> int:
        return self._rows[0][0] if self._rows else 0

    @property
    def last_seq(self) -> int:
        return self._rows[-1][0] if self._rows else 0

    def rows(self, after_seq: int = 0, limit: int | None = None) -> list[Row]:
        """Rows with ``seq > after_seq``, oldest first, at most ``limit``."""
        rows = self._rows
        if not rows:
            return []
        start = max(0, after_seq - rows[0][0] + 1)
        stop = None if limit is None else start + limit
        if start >= len(rows):
            return []
        # islice walks from the left; the common reader asks for a recent
        # tail, so index from the right when that is shorter.
        if stop is None and start > len(rows) // 2:
            tail = list(islice(reversed(rows), len(rows) - start))
            tail.reverse()
            return tail
        return list(islice(rows, start, stop))

    def records(self, after_seq: int = 0, limit: int | None = None) -> list[Record]:
        """Like ``rows`` but decoded (payload dicts rebuilt from msgpack)."""
        return [row_to_record(r) for r in self.rows(after_seq, limit)]

    def stats(self) -> RingStats:
        return RingStats(
            records=len(self._rows),
            bytes=self._bytes,
            pruned=self._pruned,
            first_seq=self.first_seq,
            last_seq=self.last_seq,
            records_max=self.records_max,
            bytes_max=self.bytes_max,
        )

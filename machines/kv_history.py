"""One DP rank's window of relayed KV batches: what cursors are served from.

The window covers one unbroken range of the publisher's sequence numbers,
``first ..= newest``. A sequence the relay could not obtain (lost on the wire
and not in the publisher's replay buffer) keeps its slot as a *hole*, so the
window stays contiguous and a reader can tell "nothing there" from "never
got it": holes are recorded, never skipped.

Two named bounds: ``batches_max`` slots and ``bytes_max`` (each slot charged
its raw payload size plus ``ENTRY_OVERHEAD_BYTES``); the oldest slots go
first, the newest always stays. Each slot keeps a digest of the payload as
received, so the relay can tell a duplicate from a different batch under the
same number (a restarted publisher).

Sans-io, no clock; a plain deque with a moving base sequence.
"""

from __future__ import annotations

from collections import deque
from typing import Final, Iterator

from enginelink.wire.kv_batch import KvBatch

ENTRY_OVERHEAD_BYTES: Final = 96


class _Slot:
    __slots__ = ("batch", "digest", "size")

    def __init__(self, batch: KvBatch | None, digest: int | None, size: int) -> None:
        self.batch = batch  # None: a hole
        self.digest = digest
        self.size = size


class History:
    def __init__(self, batches_max: int, bytes_max: int) -> None:
        if batches_max < 1 or bytes_max < 1:
            raise ValueError("history bounds must be >= 1")
        self.batches_max = batches_max
        self.bytes_max = bytes_max
        self._slots: deque[_Slot] = deque()
        self.first = 0  # sequence of _slots[0]
        self.bytes = 0
        self.holes = 0  # holes inside the window now
        self.evicted = 0  # slots pushed out by the bounds (counter)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def newest(self) -> int | None:
        return self.first + len(self._slots) - 1 if self._slots else None

    def push(self, seq: int, batch: KvBatch, digest: int, payload_bytes: int) -> None:
        self._append(seq, _Slot(batch, digest, payload_bytes + ENTRY_OVERHEAD_BYTES))

    def push_holes(self, first: int, last: int) -> None:
        """Record ``first ..= last`` as lost. A run longer than the window keeps its newest slots."""
        if last < first:
            return
        if last - first + 1 >= self.batches_max:
            self.clear()
            first = last + 1 - self.batches_max
        for seq in range(first, last + 1):
            self._append(seq, _Slot(None, None, ENTRY_OVERHEAD_BYTES))

    def _append(self, seq: int, slot: _Slot) -> None:
        newest = self.newest
        if newest is None:
            self.first = seq
        elif seq != newest + 1:
            raise AssertionError(f"history: append of {seq} after {newest}")  # our bug
        self._slots.append(slot)
        self.bytes += slot.size
        if slot.batch is None:
            self.holes += 1
        while len(self._slots) > self.batches_max or (self.bytes > self.bytes_max and len(self._slots) > 1):
            old = self._slots.popleft()
            self.first += 1
            self.bytes -= old.size
            self.evicted += 1
            if old.batch is None:
                self.holes -= 1

    def clear(self) -> None:
        self._slots.clear()
        self.first = 0
        self.bytes = 0
        self.holes = 0

    def _slot(self, seq: int) -> _Slot | None:
        i = seq - self.first
        return self._slots[i] if 0 <= i < len(self._slots) else None

    def digest_of(self, seq: int) -> int | None:
        """The digest held for ``seq``; None when outside the window or a hole."""
        slot = self._slot(seq)
        return None if slot is None else slot.digest

    def hole_after(self, cursor: int) -> int | None:
        """The first hole with a sequence above ``cursor``, if any."""
        if not self.holes:
            return None
        for i in range(max(0, cursor + 1 - self.first), len(self._slots)):
            if self._slots[i].batch is None:
                return self.first + i
        return None

    def entries(self, start: int) -> Iterator[tuple[int, KvBatch | None]]:
        """``(seq, batch or None for a hole)`` from ``start`` to the newest."""
        for i in range(max(0, start - self.first), len(self._slots)):
            yield self.first + i, self._slots[i].batch

"""The ring: both budgets, oldest-first pruning, reads by seq."""

from __future__ import annotations

import pytest

from enginelink.journal import records as r
from enginelink.journal.ring import Ring


def row(seq: int, size: int = 10) -> r.Row:
    return (seq, float(seq), "engine/0", r.KIND_ENGINE_FRAME, bytes(size))


def test_record_budget_prunes_oldest_first():
    ring = Ring(records_max=3, bytes_max=10**6)
    for seq in range(1, 8):
        ring.push(row(seq))
    stats = ring.stats()
    assert (stats.records, stats.bytes, stats.pruned) == (3, 30, 4)
    assert (stats.first_seq, stats.last_seq) == (5, 7)
    assert [x[0] for x in ring.rows()] == [5, 6, 7]


def test_byte_budget_prunes_oldest_first():
    ring = Ring(records_max=100, bytes_max=35)
    for seq in range(1, 6):
        ring.push(row(seq, size=10))
    assert [x[0] for x in ring.rows()] == [3, 4, 5]
    assert ring.stats().bytes == 30
    # One large payload evicts several small ones.
    ring.push(row(6, size=30))
    assert [x[0] for x in ring.rows()] == [6]
    assert ring.stats().pruned == 5


def test_newest_row_is_kept_even_over_the_byte_budget():
    ring = Ring(records_max=10, bytes_max=5)
    ring.push(row(1, size=100))
    assert ring.last_seq == 1
    assert ring.stats().bytes == 100
    ring.push(row(2, size=1))
    assert [x[0] for x in ring.rows()] == [2]
    assert ring.stats().bytes == 1


def test_rows_after_seq_and_limit():
    ring = Ring(records_max=10)
    for seq in range(1, 26):
        ring.push(row(seq))
    # Ring holds 16..25.
    assert [x[0] for x in ring.rows(after_seq=0)] == list(range(16, 26))
    assert [x[0] for x in ring.rows(after_seq=17)] == list(range(18, 26))  # head path
    assert [x[0] for x in ring.rows(after_seq=22)] == [23, 24, 25]  # tail path
    assert [x[0] for x in ring.rows(after_seq=16, limit=2)] == [17, 18]
    assert ring.rows(after_seq=25) == []
    assert ring.rows(after_seq=99) == []


def test_records_are_decoded():
    ring = Ring()
    payload = {"request_id": "a", "index": 0, "tokens_sent": 3, "finish_reason": "stop"}
    ring.push((1, 0.5, "req/a", r.KIND_CLIENT_SENT, r.encode_payload(r.KIND_CLIENT_SENT, payload)))
    assert ring.records() == [r.Record(1, 0.5, "req/a", r.KIND_CLIENT_SENT, payload)]


def test_empty_ring():
    ring = Ring()
    assert (ring.first_seq, ring.last_seq, len(ring), ring.rows()) == (0, 0, 0, [])


@pytest.mark.parametrize(("records_max", "bytes_max"), [(0, 10), (1, -1)])
def test_budgets_must_be_sane(records_max, bytes_max):
    with pytest.raises(ValueError):
        Ring(records_max, bytes_max)

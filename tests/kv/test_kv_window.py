"""Cursors against a small history window (``SMG_KV_EVENT_HISTORY_BATCHES=8``), end to end.

The full warm-up publishes far more than eight batches, so by the time the
servicer is SERVING the window has rolled: a subscriber from 0 gets a
snapshot (chunks numbered up to the cut, chunk 0 opening with a clear, the
live blocks parents first), then live batches; a cursor just inside the
window resumes, one below it is refused with OUT_OF_RANGE.
"""

from __future__ import annotations

import grpc
import pytest

from tests.kv.conftest import kv_servicer, sequence_base
from tests.kv.kv_client import Chain, KvSubscription, generate, newest_sequence, prompt

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

BLOCK = 16
WINDOW = 8


@pytest.fixture(scope="module")
def small_window(tmp_path_factory, test_model_dir):
    servicer = kv_servicer(tmp_path_factory.mktemp("kv-window"), test_model_dir,
                           env={"SMG_KV_EVENT_HISTORY_BATCHES": str(WINDOW)}).start()  # fmt: skip
    try:
        yield servicer
    finally:
        servicer.stop()


def test_zero_after_the_window_rolled_gets_a_snapshot_then_live(small_window):
    p1 = prompt(11, 4 * BLOCK)
    generate(small_window, "w-p1", p1)  # its batch opens with the warm-up flush's clear
    with KvSubscription(small_window, 0) as sub:
        sub.wait(lambda s: s.kv_batches() and s.kv_batches()[-1].snapshot.index + 1 == s.kv_batches()[-1].snapshot.count,
                 what="the whole snapshot")  # fmt: skip
        chunks = sub.kv_batches()
        assert all(b.HasField("snapshot") for b in chunks)
        assert [b.snapshot.index for b in chunks] == list(range(chunks[0].snapshot.count))
        numbers = [b.sequence_number for b in chunks]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert chunks[0].events[0].WhichOneof("data") == "cleared"
        assert chunks[0].snapshot.unknown_before == 0 and chunks[0].snapshot.blocks == 4
        assert numbers[-1] > sequence_base(small_window) + WINDOW  # the cut: the newest batch, past the window
        seen: set[int] = set()
        for event in (e for b in chunks for e in b.events if e.WhichOneof("data") == "stored"):
            assert event.event_id == 0
            parent = event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
            assert parent is None or parent in seen, "a child before its parent"
            seen.update(b.block_hash for b in event.stored.blocks)
        assert Chain().apply(chunks).prefix_of(p1, BLOCK) == 4

        p2 = prompt(12, 2 * BLOCK)
        generate(small_window, "w-p2", p2)
        sub.wait(lambda s: newest_sequence(s.snapshot()) == numbers[-1] + 1, what="the live batch after the cut")
        assert Chain().apply(sub.kv_batches()).prefix_of(p2, BLOCK) == 2


def test_cursors_at_the_edge_of_the_window(small_window):
    generate(small_window, "w-p3", prompt(13, 2 * BLOCK))
    with KvSubscription(small_window, 0) as sub:
        newest = sub.caught_up()
    inside = newest - WINDOW  # oldest - 1: the whole window follows
    with KvSubscription(small_window, inside) as sub:
        sub.wait(lambda s: newest_sequence(s.snapshot()) == newest, what="the window")
        assert [b.sequence_number for b in sub.kv_batches()] == list(range(inside + 1, newest + 1))
    for below in (newest - WINDOW - 1, sequence_base(small_window) + 1):
        sub = KvSubscription(small_window, below)
        assert sub.wait_end() == grpc.StatusCode.OUT_OF_RANGE, below
        assert "below" in sub.details()

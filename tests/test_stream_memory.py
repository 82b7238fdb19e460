"""``runtime/rpc/stream_memory.py``: an Event attribute that keeps no Event until waited on, with Event's semantics."""

from __future__ import annotations

import asyncio

import pytest

from enginelink.runtime.rpc.stream_memory import DormantEvent
from enginelink.runtime.rpc.fastpath import BoundedStream


class Holder:
    ready = DormantEvent()

    def __init__(self) -> None:
        self.ready = asyncio.Event()  # as grpclib's Stream.__init__ assigns its Events


def test_nothing_is_kept_until_a_wait():
    h = Holder()
    assert not any(isinstance(v, asyncio.Event) for v in vars(h).values())
    h.ready.set()
    h.ready.clear()
    h.ready.set()
    assert h.ready.is_set()
    assert not any(isinstance(v, asyncio.Event) for v in vars(h).values())  # a flag, no deque


def test_it_behaves_as_an_event_in_every_order():
    async def scenario() -> None:
        h = Holder()
        h.ready.set()
        await asyncio.wait_for(h.ready.wait(), 1)  # set before the wait: returns at once
        assert isinstance(h.ready, asyncio.Event) and h.ready.is_set()

        h2 = Holder()
        h2.ready.set()
        h2.ready.clear()
        waiter = asyncio.ensure_future(h2.ready.wait())
        await asyncio.sleep(0)
        assert not waiter.done()  # cleared: it waits
        h2.ready.set()  # the real Event now: wakes the waiter
        assert await asyncio.wait_for(waiter, 1) is True

        h3 = Holder()
        stale = h3.ready  # a view kept across the wake-up must act on the real Event
        waiter = asyncio.ensure_future(h3.ready.wait())
        await asyncio.sleep(0)
        stale.set()
        assert await asyncio.wait_for(waiter, 1) is True
        stale.clear()
        assert not h3.ready.is_set()

    asyncio.run(scenario())


def test_only_a_fresh_event_may_be_assigned():
    h = Holder()
    done = asyncio.Event()
    done.set()
    with pytest.raises(AttributeError):
        h.ready = done
    with pytest.raises(AttributeError):
        h.ready = True


def test_server_streams_use_it_for_grpclibs_three_events():
    for name in ("window_updated", "headers_received", "trailers_received"):
        assert isinstance(vars(BoundedStream)[name], DormantEvent)


def test_lean_buffer_reads_what_grpclibs_buffer_reads():
    """Same bytes, same acknowledgements, same EOF, whatever the chunking; nothing kept once drained."""
    from grpclib.protocol import Buffer

    from enginelink.runtime.rpc.stream_memory import LeanBuffer

    async def feed_and_read(cls) -> tuple[list[bytes], list[int], object]:
        acks: list[int] = []
        buffer = cls(acks.append)
        reads = []

        async def reader() -> None:
            reads.append(await buffer.read(5))
            reads.append(await buffer.read(7))
            reads.append(await buffer.read(4))  # only EOF is left: b""

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits before anything came
        for chunk in (b"ab", b"cdefg", b"hij", b"kl"):
            buffer.add(chunk, len(chunk) + 1)  # padding counts for flow control, not for the bytes
            await asyncio.sleep(0)
        buffer.eof()
        await asyncio.wait_for(task, 1)
        return reads, acks, buffer

    lean = asyncio.run(feed_and_read(LeanBuffer))
    stock = asyncio.run(feed_and_read(Buffer))
    assert lean[:2] == stock[:2] == ([b"abcde", b"fghijkl", b""], [3, 6, 4, 3])
    assert lean[2]._unacked.qsize() == 0 and lean[2]._unacked._rest is None and lean[2]._acked is None


def test_a_unary_request_read_keeps_no_deque_for_the_eof_it_leaves():
    """grpclib reads a unary call's one message and never its END_STREAM: the marker stays queued
    for the call's life, in the queue's slot; the acknowledged-data deque goes once a read took all."""
    from enginelink.runtime.rpc.stream_memory import LeanBuffer

    async def scenario() -> None:
        acks: list[int] = []
        buffer = LeanBuffer(acks.append)
        body = b"\x00\x00\x00\x00\x03abc"
        buffer.add(body, len(body))
        buffer.eof()
        assert await buffer.read(5) == body[:5]
        assert await buffer.read(3) == b"abc"
        assert acks == [len(body)]
        assert buffer._acked is None and buffer._unacked._rest is None
        assert buffer._unacked.qsize() == 1  # the EOF marker, unread, as with grpclib's own Buffer
        assert await buffer.read(4) == b""  # and it still reads as EOF

    asyncio.run(scenario())


def test_lean_queue_keeps_order_across_its_slot_and_its_deque():
    from enginelink.runtime.rpc.stream_memory import LeanQueue

    async def scenario() -> None:
        q = LeanQueue()
        for i in range(5):
            q.put_nowait(i)
        assert q.qsize() == 5
        got = [await q.get() for _ in range(3)]
        q.put_nowait(5)
        got += [q.get_nowait() for _ in range(3)]
        assert got == [0, 1, 2, 3, 4, 5] and q.empty() and q._rest is None

    asyncio.run(scenario())


def test_wake_event_behaves_as_an_event_for_its_one_waiter():
    from enginelink.runtime.rpc.stream_memory import WakeEvent

    async def scenario() -> None:
        wake = WakeEvent()
        wake.set()
        assert await asyncio.wait_for(wake.wait(), 1) is True  # set before the wait: at once
        wake.clear()
        assert not wake.is_set()
        waiter = asyncio.ensure_future(wake.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        with pytest.raises(RuntimeError, match="one waiter"):
            await wake.wait()
        wake.set()
        wake.set()  # a second set before the waiter ran changes nothing
        assert await asyncio.wait_for(waiter, 1) is True and wake._waiter is None
        wake.clear()
        cancelled = asyncio.ensure_future(wake.wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert wake._waiter is None  # a cancelled writer leaves nothing behind; the next wait works
        later = asyncio.ensure_future(wake.wait())
        await asyncio.sleep(0)
        wake.set()
        assert await asyncio.wait_for(later, 1) is True

    asyncio.run(scenario())


def test_lean_queue_has_one_reader_and_survives_a_cancelled_wait():
    from enginelink.runtime.rpc.stream_memory import LeanQueue

    async def scenario() -> None:
        q = LeanQueue()
        first = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await q.get()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        q.put_nowait(1)
        q.put_nowait(2)
        assert (q.qsize(), await q.get(), q.get_nowait(), q.empty()) == (2, 1, 2, True)
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()

    asyncio.run(scenario())

"""``runtime/dormant_event.py``: an Event attribute that keeps no Event until waited on, with Event's semantics."""

from __future__ import annotations

import asyncio

import pytest

from enginelink.runtime.dormant_event import DormantEvent
from enginelink.runtime.grpc_limits import BoundedStream


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

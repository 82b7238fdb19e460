"""What an open gRPC stream keeps, cut: grpclib's per-stream asyncio objects made only when used.

Why: measured with tracemalloc between 32 and 1,000 open streams (sim engine;
docs/benchmarks-history.md, "Memory per open stream"), an open call held ~19 KiB of
Python heap, and the largest single items were grpclib's per-stream asyncio
primitives: three ``asyncio.Event``s in ``Stream.__init__`` (each with its own
waiter deque; ~2.3 KiB together) and the request ``Buffer``'s
``asyncio.Queue`` (three deques and an Event of its own; ~3.9 KiB with the
Buffer), all kept for the call's whole life although a server stream uses
them for a moment or never.

- ``DormantEvent`` (``window_updated``, ``headers_received``,
  ``trailers_received``): a class-level descriptor that keeps each
  instance's event state as a plain flag until ``wait()`` is called, and only
  then makes the real ``asyncio.Event`` (already set if the flag was). A
  server stream never waits on the two header events (the client side's)
  and waits on ``window_updated`` only when the peer's window is shut, which
  the direct write path mostly bypasses; yet grpclib *sets* them (a
  connection-level WINDOW_UPDATE sets every open stream's), so a set before
  any wait must cost nothing. ``set``, ``clear`` and ``is_set`` touch only the
  flag until then: the semantics are an Event's in any order of calls.
  Assignments (grpclib's ``__init__`` assigns fresh Events) are dropped, so
  the Event it built is freed at once.
- ``LeanBuffer``: grpclib's ``Buffer`` with its ``asyncio.Queue`` replaced by
  ``LeanQueue``, a single-consumer queue that holds its head item in a slot,
  a deque only for more, and a future only while its reader waits; and its
  acknowledged-data deque made by a read and dropped once empty. grpclib
  reads a stream's buffer from one task (the handler's ``recv_message``).
- ``WakeEvent``: a call's wake, an ``asyncio.Event`` for its one waiter
  without the Event's waiter deque.
"""

from __future__ import annotations

import asyncio
from collections import deque

from grpclib.protocol import Buffer


class _Dormant:
    """What an attribute read gives before the real Event exists (a short-lived view on the flag)."""

    __slots__ = ("_owner", "_key")

    def __init__(self, owner: object, key: str) -> None:
        self._owner = owner
        self._key = key

    def _event(self) -> asyncio.Event | None:
        # A view kept across an await may outlive the flag: the real Event, once made, decides.
        state = self._owner.__dict__.get(self._key)
        return state if isinstance(state, asyncio.Event) else None

    def set(self) -> None:
        event = self._event()
        if event is not None:
            event.set()
        else:
            self._owner.__dict__[self._key] = True

    def clear(self) -> None:
        event = self._event()
        if event is not None:
            event.clear()
        else:
            self._owner.__dict__.pop(self._key, None)

    def is_set(self) -> bool:
        event = self._event()
        return event.is_set() if event is not None else self._owner.__dict__.get(self._key) is True

    async def wait(self) -> bool:
        return await self.wake().wait()

    def wake(self) -> asyncio.Event:
        """The real Event from now on, carrying the flag's state."""
        event = self._event()
        if event is None:
            event = asyncio.Event()
            if self._owner.__dict__.get(self._key) is True:
                event.set()
            self._owner.__dict__[self._key] = event
        return event


class DormantEvent:
    """``stream.NAME``: the real ``asyncio.Event`` once waited on, a flag before (see the module doc)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_dormant_{name}"

    def __get__(self, instance: object, owner: type | None = None):
        if instance is None:
            return self
        state = instance.__dict__.get(self._key)
        if isinstance(state, asyncio.Event):
            return state
        return _Dormant(instance, self._key)

    def __set__(self, instance: object, value: object) -> None:
        # grpclib's Stream.__init__ assigns a fresh, unset Event: the state stays "not set", no Event kept.
        if isinstance(value, asyncio.Event) and not value.is_set():
            instance.__dict__.pop(self._key, None)
            return
        raise AttributeError("a DormantEvent is only ever assigned a fresh, unset asyncio.Event")


_EMPTY = object()


class LeanQueue:
    """The part of ``asyncio.Queue`` grpclib's ``Buffer`` uses, for one reader, holding no deque for one item.

    The head item sits in a slot, the rest (rare: a request body in several
    DATA frames not yet read) in a deque made only then. A unary call's
    request leaves its END_STREAM marker here for the call's whole life (the
    handler reads the one message and never the EOF): a slot, not a deque."""

    __slots__ = ("_head", "_rest", "_waiter")

    def __init__(self) -> None:
        self._head = _EMPTY
        self._rest: deque | None = None
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        if self._head is _EMPTY:
            self._head = item
        else:
            if self._rest is None:
                self._rest = deque()
            self._rest.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while self._head is _EMPTY:
            if self._waiter is not None:
                raise RuntimeError("LeanQueue has one reader; a second one waits")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    def get_nowait(self):
        item = self._head
        if item is _EMPTY:
            raise asyncio.QueueEmpty
        rest = self._rest
        if rest:
            self._head = rest.popleft()
            if not rest:
                self._rest = None  # an idle stream keeps no deque
        else:
            self._head = _EMPTY
        return item

    def empty(self) -> bool:
        return self._head is _EMPTY

    def qsize(self) -> int:
        return 0 if self._head is _EMPTY else 1 + (len(self._rest) if self._rest else 0)


class LeanBuffer(Buffer):
    """grpclib's stream ``Buffer`` over a ``LeanQueue`` (same reads, acknowledgements and EOF)."""

    def __init__(self, ack_callback) -> None:
        super().__init__(ack_callback)
        self._unacked = LeanQueue()
        self._acked = None  # made by a read, dropped once the read took everything (Buffer.read's deque)

    async def read(self, size: int) -> bytes:
        if self._acked is None:
            self._acked = deque()
        try:
            return await super().read(size)
        finally:
            if not self._acked:
                self._acked = None


class WakeEvent:
    """A call's wake (``generate``'s ``wake``): ``asyncio.Event`` for its one waiter, the call's writer.

    ``asyncio.Event`` keeps a waiter deque from birth (~0.7 KiB) for the
    call's whole life; this keeps one future, only while the writer waits.
    ``set`` may come from the trio side (the hub's fan-out), as for an Event:
    it resolves the future, whose callbacks run on the writer's loop."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        if self._waiter is not None:
            raise RuntimeError("a WakeEvent has one waiter; a second one waits")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return True

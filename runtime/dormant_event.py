"""An ``asyncio.Event`` attribute that costs nothing until someone waits on it.

Why: grpclib's ``Stream.__init__`` gives every stream three ``asyncio.Event``s
(``window_updated``, ``headers_received``, ``trailers_received``), each with
its own waiter deque: about 1.2 KiB per open call, 3.8 KiB of the ~19 KiB of
Python heap an open stream holds (tracemalloc, 32 → 1,000 open streams;
docs/benchmarks.md, "Memory per open stream"). A server stream never waits
on the two header events (they are the client side's), and waits on
``window_updated`` only when the peer's flow-control window is shut, which
enginelink's direct write path mostly bypasses. Yet grpclib *sets* them: a
connection-level WINDOW_UPDATE sets ``window_updated`` on every open stream.

``DormantEvent`` is a class-level descriptor that keeps each instance's
event state as a plain flag until ``wait()`` is called, and only then makes
the real ``asyncio.Event`` (already set if the flag was). ``set``,
``clear`` and ``is_set`` before that touch only the flag, so the semantics
are those of an ``Event`` whatever the order of calls. Assignments (grpclib's
``__init__`` assigns fresh Events) are dropped: the Event it built is freed
at once, and the stream keeps no deque.
"""

from __future__ import annotations

import asyncio


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

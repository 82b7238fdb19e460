"""The drain's last wait: writers still sending get up to ``DRAIN_FLUSH_S``; with none left it ends at once.

``core.drain`` on trio's mock clock, with a hub and writers that behave as
the real ones do at the seam the drain reads (``hub.active_requests``,
``hub.abort``, ``app.open_writers``): a writer that returns is waited for, a
writer that never returns is given exactly the flush time, an idle servicer
does not wait at all. ``tests/test_lifecycle.py`` shows the same with a real
servicer: the abort completes of a SIGTERM under load reach their clients.
"""

from __future__ import annotations

import pytest
import trio

from enginelink.machines.link import LinkEvent, LinkState
from enginelink.runtime.lifetime import core
from enginelink.runtime.requests.writers import counted


class FakeLink:
    """The link machine as drain reads and steps it: serving (not restarting), DRAIN, then DRAINED."""

    def __init__(self) -> None:
        self.events: list[tuple[LinkEvent, float]] = []
        self.machine = self
        self.state = LinkState.SERVING  # drain fails the held calls first when restarting (docs/resume.md)

    def can(self, event: LinkEvent) -> bool:
        return not any(e is event for e, _ in self.events)

    def step(self, event: LinkEvent) -> None:
        self.events.append((event, trio.current_time()))


class FakeHub:
    """Calls in flight, each with its writer (counted from admission, as ``generate`` is): an abort
    wakes the writer, which then needs ``writer_s`` to send the abort complete (None: it never ends)."""

    def __init__(self, app, calls: int, writer_s: float | None) -> None:
        self.app, self.writer_s = app, writer_s
        self.calls = {f"call-{i}": trio.Event() for i in range(calls)}
        self.aborted: list[str] = []

    @property
    def active_requests(self) -> int:
        return len(self.calls)

    def abort(self, request_ids, reason, now) -> int:
        self.aborted += list(request_ids)
        for request_id in request_ids:
            self.calls.pop(request_id).set()  # the writer wakes to send the abort complete
        return len(request_ids)

    async def admitted(self, nursery: trio.Nursery) -> None:
        for woken in self.calls.values():
            await nursery.start(write, self.app, woken, self.writer_s)


@counted
async def write(app, woken: trio.Event, writer_s: float | None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await woken.wait()
    await trio.sleep(writer_s if writer_s is not None else float("inf"))


class FakeApp:
    def __init__(self, calls: int = 0, writer_s: float | None = 0.0) -> None:
        self.link = FakeLink()
        self.open_writers = 0
        self.hub = FakeHub(self, calls, writer_s)


async def drained_at(app: FakeApp, drain_s: float) -> float:
    """Run ``core.drain`` (the writers in a nursery that outlives it); how long until DRAINED was stepped.
    ``app.left_writing``: the writers still at it then (the front's close cancels them)."""
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await app.hub.admitted(nursery)
        await core.drain(app, drain_s)
        app.left_writing = app.open_writers
        nursery.cancel_scope.cancel()
    (drained,) = [at for event, at in app.link.events if event is LinkEvent.DRAINED]
    return drained - start


async def test_an_idle_servicer_drains_without_waiting(autojump_clock):
    app = FakeApp()
    assert await drained_at(app, drain_s=5.0) == 0.0
    assert [e for e, _ in app.link.events] == [LinkEvent.DRAIN, LinkEvent.DRAINED]


async def test_the_drain_waits_for_writers_sending_abort_completes(autojump_clock):
    app = FakeApp(calls=3, writer_s=0.3)
    # 2 s of drain time, then the three calls are aborted and their writers need 0.3 s more.
    assert await drained_at(app, drain_s=2.0) == pytest.approx(2.3, abs=core.DRAIN_POLL_S + 1e-6)
    assert app.hub.aborted == ["call-0", "call-1", "call-2"] and app.left_writing == 0


async def test_a_writer_that_never_returns_gets_the_flush_time_and_no_more(autojump_clock):
    app = FakeApp(calls=1, writer_s=None)
    assert await drained_at(app, drain_s=2.0) == pytest.approx(2.0 + core.DRAIN_FLUSH_S)
    assert app.left_writing == 1  # still at it when the front closes (grpclib cancels it then)


async def test_a_drain_time_shorter_than_the_flush_bounds_it(autojump_clock):
    app = FakeApp(calls=1, writer_s=None)
    assert await drained_at(app, drain_s=0.25) == pytest.approx(0.25 + 0.25)


async def test_a_writer_is_counted_until_it_returns_however_it_ends(autojump_clock):
    class App:
        open_writers = 0

    app = App()

    @counted
    async def fails(app) -> None:
        assert app.open_writers == 1
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError):
        await fails(app)
    with trio.move_on_after(1):
        await write(app, trio.Event(), None)  # cancelled while it waits
    assert app.open_writers == 0

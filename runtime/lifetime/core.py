"""The servicer's lifetime decisions, without gRPC: how it ends, drains, and wires link to hub.

``runtime/lifetime/compose.py`` builds the servicer and runs its lifetime for both
``runtime/lifetime/server.py`` (a grpclib server) and the simulation (``tests/sim``,
in-memory clients); the steps of that lifetime — wiring the link's batches
and failure into the hub, racing bring-up against signals and failure,
draining — live here, free of grpclib (whose health protos cannot be
imported next to grpcio's in one process).

Rules: time only from ``trio.current_time()``; one nursery per wait;
readiness is not set here: it follows the link's state
(``runtime/lifetime/readiness.py``), so a failure or a drain turns it off by the
transition itself.
"""

from __future__ import annotations

import logging
import signal

import trio

from enginelink.machines.link import LinkEvent, LinkState
from enginelink.machines.request import RequestState

log = logging.getLogger("enginelink")

# After the link fails, how long writers get to end their streams with UNAVAILABLE.
FAIL_FLUSH_S = 0.5
# After a drain, how long writers get to send the abort completes (at most: the wait ends once
# every writer returned, runtime/requests/writers.py).
DRAIN_FLUSH_S = 1.0
# How often the drain looks at the calls in flight and the writers still sending.
DRAIN_POLL_S = 0.05


class Exit(Exception):
    """Bring-up ends the run: ``status`` 1 (the engine failed) or 2 (a configuration refused)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def connect(link, hub, app, failed: trio.Event, on_failed=None) -> None:
    """Wire the link to the hub: batches fan out, loads update, a failure fails every call."""

    def on_batch(batch, now: float) -> None:
        generated = hub.on_batch(batch, now) if batch.outputs else 0
        app.loads.update(batch.engine_index, batch.stats, generated, now)
        hub.last_receive_wall = app.wall_time(now)

    def on_failure(message: str, now: float) -> None:
        hub.fail_all(message, now)
        failed.set()
        if on_failed is not None:
            on_failed(message, now)

    def on_crash(message: str, now: float) -> None:
        hub.hold_all(message, now)  # the engine restarts (docs/resume.md): each call held, or failed saying why

    link.on_batch = on_batch
    link.on_crash = on_crash
    # A wake-up's frames are written once, after the last (RequestHub.hold_writes); the journal's
    # live fold takes the wake-up's records after those writes, off the frames' way to the clients.
    hub.hold_writes()
    catch_up = hub.journal.catch_up

    def frames_done(now: float) -> None:
        hub.write_held(now)
        catch_up()

    link.on_frames_done = frames_done
    link.on_failure = on_failure
    link.load_probe = lambda: (hub.active_requests, pending_prefill_tokens(hub))


async def wait_for_end(signals, failed: trio.Event, link, bring_up) -> tuple[int, str]:
    """Run ``bring_up`` and wait for whichever comes first: a signal (0), a failure (1, or 2 when
    the engine refused its arguments), an ``Exit``."""
    result: list[tuple[int, str]] = []
    async with trio.open_nursery() as nursery:

        def end(status: int, reason: str) -> None:
            if not result:
                result.append((status, reason))
            nursery.cancel_scope.cancel()

        async def on_signal() -> None:
            async for signum in signals:
                end(0, f"signal {signal.Signals(signum).name}")
                return

        async def on_failure() -> None:
            await failed.wait()
            # 2 when the engine refused the operator's arguments (EngineLink.failure_status).
            end(getattr(link, "failure_status", 1), f"engine link failed: {link.machine.failure}")

        async def start() -> None:
            try:
                await bring_up()
            except Exit as stop:
                end(stop.status, stop.reason)

        nursery.start_soon(on_signal)
        nursery.start_soon(on_failure)
        nursery.start_soon(start)
    return result[0]


async def drain(app, drain_s: float) -> None:
    """Close admission (``draining``: health NOT_SERVING), let in-flight calls finish for ``drain_s``, abort the rest."""
    link, hub = app.link, app.hub
    if link.machine.state is LinkState.RESTARTING:
        # Nothing held can go on: the engine is not back, and a draining servicer does not resume.
        hub.fail_held("the servicer is draining while its engine restarts; the request was not resumed; "
                      "retry on another worker", trio.current_time())
    if link.machine.can(LinkEvent.DRAIN):
        link.step(LinkEvent.DRAIN)
    log.info("draining: %d requests in flight, up to %g s", hub.active_requests, drain_s)
    with trio.move_on_after(drain_s):
        while hub.active_requests:
            await trio.sleep(DRAIN_POLL_S)
    if hub.active_requests:
        log.info("drain time is up: aborting %d requests", hub.active_requests)
        hub.abort(list(hub.calls), "drain", trio.current_time())
    # The writers send what the hub handed them (the abort completes, a finished call's last
    # chunks) before the engine stops and the front cancels every handler: as long as one is
    # at it, up to the flush time; none left (an idle servicer), no wait.
    with trio.move_on_after(min(DRAIN_FLUSH_S, drain_s)):
        while app.open_writers:
            await trio.sleep(DRAIN_POLL_S)
    if link.machine.can(LinkEvent.DRAINED):
        link.step(LinkEvent.DRAINED)


def pending_prefill_tokens(hub) -> int:
    """Prompt tokens of choices the engine has not answered yet (extends the silence limit)."""
    return sum(
        call.prompt_tokens * call.open_choices
        for call in hub.calls.values()
        if call.machine.state is RequestState.ADMITTED
    )

"""A KV-event send that fails after the relay gave up on it must not end the servicer.

``grpc_kv._send_bounded`` races a message's send against the stream's end and a
stall bound, in asyncio tasks. A send cancelled there can still end with an error
(h2's ``StreamClosedError`` when the subscriber reset its stream), and a call
cancelled mid-wait leaves its tasks behind. An error nobody retrieves is raised
out of the loop by trio-asyncio, ending every call of the servicer: it happened in
CI, a SubscribeKvEvents reset by its client killing an SGLang servicer 16 s later.
"""

from __future__ import annotations

import asyncio
import gc

from h2.exceptions import StreamClosedError

from enginelink.runtime.contracts.shared.grpc_kv import _send_bounded


class StalledStream:
    """A subscriber that stopped reading: the send waits for a window, then fails when cancelled."""

    def __init__(self) -> None:
        self.sends = 0

    async def send_message(self, message) -> None:
        self.sends += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise StreamClosedError(1) from None


def _unretrieved(scenario) -> list[dict]:
    """The loop's unhandled-exception reports while ``scenario(loop)`` runs and its tasks are collected."""
    reports: list[dict] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reports.append(context))
        await scenario()
        await asyncio.sleep(0.05)  # the cancelled send's task ends
        gc.collect()  # "exception was never retrieved" is reported when a task is collected
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    return reports


def test_a_stalled_send_that_fails_when_cancelled_leaves_no_unretrieved_error():
    stream = StalledStream()

    async def scenario() -> None:
        sent = await _send_bounded(stream, object(), asyncio.Event(), stall_s=0.01)
        assert sent is False  # the stall bound: the relay ends this stream

    assert _unretrieved(scenario) == []
    assert stream.sends == 1


def test_a_call_cancelled_mid_send_leaves_no_unretrieved_error():
    stream = StalledStream()

    async def scenario() -> None:
        waiting = asyncio.ensure_future(_send_bounded(stream, object(), asyncio.Event(), stall_s=60))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the subscriber reset its stream: grpclib cancels the handler
        try:
            await waiting
        except asyncio.CancelledError:
            pass

    assert _unretrieved(scenario) == []


def test_the_send_error_is_still_the_calls_when_it_awaits_it():
    class Closed:
        async def send_message(self, message) -> None:
            raise StreamClosedError(1)

    async def scenario() -> None:
        try:
            await _send_bounded(Closed(), object(), asyncio.Event(), stall_s=5)
        except StreamClosedError:
            return
        raise AssertionError("the send's error was swallowed")

    assert _unretrieved(scenario) == []

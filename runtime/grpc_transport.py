"""One socket write per event-loop tick per HTTP/2 connection.

grpclib writes to its transport once for every message, header block and
trailer. With hundreds of streams on one connection (the router multiplexes
every call over one channel) that is one ``send`` syscall, and one TCP segment
for the client to take apart, per message. ``CoalescingTransport`` buffers the
writes of one loop tick and hands them to the real transport as one write on
the next tick: measured side by side in ``docs/benchmarks.md`` (servicer CPU
per message about a third lower, client CPU per token about half).

Rules: ordering is preserved (one buffer per connection, flushed in order);
``close`` flushes first; nothing is buffered once the transport is closing;
flow control is untouched (the real transport still calls the protocol's
``pause_writing`` / ``resume_writing``).

``CoalescingServer`` installs it, and raises the HTTP/2 limit on concurrent
streams per connection from h2's default of 100 to ``MAX_CONCURRENT_STREAMS``.
The router multiplexes every call over one connection: at 100 the 101st call
waited in the client, unseen, while the engine ran under-full (measured at
concurrency 128: the engine never held more than 100 requests). Admission
(``RequestHub``, ``IN_FLIGHT_MAX``) is the bound that answers, with a
retryable UNAVAILABLE; the transport's limit sits above it with room for the
control calls (health, loads, KV subscriptions) beside a full load.

It overrides grpclib's ``_protocol_factory``
(private API): grpclib is pinned below 0.5 in pyproject.toml for that reason.
"""

from __future__ import annotations

import asyncio

from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.settings import SettingCodes

from enginelink.runtime.hub import IN_FLIGHT_MAX

MAX_CONCURRENT_STREAMS = IN_FLIGHT_MAX + 256


class CoalescingTransport:
    __slots__ = ("_transport", "_buffer", "_loop")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._buffer: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._buffer:
            self._loop.call_soon(self._flush)
        self._buffer.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        buffer, self._buffer = self._buffer, []
        if buffer and not self._transport.is_closing():
            self._transport.write(buffer[0] if len(buffer) == 1 else b"".join(buffer))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _CoalescingProtocol(H2Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(CoalescingTransport(transport))
        self.connection._connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class CoalescingServer(Server):
    def _protocol_factory(self) -> H2Protocol:
        # grpclib's factory registers the connection's handler; keep its parts.
        protocol = super()._protocol_factory()
        return _CoalescingProtocol(protocol.handler, protocol.config, protocol.h2_config)

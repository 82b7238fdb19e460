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
import time

from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.connection import ConnectionState
from h2.settings import SettingCodes
from h2.stream import StreamState

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


# Where h2 lets a server send DATA: its own transitions for SEND_DATA change nothing there.
_SENDABLE_STREAM_STATES = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE})


def direct_sender(stream):
    """Write stream messages now, from the caller's stack, when nothing has to wait.

    A streamed token otherwise costs an asyncio wake-up of the call's writer
    task (under trio-asyncio: a hop through trio's queue), grpclib's event
    dispatch and three awaits, about half the servicer's CPU per message
    (docs/benchmarks.md). This does what grpclib's ``send_message`` does
    once its headers are out: encode, frame, flush.

    The DATA frame is built here, not by ``h2.send_data``: h2 spends about as
    much again per frame on logging calls, state-machine inputs that change
    nothing in these states, a frame object and its serialisation. What h2
    must know is kept exact: both flow-control windows are charged, and
    anything h2 had queued goes out first, so the wire order is h2's.

    ``stream`` is a grpclib server ``Stream`` whose initial headers were sent.
    The returned function takes messages in order and returns how many it
    wrote; it stops at the first one that would have to wait (connection
    paused, flow-control window or frame size too small) or fail (the stream
    or the connection is closing), and the caller hands the rest to the
    writer task, which waits or raises as grpclib does. Private grpclib and
    h2 API: grpclib is pinned below 0.5 and h2 below 5.
    """
    h2_stream = stream._stream
    connection = h2_stream.connection
    h2_connection = h2_stream._h2_connection
    h2_state = h2_connection.state_machine
    codec, reply_type = stream._codec, stream._send_type
    stream_id = h2_stream.id
    frame_id = stream_id.to_bytes(4, "big")
    own = h2_connection.streams.get(stream_id)

    def send(messages) -> int:
        if (own is None or own.state_machine.state not in _SENDABLE_STREAM_STATES
                or h2_state.state is not ConnectionState.SERVER_OPEN):
            return 0
        frames = []
        size = 0
        for message in messages:
            if not connection.write_ready.is_set():
                break
            body = codec.encode(message, reply_type)
            length = len(body) + 5
            if length > min(h2_connection.outbound_flow_control_window, own.outbound_flow_control_window,
                            h2_connection.max_outbound_frame_size):
                break
            # DATA frame header (RFC 9113 4.1): 24-bit length, type 0, no flags, stream id; then the gRPC prefix.
            frames.append(length.to_bytes(3, "big") + b"\x00\x00" + frame_id
                          + b"\x00" + len(body).to_bytes(4, "big") + body)
            h2_connection.outbound_flow_control_window -= length
            own.outbound_flow_control_window -= length
            size += length
        written = len(frames)
        if written:
            h2_stream._transport.write(h2_connection.data_to_send() + b"".join(frames))
            now = time.monotonic()
            h2_stream.data_sent += size
            connection.data_sent += size
            connection.messages_sent += written
            connection.last_data_sent = connection.last_message_sent = now
            connection.ping_count_in_sequence = 0
            stream._messages_sent += written
        return written

    return send

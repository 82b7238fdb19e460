"""One socket write per event-loop tick per HTTP/2 connection.

grpclib writes to its transport once for every message, header block and
trailer. With hundreds of streams on one connection (the router multiplexes
every call over one channel) that is one ``send`` syscall, and one TCP segment
for the client to take apart, per message. ``CoalescingTransport`` buffers the
writes of one loop tick and hands them to the real transport as one write on
the next tick, which lowered both the servicer's CPU per message and the
client's per token (the figures: ``docs/benchmarks.md``, "After coalescing
socket writes").

Rules: ordering is preserved (one buffer per connection, flushed in order);
``close`` flushes first; nothing is buffered once the transport is closing;
flow control is untouched (the real transport still calls the protocol's
``pause_writing`` / ``resume_writing``).

``CoalescingServer`` installs it, and raises the HTTP/2 limit on concurrent
streams per connection from h2's default of 100 to ``MAX_CONCURRENT_STREAMS``.
The router multiplexes every call over one connection: at 100 the 101st call
waited in the client, unseen, while the engine ran under-full (above 100
concurrent calls the engine never held more than 100 requests). Admission
(``RequestHub``, ``IN_FLIGHT_MAX``) is the bound that answers, with a
retryable UNAVAILABLE; the transport's limit sits above it with room for the
control calls (health, loads, KV subscriptions) beside a full load.

Its protocol is ``grpc_limits.LimitedProtocol``: message size, reassembly
per connection, the connection cap, handshake and idle timeouts.

It overrides grpclib's ``_protocol_factory``
(private API): grpclib is pinned below 0.5 in pyproject.toml for that reason.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from dataclasses import dataclass

import hpack
from grpclib.protocol import H2Protocol
from grpclib.server import Server
from h2.connection import ConnectionInputs, ConnectionState
from h2.stream import StreamInputs, StreamState

from enginelink.runtime.grpc_limits import ConnectionGuard, GrpcLimits, LimitedProtocol
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

    def write_now(self, data: bytes) -> None:
        """Write at once (``FrameWrites``), after anything this tick buffered."""
        if self._buffer:
            self._buffer.append(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _CoalescingProtocol(LimitedProtocol):
    max_concurrent_streams = MAX_CONCURRENT_STREAMS  # announced with the server preface

    def connection_made(self, transport) -> None:
        super().connection_made(CoalescingTransport(transport))


class CoalescingServer(Server):
    """grpclib's server with the coalescing transport and ``GrpcLimits`` (``runtime/grpc_limits.py``)."""

    def __init__(self, handlers, *, limits: GrpcLimits | None = None, **kwargs) -> None:
        super().__init__(handlers, **kwargs)
        self.guard = ConnectionGuard(limits or GrpcLimits())

    def _protocol_factory(self) -> H2Protocol:
        # grpclib's factory registers the connection's handler; keep its parts.
        protocol = super()._protocol_factory()
        limited = _CoalescingProtocol(protocol.handler, protocol.config, protocol.h2_config)
        limited.guard = self.guard
        return limited


# A DATA frame's head (RFC 9113 4.1: 24-bit length and type 0 in one word, no flags, stream id)
# and gRPC's message prefix (not compressed, 32-bit length), in one pack.
_DATA_HEAD = struct.Struct(">IxIxI")
# HEADERS frame head (RFC 9113 4.1, 6.2): 24-bit length and type 1 in one 32-bit word, flags, stream id.
_HEADERS_HEAD = struct.Struct(">IBI")
_END_STREAM, _END_HEADERS = 0x1, 0x4


@functools.cache
def header_block(headers: tuple[tuple[str, str], ...]) -> bytes:
    """An HPACK block for ``headers`` that any HPACK state can take and that changes none.

    Every field is a "never indexed" literal (RFC 7541 6.2.3), with a name from
    the static table where it has one: the peer adds nothing to its dynamic
    table, so h2's encoder for the connection stays in step with the peer's
    decoder without being used. The block is the same for every stream, hence cached.
    """
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(name, value) for name, value in headers])


# What grpclib sends for a call that ends OK after its initial headers (send_trailing_metadata).
_OK_TRAILERS = (("grpc-status", "0"),)

# Where h2 lets a server send DATA: its own transitions for SEND_DATA change nothing there.
_SENDABLE_STREAM_STATES = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE})


@dataclass(frozen=True)
class DirectSendStats:
    """The direct path's headers and trailers, exported as ``smg_servicer_grpc_*``."""

    direct_headers: int  # response headers sent as a pre-built block
    grpclib_headers: int  # response headers grpclib sent, because they could not go at once
    direct_trailers: int  # OK trailers sent with an engine frame's writes


class FrameWrites:
    """The direct path's DATA frames of one engine frame: one socket write per connection.

    At one token per message every call gets one message per engine frame,
    and writing each call's message as it comes cost a transport write, a
    clock read and the connection's counters per call, and one trio-asyncio
    callback (the coalescing flush) per frame. Here the frames are collected
    per connection while the hub fans one engine frame out, and ``flush``
    (the hub's ``end_of_batch``) writes each connection's at once, straight
    to its socket. Nothing else writes to a connection while the hub fans
    out (it is one synchronous call), so the order on the wire is the order
    taken; bytes h2 had queued go first.
    """

    __slots__ = ("_pending", "direct_headers", "grpclib_headers", "direct_trailers")

    def __init__(self) -> None:
        self._pending: dict[object, list[bytes]] = {}  # grpclib Connection -> its DATA frames, in order
        # What the direct path sent itself and what it left to grpclib, for
        # /metrics (``stats``): a call's response headers go as a pre-built
        # block or, when they cannot go at once, through grpclib; a streaming
        # call's OK trailers go from the engine frame's write or, when not,
        # from grpclib as the handler returns (not counted: every other call).
        self.direct_headers = 0
        self.grpclib_headers = 0
        self.direct_trailers = 0

    def stats(self) -> DirectSendStats:
        return DirectSendStats(self.direct_headers, self.grpclib_headers, self.direct_trailers)

    def pending(self, connection) -> bool:
        """Whether this engine frame has writes for ``connection`` not yet flushed."""
        return connection in self._pending

    def add(self, connection, frames: list[bytes]) -> None:
        pending = self._pending.get(connection)
        if pending is None:
            self._pending[connection] = frames
        else:
            pending += frames

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        now = time.monotonic()
        for connection, frames in pending.items():
            if connection.is_closing():
                continue  # gone: its streams' writers see the connection closed
            data = b"".join(frames)
            connection._transport.write_now(connection._connection.data_to_send() + data)
            connection.data_sent += len(data)
            connection.messages_sent += len(frames)
            connection.last_data_sent = connection.last_message_sent = now
            connection.ping_count_in_sequence = 0


class DirectSender:
    """Write stream messages from the caller's stack, when nothing has to wait.

    A streamed token otherwise costs an asyncio wake-up of the call's writer
    task (under trio-asyncio: a hop through trio's queue), grpclib's event
    dispatch and three awaits, about half the servicer's CPU per message
    (docs/benchmarks.md). This does what grpclib's ``send_message`` does
    once its headers are out: encode, frame, send; the socket write itself
    is ``writes.flush``'s, once per connection per engine frame.

    The DATA frame is built here, not by ``h2.send_data``: h2 spends about as
    much again per frame on logging calls, state-machine inputs that change
    nothing in these states, a frame object and its serialisation. What h2
    must know is kept exact: both flow-control windows are charged here, at
    once, and anything h2 had queued goes out first, so the wire order is h2's.
    grpclib's per-stream counters (``data_sent``, ``_messages_sent``) feed
    only channelz, which enginelink does not serve, and are left alone; the
    connection's are kept (``FrameWrites.flush``).

    One object with slots rather than a closure: at one message per call per
    engine frame, each call's state is read cold, and every closure cell is
    another object to read (docs/benchmarks.md).

    ``stream`` is a grpclib server ``Stream``; ``send`` may only be called
    once ``send_headers`` has sent its initial headers (``generate`` hands
    it to the hub then). ``send`` takes messages in order and returns how many it wrote; it stops
    at the first one that would have to wait (connection paused, flow-control
    window or frame size too small) or fail (the stream or the connection is
    closing), and the caller hands the rest to the writer task, which waits
    or raises as grpclib does. Private grpclib and h2 API: grpclib is pinned
    below 0.5 and h2 below 5.
    """

    __slots__ = ("_stream", "_own", "_h2_connection", "_connection", "_stream_id", "_writes")

    def __init__(self, stream, writes: FrameWrites) -> None:
        h2_stream = stream._stream
        self._stream = stream
        self._connection = h2_stream.connection
        self._h2_connection = h2_stream._h2_connection
        self._own = self._h2_connection.streams.get(h2_stream.id)
        self._stream_id = h2_stream.id
        self._writes = writes

    async def send_headers(self) -> None:
        """The response headers; ``send`` may be used once they are out.

        What grpclib's ``send_initial_metadata`` sends with no metadata, built
        here when the stream and the connection can take it now (h2's
        ``send_headers`` and grpclib's dispatch cost ~10% of a call's CPU;
        docs/benchmarks.md); otherwise grpclib sends them, waiting as it does.
        """
        stream = self._stream
        block = header_block(((":status", "200"), ("content-type", stream._content_type)))
        if self._headers_now(block, end_stream=False):
            stream._send_initial_metadata_done = True
            self._writes.direct_headers += 1
            return
        self._writes.grpclib_headers += 1
        await stream.send_initial_metadata()

    def _writable(self) -> bool:
        """The stream is one h2 lets this server send on, the connection is open and not paused."""
        own = self._own
        return (own is not None and own.state_machine.state in _SENDABLE_STREAM_STATES
                and self._h2_connection.state_machine.state is ConnectionState.SERVER_OPEN
                and self._connection.write_ready.is_set())

    def _headers_now(self, block: bytes, end_stream: bool) -> bool:
        """A HEADERS frame with ``block`` (from ``header_block``) on this stream, if it can go now.

        h2's state machines take the same inputs its ``send_headers`` gives
        them (the connection's SEND_HEADERS, the stream's SEND_HEADERS and
        SEND_END_STREAM), so h2's view of the stream stays exact; its encoder
        is not touched, which the block allows. The frame goes behind anything
        queued for the connection: this engine frame's writes when there are
        some, else the coalesced transport (ordered behind grpclib's writes).
        """
        if not self._writable() or len(block) > self._h2_connection.max_outbound_frame_size:
            return False
        own = self._own
        h2_connection = self._h2_connection
        h2_connection.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
        own.state_machine.process_input(StreamInputs.SEND_HEADERS)
        flags = _END_HEADERS
        if end_stream:
            own.state_machine.process_input(StreamInputs.SEND_END_STREAM)
            flags |= _END_STREAM
        frame = _HEADERS_HEAD.pack(len(block) << 8 | 1, flags, self._stream_id) + block
        if self._writes.pending(self._connection):
            self._writes.add(self._connection, [frame])
        else:
            self._connection._transport.write(h2_connection.data_to_send() + frame)
        self._connection.headers_send_process()
        return True

    def send(self, messages) -> int:
        # The hub's own GenerateResponses: grpclib's codec would only add a type check.
        return self.send_bodies([message.SerializeToString() for message in messages])

    def send_bodies(self, bodies) -> int:
        """``send`` for messages already serialized (``hub.stream_chunk_body``)."""
        if not self._writable():
            return 0
        own = self._own
        h2_connection = self._h2_connection
        window = min(h2_connection.outbound_flow_control_window, own.outbound_flow_control_window)
        frame_max = h2_connection.max_outbound_frame_size
        stream_id = self._stream_id
        frames = []
        size = 0
        for body in bodies:
            length = len(body) + 5
            if length > frame_max or size + length > window:
                break
            frames.append(_DATA_HEAD.pack(length << 8, stream_id, len(body)) + body)
            size += length
        if size:
            h2_connection.outbound_flow_control_window -= size
            own.outbound_flow_control_window -= size
            self._writes.add(self._connection, frames)
        return len(frames)

    def end_ok(self) -> bool:
        """The OK trailers from here, after this call's messages; False when they must wait for the writer.

        Why: the client starts its next call when the trailers arrive. Sent by
        the writer task they left 3-16 ms after the engine frame that finished
        the call (its wake-up waits behind the frame's fan-out and for a core),
        and the next call reached the engine a step later than a bare driver's
        (docs/benchmarks.md). Here they go out in this engine frame's write.

        The frame is built as ``send_headers`` builds the response headers,
        queued behind the call's DATA frames, so the wire order is the call's
        order. grpclib's stream is marked as having sent its trailers, so its
        ``__aexit__`` sends nothing more when the handler returns. grpclib's
        ``send_trailing_metadata`` event is not dispatched: enginelink
        registers no grpclib event listeners.
        """
        stream = self._stream
        if stream._send_trailing_metadata_done or not self._headers_now(header_block(_OK_TRAILERS), end_stream=True):
            return False
        stream._send_trailing_metadata_done = True
        self._writes.direct_trailers += 1
        return True

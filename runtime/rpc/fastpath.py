"""The gRPC fast path, and every use of grpclib's, h2's and trio-asyncio's private API, behind one door.

Why one module. grpclib has no hooks for what enginelink needs (a receive
limit, a connection cap, idle and handshake timeouts, a write per loop tick,
writing a token's DATA frame from the engine frame's fan-out), so enginelink
reaches into it, into h2 beneath it and into trio-asyncio's loop. Each such
touch is listed here, with why; nothing else in the tree touches a private
name of these libraries (the rest uses their public API and this module's
names). The versions below are pinned exactly (``==``) in pyproject.toml:
an upgrade is a re-read of this list, then of the equivalence test
(``tests/test_fastpath_equivalence.py``), which compares this path's frames
and flow-control windows with grpclib's own.

Read against grpclib 0.4.9, h2 4.4.1, hpack 4.2.0, trio-asyncio 0.16.0.

grpclib (``grpclib.server``, ``grpclib.protocol``):
  G1 ``Server._protocol_factory`` overridden (``GrpcServer``): the only place a
     server builds its protocol; ours applies ``GrpcLimits`` and the fast path.
  G2 ``H2Protocol.connection_made`` re-implemented (``LimitedProtocol``), with
     ``Connection(h2_conn, transport, config=)`` and ``EventsProcessor(handler,
     connection)``: to build a ``BoundedConnection``, announce
     MAX_CONCURRENT_STREAMS and admit the connection through the guard (a
     connection over a bound refused, or another one giving way). (grpclib's
     private ``_set_nodelay`` is not used: the socket option is set here.)
  G3 ``Connection._connection`` / ``Connection._transport`` read: the h2
     connection (idle GOAWAY, the direct path's windows) and the transport a
     stream is built with (``BoundedConnection.create_stream``) and that
     ``FrameWrites`` writes to.
  G4 ``Connection.data_sent``, ``messages_sent``, ``last_data_sent``,
     ``last_message_sent``, ``ping_count_in_sequence`` written; and
     ``headers_send_process()`` called: the counters grpclib's own send keeps.
  G5 ``Stream._stream`` (the h2-side stream: id, connection, ``_h2_connection``; ``send_window`` reads
     the window a KV subscriber's stream may send into),
     ``Stream._content_type`` read; ``Stream._send_initial_metadata_done`` and
     ``_send_trailing_metadata_done`` written: ``DirectSender`` sends the
     headers / OK trailers itself and tells grpclib so.
  G6 ``EventsProcessor.register`` wrapped and ``EventsProcessor.streams`` read:
     a call's end counts as activity for the idle limit.
  G7 ``Stream``'s three Events (``window_updated``, ``headers_received``,
     ``trailers_received``) and its ``buffer`` replaced (``BoundedStream``) by
     ``runtime/rpc/stream_memory.py``'s lazy ``DormantEvent`` and ``LeanBuffer``
     (a ``grpclib.protocol.Buffer`` subclass): ~5 KiB less per open call.
h2 (``h2.connection``, ``h2.stream``; public names, internal contracts):
  H1 ``H2Connection.streams``, ``H2Stream.state_machine.process_input`` with
     ``ConnectionInputs`` / ``StreamInputs`` / ``StreamState`` / ``ConnectionState``:
     the state inputs h2's ``send_headers`` gives, without its encoder.
  H2 ``H2Connection.outbound_flow_control_window`` and
     ``H2Stream.outbound_flow_control_window`` decremented: the DATA frames
     ``DirectSender`` builds are charged as h2's ``send_data`` charges them.
  H3 ``H2Connection._open_streams`` overridden (``StreamCountH2Connection``,
     both ways: it is the server's h2 connection, fast path or not): h2 walks
     every stream of a connection for each new one; ours walks only when the
     table has doubled or could reach the limit, and ``exact_open_streams``
     calls h2's own walk.
hpack: public API only (``Encoder``, ``NeverIndexedHeaderTuple``); ``header_block``
  relies on RFC 7541's never-indexed literals, not on hpack's internals.
trio-asyncio (``trio_asyncio._base``):
  T1 ``loop._main_loop_one`` (and its ``no_wait`` argument) replaced on the
     instance, ``loop._stopped`` read (``run_ready_callbacks_together``).

The knob. ``ENGINELINK_FAST_PATH`` (default on; ``0``/``off``/``false``/``no``
turn it off), read once at start (``tools/serve.py``) and shown in /metrics as
``smg_servicer_grpc_fast_path``. Off, every byte of a call goes through
grpclib's own send path: no ``CoalescingTransport``, no ``DirectSender`` (no
DATA frames built here, no pre-built HPACK blocks), no ``FrameWrites``. The
limits (G1-G3, G6) and the loop's batching (T1) stay: they are not the fast
path, and the server would be unbounded without them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import functools
import struct
import time

import hpack
import trio
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, Stream
from grpclib.server import Server
from h2.connection import ConnectionInputs, ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.events import RemoteSettingsChanged
from h2.settings import SettingCodes
from h2.stream import StreamInputs, StreamState

from enginelink.runtime.env_flags import on_off
from enginelink.runtime.peers import LOCAL, peer_key
from enginelink.runtime.rpc.codec import ServicerCodec
from enginelink.runtime.rpc.grpc_limits import ConnectionGuard, GrpcLimits
from enginelink.runtime.rpc.stream_memory import DormantEvent, LeanBuffer
from enginelink.runtime.requests.hub import IN_FLIGHT_MAX

FAST_PATH_ENV = "ENGINELINK_FAST_PATH"

# HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, both ways: admission (IN_FLIGHT_MAX) is the
# bound that answers (UNAVAILABLE); this sits above it with room for control calls.
# h2's default (100) made the 101st call wait unseen in the router's client.
MAX_CONCURRENT_STREAMS = IN_FLIGHT_MAX + 256


def fast_path_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """``ENGINELINK_FAST_PATH``; ValueError names the knob for anything but on/off words."""
    return on_off(env, FAST_PATH_ENV)


# -- the coalescing transport (fast path) -----------------------------------------------


class CoalescingTransport:
    """One socket write per event-loop tick per connection (fast path).

    grpclib writes once per message, header block and trailer: with hundreds
    of streams on the router's one connection that is one ``send`` syscall
    and one TCP segment per message. The writes of one tick go as one write on
    the next tick (docs/benchmarks-history.md). Order is kept (one buffer, flushed in
    order); ``close`` flushes first; nothing is buffered once closing; flow
    control is untouched (the real transport still pauses the protocol).
    """

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


# -- grpclib's connection with GrpcLimits (both ways) -----------------------------------


class BoundedStream(Stream):
    """grpclib's stream; a message body larger than the limits is refused before it is read.

    grpclib's ``recv_message`` calls ``recv_data(5)`` for the prefix, then
    ``recv_data(length)`` with the length the prefix claims: the check sits
    there, so nothing of an oversized body is acknowledged or kept.
    """

    async def recv_data(self, size: int) -> bytes:
        connection = cast(BoundedConnection, self.connection)
        connection.guard.check_recv(connection.recv_reserved, size)
        connection.recv_reserved += size
        try:
            return await self.buffer.read(size)
        finally:
            connection.recv_reserved -= size

    # G7: grpclib's three Events per stream, made only when waited on: ~1.2 KiB less per open call.
    window_updated = DormantEvent()
    headers_received = DormantEvent()
    trailers_received = DormantEvent()

    def init_stream(self, stream_id: int, connection: Connection) -> None:
        super().init_stream(stream_id, connection)
        # grpclib's Buffer keeps an asyncio.Queue for the call's life; this one holds nothing when empty.
        self.buffer = LeanBuffer(functools.partial(connection.ack, self.id))


class BoundedConnection(Connection):
    """grpclib's connection with the guard, its reassembly budget and its last activity."""

    guard: ConnectionGuard
    recv_reserved = 0  # bytes of messages in reassembly on this connection
    preface_done = False
    on_preface: Callable[[], None] | None = None  # called once, when the client's preface and SETTINGS are in
    last_received = 0.0  # loop time of the last bytes received, or of the last call's end
    loop: asyncio.AbstractEventLoop

    @property
    def h2(self) -> H2Connection:
        return self._connection  # G3

    def feed(self, data: bytes):
        events = super().feed(data)
        self.last_received = self.loop.time()
        if not self.preface_done:
            # h2 checks the preface's magic; its SETTINGS frame is the first event.
            self.preface_done = any(isinstance(event, RemoteSettingsChanged) for event in events)
            if self.preface_done and self.on_preface is not None:
                self.on_preface()
                self.on_preface = None  # it holds the protocol: no cycle left for the collector
        return events

    def create_stream(self, *, stream_id=None, wrapper=None) -> Stream:
        return BoundedStream(self, self._connection, self._transport, stream_id=stream_id, wrapper=wrapper)  # G3


class _Processor(EventsProcessor):
    """grpclib's event processor; a call's end counts as activity for the idle limit (G6)."""

    def register(self, stream: Stream):
        release = super().register(stream)
        connection = cast(BoundedConnection, self.connection)

        def release_stream() -> None:
            release()
            connection.last_received = connection.loop.time()

        return release_stream


# The fewest streams h2's table holds before a new stream walks it (StreamCountH2Connection).
STREAM_WALK_AT_LEAST = 64


class StreamCountH2Connection(H2Connection):
    """h2's server connection, without a walk of all its streams for each new one (H3).

    h2 counts a connection's open streams by walking every stream it tracks
    (``_open_streams``) each time the peer opens one, to hold
    SETTINGS_MAX_CONCURRENT_STREAMS: O(open streams) per call, so n calls on
    one connection cost O(n²), and the router keeps all its calls to a worker
    on one connection. The streams h2 tracks include every open one, so while
    the table holds fewer than the limit no new stream can pass it, and that
    count is answered as is. The walk, which is also what moves closed
    streams out of h2's table, runs once the table has doubled since the last
    walk, or whenever it could reach the limit: O(1) per stream amortised, and
    the limit is judged exactly as h2 judges it
    (``tests/test_h2_stream_count.py`` feeds this and h2's own connection the
    same bytes and compares every answer). ``open_inbound_streams`` is
    therefore an upper bound below the limit; ``exact_open_streams`` is h2's
    exact count.
    """

    _walk_at = STREAM_WALK_AT_LEAST
    walks = 0  # walks of the table (tests read it)

    def _open_streams(self, remainder: int) -> int:
        tracked = len(self.streams)
        if (remainder == int(not self.config.client_side)  # streams the peer opens
                and tracked < self._walk_at and tracked < self.local_settings.max_concurrent_streams):
            return tracked
        self.walks += 1
        count = super()._open_streams(remainder)
        self._walk_at = max(STREAM_WALK_AT_LEAST, 2 * len(self.streams))
        return count

    def exact_open_streams(self) -> int:
        """Open streams both ways, counted by h2's own walk."""
        return H2Connection._open_streams(self, 0) + H2Connection._open_streams(self, 1)


class LimitedProtocol(H2Protocol):
    """grpclib's server protocol with ``GrpcLimits`` (``runtime/rpc/grpc_limits.py``) applied.

    It is the guard's ``Slot``: the guard decides who gives way to a new
    connection (``ConnectionGuard.admit``), this closes them (``give_way``).
    """

    guard: ConnectionGuard
    coalesce = False  # the fast path's CoalescingTransport
    live: set | None = None  # the server's set of open protocols (``GrpcServer.protocols``)
    peer = LOCAL  # runtime/peers.py
    _sock: socket.socket | None = None  # the transport's socket (asyncio's TransportSocket), for ``unread``
    _timer: asyncio.TimerHandle | None = None
    _handshake_deadline = 0.0

    def connection_made(self, transport) -> None:
        # H2Protocol.connection_made (G2), building a BoundedConnection.
        sock = self._sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = peer_key(transport.get_extra_info("peername"))
        if self.coalesce:
            transport = CoalescingTransport(transport)
        h2_conn = StreamCountH2Connection(config=self.h2_config)
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        stream_delta = self.config.http2_stream_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        settings = {SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size} if stream_delta else {}
        settings[SettingCodes.MAX_CONCURRENT_STREAMS] = MAX_CONCURRENT_STREAMS
        h2_conn.update_settings(settings)
        connection = self.connection = BoundedConnection(h2_conn, transport, config=self.config)
        connection.guard = self.guard
        connection.loop = loop = asyncio.get_running_loop()
        connection.last_received = loop.time()
        self.processor = _Processor(self.handler, connection)
        admission = self.guard.admit(self, loop.time())
        if admission.refused is not None:
            h2_conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=admission.refused)
            connection.flush()
            self.processor.close(admission.refused.decode())
            return
        for victim, kind in admission.evict:
            cast(LimitedProtocol, victim).give_way(kind)
        connection.on_preface = functools.partial(self.guard.handshake_done, self)
        if self.live is not None:
            self.live.add(self)
        connection.flush()
        connection.initialize()
        self._handshake_deadline = loop.time() + self.guard.limits.handshake_timeout_s
        first_look_s = min(self.guard.limits.handshake_timeout_s, self.guard.limits.idle_timeout_s)
        self._timer = loop.call_later(first_look_s, self._handshake_due)

    # -- the guard's Slot ------------------------------------------------------------

    def idle_since(self) -> float | None:
        if self.processor.streams:
            return None
        return cast(BoundedConnection, self.connection).last_received

    def unread(self) -> bool:
        """Bytes wait in the socket, unread: a client whose preface is about to be read (MSG_PEEK)."""
        sock = self._sock
        if sock is None or sock.fileno() < 0:
            return False
        peek = socket.socket(fileno=sock.fileno())  # the same descriptor: detached below, never closed here
        try:
            return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing waiting (EAGAIN), or the socket is gone
            return False
        finally:
            peek.detach()

    def give_way(self, kind: str) -> None:
        """The guard gave this connection's slot to a newcomer (``ConnectionGuard.admit``)."""
        connection = cast(BoundedConnection, self.connection)
        if connection.is_closing():
            return
        if kind == "handshaking":  # it has sent nothing worth an answer
            self.processor.close("evicted: still in the HTTP/2 handshake")
        else:
            self._goaway(b"evicted: idle", "evicted: idle")

    def _handshake_due(self) -> None:
        connection = cast(BoundedConnection, self.connection)
        if connection.is_closing():
            return
        if connection.preface_done:
            self._idle_due()
            return
        left = self._handshake_deadline - connection.loop.time()
        if left > 0:  # the idle limit is the shorter one: look again at the handshake's
            self._timer = connection.loop.call_later(left, self._handshake_due)
            return
        self.guard.stats.handshake_timeouts += 1
        self.processor.close("no HTTP/2 client preface in time")

    def _idle_due(self) -> None:
        """Close the connection if it has been idle for the limit, else look again when it could be."""
        connection = cast(BoundedConnection, self.connection)
        if connection.is_closing():
            return
        idle_s = self.guard.limits.idle_timeout_s
        due = connection.last_received + idle_s
        now = connection.loop.time()
        if now >= due and not self.processor.streams:
            self.guard.stats.idle_closed += 1
            self._goaway(b"idle", "idle")
            return
        # Not idle long enough, or a call is open: look again when it could be (a
        # call's end counts as activity, so a full period after a look that found one).
        self._timer = connection.loop.call_later(due - now if now < due else idle_s, self._idle_due)

    def goodbye(self) -> None:
        """The server stops: GOAWAY (no error, the last stream it took), then close the connection.

        Without it the connection stays open until the process exits, and a
        call sent on it after the handlers ended got no answer at all: on a
        loaded machine the exit (journal flush, interpreter shutdown) took long
        enough for a client's deadline to pass (DEADLINE_EXCEEDED rather than
        UNAVAILABLE). After GOAWAY a client opens a new connection for its next
        call, which the closed listener refuses at once: UNAVAILABLE, retried elsewhere.
        """
        connection = getattr(self, "connection", None)
        if connection is None or connection.is_closing():
            return
        self._goaway(b"stopping", "server stopping")

    def _goaway(self, data: bytes, reason: str) -> None:
        """GOAWAY(NO_ERROR, ``data``) naming the last stream taken, then close the connection."""
        connection = cast(BoundedConnection, self.connection)
        h2_conn = connection.h2
        try:
            h2_conn.close_connection(ErrorCodes.NO_ERROR, last_stream_id=h2_conn.highest_inbound_stream_id,
                                     additional_data=data)
            connection.flush()
        except H2ProtocolError:
            pass  # h2 already closed it (the peer's GOAWAY, a protocol error): close the socket all the same
        self.processor.close(reason)

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.guard.forget(self)
        connection = getattr(self, "connection", None)
        if connection is not None:
            # on_preface holds this protocol, which holds the connection: without this the pair
            # waits for a full collection (rare: gc_policy) and 1,000 evicted connections held ~11 MiB.
            connection.on_preface = None
        if self.live is not None:
            self.live.discard(self)
        super().connection_lost(exc)


class GrpcServer(Server):
    """grpclib's server with ``GrpcLimits`` and, when ``fast_path``, the coalescing transport."""

    def __init__(self, handlers, *, limits: GrpcLimits | None = None, fast_path: bool = True, **kwargs) -> None:
        kwargs.setdefault("codec", ServicerCodec())  # bytes pass as they are: responses serialized in slices
        super().__init__(handlers, **kwargs)
        self.guard = ConnectionGuard(limits or GrpcLimits())
        self.fast_path = fast_path
        self.protocols: set[LimitedProtocol] = set()  # open connections (flow_states)

    async def wait_closed(self) -> None:
        """grpclib's wait for the handlers, then GOAWAY and close every connection (``goodbye``).

        The connections are closed even when the wait is cut short (the caller's bound).
        """
        try:
            await super().wait_closed()
        finally:
            for protocol in list(self.protocols):
                protocol.goodbye()

    def _protocol_factory(self) -> H2Protocol:  # G1
        # grpclib's factory registers the connection's handler; keep its parts.
        protocol = super()._protocol_factory()
        limited = LimitedProtocol(protocol.handler, protocol.config, protocol.h2_config)
        limited.guard = self.guard
        limited.coalesce = self.fast_path
        limited.live = self.protocols
        return limited


# -- the direct path (fast path): frames written around h2 ------------------------------


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
    fast_path: int  # 1: ENGINELINK_FAST_PATH on (this path in use); 0: grpclib's own send path only


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
    taken; bytes h2 had queued go first. A frame that also ends calls is two
    writes: the plain chunks first, then the ends (``RequestHub._write_rest``).
    """

    __slots__ = ("_pending", "direct_headers", "grpclib_headers", "direct_trailers", "fast_path")

    def __init__(self, fast_path: bool = True) -> None:
        # Off (ENGINELINK_FAST_PATH=0): handlers build no DirectSender, so nothing is ever added.
        self.fast_path = fast_path
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
        return DirectSendStats(self.direct_headers, self.grpclib_headers, self.direct_trailers, int(self.fast_path))

    def pending(self, connection) -> bool:
        """Whether this engine frame has writes for ``connection`` not yet flushed."""
        return connection in self._pending

    def add(self, connection, frames: list[bytes]) -> None:
        pending = self._pending.get(connection)
        if pending is None:
            self._pending[connection] = frames
        else:
            pending += frames

    def add_one(self, connection, frame: bytes) -> None:
        pending = self._pending.get(connection)
        if pending is None:
            self._pending[connection] = [frame]
        else:
            pending.append(frame)

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        now = time.monotonic()
        for connection, frames in pending.items():
            if connection.is_closing():
                continue  # gone: its streams' writers see the connection closed
            data = b"".join(frames)
            connection._transport.write_now(connection.h2.data_to_send() + data)  # G3
            connection.data_sent += len(data)
            connection.messages_sent += len(frames)
            connection.last_data_sent = connection.last_message_sent = now
            connection.ping_count_in_sequence = 0


class DirectSender:
    """Write stream messages from the caller's stack, when nothing has to wait.

    A streamed token otherwise costs an asyncio wake-up of the call's writer
    task (under trio-asyncio: a hop through trio's queue), grpclib's event
    dispatch and three awaits, about half the servicer's CPU per message
    (docs/benchmarks-history.md). This does what grpclib's ``send_message`` does
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
    another object to read (docs/benchmarks-history.md).

    ``stream`` is a grpclib server ``Stream``; ``send`` may only be called
    once ``send_headers`` has sent its initial headers (``generate`` hands
    it to the hub then). ``send`` takes messages in order and returns how many it wrote; it stops
    at the first one that would have to wait (connection paused, flow-control
    window or frame size too small) or fail (the stream or the connection is
    closing), and the caller hands the rest to the writer task, which waits
    or raises as grpclib does. Private grpclib and h2 API: G3-G5, H1, H2
    in this module's header.
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
        docs/benchmarks-history.md); otherwise grpclib sends them, waiting as it does.
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

    def send_body(self, body: bytes) -> bool:
        """One message already serialized (the edge's ``chunk_body``), if it can go now.

        ``send_bodies`` for the common case, one chunk per call per engine
        frame: the same checks and charges, without the loop, the frame list
        and the window ``min`` (docs/benchmarks-history.md, stop 15).
        """
        own = self._own
        if own is None or own.state_machine.state not in _SENDABLE_STREAM_STATES:
            return False
        h2_connection = self._h2_connection
        connection = self._connection
        if h2_connection.state_machine.state is not ConnectionState.SERVER_OPEN or not connection.write_ready.is_set():
            return False
        length = len(body) + 5
        if (length > h2_connection.max_outbound_frame_size or length > h2_connection.outbound_flow_control_window
                or length > own.outbound_flow_control_window):
            return False
        h2_connection.outbound_flow_control_window -= length
        own.outbound_flow_control_window -= length
        self._writes.add_one(connection, _DATA_HEAD.pack(length << 8, self._stream_id, len(body)) + body)
        return True

    def send_bodies(self, bodies) -> int:
        """``send`` for messages already serialized (an edge's ``chunk_body``)."""
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
        (docs/benchmarks-history.md). Here they go out in this engine frame's write.

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


# -- what a test (or an operator's debugger) can read of a connection --------------------


@dataclass(frozen=True)
class FlowState:
    """One connection's send side as h2 and grpclib hold it (``tests/test_fastpath_equivalence.py``)."""

    connection_window: int  # bytes h2 may still send on the connection
    stream_windows: dict[int, int]  # per stream h2 still holds: bytes it may still send
    open_streams: int  # h2's count of open streams (both directions)
    grpclib_streams: int  # calls grpclib's processor still has registered
    write_ready: bool  # the transport has not paused the connection


def flow_states(server: GrpcServer) -> list[FlowState]:
    states = []
    for protocol in server.protocols:
        h2 = cast(BoundedConnection, protocol.connection).h2
        states.append(FlowState(
            connection_window=h2.outbound_flow_control_window,
            stream_windows={sid: s.outbound_flow_control_window for sid, s in h2.streams.items() if not s.closed},
            open_streams=cast(StreamCountH2Connection, h2).exact_open_streams(),
            grpclib_streams=len(protocol.processor.streams),
            write_ready=protocol.connection.write_ready.is_set(),
        ))  # fmt: skip
    return states


# -- trio-asyncio: ready callbacks together (T1; both ways) -----------------------------

# Callbacks run per trio round beyond trio-asyncio's own one. A gRPC call is a
# handful; 64 is dozens of calls' worth, about a millisecond of work.
READY_CALLBACKS_MAX = 64


@dataclass
class ReadyCallbackStats:
    """The bound and how often a pass reached it (``/metrics``: ``smg_servicer_asyncio_*``)."""

    ready_callbacks_max: int = READY_CALLBACKS_MAX
    # Passes that ran the bound's worth: trio's tasks ran before any callbacks still queued.
    full_passes: int = 0


def run_ready_callbacks_together(loop) -> ReadyCallbackStats:
    """Make ``loop`` (a running ``trio_asyncio`` loop) run its queued callbacks per trio round.

    trio-asyncio runs each asyncio callback in a trio scheduling round of its
    own (``_main_loop_one``: a cancel scope with the next timer's deadline, one
    callback from a memory channel, a checkpoint). A gRPC call is several
    callbacks, so it paid that round several times (docs/benchmarks-history.md). After
    trio-asyncio's own ``_main_loop_one`` the loop calls it again with
    ``no_wait=True`` while callbacks are queued, up to ``READY_CALLBACKS_MAX``:
    trio-asyncio's own dispatch without the wait, as it drains the queue at
    close and as asyncio's own loop runs every ready callback per iteration.
    The bound keeps trio's tasks from waiting behind a flood. ``_main_loop``
    looks ``_main_loop_one`` up on the loop at every turn, so setting it on the
    instance is enough.
    """
    one = loop._main_loop_one  # T1
    stats = ReadyCallbackStats()

    async def main_loop_one(no_wait: bool = False) -> None:
        await one(no_wait)
        for _ in range(READY_CALLBACKS_MAX):
            if loop._stopped.is_set():  # T1
                return
            try:
                await one(True)  # no wait: nothing here yields to trio unless a trio-flavoured handle starts
            except trio.WouldBlock:
                return
        stats.full_passes += 1

    loop._main_loop_one = main_loop_one  # T1
    return stats


def send_window(stream) -> int | None:
    """G5: how many bytes a server stream may send now under HTTP/2 flow control (its window and its
    connection's, the lesser); None when h2 no longer has the stream."""
    try:
        h2_stream = stream._stream
        return h2_stream._h2_connection.local_flow_control_window(h2_stream.id)
    except (AttributeError, KeyError, H2ProtocolError):
        return None

"""What one gRPC client may hold: message size, reassembly per connection, connections, silence.

grpclib has no receive limit. Its ``recv_message`` reads the 5-byte gRPC
prefix and then asks the stream's buffer for as many bytes as the prefix
claims; the buffer acknowledges (WINDOW_UPDATE) every DATA frame as it moves
it to the reader, so the HTTP/2 windows never bound a message: a prefix
claiming 4 GB let a client push 4 GB into the servicer. Data nobody reads
yet stays unacknowledged, so *that* is bounded by the connection's receive
window (grpclib's 4 MiB); data for a stream already released is acknowledged
and dropped. What this module adds, each bound a named setting
(``GrpcLimits.from_env``) shown in ``/metrics`` (``smg_servicer_grpc_*``):

- ``max_recv_bytes``: a message whose prefix claims more is refused with
  RESOURCE_EXHAUSTED before one byte of its body is read (``BoundedStream``);
- ``connection_recv_bytes``: the messages one connection may have in
  reassembly at once, reserved at their claimed size when their body is
  asked for; one that does not fit is refused with RESOURCE_EXHAUSTED (never
  waited for: streams waiting on each other's budget while their unread data
  fills the connection window would deadlock). So one connection holds at
  most this plus its receive window, whatever it sends;
- ``max_connections``: a connection beyond it gets the server preface and a
  GOAWAY (ENHANCE_YOUR_CALM, "connection limit") and is closed at once;
  those already open are untouched;
- ``handshake_timeout_s``: a connection that has not sent the HTTP/2 client
  preface and its SETTINGS by then is closed;
- ``idle_timeout_s``: a connection with no call open that has received
  nothing at all (no frame, not even a PING) for that long gets a GOAWAY
  (NO_ERROR) and is closed; a client reconnects on its next call. The SMG
  router pings every 30 s, also when idle (smg contract §15): h2 answers
  every PING itself and a PING counts as activity, so the router's
  connection is kept however long it stays idle; nothing penalises pings.

The protocol here (``LimitedProtocol``) builds grpclib's connection as
``H2Protocol.connection_made`` does, with ``BoundedConnection`` (which makes
``BoundedStream``s) in place of grpclib's; private grpclib API, pinned below
0.5 in pyproject.toml for that reason.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from functools import partial
from typing import Mapping, cast

from grpclib.protocol import Connection, EventsProcessor, H2Protocol, Stream, _set_nodelay
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import RemoteSettingsChanged
from h2.settings import SettingCodes

from enginelink.runtime.stream_memory import DormantEvent, LeanBuffer
from enginelink.runtime.errors import ResourceExhausted, to_grpc_error

MAX_RECV_BYTES_ENV = "ENGINELINK_GRPC_MAX_RECV_BYTES"
CONNECTION_RECV_BYTES_ENV = "ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES"
MAX_CONNECTIONS_ENV = "ENGINELINK_GRPC_MAX_CONNECTIONS"
HANDSHAKE_TIMEOUT_ENV = "ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS"
IDLE_TIMEOUT_ENV = "ENGINELINK_GRPC_IDLE_TIMEOUT_SECS"


@dataclass(frozen=True)
class GrpcLimits:
    # 64 MiB: 16x grpc's and tonic's 4 MiB default, room for the large (multimodal)
    # requests SMG may send later, a quarter of the reference Python servicer's 256 MiB.
    # A text request is far below it (a 128k-token prompt is ~0.5 MB).
    max_recv_bytes: int = 64 << 20
    # Two maximal messages in reassembly at once per connection (the router sends
    # every call over one connection; small calls reserve almost nothing).
    connection_recv_bytes: int = 128 << 20
    # The router opens one connection per worker (plus its health and KV streams on
    # it); 1024 leaves room for many routers, probes and tools. An idle
    # connection costs ~25 KiB (docs/limits.md).
    max_connections: int = 1024
    handshake_timeout_s: float = 10.0
    # 10x the router's 30 s keepalive PING interval: a router is never closed, an
    # abandoned client holds a slot at most 5 minutes.
    idle_timeout_s: float = 300.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "GrpcLimits":
        """The limits from the environment; ValueError names a bad knob."""
        values: dict = {}
        for name, key, kind in (
            (MAX_RECV_BYTES_ENV, "max_recv_bytes", int), (CONNECTION_RECV_BYTES_ENV, "connection_recv_bytes", int),
            (MAX_CONNECTIONS_ENV, "max_connections", int), (HANDSHAKE_TIMEOUT_ENV, "handshake_timeout_s", float),
            (IDLE_TIMEOUT_ENV, "idle_timeout_s", float),
        ):  # fmt: skip
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                value = kind(raw)
            except ValueError:
                value = 0
            if not value > 0 or value != value or value == float("inf"):
                raise ValueError(f"{name}={raw!r}: expected a positive {'whole number' if kind is int else 'number'}")
            values[key] = value
        limits = cls(**values)
        if limits.connection_recv_bytes < limits.max_recv_bytes:
            raise ValueError(f"{CONNECTION_RECV_BYTES_ENV} ({limits.connection_recv_bytes}) must be at least "
                             f"{MAX_RECV_BYTES_ENV} ({limits.max_recv_bytes})")  # fmt: skip
        return limits


@dataclass
class ConnectionStats:
    """The limits and what they caught, exported as ``smg_servicer_grpc_*`` gauges."""

    connections: int = 0  # open now
    connections_max: int = 0
    connections_refused: int = 0  # closed at once: the cap was reached
    handshake_timeouts: int = 0  # closed: no client preface in time
    idle_closed: int = 0  # closed: no call and nothing received for idle_timeout_s
    handshake_timeout_seconds: float = 0.0
    idle_timeout_seconds: float = 0.0
    recv_message_bytes_max: int = 0
    connection_recv_bytes_max: int = 0
    messages_refused_size: int = 0  # RESOURCE_EXHAUSTED: the prefix claimed more than recv_message_bytes_max
    messages_refused_connection: int = 0  # RESOURCE_EXHAUSTED: the connection's reassembly budget was full


class ConnectionGuard:
    """The server's count of connections and the limits' counters (one per ``CoalescingServer``)."""

    def __init__(self, limits: GrpcLimits) -> None:
        self.limits = limits
        self.stats = ConnectionStats(
            connections_max=limits.max_connections,
            handshake_timeout_seconds=limits.handshake_timeout_s,
            idle_timeout_seconds=limits.idle_timeout_s,
            recv_message_bytes_max=limits.max_recv_bytes,
            connection_recv_bytes_max=limits.connection_recv_bytes,
        )

    def read(self) -> ConnectionStats:
        return self.stats


class BoundedStream(Stream):
    """grpclib's stream, refusing a message body larger than the limits before reading it.

    grpclib's ``recv_message`` calls ``recv_data(5)`` for the prefix, then
    ``recv_data(length)`` with the length the prefix claims: the check sits
    there, so nothing of an oversized body is acknowledged or kept.
    """

    # grpclib's three Events per stream, made only when waited on (runtime/stream_memory.py): ~1.2 KiB
    # less per open call.
    window_updated = DormantEvent()
    headers_received = DormantEvent()
    trailers_received = DormantEvent()

    def init_stream(self, stream_id: int, connection: Connection) -> None:
        super().init_stream(stream_id, connection)
        # grpclib's Buffer keeps an asyncio.Queue for the call's life; this one holds nothing when empty.
        self.buffer = LeanBuffer(partial(connection.ack, self.id))

    async def recv_data(self, size: int) -> bytes:
        connection = cast(BoundedConnection, self.connection)
        guard = connection.guard
        limits = guard.limits
        if size > limits.max_recv_bytes:
            guard.stats.messages_refused_size += 1
            raise to_grpc_error(ResourceExhausted(
                f"message of {size} bytes is larger than this server accepts "
                f"({limits.max_recv_bytes} bytes, {MAX_RECV_BYTES_ENV})"))  # fmt: skip
        if connection.recv_reserved + size > limits.connection_recv_bytes:
            guard.stats.messages_refused_connection += 1
            raise to_grpc_error(ResourceExhausted(
                f"message of {size} bytes does not fit beside the {connection.recv_reserved} bytes this "
                f"connection has in reassembly ({limits.connection_recv_bytes} bytes, {CONNECTION_RECV_BYTES_ENV}); "
                "retry or use another connection"))  # fmt: skip
        connection.recv_reserved += size
        try:
            return await self.buffer.read(size)
        finally:
            connection.recv_reserved -= size


class BoundedConnection(Connection):
    """grpclib's connection with the guard, its reassembly budget and its last activity."""

    guard: ConnectionGuard
    recv_reserved = 0  # bytes of messages in reassembly on this connection
    preface_done = False
    last_received = 0.0  # loop time of the last bytes received, or of the last call's end
    loop: asyncio.AbstractEventLoop

    def feed(self, data: bytes):
        events = super().feed(data)
        self.last_received = self.loop.time()
        if not self.preface_done:
            # h2 checks the preface's magic; its SETTINGS frame is the first event.
            self.preface_done = any(isinstance(event, RemoteSettingsChanged) for event in events)
        return events

    def create_stream(self, *, stream_id=None, wrapper=None) -> Stream:
        return BoundedStream(self, self._connection, self._transport, stream_id=stream_id, wrapper=wrapper)


class _Processor(EventsProcessor):
    """grpclib's event processor; a call's end counts as activity for the idle limit."""

    def register(self, stream: Stream):
        release = super().register(stream)
        connection = cast(BoundedConnection, self.connection)

        def release_stream() -> None:
            release()
            connection.last_received = connection.loop.time()

        return release_stream


class LimitedProtocol(H2Protocol):
    """grpclib's server protocol with ``GrpcLimits`` applied; ``guard`` is the server's."""

    guard: ConnectionGuard
    max_concurrent_streams: int | None = None  # SETTINGS_MAX_CONCURRENT_STREAMS; None: h2's default
    _counted = False
    _timer: asyncio.TimerHandle | None = None
    _handshake_deadline = 0.0

    def connection_made(self, transport) -> None:
        # H2Protocol.connection_made, building a BoundedConnection.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = H2Connection(config=self.h2_config)
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        stream_delta = self.config.http2_stream_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        settings = {SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size} if stream_delta else {}
        if self.max_concurrent_streams is not None:
            settings[SettingCodes.MAX_CONCURRENT_STREAMS] = self.max_concurrent_streams
        if settings:
            h2_conn.update_settings(settings)
        connection = self.connection = BoundedConnection(h2_conn, transport, config=self.config)
        connection.guard = self.guard
        connection.loop = loop = asyncio.get_running_loop()
        connection.last_received = loop.time()
        self.processor = _Processor(self.handler, connection)
        stats = self.guard.stats
        if stats.connections >= self.guard.limits.max_connections:
            stats.connections_refused += 1
            h2_conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"connection limit")
            connection.flush()
            self.processor.close("connection limit")
            return
        self._counted = True
        stats.connections += 1
        connection.flush()
        connection.initialize()
        self._handshake_deadline = loop.time() + self.guard.limits.handshake_timeout_s
        first_look_s = min(self.guard.limits.handshake_timeout_s, self.guard.limits.idle_timeout_s)
        self._timer = loop.call_later(first_look_s, self._handshake_due)

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
            connection._connection.close_connection(ErrorCodes.NO_ERROR, additional_data=b"idle")
            connection.flush()
            self.processor.close("idle")
            return
        # Not idle long enough, or a call is open: look again when it could be (a
        # call's end counts as activity, so a full period after a look that found one).
        self._timer = connection.loop.call_later(due - now if now < due else idle_s, self._idle_due)

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._counted:
            self._counted = False
            self.guard.stats.connections -= 1
        super().connection_lost(exc)

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

This module is the policy (the settings, the counters, the refusals); the
grpclib classes that apply it (``LimitedProtocol``, ``BoundedConnection``,
``BoundedStream``) reach into grpclib, so they live in ``runtime/rpc/fastpath.py``
with its other private touches. They apply with the fast path on or off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

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
    """The server's count of connections and the limits' counters (one per ``fastpath.GrpcServer``)."""

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

    def check_recv(self, reserved: int, size: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a message body of ``size`` beside ``reserved`` bytes in reassembly.

        Called before one byte of the body is read (``fastpath.BoundedStream.recv_data``).
        """
        limits = self.limits
        if size > limits.max_recv_bytes:
            self.stats.messages_refused_size += 1
            raise to_grpc_error(ResourceExhausted(
                f"message of {size} bytes is larger than this server accepts "
                f"({limits.max_recv_bytes} bytes, {MAX_RECV_BYTES_ENV})"))  # fmt: skip
        if reserved + size > limits.connection_recv_bytes:
            self.stats.messages_refused_connection += 1
            raise to_grpc_error(ResourceExhausted(
                f"message of {size} bytes does not fit beside the {reserved} bytes this "
                f"connection has in reassembly ({limits.connection_recv_bytes} bytes, {CONNECTION_RECV_BYTES_ENV}); "
                "retry or use another connection"))  # fmt: skip

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
- ``max_connections``: at the cap a new connection takes the slot of one
  that is doing nothing (below); when none is, it gets the server preface
  and a GOAWAY (ENHANCE_YOUR_CALM, "connection limit") and is closed at once;
- ``max_handshaking``: connections that have not finished the HTTP/2
  handshake (client preface and SETTINGS) hold at most this many slots (a
  quarter of ``max_connections`` unless set); the rest are reserved for
  clients that have finished it, such as the router's connection. One more
  closes the oldest still in its handshake, so a client that reconnects
  while an attacker re-opens preface-less connections as fast as they close
  is served (issue 38, item 5);
- ``max_connections_per_peer``: what one peer (``runtime/peers.py``: an IPv4
  address, an IPv6 /64) may hold. One more takes the slot of the same peer's
  oldest connection still in its handshake, or of its longest idle one, or
  is refused (GOAWAY ENHANCE_YOUR_CALM, "connection limit per peer"): a peer
  only ever displaces its own connections;
- ``evict_idle_s``: a connection that has finished its handshake is given up
  for a newcomer (GOAWAY NO_ERROR, "evicted: idle"; a client reconnects on
  its next call) only when it has had no call open and received nothing,
  not even a PING, for this long, and only when its slot is needed: the
  longest idle goes first. The router pings every 30 s, so its connection
  is never idle this long; one with a call open (the router's KV stream) is
  never idle at all;
- ``handshake_timeout_s``: a connection that has not sent the HTTP/2 client
  preface and its SETTINGS by then is closed;
- ``idle_timeout_s``: a connection with no call open that has received
  nothing at all (no frame, not even a PING) for that long gets a GOAWAY
  (NO_ERROR) and is closed; a client reconnects on its next call. The SMG
  router pings every 30 s, also when idle (smg contract §15): h2 answers
  every PING itself and a PING counts as activity, so the router's
  connection is kept however long it stays idle; nothing penalises pings.

Which connection gives way, in order: at the peer's own bound, the peer's
oldest in its handshake, else its longest idle, else the newcomer is
refused; then, at the handshake share, the oldest in its handshake (anyone's);
then, at the cap, the oldest in its handshake, else the longest idle, else
the newcomer is refused. "Oldest in its handshake" passes over connections
whose first bytes wait unread in the socket (looking at ``UNREAD_SKIP_MAX``
at most): asyncio accepts up to a backlog (100) of connections before it
reads any, and a client whose preface waits is about to finish its
handshake; when all of those looked at are such clients, none gives way (at
the share the newcomer is let in over it for that moment; at the cap it is
refused).

This module is the policy (the settings, the counters, the refusals, which
connection gives way); the grpclib classes that apply it (``LimitedProtocol``, ``BoundedConnection``,
``BoundedStream``) reach into grpclib, so they live in ``runtime/rpc/fastpath.py``
with its other private touches. They apply with the fast path on or off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from enginelink.runtime.errors import ResourceExhausted, to_grpc_error

MAX_RECV_BYTES_ENV = "ENGINELINK_GRPC_MAX_RECV_BYTES"
CONNECTION_RECV_BYTES_ENV = "ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES"
MAX_CONNECTIONS_ENV = "ENGINELINK_GRPC_MAX_CONNECTIONS"
MAX_CONNECTIONS_PER_PEER_ENV = "ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER"
MAX_HANDSHAKING_ENV = "ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS"
EVICT_IDLE_ENV = "ENGINELINK_GRPC_EVICT_IDLE_SECS"
HANDSHAKE_TIMEOUT_ENV = "ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS"
IDLE_TIMEOUT_ENV = "ENGINELINK_GRPC_IDLE_TIMEOUT_SECS"

# GOAWAY debug data of a refused connection.
CONNECTION_LIMIT = b"connection limit"
PEER_LIMIT = b"connection limit per peer"
# Connections in their handshake passed over, when choosing which gives way, because
# their first bytes wait unread (each look is one recv(MSG_PEEK)); past it, the oldest goes.
UNREAD_SKIP_MAX = 16


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
    # A router needs one connection, a probe one at a time; 128 leaves room for a
    # proxy or NAT that puts many clients behind one address, and keeps one
    # address to an eighth of the default cap.
    max_connections_per_peer: int = 128
    # None: a quarter of max_connections (256 of 1024), more than asyncio's accept
    # backlog (100), so a burst of accepts cannot push out a client before its
    # preface is read; three quarters stay for clients past the handshake.
    max_handshaking: int | None = None
    # Twice the router's 30 s keepalive PING interval: its connection is never this idle.
    evict_idle_s: float = 60.0
    handshake_timeout_s: float = 10.0
    # 10x the router's 30 s keepalive PING interval: a router is never closed, an
    # abandoned client holds a slot at most 5 minutes.
    idle_timeout_s: float = 300.0

    @property
    def handshaking_max(self) -> int:
        """Connections still in their handshake that may hold slots at once."""
        if self.max_handshaking is not None:
            return self.max_handshaking
        return max(1, self.max_connections // 4)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "GrpcLimits":
        """The limits from the environment; ValueError names a bad knob."""
        values: dict = {}
        for name, key, kind in (
            (MAX_RECV_BYTES_ENV, "max_recv_bytes", int), (CONNECTION_RECV_BYTES_ENV, "connection_recv_bytes", int),
            (MAX_CONNECTIONS_ENV, "max_connections", int),
            (MAX_CONNECTIONS_PER_PEER_ENV, "max_connections_per_peer", int),
            (MAX_HANDSHAKING_ENV, "max_handshaking", int), (EVICT_IDLE_ENV, "evict_idle_s", float),
            (HANDSHAKE_TIMEOUT_ENV, "handshake_timeout_s", float), (IDLE_TIMEOUT_ENV, "idle_timeout_s", float),
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
        if limits.handshaking_max > limits.max_connections:
            raise ValueError(f"{MAX_HANDSHAKING_ENV} ({limits.handshaking_max}) must be at most "
                             f"{MAX_CONNECTIONS_ENV} ({limits.max_connections})")  # fmt: skip
        return limits


@dataclass
class ConnectionStats:
    """The limits and what they caught, exported as ``smg_servicer_grpc_*`` gauges."""

    connections: int = 0  # open now
    connections_max: int = 0
    handshaking_connections: int = 0  # open now and not past the HTTP/2 handshake
    handshaking_connections_max: int = 0
    peers: int = 0  # distinct peers (runtime/peers.py) with a connection open now
    connections_per_peer_max: int = 0
    connections_refused: int = 0  # closed at once: the cap was reached and no connection could give way
    connections_refused_peer: int = 0  # closed at once: the peer's bound, none of its own could give way
    evicted_handshaking: int = 0  # closed: the oldest still in its handshake, for a newcomer
    evicted_idle: int = 0  # GOAWAY(evicted: idle): the longest idle, for a newcomer
    evict_idle_seconds: float = 0.0
    handshake_timeouts: int = 0  # closed: no client preface in time
    idle_closed: int = 0  # closed: no call and nothing received for idle_timeout_s
    handshake_timeout_seconds: float = 0.0
    idle_timeout_seconds: float = 0.0
    recv_message_bytes_max: int = 0
    connection_recv_bytes_max: int = 0
    messages_refused_size: int = 0  # RESOURCE_EXHAUSTED: the prefix claimed more than recv_message_bytes_max
    messages_refused_connection: int = 0  # RESOURCE_EXHAUSTED: the connection's reassembly budget was full


class Slot(Protocol):
    """One open connection as the guard sees it (``fastpath.LimitedProtocol``)."""

    peer: str  # runtime/peers.py

    def idle_since(self) -> float | None:
        """When it last received anything or ended a call, while it has no call open; else None."""

    def unread(self) -> bool:
        """Bytes it sent wait unread in the socket."""


@dataclass(frozen=True)
class Admission:
    """The guard's answer to a new connection: who gives way first, or its refusal."""

    evict: tuple[tuple[Slot, str], ...] = ()  # (slot, "handshaking" | "idle"), already forgotten by the guard
    refused: bytes | None = None  # the GOAWAY's debug data


class ConnectionGuard:
    """The server's open connections, who gives way to whom, and the limits' counters (one per ``fastpath.GrpcServer``).

    Time is the caller's (the loop's clock); nothing here closes anything:
    ``admit`` says which slots to close, already forgotten here, so counts are
    exact before the sockets are.
    """

    def __init__(self, limits: GrpcLimits) -> None:
        self.limits = limits
        self.stats = ConnectionStats(
            connections_max=limits.max_connections,
            handshaking_connections_max=limits.handshaking_max,
            connections_per_peer_max=limits.max_connections_per_peer,
            evict_idle_seconds=limits.evict_idle_s,
            handshake_timeout_seconds=limits.handshake_timeout_s,
            idle_timeout_seconds=limits.idle_timeout_s,
            recv_message_bytes_max=limits.max_recv_bytes,
            connection_recv_bytes_max=limits.connection_recv_bytes,
        )
        # Insertion-ordered: the oldest first.
        self.open: dict[Slot, None] = {}
        self.handshaking: dict[Slot, None] = {}
        self.peers: dict[str, dict[Slot, None]] = {}
        # No connection past its handshake can have been idle ``evict_idle_s`` before this
        # (``_longest_idle``): a full server is not scanned for each refused newcomer.
        self._idle_look_at = 0.0

    def read(self) -> ConnectionStats:
        self.stats.connections = len(self.open)
        self.stats.handshaking_connections = len(self.handshaking)
        self.stats.peers = len(self.peers)
        return self.stats

    # -- admission ---------------------------------------------------------------

    def admit(self, slot: Slot, now: float) -> Admission:
        """A new connection: take it (closing the ``evict`` slots first) or refuse it."""
        limits = self.limits
        evict: list[tuple[Slot, str]] = []
        mine = self.peers.get(slot.peer)
        if mine is not None and len(mine) >= limits.max_connections_per_peer:
            victim = self._oldest_handshaking(mine) or self._longest_idle(mine, now)
            if victim is None:
                self.stats.connections_refused_peer += 1
                return Admission(refused=PEER_LIMIT)
            evict.append(self._evict(victim))
        if len(self.handshaking) >= limits.handshaking_max:
            victim = self._oldest_handshaking(self.handshaking)
            if victim is not None:  # else a burst of clients whose prefaces wait: over the share for a moment
                evict.append(self._evict(victim))
        if len(self.open) >= limits.max_connections:  # only when nothing gave way above
            victim = self._oldest_handshaking(self.handshaking) or self._longest_idle_anywhere(now)
            if victim is None:
                self.stats.connections_refused += 1
                return Admission(refused=CONNECTION_LIMIT)
            evict.append(self._evict(victim))
        self.open[slot] = None
        self.handshaking[slot] = None
        self.peers.setdefault(slot.peer, {})[slot] = None
        return Admission(tuple(evict))

    def handshake_done(self, slot: Slot) -> None:
        self.handshaking.pop(slot, None)

    def forget(self, slot: Slot) -> None:
        """The connection is gone (or given up): its slot is free. Idempotent."""
        if slot not in self.open:
            return
        del self.open[slot]
        self.handshaking.pop(slot, None)
        mine = self.peers[slot.peer]
        del mine[slot]
        if not mine:
            del self.peers[slot.peer]

    def _evict(self, slot: Slot) -> tuple[Slot, str]:
        kind = "handshaking" if slot in self.handshaking else "idle"
        if kind == "handshaking":
            self.stats.evicted_handshaking += 1
        else:
            self.stats.evicted_idle += 1
        self.forget(slot)
        return slot, kind

    def _oldest_handshaking(self, slots: Iterable[Slot]) -> Slot | None:
        """The oldest of ``slots`` still in its handshake with nothing waiting unread, among the oldest few.

        None when those few all have bytes waiting: clients about to finish
        their handshake (a burst larger than the share, read on the loop's
        next turn), not connections to close.
        """
        looked = 0
        for slot in slots:
            if slot not in self.handshaking:
                continue
            if not slot.unread():
                return slot
            looked += 1
            if looked >= UNREAD_SKIP_MAX:
                break
        return None

    def _longest_idle(self, slots: Iterable[Slot], now: float) -> Slot | None:
        """The one of ``slots`` past its handshake idle longest, if for ``evict_idle_s`` at least."""
        best, best_since = None, now - self.limits.evict_idle_s
        for slot in slots:
            if slot in self.handshaking:
                continue
            since = slot.idle_since()
            if since is not None and since <= best_since:
                best, best_since = slot, since
        return best

    def _longest_idle_anywhere(self, now: float) -> Slot | None:
        if now < self._idle_look_at:
            return None
        victim = self._longest_idle(self.open, now)
        if victim is None:
            # A connection's idle time only restarts (a read, a call's end, the end of its
            # handshake: all "now"), so none can reach evict_idle_s before the soonest of these.
            soonest = now
            for slot in self.open:
                since = None if slot in self.handshaking else slot.idle_since()
                if since is not None and since < soonest:
                    soonest = since
            self._idle_look_at = soonest + self.limits.evict_idle_s
        return victim

    # -- messages ------------------------------------------------------------------

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

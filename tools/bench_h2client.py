"""The bench's lean load client: streaming Generate calls over one HTTP/2 connection, no gRPC library.

Why it exists. On a small machine the load client shares the cores with
the engine and the servicer, so its CPU is counted against enginelink:
grpc.aio spends about as much per streamed message as the servicer
(docs/benchmarks-history.md, "The load client counts against enginelink"). The
users' router is native code. This
client reads the wire directly (one ``recv`` per batch of frames, a 9-byte
header parse per frame, one protobuf parse per message), so what the bench
measures is closer to the servicer itself. ``--client grpcio`` keeps the
grpc.aio client, the independent check that enginelink speaks gRPC as a
real library expects; tests run the bench with both.

What it does (RFC 9113, gRPC over HTTP/2): the client preface and SETTINGS
(no push, the largest stream window), a connection WINDOW_UPDATE topped up
as data is read, and per call one HEADERS frame (HPACK via ``hpack``) and
one DATA frame with END_STREAM. It answers SETTINGS and PING, honours the
server's send windows (requests wait for WINDOW_UPDATE), reassembles gRPC
messages across DATA frames and reads ``grpc-status`` from the trailers
(or a trailers-only reply). Anything outside that (GOAWAY, a malformed or
compressed message, a frame it cannot place) fails the run with the reason:
a load client must not guess.

Single-threaded, blocking socket: the load is one connection and the client
does nothing but read it, so there is no event loop to pay for.

This module is the protocol only; ``tools/bench_load.py`` (``_h2_client``) runs
the load over it and records the calls as it does for grpc.aio.
"""

from __future__ import annotations

import socket
import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
WINDOW_MAX = 2**31 - 1
WINDOW_DEFAULT = 65_535  # RFC 9113 6.9.2: every window starts here
RECV_BYTES = 1 << 18

_u32 = struct.Struct(">I")

# An RST_STREAM's HTTP/2 error as the gRPC status a client reports (gRPC's PROTOCOL-HTTP2.md);
# anything else is INTERNAL.
RESET_STATUS = {7: 14, 8: 1, 11: 8, 12: 7}  # REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM, INADEQUATE_SECURITY


class ProtocolError(Exception):
    """The server sent something this client does not take: the run stops with it."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


class Call:
    __slots__ = ("on_message", "on_end", "buffer", "headers", "ending", "received")

    def __init__(self, on_message, on_end) -> None:
        self.on_message = on_message  # (bytes) -> None, one gRPC message
        self.on_end = on_end  # (grpc status code, message) -> None
        self.buffer = b""
        self.headers = b""  # a header block waiting for its CONTINUATION frames
        self.ending = False  # that block came with END_STREAM: it is the trailers
        self.received = 0  # stream window used since its last top-up


class Connection:
    """One client HTTP/2 connection carrying unary-request, streamed-response gRPC calls."""

    def __init__(self, target: str, path: str, window: int = WINDOW_MAX, timeout_s: float = 120.0) -> None:
        """``window``: the receive window this side offers, per stream and for the connection.
        ``timeout_s``: how long the server may stay silent while calls are open."""
        host, _, port = target.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.timeout_s = timeout_s
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.request_headers = [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", target),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ]
        self.calls: dict[int, Call] = {}
        self.next_stream = 1
        self.received = 0  # connection window used since the last top-up
        self.data_received = 0  # DATA payload bytes in all, for the record
        self.refill_at = window // 2  # top the window back up once this much of it is used
        self.send_window = WINDOW_DEFAULT  # the server's connection window for us
        self.stream_window = WINDOW_DEFAULT  # the server's initial window for each new stream
        self.waiting: list[tuple[bytes, Call]] = []  # requests held back by the server's windows
        self.inbox = b""
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, window)
        opening = PREFACE + frame(SETTINGS, 0, 0, settings)
        if window > WINDOW_DEFAULT:
            opening += frame(WINDOW_UPDATE, 0, 0, _u32.pack(window - WINDOW_DEFAULT))
        self.sock.sendall(opening)

    def close(self) -> None:
        try:
            # Last stream id 0: the server started no streams of its own; error 0: NO_ERROR.
            self.sock.sendall(frame(GOAWAY, 0, 0, _u32.pack(0) + _u32.pack(0)))
        except OSError:
            pass
        self.sock.close()

    @property
    def open_calls(self) -> int:
        return len(self.calls) + len(self.waiting)

    def start(self, message: bytes, on_message, on_end) -> None:
        """Start a call: ``message`` is the serialized request; replies go to the callbacks."""
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        call = Call(on_message, on_end)
        if self.waiting or len(body) > min(self.send_window, self.stream_window):
            self.waiting.append((body, call))
            return
        self._send(body, call)

    def _send(self, body: bytes, call: Call) -> None:
        stream_id = self.next_stream
        self.next_stream += 2
        self.calls[stream_id] = call
        self.send_window -= len(body)
        block = self.encoder.encode(self.request_headers)
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream_id, block) + frame(DATA, END_STREAM, stream_id, body))

    def _send_waiting(self) -> None:
        while self.waiting and len(self.waiting[0][0]) <= min(self.send_window, self.stream_window):
            self._send(*self.waiting.pop(0))

    def pump(self) -> None:
        """Read what the server sent (blocking until something arrives) and dispatch it."""
        try:
            data = self.sock.recv(RECV_BYTES)
        except TimeoutError:
            raise ProtocolError(f"no data from the server for {self.timeout_s:g} s with {self.open_calls} calls open") from None
        if not data:
            raise ProtocolError(f"the server closed the connection with {self.open_calls} calls open")
        inbox = self.inbox + data if self.inbox else data
        at, end = 0, len(inbox)
        replies = []
        while end - at >= 9:
            length = int.from_bytes(inbox[at:at + 3], "big")
            if end - at < 9 + length:
                break
            kind, flags, stream_id = inbox[at + 3], inbox[at + 4], _u32.unpack_from(inbox, at + 5)[0] & 0x7FFFFFFF
            payload = inbox[at + 9:at + 9 + length]
            at += 9 + length
            if kind == DATA:
                self._on_data(stream_id, flags, payload, length, replies)
            elif kind == HEADERS or kind == CONTINUATION:
                self._on_headers(kind, stream_id, flags, payload)
            elif kind == SETTINGS:
                if not flags & ACK:
                    self._on_settings(payload)
                    replies.append(frame(SETTINGS, ACK, 0))
            elif kind == PING:
                if not flags & ACK:
                    replies.append(frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                increment = _u32.unpack(payload)[0] & 0x7FFFFFFF
                if stream_id == 0:
                    self.send_window += increment
            elif kind == RST_STREAM:
                call = self.calls.pop(stream_id, None)
                if call is not None:
                    error = _u32.unpack(payload)[0]
                    call.on_end(RESET_STATUS.get(error, 13), f"stream reset by the server (HTTP/2 error {error})")
            elif kind == GOAWAY:
                raise ProtocolError(f"the server sent GOAWAY (HTTP/2 error {_u32.unpack_from(payload, 4)[0]}): "
                                    f"{payload[8:].decode(errors='replace')}")
            # PRIORITY, PUSH_PROMISE (push is off) and unknown kinds carry nothing for us.
        self.inbox = inbox[at:]
        if self.received >= self.refill_at:
            replies.append(frame(WINDOW_UPDATE, 0, 0, _u32.pack(self.received)))
            self.received = 0
        if replies:
            self.sock.sendall(b"".join(replies))
        self._send_waiting()

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                self.stream_window = value

    def _on_data(self, stream_id: int, flags: int, payload: bytes, length: int, replies: list) -> None:
        self.received += length
        self.data_received += length
        call = self.calls.get(stream_id)
        if call is None:
            return  # a stream this side reset or finished: its data is flow-control only
        call.received += length
        if call.received >= self.refill_at and not flags & END_STREAM:
            replies.append(frame(WINDOW_UPDATE, 0, stream_id, _u32.pack(call.received)))
            call.received = 0
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        buffer = call.buffer + payload if call.buffer else payload
        at, end = 0, len(buffer)
        while end - at >= 5:
            size = _u32.unpack_from(buffer, at + 1)[0]
            if end - at < 5 + size:
                break
            if buffer[at]:
                raise ProtocolError(f"stream {stream_id}: a compressed message, which this client did not ask for")
            call.on_message(buffer[at + 5:at + 5 + size])
            at += 5 + size
        call.buffer = buffer[at:]

    def _on_headers(self, kind: int, stream_id: int, flags: int, payload: bytes) -> None:
        call = self.calls.get(stream_id)
        if kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            if call is not None:
                call.ending = bool(flags & END_STREAM)  # remembered until the block is complete
        if call is None:
            # Decode anyway: HPACK's table is the connection's, not the stream's.
            if flags & END_HEADERS:
                self.decoder.decode(payload)
            return
        call.headers += payload
        if not flags & END_HEADERS:
            return
        headers = dict(self.decoder.decode(call.headers))
        call.headers = b""
        if not call.ending:  # response headers; the trailers end the stream
            if headers.get(":status", "200") != "200":
                raise ProtocolError(f"stream {stream_id}: HTTP status {headers.get(':status')}")
            return
        del self.calls[stream_id]
        if call.buffer:
            raise ProtocolError(f"stream {stream_id}: {len(call.buffer)} bytes of an unfinished message at its end")
        status = headers.get("grpc-status")
        if status is None:
            raise ProtocolError(f"stream {stream_id}: trailers without grpc-status: {headers}")
        call.on_end(int(status), headers.get("grpc-message", ""))


def run_calls(connection: Connection, n_concurrent: int, take, make_request, on_message, on_end) -> None:
    """Keep ``n_concurrent`` calls open until ``take()`` returns None and every call has ended.

    ``make_request(n)`` gives the serialized request for call number ``n``;
    ``on_message(n, bytes)`` and ``on_end(n, code, message)`` receive its replies.
    """
    def start_next() -> None:
        n = take()
        if n is not None:
            connection.start(make_request(n), lambda body: on_message(n, body),
                             lambda code, text: (on_end(n, code, text), start_next()))

    for _ in range(n_concurrent):
        start_next()
    while connection.open_calls:
        connection.pump()

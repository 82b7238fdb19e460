"""A raw HTTP/2 gRPC client for attacks: it does only what the test tells it (h2, one socket).

It never acknowledges received DATA unless asked (``ack=True``), so a test can
play a client whose flow-control window stays shut; it can send a gRPC
prefix that lies about the body's length, trickle bytes, ping, or stop
half-way through the preface (use ``raw_socket`` for that).
"""

from __future__ import annotations

import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from h2.settings import SettingCodes

HEALTH_CHECK = "/vllm.grpc.engine.VllmEngine/HealthCheck"
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
SUBSCRIBE_KV = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"


def grpc_frame(body: bytes, claimed: int | None = None) -> bytes:
    """A gRPC message: not compressed, a 32-bit length (``claimed`` instead of the real one if given)."""
    return struct.pack(">?I", False, len(body) if claimed is None else claimed) + body


def raw_socket(port: int, timeout_s: float = 5.0, source: str | None = None) -> socket.socket:
    """A TCP connection to the servicer on 127.0.0.1, from ``source`` (another 127.0.0.x plays another peer)."""
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s,
                                    source_address=None if source is None else (source, 0))


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Read (and drop) what the server sends until it closes the socket; False if still open after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
    return False


class Call:
    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.data = bytearray()
        self.ended = False
        self.reset = False

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers (or a trailers-only response's headers)."""
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)

    @property
    def message(self) -> str:
        return self.trailers.get("grpc-message", self.headers.get("grpc-message", ""))


class H2Client:
    def __init__(self, port: int, *, initial_window: int | None = None, timeout_s: float = 5.0,
                 source: str | None = None) -> None:
        self.sock = raw_socket(port, timeout_s, source)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if initial_window is not None:
            self.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: initial_window})
        self.calls: dict[int, Call] = {}
        self.pings_acked = 0
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.ack = True
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def start(self, path: str, data: bytes = b"", *, end: bool = True) -> Call:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ], end_stream=not data and end)  # fmt: skip
        call = self.calls[stream_id] = Call(stream_id)
        self.flush()
        if data:
            self.send(call, data, end=end)
        return call

    def send(self, call: Call, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` on the call as flow control allows, reading the server's frames while it waits."""
        view = memoryview(data)
        while view:
            window = min(self.conn.local_flow_control_window(call.stream_id), self.conn.max_outbound_frame_size)
            if window <= 0:
                if call.ended or call.reset or self.closed:
                    return
                self.pump(0.2)
                continue
            chunk, view = view[:window], view[window:]
            try:
                self.conn.send_data(call.stream_id, bytes(chunk), end_stream=end and not view)
            except h2.exceptions.StreamClosedError:  # the server reset it: the rest has nowhere to go
                call.reset = True
                return
            self.flush()
        if end and not data:
            self.conn.end_stream(call.stream_id)
            self.flush()

    def ping(self) -> None:
        self.conn.ping(struct.pack(">Q", time.monotonic_ns()))
        self.flush()

    def pump(self, timeout_s: float) -> None:
        """Read whatever arrives within ``timeout_s`` (at most one read) and apply it."""
        if self.closed:
            return
        self.sock.settimeout(max(timeout_s, 0.001))  # 0 would make the socket non-blocking
        try:
            data = self.sock.recv(1 << 20)
        except socket.timeout:
            return
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            self._apply(event)
        try:
            self.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True

    def _apply(self, event) -> None:
        call = self.calls.get(getattr(event, "stream_id", None) or -1)
        match event:
            case h2.events.ResponseReceived(headers=headers) if call:
                call.headers = dict(headers)
            case h2.events.TrailersReceived(headers=headers) if call:
                call.trailers = dict(headers)
            case h2.events.DataReceived(data=data, flow_controlled_length=length) if call:
                call.data += data
                if self.ack:
                    self.conn.acknowledge_received_data(length, event.stream_id)
            case h2.events.StreamEnded() if call:
                call.ended = True
            case h2.events.StreamReset() if call:
                call.reset = True
            case h2.events.PingAckReceived():
                self.pings_acked += 1
            case h2.events.ConnectionTerminated():
                self.goaway = event

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            result = predicate()
            if result:
                return result
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                result = predicate()
                if result:
                    return result
                raise AssertionError(f"{what} not seen within {timeout_s} s "
                                     f"(closed: {self.closed}, goaway: {self.goaway})")
            self.pump(min(left, 0.2))

    def finish(self, call: Call, timeout_s: float = 5.0) -> Call:
        """Wait for the call's end (trailers or reset)."""
        self.wait(lambda: call.ended or call.reset, timeout_s, f"the end of stream {call.stream_id}")
        return call

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "H2Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

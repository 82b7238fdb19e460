"""Attackers that hold slots and take them back as soon as the servicer frees them (issue 38, item 5).

Each runs on a thread, bounded in connections and time, and targets the
servicer on 127.0.0.1 from 127.0.0.x source addresses only (on Linux all of
127.0.0.0/8 is loopback, so each address plays another peer):

- ``PrefaceReopener`` keeps ``keep`` connections open that never send the
  HTTP/2 preface, and opens a new one for each the servicer closes;
- ``KvResubscriber`` keeps ``keep`` ``SubscribeKvEvents`` streams whose
  receive window is shut (they never take a message), and subscribes again
  for each one the servicer ends or refuses.

Use as context managers: the attack runs from ``__enter__`` until
``__exit__`` or its bounds; ``stats()`` says what it did.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import Counter

from smg_grpc_proto.generated import common_pb2

from tests.adversarial.h2_client import SUBSCRIBE_KV, H2Client, grpc_frame


def sources(first: int, count: int) -> list[str]:
    """``count`` loopback source addresses from 127.0.0.``first`` on."""
    assert 2 <= first and first + count <= 255
    return [f"127.0.0.{i}" for i in range(first, first + count)]


class _Attack:
    def __init__(self, *, max_opened: int, max_s: float, rate_per_s: float) -> None:
        self.max_opened = max_opened
        self.max_s = max_s
        self.rate_per_s = rate_per_s
        self.opened = 0
        self.open_max = 0  # the most it held at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, daemon=True)
        self.error: BaseException | None = None
        self.started = 0.0

    def __enter__(self):
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the attacker did not stop"

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as error:  # reported by the test, not lost on the thread
            self.error = error

    def _may_open(self) -> bool:
        elapsed = time.monotonic() - self.started
        return self.opened < self.max_opened and self.opened < self.rate_per_s * max(elapsed, 0.05)

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() - self.started < self.max_s

    def _run(self) -> None:
        raise NotImplementedError


class PrefaceReopener(_Attack):
    """``keep`` connections that never send the preface, re-opened as the servicer closes them."""

    def __init__(self, port: int, keep: int, addresses: list[str], *, max_opened: int = 5000, max_s: float = 15.0,
                 rate_per_s: float = 500.0) -> None:  # fmt: skip
        super().__init__(max_opened=max_opened, max_s=max_s, rate_per_s=rate_per_s)
        self.port = port
        self.keep = keep
        self.addresses = addresses
        self.closed_by_server = 0
        self.connect_failures = 0
        self.lifetimes: list[float] = []  # seconds each closed one was open

    def _run(self) -> None:
        selector = selectors.DefaultSelector()  # epoll: more than FD_SETSIZE sockets
        held: dict[socket.socket, float] = {}
        try:
            while self._running():
                while len(held) < self.keep and self._may_open():
                    source = self.addresses[self.opened % len(self.addresses)]
                    try:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=1.0,
                                                        source_address=(source, 0))  # fmt: skip
                    except OSError:
                        self.connect_failures += 1
                        break
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ)
                    held[sock] = time.monotonic()
                    self.opened += 1
                self.open_max = max(self.open_max, len(held))
                for key, _ in selector.select(timeout=0.005):
                    sock = key.fileobj
                    try:
                        data = sock.recv(65536)  # the server's preface, or its close
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        selector.unregister(sock)
                        self.lifetimes.append(time.monotonic() - held.pop(sock))
                        sock.close()
                        self.closed_by_server += 1
        finally:
            for sock in held:
                sock.close()
            selector.close()

    def stats(self) -> str:
        lifetimes = sorted(self.lifetimes) or [0.0]
        return (f"{self.opened} preface-less connections opened in {time.monotonic() - self.started:.1f} s "
                f"(at most {self.open_max} at once), {self.closed_by_server} closed by the servicer "
                f"(median life {lifetimes[len(lifetimes) // 2]:.2f} s), {self.connect_failures} connects failed")


class KvResubscriber(_Attack):
    """``keep`` subscribers that never read, each one subscribing again as soon as its stream ends."""

    def __init__(self, port: int, keep: int, addresses: list[str], *, max_opened: int = 2000, max_s: float = 15.0,
                 rate_per_s: float = 200.0) -> None:  # fmt: skip
        super().__init__(max_opened=max_opened, max_s=max_s, rate_per_s=rate_per_s)
        self.port = port
        self.keep = keep
        self.addresses = addresses
        self.ends: Counter[str] = Counter()  # grpc-status of the streams the servicer ended or refused
        request = common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True)
        self.request = grpc_frame(request.SerializeToString())

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        held: dict[H2Client, object] = {}
        try:
            while self._running():
                while len(held) < self.keep and self._may_open():
                    source = self.addresses[self.opened % len(self.addresses)]
                    client = H2Client(self.port, initial_window=0, timeout_s=2.0, source=source)
                    held[client] = client.start(SUBSCRIBE_KV, self.request)
                    selector.register(client.sock, selectors.EVENT_READ, client)
                    self.opened += 1
                self.open_max = max(self.open_max, len(held))
                for key, _ in selector.select(timeout=0.005):
                    client = key.data
                    client.pump(0.001)
                    call = held[client]
                    if call.ended or call.reset or client.closed:
                        self.ends[str(call.status if call.status is not None else "reset")] += 1
                        selector.unregister(client.sock)
                        del held[client]
                        client.close()
        finally:
            for client in held:
                client.close()
            selector.close()

    def stats(self) -> str:
        return (f"{self.opened} non-reading subscriptions in {time.monotonic() - self.started:.1f} s "
                f"(at most {self.open_max} at once); ended by the servicer, by grpc-status: {dict(self.ends)}")

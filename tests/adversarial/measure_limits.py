"""Figures for docs/limits.md, "Connections and messages": attack `enginelink serve` and measure.

Not a test: it prints what each limit answered and the servicer's RSS around
it. Run from the repository root (loopback only, sim engine, a few minutes):

    .venv/bin/python -m tests.adversarial.measure_limits [--only NAME ...]

Every servicer runs with the defaults unless a scenario names a knob.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

from enginelink.tools.test_model import make_test_model
from tests.adversarial.conftest import limited_servicer, metric, rss_bytes
from tests.adversarial.h2_client import (
    GENERATE, HEALTH_CHECK, SUBSCRIBE_KV, H2Client, closed_by_peer, grpc_frame, raw_socket,
)
from tests.adversarial.test_adv_messages import padded_health_check
from tests.harness import wait_until

MiB = 1 << 20


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


@contextlib.contextmanager
def servicer(tmp: Path, model: Path, env: dict[str, str] | None = None):
    with limited_servicer(tmp, model, env or {}) as running:
        running.channel.close()  # every connection is the scenario's
        wait_until(lambda: metric(running, "smg_servicer_grpc_connections") == 0, 10, "no connection")
        yield running


def preface_less(tmp, model, n: int = 1000) -> None:
    with servicer(tmp, model) as s:
        pid = s.process.pid
        for round_ in (1, 2):  # the second round shows the first one's memory is reused, not leaked
            rss0 = rss_bytes(pid)
            start = time.monotonic()
            socks = [raw_socket(s.port, timeout_s=30) for _ in range(n)]
            opened = time.monotonic() - start
            wait_until(lambda: metric(s, "smg_servicer_grpc_connections") == n, 30, "all accepted")
            rss_open = rss_bytes(pid)
            closed = [closed_by_peer(sock, 30) for sock in socks]
            took = time.monotonic() - start
            for sock in socks:
                sock.close()
            print(f"preface-less, round {round_}: {n} connections opened in {opened:.1f} s, "
                  f"{sum(closed)} closed by the server by {took:.1f} s (limit 10 s from each one's start); "
                  f"RSS {mib(rss0)} -> {mib(rss_open)} open -> {mib(rss_bytes(pid))} after; handshake_timeouts "
                  f"{metric(s, 'smg_servicer_grpc_handshake_timeouts'):.0f}")


def beyond_the_cap(tmp, model, extra: int = 200) -> None:
    with servicer(tmp, model) as s:
        pid, rss0, cap = s.process.pid, rss_bytes(s.process.pid), int(metric(s, "smg_servicer_grpc_connections_max"))
        clients = [H2Client(s.port, timeout_s=30) for _ in range(cap)]
        for c in clients:
            c.ping()
        for c in clients:
            c.wait(lambda c=c: c.pings_acked, 30, "PING ACK")
        rss_full = rss_bytes(pid)
        worst = 0.0
        refused = 0
        for _ in range(extra):
            started = time.monotonic()
            extra_client = H2Client(s.port)
            extra_client.wait(lambda: extra_client.closed, 5, "refusal")
            worst = max(worst, time.monotonic() - started)
            refused += extra_client.goaway is not None
            extra_client.close()
        ok = sum(c.finish(c.start(HEALTH_CHECK, grpc_frame(b""))).status == 0 for c in clients[::64])
        print(f"cap: {cap} connections with the preface done: RSS {mib(rss0)} -> {mib(rss_full)} "
              f"({(rss_full - rss0) / cap / 1024:.1f} KiB each); {extra} more: {refused} got GOAWAY and were closed, "
              f"slowest {worst * 1000:.1f} ms; {ok}/{len(clients[::64])} sampled open ones still served a call; "
              f"connections_refused {metric(s, 'smg_servicer_grpc_connections_refused'):.0f}")
        for c in clients:
            c.close()


def idle(tmp, model, n: int = 500, idle_s: float = 5.0) -> None:
    with servicer(tmp, model, {"ENGINELINK_GRPC_IDLE_TIMEOUT_SECS": str(idle_s)}) as s:
        clients = [H2Client(s.port, timeout_s=30) for _ in range(n)]
        opened = time.monotonic()
        pinging = H2Client(s.port)
        start = time.monotonic()
        all_closed = None
        while time.monotonic() - start < 3 * idle_s:
            pinging.ping()
            pinging.wait(lambda n=pinging.pings_acked + 1: pinging.pings_acked >= n, 5, "PING ACK")
            if all_closed is None and metric(s, "smg_servicer_grpc_idle_closed") == n:
                all_closed = time.monotonic() - opened
            time.sleep(0.5)
        for c in clients:
            c.wait(lambda c=c: c.closed, 30, "idle close")
        print(f"idle: {n} connections that finished the preface and sent nothing: all closed with GOAWAY(idle) "
              f"{all_closed:.1f} s after the last opened (limit {idle_s} s); "
              f"one pinging every 0.5 s for {3 * idle_s:.0f} s: "
              f"{'kept' if not pinging.closed else 'CLOSED'}, {pinging.pings_acked} PINGs answered; "
              f"idle_closed {metric(s, 'smg_servicer_grpc_idle_closed'):.0f}")


def message_size(tmp, model, pushed: int = 300 * MiB) -> None:
    with servicer(tmp, model) as s:
        pid, rss0 = s.process.pid, rss_bytes(s.process.pid)
        with H2Client(s.port, timeout_s=30) as c:
            started = time.monotonic()
            call = c.start(HEALTH_CHECK, grpc_frame(b"", claimed=0xFFFF_FFFF), end=False)
            c.finish(call, 10)
            answer_ms = (time.monotonic() - started) * 1000
            chunk, sent, calls = b"z" * MiB, 0, 1
            while sent < pushed and not c.closed:
                if call.reset:  # the server is done with it: lie again on a new stream
                    call, calls = c.start(HEALTH_CHECK, grpc_frame(b"", claimed=0xFFFF_FFFF), end=False), calls + 1
                c.send(call, chunk)
                sent += len(chunk)
            print(f"   ({calls} streams used)")
        rss_after = rss_bytes(pid)
        print(f"4 GB prefix: RESOURCE_EXHAUSTED after {answer_ms:.1f} ms with no body sent; {mib(sent)} pushed behind "
              f"it anyway: RSS {mib(rss0)} -> {mib(rss_after)}")
        body = padded_health_check(64 * MiB)
        with H2Client(s.port, timeout_s=60) as c:
            started = time.monotonic()
            call = c.finish(c.start(HEALTH_CHECK, grpc_frame(body)), 60)
            print(f"a 64 MiB message (the limit): status {call.status} in {time.monotonic() - started:.2f} s; "
                  f"RSS after {mib(rss_bytes(pid))}")
            call = c.finish(c.start(HEALTH_CHECK, grpc_frame(body + b"p")), 60)
            print(f"64 MiB + 1 byte: status {call.status} ({call.message[:60]}...)")


def open_streams(tmp, model, n: int = 4000) -> None:
    with servicer(tmp, model) as s:
        pid, rss0 = s.process.pid, rss_bytes(s.process.pid)
        with H2Client(s.port, timeout_s=60) as c:
            c.ping()  # its answer comes after the server's SETTINGS (4352 streams), which the client then has
            c.wait(lambda: c.pings_acked, 60, "PING ACK")
            calls = [c.start(GENERATE, grpc_frame(b"", claimed=100) + b"x" * 10, end=False) for _ in range(n)]
            c.ping()
            c.wait(lambda: c.pings_acked == 2, 60, "PING ACK")
            rss_open = rss_bytes(pid)
            print(f"open streams: {n} Generate calls on one connection, each waiting for the rest of its body: "
                  f"RSS {mib(rss0)} -> {mib(rss_open)} ({(rss_open - rss0) / n / 1024:.1f} KiB each); "
                  f"none ended: {not any(x.ended for x in calls)}")


def kv_non_readers(tmp, model, n: int = 64) -> None:
    with servicer(tmp, model) as s:
        subscribe = common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True)
        request = grpc_frame(subscribe.SerializeToString())
        clients = [H2Client(s.port, initial_window=0, timeout_s=60) for _ in range(n)]
        calls = [c.start(SUBSCRIBE_KV, request) for c in clients]
        wait_until(lambda: metric(s, "smg_servicer_kv_subscribers") == n, 30, "all subscribed")
        started = time.monotonic()
        extra = H2Client(s.port)
        refused = extra.finish(extra.start(SUBSCRIBE_KV, request), 10)
        for c, call in zip(clients, calls):
            c.finish(call, 120)
        took = time.monotonic() - started
        print(f"KV: {n} subscribers with a shut window: one more refused with status {refused.status}; all {n} ended "
              f"with status {sorted({call.status for call in calls})} within {took:.1f} s (stall limit 30 s); "
              f"subscribers now {metric(s, 'smg_servicer_kv_subscribers'):.0f}")


SCENARIOS = {f.__name__: f for f in (preface_less, beyond_the_cap, idle, message_size, open_streams, kv_non_readers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="el-limits-") as tmp:
        model = make_test_model(Path(tmp) / "tiny-test-model")
        for name in args.only:
            work = Path(tmp) / name
            work.mkdir()
            SCENARIOS[name](work, model)


if __name__ == "__main__":
    main()

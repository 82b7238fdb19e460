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
from tests.harness import scrape, wait_until
from tests.kv.kv_client import metric as labelled

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
        # One peer (127.0.0.1): held at most its own bound or the handshake share, whichever is less.
        share = int(min(metric(s, "smg_servicer_grpc_handshaking_connections_max"),
                        metric(s, "smg_servicer_grpc_connections_per_peer_max")))
        for round_ in (1, 2):  # the second round shows the first one's memory is reused, not leaked
            rss0 = rss_bytes(pid)
            start = time.monotonic()
            socks = [raw_socket(s.port, timeout_s=30) for _ in range(n)]
            opened = time.monotonic() - start
            # Each one beyond it closed the oldest.
            wait_until(lambda: metric(s, "smg_servicer_grpc_connections") == min(n, share), 30, "the share held")
            rss_open = rss_bytes(pid)
            closed = [closed_by_peer(sock, 30) for sock in socks]
            took = time.monotonic() - start
            for sock in socks:
                sock.close()
            print(f"preface-less, round {round_}: {n} connections opened in {opened:.1f} s, at most {share} held, "
                  f"{sum(closed)} closed by the server by {took:.1f} s (limit 10 s from each one's start); "
                  f"RSS {mib(rss0)} -> {mib(rss_open)} open -> {mib(rss_bytes(pid))} after; handshake_timeouts "
                  f"{metric(s, 'smg_servicer_grpc_handshake_timeouts'):.0f}, evicted_handshaking "
                  f"{metric(s, 'smg_servicer_grpc_evicted_handshaking'):.0f}")


def beyond_the_cap(tmp, model, extra: int = 200) -> None:
    with servicer(tmp, model) as s:
        pid, rss0, cap = s.process.pid, rss_bytes(s.process.pid), int(metric(s, "smg_servicer_grpc_connections_max"))
        # From 16 addresses: one peer may hold 128 (ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER).
        addresses = [f"127.0.0.{i}" for i in range(2, 18)]
        clients = [H2Client(s.port, timeout_s=30, source=addresses[i % 16]) for i in range(cap)]
        for c in clients:
            c.ping()
        for c in clients:
            c.wait(lambda c=c: c.pings_acked, 30, "PING ACK")
        rss_full = rss_bytes(pid)
        worst = 0.0
        refused = 0
        for _ in range(extra):
            started = time.monotonic()
            extra_client = H2Client(s.port, source="127.0.0.100")
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
        addresses = [f"127.0.0.{i}" for i in range(2, 10)]  # 8 peers: one may hold 128
        clients = [H2Client(s.port, timeout_s=30, source=addresses[i % 8]) for i in range(n)]
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
        # From 8 addresses: one peer may hold 16 (ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER).
        addresses = [f"127.0.0.{i}" for i in range(2, 10)]
        clients = [H2Client(s.port, initial_window=0, timeout_s=60, source=addresses[i % 8]) for i in range(n)]
        calls = [c.start(SUBSCRIBE_KV, request) for c in clients]
        wait_until(lambda: metric(s, "smg_servicer_kv_subscribers") == n, 30, "all subscribed")
        started = time.monotonic()
        extra = H2Client(s.port, initial_window=0, source="127.0.0.10")  # one more: the one held longest gives way
        extra_call = extra.start(SUBSCRIBE_KV, request)
        clients[0].finish(calls[0], 10)
        gave_way = time.monotonic() - started
        for c, call in zip(clients + [extra], calls + [extra_call]):
            c.finish(call, 120)
        took = time.monotonic() - started
        samples = scrape(s.metrics_port)
        print(f"KV: {n} subscribers with a shut window, then one more: the first gave way to it after "
              f"{gave_way * 1000:.0f} ms (status {calls[0].status}); all {n + 1} ended with status "
              f"{sorted({call.status for call in calls + [extra_call]})} within {took:.1f} s (stall limit 30 s); "
              f"data_loss evicted {labelled(samples, 'smg_servicer_kv_data_loss_total', reason='evicted'):.0f}, "
              f"stalled {labelled(samples, 'smg_servicer_kv_data_loss_total', reason='stalled'):.0f}; "
              f"subscribers now {metric(s, 'smg_servicer_kv_subscribers'):.0f}")


# ---- fairness (issue 38, item 5): another client while an attacker takes slots back as they are freed ------


def _percentiles(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return f"p50 {pick(0.5):.0f} ms, p95 {pick(0.95):.0f} ms, max {ordered[-1] * 1000:.0f} ms"


def _probe(port: int) -> tuple[bool, float]:
    """A health check on a connection of its own (a load balancer's probe): (served, seconds)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.harness import VLLM_SERVICE

    started = time.monotonic()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE),
                                                               timeout=5)  # fmt: skip
        return reply.status == health_pb2.HealthCheckResponse.SERVING, time.monotonic() - started
    except grpc.RpcError:
        return False, time.monotonic() - started


def _generate(port: int, request_id: str, max_tokens: int = 16) -> tuple[bool, float]:
    """A streamed Generate on a connection of its own: (all its tokens came, seconds)."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    from tests.harness import generate_request

    request = generate_request(request_id, list(range(100, 132)), stream=True, max_tokens=max_tokens,
                               ignore_eos=True, temperature=0.0)  # fmt: skip
    started = time.monotonic()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = list(pb_grpc.VllmEngineStub(channel).Generate(request, timeout=10))
        tokens = sum(len(r.chunk.token_ids) for r in replies if r.WhichOneof("response") == "chunk")
        return tokens == max_tokens, time.monotonic() - started
    except grpc.RpcError:
        return False, time.monotonic() - started


def _served(results: list[tuple[bool, float]]) -> str:
    ok = [s for served, s in results if served]
    return f"{len(ok)}/{len(results)} served ({_percentiles(ok)})"


def preface_reopen(tmp, model, attack_s: float = 30.0) -> None:
    """Connections that never send the preface, re-opened as they close, beyond the cap, from 16 addresses."""
    from tests.adversarial.attackers import PrefaceReopener, sources

    with servicer(tmp, model) as s:
        cap = int(metric(s, "smg_servicer_grpc_connections_max"))
        quiet = [_probe(s.port) for _ in range(10)]
        attacker = PrefaceReopener(s.port, cap + 100, sources(2, 16), max_opened=100_000, max_s=attack_s + 30,
                                   rate_per_s=1000)  # fmt: skip
        with attacker:
            wait_until(lambda: attacker.opened >= cap + 100, 30, "the attacker's first connections")
            probes, generates = [], []
            started = time.monotonic()
            while time.monotonic() - started < attack_s:
                probes.append(_probe(s.port))
                if len(probes) % 4 == 0:
                    generates.append(_generate(s.port, f"measure-{len(generates)}"))
                time.sleep(0.5)
            report = attacker.stats()
        print(f"preface re-opening attack, {attack_s:.0f} s: health probes before it {_served(quiet)}; during it "
              f"{_served(probes)}; streamed Generate (16 tokens) during it {_served(generates)}; attacker: {report}")
        print("   evicted_handshaking", _metric_or(s, "smg_servicer_grpc_evicted_handshaking"),
              "connections_refused", _metric_or(s, "smg_servicer_grpc_connections_refused"),
              "handshake_timeouts", _metric_or(s, "smg_servicer_grpc_handshake_timeouts"))


def _metric_or(s, name: str) -> str:
    try:
        return f"{metric(s, name):.0f}"
    except AssertionError:
        return "(none)"


def kv_resubscribe(tmp, model, attack_s: float = 45.0) -> None:
    """Every KV slot held by subscribers that never read, each re-subscribing as it is dropped; the router subscribes."""
    from tests.adversarial.attackers import KvResubscriber, sources
    from tests.kv.kv_client import KvSubscription, generate, prompt

    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    with servicer(tmp, model) as s:
        # The router's one connection (``servicer`` closed the harness's): its KV stream and its Generate calls.
        s.channel = grpc.insecure_channel(f"127.0.0.1:{s.port}")
        s.stub = pb_grpc.VllmEngineStub(s.channel)
        slots = int(metric(s, "smg_servicer_kv_subscribers_max"))
        attacker = KvResubscriber(s.port, slots + 8, sources(2, 8), max_opened=100_000, max_s=attack_s + 30,
                                  rate_per_s=200)  # fmt: skip
        with attacker:
            wait_until(lambda: metric(s, "smg_servicer_kv_subscribers") >= slots, 30, "every slot taken")
            started = time.monotonic()
            attempts, served_after, router = 0, None, None
            waits: list[float] = []
            generated: list[float] = []
            while time.monotonic() - started < attack_s:
                if router is None:  # the router re-subscribes after each refusal (its backoff: 0.5 s here)
                    attempts += 1
                    asked = time.monotonic()
                    sub = KvSubscription(s, 0)
                    try:
                        sub.wait(lambda x: x.snapshot(), 2.0, "a first record")
                        router, served_after = sub, time.monotonic() - started
                        waits.append(time.monotonic() - asked)
                    except AssertionError:
                        sub.cancel()
                asked = time.monotonic()
                generate(s, f"measure-kv-{int(asked * 1000)}", prompt(int(asked), 32))  # KV events to relay
                generated.append(time.monotonic() - asked)
                time.sleep(0.5)
            kept = router is not None and router.error is None and not router.done.is_set()
            records = len(router.snapshot()) if router is not None else 0
            report = attacker.stats()
            if router is not None:
                router.cancel()
        served = (f"served at attempt {attempts}, {served_after:.1f} s into the attack" if router
                  else f"never served ({attempts} attempts)")
        print(f"KV re-subscribing attack, {attack_s:.0f} s: the router-like subscriber {served} "
              f"(first record {_percentiles(waits)} after asking); it {'kept' if kept else 'LOST'} its stream "
              f"to the end ({records} batches); its Generate calls (1 token): {_percentiles(generated)}; "
              f"attacker: {report}")


SCENARIOS = {f.__name__: f for f in (preface_less, beyond_the_cap, idle, message_size, open_streams, kv_non_readers,
                                     preface_reopen, kv_resubscribe)}  # fmt: skip


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

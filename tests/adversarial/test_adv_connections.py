"""Attacks on connections: no preface, half a preface, a trickled preface, beyond the cap, idle.

The servicer runs with 8 connections at most, a 1 s handshake limit and a
2 s idle limit (``ENGINELINK_GRPC_MAX_CONNECTIONS``,
``ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS``, ``ENGINELINK_GRPC_IDLE_TIMEOUT_SECS``).
The harness's own grpcio channel is closed first, so every connection here is the test's.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.adversarial.conftest import limited_servicer, metric
from tests.adversarial.h2_client import GENERATE as GENERATE_PATH
from tests.adversarial.h2_client import HEALTH_CHECK, H2Client, closed_by_peer, grpc_frame, raw_socket
from tests.harness import VLLM_SERVICE, shared, wait_until

CAP = 8
HANDSHAKE_S = 1.0
IDLE_S = 2.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    env = {"ENGINELINK_GRPC_MAX_CONNECTIONS": str(CAP), "ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS": str(HANDSHAKE_S),
           "ENGINELINK_GRPC_IDLE_TIMEOUT_SECS": str(IDLE_S)}  # fmt: skip
    with shared(limited_servicer(tmp_path_factory.mktemp("adv-connections"), test_model_dir, env)) as running:
        running.channel.close()
        yield running


@pytest.fixture
def quiet(servicer):
    """Wait until the servicer holds no connection (what earlier tests opened is gone)."""
    wait_until(lambda: metric(servicer, "smg_servicer_grpc_connections") == 0, 10, "no gRPC connection open")
    return servicer


def serving(servicer) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{servicer.port}") as channel:
        request = health_pb2.HealthCheckRequest(service=VLLM_SERVICE)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_connections_that_never_send_the_preface_are_closed(quiet):
    """Each is closed by the handshake limit, or earlier when a newer one needs its slot.

    Connections still in their handshake hold at most a quarter of the cap
    (``ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS`` unset): each one beyond
    that closes the oldest (issue 38, item 5; before it, those beyond the cap
    were refused and the cap's worth held until the limit).
    """
    servicer = quiet
    share = CAP // 4
    assert metric(servicer, "smg_servicer_grpc_handshaking_connections_max") == share
    timeouts_before = metric(servicer, "smg_servicer_grpc_handshake_timeouts")
    evicted_before = metric(servicer, "smg_servicer_grpc_evicted_handshaking")
    sockets = [raw_socket(servicer.port) for _ in range(3 * CAP)]  # beyond the cap too
    try:
        started = time.monotonic()
        assert all(closed_by_peer(sock, HANDSHAKE_S + 4) for sock in sockets)
        assert time.monotonic() - started < HANDSHAKE_S + 4
    finally:
        for sock in sockets:
            sock.close()
    assert metric(servicer, "smg_servicer_grpc_handshake_timeouts") - timeouts_before == share
    assert metric(servicer, "smg_servicer_grpc_evicted_handshaking") - evicted_before == 3 * CAP - share
    assert serving(servicer)


@pytest.mark.parametrize("sent", [PREFACE[:10], PREFACE, "trickle"], ids=["half-magic", "magic-no-settings", "trickle"])
def test_a_preface_not_finished_in_time_is_closed(quiet, sent):
    """Half the magic, the magic without SETTINGS, or the magic one byte every 0.2 s: closed at the limit."""
    sock = raw_socket(quiet.port)
    try:
        if sent == "trickle":
            deadline = time.monotonic() + HANDSHAKE_S + 4
            for byte in PREFACE:
                try:
                    sock.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
                if closed_by_peer(sock, 0.2):
                    break
                assert time.monotonic() < deadline, "a trickled preface kept the connection open"
        else:
            sock.sendall(sent)
        assert closed_by_peer(sock, HANDSHAKE_S + 4)
    finally:
        sock.close()
    assert serving(quiet)


def test_connections_beyond_the_cap_are_refused_at_once_and_the_others_kept(quiet):
    servicer = quiet
    refused_before = metric(servicer, "smg_servicer_grpc_connections_refused")
    clients = [H2Client(servicer.port) for _ in range(CAP)]
    try:
        for client in clients:  # each has finished its preface: a PING is answered
            client.ping()
            client.wait(lambda c=client: c.pings_acked, 5, "a PING ACK")
        assert metric(servicer, "smg_servicer_grpc_connections") == CAP
        extra = H2Client(servicer.port)
        try:
            extra.ping()
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before the PING was written: what is checked below
        started = time.monotonic()
        extra.wait(lambda: extra.closed, 2, "the connection over the cap closed")
        assert time.monotonic() - started < 2
        assert extra.goaway is not None and extra.goaway.additional_data == b"connection limit"
        assert extra.pings_acked == 0
        assert metric(servicer, "smg_servicer_grpc_connections_refused") == refused_before + 1
        for client in clients:  # the ones already open still serve calls
            assert client.finish(client.start(HEALTH_CHECK, grpc_frame(b""))).status == 0
    finally:
        for client in clients:
            client.close()
    wait_until(lambda: metric(servicer, "smg_servicer_grpc_connections") == 0, 5, "the slots freed")
    assert serving(servicer)


@pytest.mark.slow
def test_an_idle_connection_is_closed_and_a_pinging_one_is_kept(quiet):
    """The router pings every 30 s, idle or not: pings count as activity and are answered, never penalised."""
    servicer = quiet
    idle_before = metric(servicer, "smg_servicer_grpc_idle_closed")
    with H2Client(servicer.port) as idle, H2Client(servicer.port) as pinging:
        pinging.ping()
        pinging.wait(lambda: pinging.pings_acked == 1, 5, "a PING ACK")
        started = time.monotonic()
        # Ping every IDLE_S / 4 for two and a half idle periods.
        while time.monotonic() - started < 2.5 * IDLE_S:
            pinging.ping()
            pinging.wait(lambda n=pinging.pings_acked + 1: pinging.pings_acked >= n, 2, "a PING ACK")
            time.sleep(IDLE_S / 4)
            idle.pump(0.0)
        idle.wait(lambda: idle.closed, IDLE_S + 3, "the idle connection closed")
        assert idle.goaway is not None and idle.goaway.error_code == 0 and idle.goaway.additional_data == b"idle"
        assert not pinging.closed and pinging.goaway is None
        assert pinging.finish(pinging.start(HEALTH_CHECK, grpc_frame(b""))).status == 0
    assert metric(servicer, "smg_servicer_grpc_idle_closed") == idle_before + 1


@pytest.mark.slow
def test_a_connection_with_a_call_open_is_not_idle(quiet):
    """A long call whose client sends nothing (a stream that waits) is not cut by the idle limit."""
    servicer = quiet
    with H2Client(servicer.port) as client:
        # A Generate whose body never finishes: the handler waits in recv_message, the call stays open.
        call = client.start("/vllm.grpc.engine.VllmEngine/Generate", grpc_frame(b"", claimed=100), end=False)
        time.sleep(IDLE_S * 2)  # the thing under test is the passage of time with nothing sent
        client.pump(0.0)
        assert not client.closed and client.goaway is None and not call.ended
        client.conn.reset_stream(call.stream_id)
        client.flush()
        # Once the call is over, the idle limit applies again.
        client.wait(lambda: client.closed, IDLE_S + 3, "the connection closed once idle")
        assert client.goaway is not None and client.goaway.additional_data == b"idle"


@pytest.mark.slow
@pytest.mark.router
def test_the_router_reconnects_after_its_idle_connection_is_closed(tmp_path, test_model_dir):
    """GOAWAY(idle) is graceful for the real SMG router: its next request opens a new connection."""
    from tests.harness import Router
    from tests.router.openai_http import post

    env = {"ENGINELINK_GRPC_IDLE_TIMEOUT_SECS": "2", "SMG_VLLM_SERVICER_KV_EVENTS": "0"}  # no KV stream held open
    with limited_servicer(tmp_path, test_model_dir, env) as servicer:
        servicer.channel.close()
        with Router(tmp_path, servicer.port, test_model_dir, health_check_interval_s=600) as router:
            body = {"model": test_model_dir.name, "prompt": "def foo(x):", "max_tokens": 4, "temperature": 0}
            assert post(router.url, "/v1/completions", body)[0] == 200
            # Between the router's 30 s keepalive PINGs its connection is idle: closed.
            wait_until(lambda: metric(servicer, "smg_servicer_grpc_idle_closed") >= 1, 30, "the idle close")
            status, reply = post(router.url, "/v1/completions", body)
            assert status == 200, reply
            assert reply["choices"][0]["text"]


# ---- fairness: an attacker who takes slots back as fast as they are freed (issue 38, item 5) ----------------
#
# A second servicer: 32 connections at most, 16 of them for connections still in their
# handshake, 8 per peer, an idle connection given up for a newcomer after 3 s. Peers are
# 127.0.0.x source addresses (tests/adversarial/attackers.py).

FAIR_CAP = 32
FAIR_HANDSHAKING = 16
FAIR_PER_PEER = 8
FAIR_EVICT_IDLE_S = 3.0


@pytest.fixture(scope="module")
def fair_servicer(tmp_path_factory, test_model_dir):
    env = {"ENGINELINK_GRPC_MAX_CONNECTIONS": str(FAIR_CAP),
           "ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS": str(FAIR_HANDSHAKING),
           "ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER": str(FAIR_PER_PEER),
           "ENGINELINK_GRPC_EVICT_IDLE_SECS": str(FAIR_EVICT_IDLE_S)}  # fmt: skip
    with shared(limited_servicer(tmp_path_factory.mktemp("adv-fairness"), test_model_dir, env)) as running:
        running.channel.close()
        yield running


@pytest.fixture
def fair(fair_servicer):
    wait_until(lambda: metric(fair_servicer, "smg_servicer_grpc_connections") == 0, 15, "no gRPC connection open")
    return fair_servicer


def probe(servicer) -> tuple[bool, float, str]:
    """A health check on a connection of its own, as a load balancer's probe: (served, seconds, why not)."""
    started = time.monotonic()
    try:
        ok = serving(servicer)
        return ok, time.monotonic() - started, "" if ok else "not SERVING"
    except grpc.RpcError as error:
        return False, time.monotonic() - started, f"{error.code().name}: {error.details()}"


def generate_stream(servicer, request_id: str, max_tokens: int = 16) -> int:
    """A streamed Generate on a connection of its own; the number of tokens it got."""
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    from tests.harness import generate_request

    request = generate_request(request_id, list(range(100, 132)), stream=True, max_tokens=max_tokens,
                               ignore_eos=True, temperature=0.0)  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{servicer.port}") as channel:
        replies = list(pb_grpc.VllmEngineStub(channel).Generate(request, timeout=10))
    return sum(len(r.chunk.token_ids) for r in replies if r.WhichOneof("response") == "chunk")


@pytest.mark.process
@pytest.mark.slow
def test_clients_are_served_while_an_attacker_reopens_preface_less_connections(fair):
    """The issue's attack: every slot taken by connections that never send the preface, re-opened as they close.

    Before: the cap was full of them, so every new client was refused
    ("connection limit") until they timed out, and then they were taken back
    first. Now they hold at most the handshake share; each new one closes
    the oldest, and a client that sends its preface finishes its handshake
    in a slot the share cannot take.
    """
    from tests.adversarial.attackers import PrefaceReopener, sources

    servicer = fair
    attacker = PrefaceReopener(servicer.port, FAIR_CAP + 16, sources(2, 16), max_opened=6000, max_s=20, rate_per_s=300)
    with attacker:
        wait_until(lambda: attacker.opened >= FAIR_CAP + 16, 10, "the attacker's first connections")
        probes = []
        for i in range(20):
            probes.append(probe(servicer))
            if i == 10:
                tokens = generate_stream(servicer, "adv-fair-generate")
            time.sleep(0.1)
        assert attacker.error is None, attacker.error
        report = attacker.stats()
    failed = [p for p in probes if not p[0]]
    assert not failed, f"{len(failed)} of {len(probes)} probes failed ({failed[:3]}); attacker: {report}"
    assert tokens == 16, report
    assert attacker.closed_by_server > FAIR_CAP, report  # the attack went on: its connections were closed and re-opened
    assert metric(servicer, "smg_servicer_grpc_evicted_handshaking") > FAIR_CAP
    assert metric(servicer, "smg_servicer_grpc_handshaking_connections_max") == FAIR_HANDSHAKING


@pytest.mark.process
def test_one_peer_holds_at_most_its_share_and_displaces_only_its_own(fair):
    servicer = fair
    greedy = [raw_socket(servicer.port, source="127.0.0.2") for _ in range(3 * FAIR_PER_PEER)]
    try:
        # Each beyond the peer's bound closed the same peer's oldest at once, long before the handshake limit.
        assert all(closed_by_peer(sock, 1.0) for sock in greedy[:-FAIR_PER_PEER])
        assert not any(closed_by_peer(sock, 0.05) for sock in greedy[-FAIR_PER_PEER:])
        # Another peer, meanwhile, finishes its handshake, holds as many and is served.
        others = [H2Client(servicer.port, source="127.0.0.3") for _ in range(FAIR_PER_PEER)]
        try:
            for client in others:
                assert client.finish(client.start(HEALTH_CHECK, grpc_frame(b""))).status == 0
            assert not any(closed_by_peer(sock, 0.05) for sock in greedy[-FAIR_PER_PEER:])
            # One more from that peer: none of its own is in its handshake or idle long enough to give way
            # (a PING each, answered, however long the calls above took on a loaded machine).
            for client in others:
                client.ping()
                client.wait(lambda c=client: c.pings_acked, 5, "a PING ACK")
            extra = H2Client(servicer.port, source="127.0.0.3")
            extra.wait(lambda: extra.closed, 2, "the connection over the peer's bound closed")
            assert extra.goaway is not None and extra.goaway.additional_data == b"connection limit per peer"
            assert not any(client.closed for client in others)
            assert metric(servicer, "smg_servicer_grpc_connections_refused_peer") >= 1
        finally:
            for client in others:
                client.close()
    finally:
        for sock in greedy:
            sock.close()
    assert metric(servicer, "smg_servicer_grpc_connections_per_peer_max") == FAIR_PER_PEER


@pytest.mark.process
@pytest.mark.slow
def test_at_the_cap_the_longest_idle_connection_gives_way_and_a_busy_one_does_not(fair):
    servicer = fair
    peers = ["127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7"]
    clients = [H2Client(servicer.port, source=peers[i % 4]) for i in range(FAIR_CAP)]
    try:
        for client in clients:
            client.ping()
            client.wait(lambda c=client: c.pings_acked, 5, "a PING ACK")
        assert metric(servicer, "smg_servicer_grpc_connections") == FAIR_CAP
        idle, busy = clients[0], clients[1]  # busy: a call open that waits for the rest of its body
        call = busy.start(GENERATE_PATH, grpc_frame(b"", claimed=100), end=False)
        time.sleep(FAIR_EVICT_IDLE_S / 2)
        for client in clients[2:]:  # the rest keep pinging: never idle long enough
            client.ping()
        time.sleep(FAIR_EVICT_IDLE_S / 2 + 0.5)  # the passage of time is what is tested
        newcomer = H2Client(servicer.port, source="127.0.0.8")
        assert newcomer.finish(newcomer.start(HEALTH_CHECK, grpc_frame(b""))).status == 0
        idle.wait(lambda: idle.closed, 2, "the idle connection closed")
        assert idle.goaway is not None and idle.goaway.error_code == 0
        assert idle.goaway.additional_data == b"evicted: idle"
        busy.pump(0.0)
        assert not busy.closed and not call.ended
        # Full again, and nobody idle long enough (each PING answered: the servicer has seen it).
        for client in clients[1:]:
            client.ping()
        for i, client in enumerate(clients[1:], start=1):  # PINGs so far: 1 each, 2 the rest, and this one
            client.wait(lambda c=client, n=2 if i == 1 else 3: c.pings_acked >= n, 5, "a PING ACK")
        refused = H2Client(servicer.port, source="127.0.0.9")
        refused.wait(lambda: refused.closed, 2, "the connection over the cap closed")
        assert refused.goaway is not None and refused.goaway.additional_data == b"connection limit"
        newcomer.close()
    finally:
        for client in clients:
            client.close()
    assert metric(servicer, "smg_servicer_grpc_evicted_idle") == 1

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
    servicer = quiet
    before = metric(servicer, "smg_servicer_grpc_handshake_timeouts")
    sockets = [raw_socket(servicer.port) for _ in range(3 * CAP)]  # beyond the cap too
    try:
        started = time.monotonic()
        assert all(closed_by_peer(sock, HANDSHAKE_S + 4) for sock in sockets)
        assert time.monotonic() - started < HANDSHAKE_S + 4
    finally:
        for sock in sockets:
            sock.close()
    assert metric(servicer, "smg_servicer_grpc_handshake_timeouts") - before == CAP
    assert metric(servicer, "smg_servicer_grpc_connections_refused") >= 2 * CAP
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

"""Attacks on message size: a lying length prefix, a real oversized message, the per-connection budget.

The servicer runs with a 1 MiB message limit and a 1.5 MiB reassembly budget
per connection (``ENGINELINK_GRPC_MAX_RECV_BYTES``,
``ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES``), so the attacks stay small;
the defaults (64 MiB, 128 MiB) are checked the same way by docs/limits.md's script.
"""

from __future__ import annotations

import os

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.adversarial.conftest import limited_servicer, metric, rss_bytes
from tests.adversarial.h2_client import HEALTH_CHECK, H2Client, grpc_frame
from tests.harness import generate_request, shared

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

LIMIT = 1 << 20
BUDGET = 3 * LIMIT // 2
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    env = {"ENGINELINK_GRPC_MAX_RECV_BYTES": str(LIMIT), "ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES": str(BUDGET)}
    with shared(limited_servicer(tmp_path_factory.mktemp("adv-messages"), test_model_dir, env)) as running:
        yield running


def padded_health_check(size: int) -> bytes:
    """A HealthCheckRequest of exactly ``size`` bytes: one unknown length-delimited field (protobuf keeps it)."""
    for header in range(3, 10):
        payload = size - header
        head = b"\xc2\x3e" + _varint(payload)  # field 1000, wire type 2
        if len(head) == header:
            body = head + b"p" * payload
            assert len(body) == size and pb.HealthCheckRequest.FromString(body) is not None
            return body
    raise AssertionError(size)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def raw_health_check(channel: grpc.Channel):
    return channel.unary_unary("/vllm.grpc.engine.VllmEngine/HealthCheck", request_serializer=lambda body: body,
                               response_deserializer=pb.HealthCheckResponse.FromString)  # fmt: skip


def big_channel(servicer) -> grpc.Channel:
    """A grpcio channel that will send messages of any size (its own limit lifted)."""
    return grpc.insecure_channel(f"127.0.0.1:{servicer.port}", options=[("grpc.max_send_message_length", -1)])


def test_a_prefix_claiming_4_gb_is_refused_before_its_body_arrives(servicer):
    with H2Client(servicer.port) as client:
        call = client.start(HEALTH_CHECK, grpc_frame(b"x" * 10, claimed=0xFFFF_FFFF), end=False)
        # Trickle: the answer must come without the body, which never will.
        for _ in range(20):
            if call.ended:
                break
            client.send(call, b"y" * 100)
            client.pump(0.1)
        client.finish(call)
        assert call.status == RESOURCE_EXHAUSTED, (call.headers, call.trailers)
        assert "4294967295 bytes" in call.message and "ENGINELINK_GRPC_MAX_RECV_BYTES" in call.message
        assert metric(servicer, "smg_servicer_grpc_messages_refused_size") >= 1
        # The connection is still good for honest calls.
        ok = client.finish(client.start(HEALTH_CHECK, grpc_frame(b"")))
        assert ok.status == 0


def test_a_body_pushed_behind_a_lying_prefix_is_not_kept(servicer):
    """The attack of issue 21: 300 MB behind a 4 GB prefix grew RSS by 270 MB. Here 64 MB must not stay."""
    pid = servicer.process.pid
    before = rss_bytes(pid)
    sent = 0
    with H2Client(servicer.port) as client:
        call = client.start(HEALTH_CHECK, grpc_frame(b"", claimed=0xFFFF_FFFF), end=False)
        chunk = b"z" * (1 << 20)
        for _ in range(64):
            if call.reset or client.closed or client.conn.local_flow_control_window(call.stream_id) <= 0 and call.ended:
                break
            client.send(call, chunk)
            sent += len(chunk)
        client.finish(call)
        assert call.status == RESOURCE_EXHAUSTED
        assert client.finish(client.start(HEALTH_CHECK, grpc_frame(b""))).status == 0
    grown = rss_bytes(pid) - before
    assert grown < 16 << 20, f"RSS grew by {grown} bytes after {sent} bytes sent behind a 4 GB prefix"


def test_a_real_oversized_generate_from_grpcio_is_refused(servicer):
    request = generate_request("adv-big", [1000] * (LIMIT // 2 + 1000), max_tokens=1)
    assert request.ByteSize() > LIMIT
    with big_channel(servicer) as channel:
        stub_call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate",
                                         request_serializer=pb.GenerateRequest.SerializeToString,
                                         response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            list(stub_call(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ENGINELINK_GRPC_MAX_RECV_BYTES" in refused.value.details()
        # The same channel (connection) keeps working.
        assert raw_health_check(channel)(padded_health_check(16), timeout=5).healthy


def test_a_message_exactly_at_the_limit_is_accepted_and_one_byte_more_is_not(servicer):
    with big_channel(servicer) as channel:
        check = raw_health_check(channel)
        assert check(padded_health_check(LIMIT), timeout=10).healthy
        with pytest.raises(grpc.RpcError) as refused:
            check(padded_health_check(LIMIT + 1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{LIMIT + 1} bytes" in refused.value.details()


def test_one_connection_cannot_hold_more_than_its_reassembly_budget(servicer):
    """Two maximal messages half-sent on one connection: one fits the 1.5 MiB budget, the other is refused."""
    body = padded_health_check(LIMIT)
    with H2Client(servicer.port) as client:
        calls = [client.start(HEALTH_CHECK, grpc_frame(body)[:4096], end=False) for _ in range(2)]
        refused = client.wait(lambda: [c for c in calls if c.ended], 5, "a refusal")
        assert len(refused) == 1 and refused[0].status == RESOURCE_EXHAUSTED, [(c.status, c.message) for c in calls]
        assert "ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES" in refused[0].message
        # Another connection is not affected: a whole maximal message goes through there.
        with big_channel(servicer) as channel:
            assert raw_health_check(channel)(body, timeout=10).healthy
        # The one that fit completes normally once its body arrives.
        (kept,) = [c for c in calls if not c.ended]
        client.send(kept, grpc_frame(body)[4096:], end=True)
        assert client.finish(kept).status == 0
        assert pb.HealthCheckResponse.FromString(bytes(kept.data[5:])).healthy
    assert metric(servicer, "smg_servicer_grpc_messages_refused_connection") >= 1
    assert metric(servicer, "smg_servicer_grpc_recv_message_bytes_max") == LIMIT
    assert metric(servicer, "smg_servicer_grpc_connection_recv_bytes_max") == BUDGET


@pytest.mark.parametrize("name, value", [
    ("ENGINELINK_GRPC_MAX_RECV_BYTES", "lots"), ("ENGINELINK_GRPC_MAX_RECV_BYTES", "0"),
    ("ENGINELINK_GRPC_MAX_CONNECTION_RECV_BYTES", "1024"),  # below the message limit: no maximal message could fit
    ("ENGINELINK_GRPC_MAX_CONNECTIONS", "-1"), ("ENGINELINK_GRPC_HANDSHAKE_TIMEOUT_SECS", "inf"),
    ("ENGINELINK_GRPC_IDLE_TIMEOUT_SECS", "nan"), ("ENGINELINK_KV_MAX_SUBSCRIBERS", "0"),
    ("ENGINELINK_KV_SEND_STALL_SECS", "soon"),
    # issue 38, item 5
    ("ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER", "0"), ("ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS", "many"),
    ("ENGINELINK_GRPC_EVICT_IDLE_SECS", "-1"), ("ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER", "0"),
])  # fmt: skip
def test_a_limit_that_cannot_work_is_refused_before_the_engine_starts(tmp_path, name, value):
    import subprocess

    from tests.harness import VENV_BIN

    argv = [str(VENV_BIN / "enginelink"), "serve", "--port", "1", "--journal", str(tmp_path / "j.sqlite")]
    done = subprocess.run(argv, env={**os.environ, name: value}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert name in done.stderr and "Traceback" not in done.stderr

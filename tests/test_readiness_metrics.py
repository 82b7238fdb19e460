"""Readiness and metrics as an operator sees them, through start-up, warm-up and serving.

A slow cost model (20 ms per engine step) makes the planned warm-up last a
few seconds of real time, long enough to observe every state; nothing here
asserts a duration.
"""

from __future__ import annotations


import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.harness import Servicer, free_port, generate_request, scrape, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

PROMPT = [318, 283, 1552, 10, 90, 305]
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def current_state(samples: dict[str, float]) -> str:
    states = [name.split('state="')[1].split('"')[0] for name, v in samples.items()
              if name.startswith("smg_servicer_state{") and v == 1.0]
    assert len(states) == 1, states
    return states[0]


def sample(samples: dict[str, float], family: str, **labels) -> float:
    for name, value in samples.items():
        if name.startswith(family + "{") and all(f'{k}="{v}"' in name for k, v in labels.items()):
            return value
    return 0.0


def test_readiness_and_metrics_follow_the_lifecycle(tmp_path, test_model_dir):
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(metrics_port)],
                        engine_args=["--step-us", "20000"], env={"ENGINELINK_WARMUP": "fast"})
    servicer.start(wait_serving=False)
    try:
        health = health_pb2_grpc.HealthStub(servicer.channel)
        seen_states = []

        def observe() -> str:
            state = current_state(scrape(metrics_port))
            if not seen_states or seen_states[-1] != state:
                seen_states.append(state)
            return state

        wait_until(lambda: observe() == "warming_up", 30, "metrics state warming_up", interval_s=0.02)
        # While warming up: readiness held, clients refused (retryable), HealthCheck says why.
        for service in ("", "vllm.grpc.engine.VllmEngine"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status == NOT_SERVING
        reply = servicer.stub.HealthCheck(pb.HealthCheckRequest(), timeout=2)
        assert reply.message == "Engine is warming up"
        with pytest.raises(grpc.RpcError) as refused:
            list(servicer.stub.Generate(generate_request("early", PROMPT, max_tokens=4), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "warming up" in refused.value.details()

        wait_until(lambda: observe() == "serving", 60, "metrics state serving", interval_s=0.05)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == SERVING
        assert "starting" in seen_states[0:1] or seen_states[0] == "warming_up"
        assert seen_states[-2:] == ["warming_up", "serving"]
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=2)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        # Counters match what this client sent and received (warm-up calls are not counted).
        before = scrape(metrics_port)
        assert sample(before, "smg_servicer_refusals_total", reason="warming_up") == 1
        received = 0
        for i in range(3):
            for message in servicer.stub.Generate(generate_request(f"c{i}", PROMPT, stream=True, max_tokens=5,
                                                                   ignore_eos=True), timeout=10):
                if message.HasField("chunk"):
                    received += len(message.chunk.token_ids)
        after = scrape(metrics_port)
        assert received == 15
        assert sample(after, "smg_servicer_generated_tokens_total") == 15
        assert sample(after, "smg_servicer_prompt_tokens_total") == 3 * len(PROMPT)
        assert sample(after, "smg_servicer_requests_total", finish_reason="length") == 3
        assert sample(after, "smg_servicer_time_to_first_token_seconds_count") == 3
        assert sample(after, "smg_servicer_e2e_request_latency_seconds_count") == 3
        assert sample(after, "smg_servicer_in_flight_requests") == 0
        assert sample(after, "smg_servicer_journal_records") > 0
        # Warm-up ran: one INFO summary; its steps are DEBUG lines, not in this INFO log.
        assert "INFO enginelink.warmup: warm-up done in " in servicer.log()
        assert "warm-up step 1/" not in servicer.log()
    finally:
        servicer.stop()


def test_scrape_during_start_up_says_starting(tmp_path, test_model_dir):
    """A scrape before the engine's handshake already answers state="starting"."""
    metrics_port = free_port()
    # The sim engine waits 3 s before dialing in, as a slow engine would.
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(metrics_port)],
                        engine_args=["--startup-delay-s", "3"])
    servicer.start(wait_serving=False)
    try:
        state = wait_until(lambda: current_state(scrape(metrics_port)), 10, "first scrape", interval_s=0.02)
        assert state == "starting"
        reply = servicer.stub.HealthCheck(pb.HealthCheckRequest(), timeout=2)
        assert (reply.healthy, reply.message) == (False, "Engine is starting")
    finally:
        servicer.stop()


def test_metrics_port_equal_to_grpc_port_is_refused_before_the_engine_starts(tmp_path, test_model_dir):
    port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", "0"])
    servicer.argv[servicer.argv.index("--port") + 1] = str(port)
    servicer.argv[servicer.argv.index("--metrics-port") + 1] = str(port)
    servicer.start(wait_serving=False)
    try:
        assert servicer.wait(30) == 2
        assert "is the gRPC port" in servicer.log()
        assert "sim-engine" not in servicer.log()
    finally:
        servicer.stop()

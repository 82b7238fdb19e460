"""Every RPC of the vLLM contract as a client sees it, plus grpc.health.v1 and UNIMPLEMENTED paths."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import (
    common_pb2,
    mlx_engine_pb2,
    sglang_scheduler_pb2,
    tokenspeed_scheduler_pb2,
    trtllm_service_pb2,
)
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import CALL_TIMEOUT_S
from tests.harness import VLLM_SERVICE

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

CHUNK_BYTES_MAX = 64 * 1024


def test_health_check_is_healthy(servicer):
    reply = servicer.stub.HealthCheck(pb.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.healthy is True
    assert reply.message == "Health"


def test_model_info_comes_from_the_model_dir(servicer, test_model_dir):
    config = json.loads((test_model_dir / "config.json").read_text())
    info = servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.vocab_size == 4096 == config["vocab_size"]
    assert list(info.eos_token_ids) == [2]
    assert list(info.architectures) == config["architectures"]
    assert info.served_model_name == test_model_dir.name
    assert info.max_context_length == 2048
    assert info.is_generation is True
    assert info.tokenizer_path and (test_model_dir.resolve() / "tokenizer.json").samefile(
        f"{info.tokenizer_path}/tokenizer.json"
    )


def test_server_info(servicer):
    info = servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.server_type == "vllm-grpc"
    assert info.active_requests == 0
    assert info.block_size == 16
    assert info.model_dtype == "bfloat16"
    assert info.max_num_seqs == 128
    assert info.data_parallel_size == 1
    assert info.uptime_seconds > 0


def test_loads_has_the_first_rank(servicer):
    reply = servicer.stub.GetLoads(pb.GetLoadsRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.dp_rank_count == 1
    assert [load.dp_rank for load in reply.loads] == [0]
    assert reply.loads[0].max_running_requests == 128
    assert reply.loads[0].max_total_num_tokens > 0


def test_tokenizer_streams_a_verified_zip(servicer, test_model_dir):
    chunks = list(servicer.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=CALL_TIMEOUT_S))
    assert chunks, "no tokenizer chunks"
    assert all(0 < len(c.data) <= CHUNK_BYTES_MAX for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1), "only the last chunk carries the sha256"
    blob = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(blob).hexdigest()
    with zipfile.ZipFile(io.BytesIO(blob)) as bundle:
        assert bundle.testzip() is None
        names = bundle.namelist()
        assert "tokenizer.json" in names
        assert bundle.read("tokenizer.json") == (test_model_dir / "tokenizer.json").read_bytes()
        assert "model.safetensors" not in names
    if len(blob) > CHUNK_BYTES_MAX:
        assert len(chunks) >= 2


@pytest.mark.parametrize("service", ["", VLLM_SERVICE])
def test_grpc_health_check_serving(servicer, service):
    health = health_pb2_grpc.HealthStub(servicer.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_health_unknown_service_is_not_found(servicer):
    health = health_pb2_grpc.HealthStub(servicer.channel)
    with pytest.raises(grpc.RpcError) as error:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=CALL_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_health_watch_yields_serving(servicer):
    health = health_pb2_grpc.HealthStub(servicer.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=CALL_TIMEOUT_S)
    try:
        first = next(watch)
    finally:
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "rpc, message",
    [
        ("Embed", pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[5, 6]))),
    ],
)
def test_unoffered_vllm_rpcs_are_unimplemented(servicer, rpc, message):
    with pytest.raises(grpc.RpcError) as error:
        getattr(servicer.stub, rpc)(message, timeout=CALL_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    "rpc, message",
    [("StartProfile", common_pb2.StartProfileRequest()), ("StopProfile", common_pb2.StopProfileRequest())],
)
def test_profiling_is_refused_clearly_when_the_engine_has_no_profiler(servicer, rpc, message):
    """The engine was launched without --profiler-config: FAILED_PRECONDITION, with its own words."""
    with pytest.raises(grpc.RpcError) as error:
        getattr(servicer.stub, rpc)(message, timeout=CALL_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Profiling is not enabled. Please set --profiler-config" in error.value.details()


def test_start_profile_options_are_refused_before_the_engine_sees_them(servicer):
    with pytest.raises(grpc.RpcError) as error:
        servicer.stub.StartProfile(common_pb2.StartProfileRequest(output_dir="/tmp/x", num_steps=3),
                                   timeout=CALL_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_dir, num_steps" in error.value.details() and "--profiler-config" in error.value.details()


def test_flush_cache_resets_the_prefix_cache(servicer):
    reply = servicer.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=CALL_TIMEOUT_S)
    assert reply.success and reply.message == "Local KV prefix cache flushed successfully"


def test_subscribe_kv_events_streams_from_the_relay(servicer):
    """KV events are on by default (tests/kv/ covers the stream itself)."""
    stream = servicer.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                             timeout=CALL_TIMEOUT_S)  # fmt: skip
    try:
        first = next(stream)
    finally:
        stream.cancel()
    assert first.dp_rank == 0 and first.HasField("load")


@pytest.mark.parametrize(
    "path, module",
    [
        ("/sglang.grpc.scheduler.SglangScheduler/HealthCheck", sglang_scheduler_pb2),
        ("/tokenspeed.grpc.scheduler.TokenSpeedScheduler/HealthCheck", tokenspeed_scheduler_pb2),
        ("/mlx.grpc.engine.MlxEngine/HealthCheck", mlx_engine_pb2),
        ("/trtllm.TrtllmService/HealthCheck", trtllm_service_pb2),
        ("/vllm.grpc.engine.VllmEngine/NoSuchMethod", pb),
    ],
)
def test_other_engine_services_are_unimplemented(servicer, path, module):
    """The router detects the backend by which HealthCheck answers: the others must say UNIMPLEMENTED."""
    method = servicer.channel.unary_unary(
        path,
        request_serializer=module.HealthCheckRequest.SerializeToString,
        response_deserializer=module.HealthCheckResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as error:
        method(module.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

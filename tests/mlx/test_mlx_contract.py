"""``enginelink serve --engine mlx`` answers as an MLX worker: the MlxEngine service and nothing else.

The router detects a gRPC worker's backend by which engine service answers
(reference/router-harness.md): this worker must answer ``MlxEngine`` and
health for ``""`` and ``mlx.grpc.engine.MlxEngine``, and UNIMPLEMENTED for
``VllmEngine`` and every other engine service. The facts RPCs answer in MLX's
shapes (reference/mlx.md §1, §5, §6).
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2, mlx_engine_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.mlx.conftest import MLX_SERVICE, mlx_request

pytestmark = pytest.mark.mlx


def test_health_answers_for_the_overall_and_the_mlx_service_only(mlx_stack):
    servicer, _ = mlx_stack
    health = health_pb2_grpc.HealthStub(servicer.channel)
    for name in ("", MLX_SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    for name in ("vllm.grpc.engine.VllmEngine", "nope"):
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, name


def test_every_other_engine_service_is_unimplemented(mlx_stack):
    servicer, _ = mlx_stack
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(servicer.channel)
    calls = [
        lambda: vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10),
        lambda: vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=10),
        lambda: list(vllm.Generate(vllm_engine_pb2.GenerateRequest(request_id="v"), timeout=10)),
        lambda: sglang_scheduler_pb2_grpc.SglangSchedulerStub(servicer.channel).HealthCheck(
            vllm_engine_pb2.HealthCheckRequest(), timeout=10),
        # A path MLX's proto does not have (the reference answers UNIMPLEMENTED too).
        lambda: servicer.channel.unary_unary(f"/{MLX_SERVICE}/GetLoads")(b"", timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as missing:
            call()
        assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_check_server_info_and_model_info(mlx_stack, test_model_dir):
    servicer, _ = mlx_stack
    stub = servicer.stub
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy and health.message == "OK"
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.server_type == "mlx-grpc" and info.uptime_seconds > 0
    config = json.loads((test_model_dir / "config.json").read_text())
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert model.model_path == str(test_model_dir) and model.is_generation
    assert model.max_context_length == model.max_req_input_len == config["max_position_embeddings"]
    assert model.vocab_size == config["vocab_size"] and model.model_type == config["model_type"]
    assert list(model.architectures) == config["architectures"]
    assert list(model.eos_token_ids) == [config["eos_token_id"]]
    assert model.served_model_name == test_model_dir.name


def test_the_tokenizer_bundle_matches_its_sha(mlx_stack):
    servicer, _ = mlx_stack
    chunks = list(servicer.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert {"tokenizer.json", "config.json"} <= set(zipfile.ZipFile(io.BytesIO(data)).namelist())


def test_text_input_is_refused_as_the_reference_does(mlx_stack):
    servicer, _ = mlx_stack
    with pytest.raises(grpc.RpcError) as refused:
        list(servicer.stub.Generate(pb.GenerateRequest(request_id="text", text="hello"), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenized" in refused.value.details()


def test_logprobs_zero_returns_none_and_active_requests_counts_a_call(mlx_stack):
    servicer, _ = mlx_stack
    replies = list(servicer.stub.Generate(mlx_request("lp0", [7, 8, 9], stream=True, temperature=0.0, max_tokens=3,
                                                      logprobs=0), timeout=60))  # fmt: skip
    assert len(replies) == 4
    assert all(not r.chunk.HasField("output_logprobs") for r in replies[:3])
    assert servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).active_requests == 0

"""gRPC server reflection: what ``grpcurl -plaintext HOST:PORT list`` (and ``describe``) shows.

The reference servicer lists its engine service, ``grpc.health.v1.Health`` and
``grpc.reflection.v1alpha.ServerReflection``; enginelink lists the same, for
each contract, through both reflection versions a client may ask (grpcurl
tries v1, then v1alpha). The client is grpclib's own reflection stub, run
here on asyncio against a servicer in its own process.
"""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpclib.client import Channel
from grpclib.reflection.v1 import reflection_grpc as v1_grpc, reflection_pb2 as v1_pb
from grpclib.reflection.v1alpha import reflection_grpc as v1alpha_grpc, reflection_pb2 as v1alpha_pb

from tests.harness import Servicer

VERSIONS = {"v1": (v1_grpc, v1_pb), "v1alpha": (v1alpha_grpc, v1alpha_pb)}
CONTRACTS = {
    "vllm": ("vllm.grpc.engine.VllmEngine", []),
    "sglang": ("sglang.grpc.scheduler.SglangScheduler", ["--engine", "sim", "--wire", "sglang"]),
    "tokenspeed": ("tokenspeed.grpc.scheduler.TokenSpeedScheduler", ["--engine", "sim", "--wire", "tokenspeed"]),
}


def ask(port: int, version: str, **request) -> list:
    """The replies of one ServerReflectionInfo call carrying one request."""
    grpc_module, pb = VERSIONS[version]

    async def call():
        channel = Channel("127.0.0.1", port)
        try:
            stub = grpc_module.ServerReflectionStub(channel)
            return await stub.ServerReflectionInfo([pb.ServerReflectionRequest(**request)], timeout=10)
        finally:
            channel.close()

    return asyncio.run(call())


@pytest.fixture(scope="module", params=list(CONTRACTS))
def contract_servicer(request, tmp_path_factory, test_model_dir):
    service, extra = CONTRACTS[request.param]
    with Servicer(tmp_path_factory.mktemp(f"reflection-{request.param}"), model_dir=test_model_dir, extra=extra,
                  health_service=service, env={"ENGINELINK_WARMUP": "off"}) as running:
        yield service, running


@pytest.mark.process
@pytest.mark.parametrize("version", list(VERSIONS))
def test_list_names_the_served_services_as_the_reference_does(contract_servicer, version):
    service, servicer = contract_servicer
    [reply] = ask(servicer.port, version, list_services="")
    names = [entry.name for entry in reply.list_services_response.service]
    assert names == [service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]


@pytest.mark.process
def test_describe_finds_the_contracts_file(contract_servicer):
    service, servicer = contract_servicer
    [reply] = ask(servicer.port, "v1", file_containing_symbol=service)
    files = [FileDescriptorProto.FromString(raw) for raw in reply.file_descriptor_response.file_descriptor_proto]
    package, _, name = service.rpartition(".")
    assert any(f.package == package and name in [s.name for s in f.service] for f in files), files


@pytest.mark.process
def test_an_unknown_symbol_is_not_found(contract_servicer):
    _, servicer = contract_servicer
    [reply] = ask(servicer.port, "v1", file_containing_symbol="no.such.Service")
    assert reply.error_response.error_code == 5  # NOT_FOUND

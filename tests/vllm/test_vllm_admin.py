"""FlushCache and the profiler RPCs against a real vLLM engine (launched without a profiler)."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

pytestmark = pytest.mark.vllm


def test_flush_cache_resets_the_real_engines_prefix_cache(vllm_stack):
    servicer, _ = vllm_stack
    reply = servicer.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=60)
    assert reply.success and reply.message == "Local KV prefix cache flushed successfully"


@pytest.mark.parametrize("rpc, message", [("StartProfile", common_pb2.StartProfileRequest()),
                                          ("StopProfile", common_pb2.StopProfileRequest())])
def test_profiler_rpcs_are_refused_with_vllms_own_reason(vllm_stack, rpc, message):
    servicer, _ = vllm_stack
    with pytest.raises(grpc.RpcError) as error:
        getattr(servicer.stub, rpc)(message, timeout=60)
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "Profiling is not enabled" in error.value.details()

"""FlushCache, the profiler RPCs (the engine was launched without a profiler) and the engine's priority, against a real vLLM engine."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from enginelink.runtime.engine_process import ENGINE_NICE_DEFAULT, session_members
from tests.harness import engine_pid

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


def test_every_engine_process_runs_below_the_servicer(vllm_stack):
    """The launcher, EngineCore and the Worker busy-poll: all run ten nice levels below the servicer."""
    servicer, _ = vllm_stack
    launcher = engine_pid(servicer.journal)
    members = session_members(launcher)
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in members}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # comm is cut at 15 characters
    expected = min(19, os.getpriority(os.PRIO_PROCESS, servicer.process.pid) + ENGINE_NICE_DEFAULT)
    assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in members} == {pid: expected for pid in members}
    # The servicer waits for the engine to yield rather than preempt it; the engine keeps the normal policy.
    assert {pid: os.sched_getscheduler(pid) for pid in members} == {pid: os.SCHED_OTHER for pid in members}
    assert os.sched_getscheduler(servicer.process.pid) == os.SCHED_BATCH

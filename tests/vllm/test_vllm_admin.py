"""FlushCache, the profiler RPCs (the engine was launched without a profiler), the engine's priority and placement, against a real vLLM engine."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from enginelink.journal.records import KIND_ENGINE_FACTS, KIND_ENGINE_HANDSHAKE
from enginelink.journal.store import open_reader
from enginelink.runtime.engine.placement import ENGINE_NICE_DEFAULT, cpu_list
from enginelink.runtime.engine.engine_processes import engine_members
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
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Profiling is not enabled" in error.value.details()


def test_every_engine_process_runs_below_the_servicer(vllm_stack):
    """The launcher, EngineCore and the Worker run at the servicer's priority by default (issue 23)."""
    servicer, _ = vllm_stack
    launcher = engine_pid(servicer.journal)
    members = engine_members(launcher)
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in members}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # comm is cut at 15 characters
    # One engine, no DP: the launcher runs the EngineCore itself (one process importing vLLM less).
    cores = [pid for pid in members if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::EngineCor"]
    assert cores == [launcher], (cores, launcher)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, servicer.process.pid) + ENGINE_NICE_DEFAULT)
    assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in members} == {pid: expected for pid in members}
    # Everyone keeps the normal policy: SCHED_BATCH for the servicer is opt-in (ENGINELINK_SERVICER_SCHED=batch).
    assert {pid: os.sched_getscheduler(pid) for pid in members} == {pid: os.SCHED_OTHER for pid in members}
    assert os.sched_getscheduler(servicer.process.pid) == os.SCHED_OTHER


def test_the_servicer_and_engine_core_keep_off_the_cpu_the_worker_binds(vllm_stack):
    """vLLM's CPU backend binds the Worker's OpenMP thread (core 0 of 2) and leaves the rest to the
    front end: the servicer and EngineCore run there, so neither preempts the Worker mid-step."""
    servicer, _ = vllm_stack
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM binds its only CPU: nothing is left to place the front end on")
    with open_reader(servicer.journal) as reader:
        steps = [r.payload for r in reader.records(kinds=[KIND_ENGINE_HANDSHAKE])]
    placement = next(s["message"] for s in steps if s["step"] == "placement")
    bound, front_end = set(placement["bound_cpus"]), set(placement["front_end_cpus"])
    assert bound and front_end and not bound & front_end, placement
    assert bound | front_end == os.sched_getaffinity(0)
    threads = {}
    for pid in [servicer.process.pid, *engine_members(engine_pid(servicer.journal))]:
        process = Path(f"/proc/{pid}/comm").read_text().strip()
        for tid in os.listdir(f"/proc/{pid}/task"):
            threads[(process, int(tid))] = os.sched_getaffinity(int(tid))
    worker_main = [cpus for (process, tid), cpus in threads.items()
                   if process == "VLLM::Worker" and Path(f"/proc/{tid}/comm").read_text().strip() == "VLLM::Worker"]
    assert worker_main and all(cpus <= bound for cpus in worker_main), worker_main
    for (process, tid), cpus in threads.items():
        if process != "VLLM::Worker":  # the servicer, the launcher and EngineCore: every thread
            assert cpus == front_end, (process, tid, cpus)
    assert f"placement: the engine binds {cpu_list(bound)}; the servicer's" in servicer.log()


def test_the_generation_engine_refuses_embed_and_says_it_generates(vllm_stack):
    """The engine's own facts (runner_type "generate", from vLLM's resolved config) decide: Embed is UNIMPLEMENTED."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    servicer, _ = vllm_stack
    assert servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).is_generation is True
    with pytest.raises(grpc.RpcError) as error:
        servicer.stub.Embed(pb.EmbedRequest(request_id="embed-on-generate",
                                            tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])), timeout=60)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "generation model" in error.value.details()
    (facts,) = open_reader(servicer.journal).records(kinds=[KIND_ENGINE_FACTS])
    assert facts.payload["facts"]["runner_type"] == "generate"

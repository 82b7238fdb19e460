"""Lifecycle with a real vLLM engine: its engine core killed under load, and SIGTERM under load.

Each test starts its own servicer (it ends it). vLLM's headless launcher
spawns an EngineCore process, which spawns a Worker: all of them live in the
session enginelink started the launcher in, and none may outlive the servicer.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginelink.runtime.engine.engine_processes import ENGINE_STOP_GRACE_S
from enginelink.runtime.engine.engine_processes import engine_members
from tests.harness import Servicer, engine_pid, free_port, generate_request, scrape, wait_not_serving, wait_until
from tests.test_engine_stop import STOP_BOUND_OVER_GRACE_S
from tests.test_lifecycle import StreamReader
from tests.vllm.conftest import START_TIMEOUT_S, StoppedEngine, engine_core_pid, vllm_servicer

pytestmark = pytest.mark.vllm

PROMPT = [318, 283, 1552, 10, 90, 305]
# The model's whole context (max_position_embeddings 2048), twice the generation
# tests': a long request must still be running in the engine when the test acts
# (the kill, the drain's end). Alone it takes ~7 s here; 1000 tokens (~3.6 s)
# once finished before a SIGKILL landed on a loaded CI machine, because the
# servicer read the engine's queued outputs seconds late.
ENGINE_ARGS = ["--max-model-len", "2048", "--enforce-eager"]
LONG = 2040
# These servicers test what happens to them, not warm-up: skip it (~4 s each).
NO_WARMUP = {"SMG_VLLM_SERVICER_WARMUP": "off"}
DRAIN_S = 1.0


def in_flight(metrics_port: int) -> float:
    """The servicer's Generate calls in flight, from its metrics."""
    return sum(value for name, value in scrape(metrics_port).items()
               if name.startswith("smg_servicer_in_flight_requests{"))


def no_process_left(launcher: int) -> None:
    wait_until(lambda: not engine_members(launcher), 10, f"no process of the engine left {launcher}")


def test_engine_core_killed_under_load_fails_streams_and_exits_1(tmp_path, test_model_dir, vllm_python):
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "vllm", "--metrics-port", str(metrics_port)],
                        engine_args=ENGINE_ARGS, env=NO_WARMUP).start(timeout_s=START_TIMEOUT_S)
    engine = None
    try:
        launcher = engine_pid(servicer.journal)
        # The engine is stopped before the four calls come, and runs in short bursts until each stream has
        # its first tokens: the kill lands on four flowing streams, none of which can have ended (a CI box at
        # load 17 once let a 2040-token stream finish between its first token and the last reader's).
        engine = StoppedEngine(launcher)
        readers = [StreamReader(servicer.stub, generate_request(f"r-{i}", PROMPT, stream=True, temperature=0.0,
                                                                max_tokens=LONG, ignore_eos=True)) for i in range(4)]
        for reader in readers:
            reader.start()
        wait_until(lambda: in_flight(metrics_port) == 4, 60, "all four calls in flight in the servicer")
        engine.run_until(lambda: all(r.messages for r in readers), "every stream's first tokens at the client")
        assert in_flight(metrics_port) == 4
        assert not any(r.completes for r in readers), "a call finished before the kill"
        killed_at = time.monotonic()
        engine.kill_core()
        for reader in readers:
            reader.join(10)
        ended_within = time.monotonic() - killed_at
        for reader in readers:
            assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE, (
                f"{reader.request.request_id}: error {reader.error}, {len(reader.messages)} messages, "
                f"completes {[c.finish_reason for c in reader.completes]}\n{servicer.log()[-3000:]}"
            )
        assert ended_within < 1.5, f"streams took {ended_within:.2f} s to end"
        assert servicer.wait(30) == 1
        assert "engine link failed" in servicer.log()
        assert engine_members(launcher) == [], "processes of the engine outlived the servicer"
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        if engine is not None:
            engine.close()
        servicer.stop()


def test_sigterm_under_load_drains_then_exits_0(tmp_path, test_model_dir, vllm_python):
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "vllm", "--metrics-port", str(metrics_port)],
                        engine_args=ENGINE_ARGS,
                        env={**NO_WARMUP, "ENGINELINK_DRAIN_SECS": str(DRAIN_S)}).start(timeout_s=START_TIMEOUT_S)
    engine = None
    try:
        launcher = engine_pid(servicer.journal)
        # Stopped before the six calls come, the engine runs in short bursts until the three short ones
        # (8 tokens) are done, and stays stopped through the drain: the long ones (2040 tokens; the tiny
        # model writes them in a few seconds) are surely open when the drain's time runs out. (Loaded CI
        # boxes let a long stream finish first when the engine ran freely while the calls started.)
        engine = StoppedEngine(launcher)
        short = [StreamReader(servicer.stub, generate_request(f"short-{i}", PROMPT, stream=True, temperature=0.0,
                                                              max_tokens=8, ignore_eos=True)) for i in range(3)]
        long = [StreamReader(servicer.stub, generate_request(f"long-{i}", PROMPT, stream=True, temperature=0.0,
                                                             max_tokens=LONG, ignore_eos=True)) for i in range(3)]
        for reader in short + long:
            reader.start()
        wait_until(lambda: in_flight(metrics_port) == 6, 60, "all six calls in flight in the servicer")
        engine.run_until(lambda: all(r.completes for r in short) and all(r.messages for r in long),
                         "the short streams done and the long ones flowing")
        assert not any(r.completes for r in long), "a long call finished before the drain"
        assert len(engine_members(launcher)) >= 3  # launcher, EngineCore, Worker (and a resource tracker)
        signalled = time.monotonic()
        servicer.signal(signal.SIGTERM)
        wait_not_serving(servicer, 1.0, "readiness NOT_SERVING right after SIGTERM")
        wait_until(lambda: all(reader.completes for reader in long), DRAIN_S + 10,
                   "the long streams' abort at the drain's end", interval_s=0.02)
        engine.close()  # continued: the servicer stops it after the drain
        engine = None
        with pytest.raises(grpc.RpcError) as refused:
            list(servicer.stub.Generate(generate_request("late", PROMPT, max_tokens=4), timeout=5))
        # Refused while draining or stopping, or (sent after the front closed) by the closed port.
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (
            f"{refused.value.code()} {refused.value.details()!r}, {time.monotonic() - signalled:.1f} s after "
            f"SIGTERM; the servicer's log ends:\n{servicer.log()[-3000:]}")
        assert servicer.wait(40) == 0
        took = time.monotonic() - signalled
        # Issue 22: the servicer never exits before every process of its engine's
        # session is gone (a Worker was once left running, reparented to PID 1)...
        assert engine_members(launcher) == [], "processes of the engine outlived the servicer"
        # ...and the stop is bounded: the drain, then the engine stop's grace + 8 s (docs/running.md).
        assert took <= DRAIN_S + ENGINE_STOP_GRACE_S + STOP_BOUND_OVER_GRACE_S, f"SIGTERM to exit took {took:.1f} s"
        for reader in short + long:
            reader.join(5)
            assert reader.error is None, reader.error
        assert [c.finish_reason for r in short for c in r.completes] == ["length"] * 3
        assert [c.finish_reason for r in long for c in r.completes] == ["abort"] * 3
        no_process_left(launcher)
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        if engine is not None:
            engine.close()
        servicer.stop()


def test_servicer_sigkilled_leaves_no_engine_behind(tmp_path, test_model_dir, vllm_python):
    # No cleanup runs in a SIGKILLed servicer: the engine's launcher notices its
    # parent is gone and shuts down its EngineCore and Worker itself.
    servicer = vllm_servicer(tmp_path, test_model_dir, ENGINE_ARGS, env=NO_WARMUP).start(timeout_s=START_TIMEOUT_S)
    try:
        launcher = engine_pid(servicer.journal)
        assert len(engine_members(launcher)) >= 3  # launcher, EngineCore, Worker (and a resource tracker)
        servicer.process.send_signal(signal.SIGKILL)
        servicer.wait(10)
        wait_until(lambda: not engine_members(launcher), 30, "the engine gone after the servicer died")
    finally:
        servicer.stop()


def test_a_frozen_idle_engine_core_is_noticed_by_the_idle_probe(tmp_path, test_model_dir, vllm_python):
    # Issue 21: SIGSTOP the engine with nothing in flight and health stayed
    # SERVING for ever. vLLM's EngineCore answers the probe (is_sleeping) from
    # its busy loop: answered while it runs, unanswered once it is stopped.
    probe_s, timeout_s = 0.5, 5.0
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "vllm", "--metrics-port", str(metrics_port)],
                        engine_args=ENGINE_ARGS, env={
        **NO_WARMUP, "ENGINELINK_IDLE_PROBE_SECS": str(probe_s), "ENGINELINK_IDLE_PROBE_TIMEOUT_SECS": str(timeout_s),
    }).start(timeout_s=START_TIMEOUT_S)  # fmt: skip
    try:
        launcher = engine_pid(servicer.journal)
        core = engine_core_pid(launcher)

        def probes() -> float:
            return sum(v for k, v in scrape(metrics_port).items() if k.startswith("smg_servicer_link_idle_probes{"))

        wait_until(lambda: probes() >= 3, 30, "three probes answered by the real engine")
        health = health_pb2_grpc.HealthStub(servicer.channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == \
            health_pb2.HealthCheckResponse.SERVING
        os.kill(core, signal.SIGSTOP)
        assert servicer.wait(probe_s + timeout_s + 30) == 1
        assert "answered no liveness probe" in servicer.log()
        assert engine_members(launcher) == [], "processes of the engine outlived the servicer"
    finally:
        servicer.stop()

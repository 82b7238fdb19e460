"""Lifecycle with a real MLX engine: the engine SIGKILLed under load, SIGTERM under load.

Each test starts its own servicer. The MLX engine is one process (one
thread steps mlx-lm), in the session enginelink started it in.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from enginelink.runtime.engine.engine_processes import ENGINE_STOP_GRACE_S, engine_members
from tests.harness import engine_pid, wait_not_serving, wait_until
from tests.mlx.conftest import START_TIMEOUT_S, mlx_request as generate_request, mlx_servicer
from tests.test_engine_stop import STOP_BOUND_OVER_GRACE_S
from tests.test_lifecycle import StreamReader

pytestmark = pytest.mark.mlx

PROMPT = [318, 283, 1552, 10, 90, 305]
LONG = 2040  # the model's whole context: still running when the test acts
DRAIN_S = 1.0


def test_engine_killed_under_load_fails_every_stream_unavailable_and_exits_1(tmp_path, test_model_dir, mlx_python):
    servicer = mlx_servicer(tmp_path, test_model_dir).start(timeout_s=START_TIMEOUT_S)
    try:
        engine = engine_pid(servicer.journal)
        readers = [StreamReader(servicer.stub, generate_request(f"r-{i}", PROMPT, stream=True, temperature=0.0,
                                                                max_tokens=LONG, ignore_eos=True)) for i in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.started_streaming.wait(60)
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for reader in readers:
            reader.join(10)
        ended_within = time.monotonic() - killed_at
        for reader in readers:
            assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE, (
                f"{reader.request.request_id}: error {reader.error}, {len(reader.messages)} messages\n"
                f"{servicer.log()[-3000:]}")
        # The same bound as the vLLM engine's test (tests/vllm/test_vllm_lifecycle.py).
        assert ended_within < 1.5, f"streams took {ended_within:.2f} s to end"
        assert servicer.wait(30) == 1
        assert "engine link failed" in servicer.log()
        assert engine_members(engine) == []
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        servicer.stop()


def test_sigterm_under_load_drains_then_exits_0(tmp_path, test_model_dir, mlx_python):
    servicer = mlx_servicer(tmp_path, test_model_dir, env={"ENGINELINK_DRAIN_SECS": str(DRAIN_S)})
    servicer.start(timeout_s=START_TIMEOUT_S)
    try:
        engine = engine_pid(servicer.journal)
        short = [StreamReader(servicer.stub, generate_request(f"short-{i}", PROMPT, stream=True, temperature=0.0,
                                                              max_tokens=4, ignore_eos=True)) for i in range(3)]
        long = [StreamReader(servicer.stub, generate_request(f"long-{i}", PROMPT, stream=True, temperature=0.0,
                                                             max_tokens=LONG, ignore_eos=True)) for i in range(3)]
        for reader in short + long:
            reader.start()
        for reader in short + long:
            assert reader.started_streaming.wait(60)
        signalled = time.monotonic()
        servicer.signal(signal.SIGTERM)
        wait_not_serving(servicer, 1.0, "NOT_SERVING right after SIGTERM")
        with pytest.raises(grpc.RpcError) as refused:
            list(servicer.stub.Generate(generate_request("late", PROMPT, max_tokens=4), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.wait(40) == 0
        took = time.monotonic() - signalled
        assert took <= DRAIN_S + ENGINE_STOP_GRACE_S + STOP_BOUND_OVER_GRACE_S, f"SIGTERM to exit took {took:.1f} s"
        for reader in short + long:
            reader.join(5)
            assert reader.error is None, reader.error
        assert [c.finish_reason for r in short for c in r.completes] == ["length"] * 3
        assert [c.finish_reason for r in long for c in r.completes] == ["abort"] * 3
        wait_until(lambda: not engine_members(engine), 10, "no process of the engine left")
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        servicer.stop()

"""Lifecycle as an operator sees it: drain on SIGTERM, and the engine dying under load."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from tests.harness import Servicer, alive, engine_pid, generate_request, wait_not_serving

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

PROMPT = [318, 283, 1552, 10, 90, 305]
SLOW_ENGINE = ["--step-us", "20000"]  # 50 steps/s: long requests stay in flight


class StreamReader(threading.Thread):
    """Reads one streaming Generate to its end, keeping what arrived."""

    def __init__(self, stub, request) -> None:
        super().__init__(daemon=True)
        self.stub, self.request = stub, request
        self.messages = []
        self.error: grpc.RpcError | None = None
        self.started_streaming = threading.Event()

    def run(self) -> None:
        try:
            for message in self.stub.Generate(self.request):
                self.messages.append(message)
                self.started_streaming.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.started_streaming.set()

    @property
    def completes(self):
        return [m.complete for m in self.messages if m.HasField("complete")]


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=SLOW_ENGINE,
                        env={"ENGINELINK_DRAIN_SECS": "1.5"}).start()
    try:
        pid = engine_pid(servicer.journal)
        # Short calls finish inside the drain budget; long ones cannot.
        short = [StreamReader(servicer.stub, generate_request(f"short-{i}", PROMPT, stream=True,
                                                              max_tokens=20, ignore_eos=True)) for i in range(3)]
        long = [StreamReader(servicer.stub, generate_request(f"long-{i}", PROMPT, stream=True,
                                                             max_tokens=1500, ignore_eos=True)) for i in range(3)]
        for reader in short + long:
            reader.start()
        for reader in short + long:
            assert reader.started_streaming.wait(5)
        servicer.signal(signal.SIGTERM)
        wait_not_serving(servicer, 1.0, "readiness NOT_SERVING right after SIGTERM")
        with pytest.raises(grpc.RpcError) as refused:
            list(servicer.stub.Generate(generate_request("late", PROMPT, max_tokens=4)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert servicer.wait(20) == 0
        for reader in short + long:
            reader.join(5)
            assert reader.error is None, reader.error
        assert [c.finish_reason for r in short for c in r.completes] == ["length"] * 3
        assert [c.finish_reason for r in long for c in r.completes] == ["abort"] * 3
        assert not alive(pid), "engine process left behind"
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        servicer.stop()


def test_engine_killed_under_load_fails_streams_and_exits_1(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=SLOW_ENGINE).start()
    try:
        pid = engine_pid(servicer.journal)
        readers = [StreamReader(servicer.stub, generate_request(f"r-{i}", PROMPT, stream=True,
                                                                max_tokens=1500, ignore_eos=True)) for i in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.started_streaming.wait(5)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for reader in readers:
            reader.join(5)
        ended_within = time.monotonic() - killed_at
        for reader in readers:
            assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "exited" in reader.error.details()
        assert ended_within < 2.0, f"streams took {ended_within:.2f} s to end"
        assert servicer.wait(20) == 1
        assert "engine link failed" in servicer.log()
        assert servicer.socket_files() == [], "ipc socket files left behind"
    finally:
        servicer.stop()

"""The sim engine as a process, driven by a raw pyzmq front end on loopback.

Waits are bounded polls (an upper bound for a slow machine, never a sleep
the test depends on); the engine process is always ended by the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from enginelink.wire import vllm
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, SamplingSpec

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

WAIT_MS = 30_000  # generous: the child imports msgspec and pyzmq first
CODEC = vllm.VllmCodec()


def recv(socket: zmq.Socket) -> list[bytes]:
    assert socket.poll(WAIT_MS), "the sim engine did not answer in time"
    return socket.recv_multipart()


class FrontEnd:
    """Handshake ROUTER, input ROUTER and output PULL, all bound like vLLM's client."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.handshake, self.handshake_address = self._bind(zmq.ROUTER)
        self.inputs, self.inputs_address = self._bind(zmq.ROUTER)
        self.outputs, self.outputs_address = self._bind(zmq.PULL)

    def _bind(self, kind: int) -> tuple[zmq.Socket, str]:
        socket = self.ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        return socket, f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def handshake_engine(self) -> tuple[bytes, vllm.ReadyResponse]:
        identity, payload = recv(self.handshake)
        assert identity == b"\x00\x00"
        hello = vllm.decode_handshake_status(payload)
        assert (hello.status, hello.local, hello.headless) == ("HELLO", False, True)
        init = vllm.HandshakeInit(
            addresses=vllm.HandshakeAddresses(inputs=[self.inputs_address], outputs=[self.outputs_address])
        )
        self.handshake.send_multipart([identity, vllm.encode_handshake_init(init)])
        # The ready response and READY may come in either order.
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.inputs, zmq.POLLIN)
        ready = status = None
        while ready is None or status is None:
            events = dict(poller.poll(WAIT_MS))
            assert events, "handshake stalled"
            if self.inputs in events:
                who, payload = self.inputs.recv_multipart()
                assert who == identity
                ready = vllm.decode_ready_response(payload)
            if self.handshake in events:
                _, payload = self.handshake.recv_multipart()
                status = vllm.decode_handshake_status(payload)
        assert status.status == "READY"
        return identity, ready

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        self.inputs.send_multipart([identity, *frames])

    def next_batch(self) -> OutputBatch:
        return CODEC.decode_output(recv(self.outputs))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 512, "max_position_embeddings": 128, "eos_token_id": [2, 5]})
    )
    return tmp_path


@pytest.fixture
def front_end():
    fe = FrontEnd()
    yield fe
    fe.close()


def launch(front_end: FrontEnd, model_dir: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "enginelink.tools.sim_engine", "--handshake", front_end.handshake_address,
            "--model", str(model_dir), *extra]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(engine: subprocess.Popen) -> int:
    if engine.poll() is None:
        engine.send_signal(signal.SIGTERM)
    try:
        return engine.wait(timeout=WAIT_MS / 1000)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()
        raise


def test_handshake_generate_and_sigterm(front_end, model_dir):
    engine = launch(front_end, model_dir, "--max-num-seqs", "8", "--step-us", "50")
    try:
        identity, ready = front_end.handshake_engine()
        assert (ready.vllm_version, ready.max_model_len, ready.max_num_seqs) == ("0.32.0", 128, 8)
        assert (ready.block_size, ready.num_gpu_blocks, ready.data_parallel_rank) == (16, 8192, 0)

        front_end.send(identity, CODEC.encode_utility(1, "get_supported_tasks", ()))
        assert front_end.next_batch().utility.result == ["generate"]

        spec = GenerateSpec(
            request_id="r1",
            prompt_token_ids=list(range(3, 40)),
            sampling=SamplingSpec(max_tokens=6, ignore_eos=True, eos_token_ids=(2, 5)),
        )
        front_end.send(identity, CODEC.encode_add(spec))
        got, finish = [], None
        while finish is None:
            batch = front_end.next_batch()
            assert batch.stats is not None
            for out in batch.outputs:
                assert out.request_id == "r1"
                got += out.new_token_ids
                finish = out.finish_reason
        assert len(got) == 6 and finish == FinishReason.LENGTH
        assert batch.finished_requests == ["r1"]
    finally:
        status = stop(engine)
    assert status == 0, engine.stderr.read().decode()


def test_exits_when_told_to_stop_before_the_handshake(front_end, model_dir):
    engine = launch(front_end, model_dir)
    try:
        recv(front_end.handshake)  # HELLO arrived; never answer it
    finally:
        status = stop(engine)
    assert status == 0, engine.stderr.read().decode()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # an unreaped zombie has exited


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_exits_when_its_parent_dies(front_end, model_dir):
    # A middle process starts the engine, reports its pid, and exits when we
    # close its stdin; the engine must notice and exit rather than orphan.
    argv = [sys.executable, "-m", "enginelink.tools.sim_engine", "--handshake", front_end.handshake_address,
            "--model", str(model_dir)]  # fmt: skip
    middle_code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen({argv!r}, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", middle_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pid = int(middle.stdout.readline())
    try:
        recv(front_end.handshake)  # the engine is up and knows its parent
        middle.stdin.close()
        middle.wait(timeout=WAIT_MS / 1000)
        deadline = time.monotonic() + WAIT_MS / 1000
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the sim engine outlived its parent"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)

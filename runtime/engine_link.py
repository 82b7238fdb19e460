"""One engine link: sockets, the engine process, the handshake, and the receive loop.

Lifetime (one nursery): bind the handshake ROUTER (tcp on loopback, a port
the OS picks), the input ROUTER and the output PULL (ipc sockets in a private
0700 directory); launch the engine, which dials the handshake socket; HELLO →
init addresses → ready response (on the input socket) and READY (on the
handshake socket, in either order); then the link is up and the receive loop
decodes each output frame once, journals it as received, and hands it to the
hub. The engine process is watched: if it exits, or says ENGINE_CORE_DEAD,
the link fails and every open request ends with UNAVAILABLE.

Rules: no request I/O outside this file and the hub; the machine decides
state, this file only feeds it events; every handshake message is journaled.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Callable

import msgspec
import trio
import zmq

from enginelink.journal.records import (
    KIND_ENGINE_FACTS,
    KIND_ENGINE_FRAME,
    KIND_ENGINE_HANDSHAKE,
    KIND_ERROR,
    KIND_TRANSITION,
    engine_stream,
    link_stream,
)
from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.runtime.launchers import EngineLauncher
from enginelink.runtime.zmq_trio import make_socket, recv_multipart
from enginelink.wire import vllm as vllm_wire
from enginelink.wire.engine import EngineCodec, EngineDead, OutputBatch, WireError

# Frames handled per wake-up before yielding, so writers get to coalesce.
FRAMES_PER_WAKEUP = 64
# After SIGTERM, how long the engine gets before SIGKILL.
ENGINE_TERM_GRACE_S = 10.0
# The handshake is a one-off: polling it keeps the code simple.
HANDSHAKE_POLL_S = 0.01


class LinkFailed(Exception):
    """The engine link failed; the message says why (whose fault: the engine's)."""


def socket_dir() -> Path:
    """The private directory for ipc sockets (``SMG_ZMQ_SOCKET_DIR`` honoured)."""
    configured = os.environ.get("SMG_ZMQ_SOCKET_DIR")
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"smg-zmq-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


class EngineLink:
    def __init__(
        self,
        *,
        name: str,
        launcher: EngineLauncher,
        codec: EngineCodec,
        journal,
        startup_timeout_s: float,
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.codec = codec
        self.journal = journal
        self.startup_timeout_s = startup_timeout_s
        self.machine = LinkMachine(name, trio.current_time())
        self.ready: dict = {}
        self.process: trio.Process | None = None
        self.on_batch: Callable[[OutputBatch, float], None] = lambda batch, now: None
        self.on_failure: Callable[[str, float], None] = lambda message, now: None
        self._context = zmq.Context.instance()
        self._identity = b"\x00\x00"
        self._input: zmq.Socket | None = None
        self._paths: list[Path] = []
        self._next_call_id = 1
        self._utility_waiters: dict[int, tuple[trio.Event, list]] = {}
        self.frames_received = 0

    # -- public --------------------------------------------------------------------

    def send(self, frames: list[bytes]) -> None:
        """Send one request frame set to the engine; never blocks."""
        if self._input is None:
            raise LinkFailed("engine link is not connected")
        self._input.send_multipart([self._identity, *frames], zmq.NOBLOCK)

    def step(self, event: LinkEvent, reason: str | None = None) -> None:
        now = trio.current_time()
        transition = self.machine.handle(event, now, reason)
        payload = transition.payload()
        if reason:
            payload["reason"] = reason
        self.journal.append(now, link_stream(self.name), KIND_TRANSITION, payload)

    async def utility(self, method: str, args: list, timeout_s: float) -> object:
        """Call an engine utility method; raises LinkFailed on failure or timeout."""
        call_id = self._next_call_id
        self._next_call_id += 1
        done = trio.Event()
        box: list = []
        self._utility_waiters[call_id] = (done, box)
        try:
            self.send(self.codec.encode_utility(call_id, method, args))
            with trio.move_on_after(timeout_s):
                await done.wait()
        finally:
            self._utility_waiters.pop(call_id, None)
        if not box:
            raise LinkFailed(f"engine did not answer {method} within {timeout_s:g} s")
        reply = box[0]
        if reply.failure:
            raise LinkFailed(f"engine refused {method}: {reply.failure}")
        return reply.result

    # -- lifetime ------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind, launch, handshake (then ``started``), receive until the engine goes."""
        handshake = make_socket(self._context, zmq.ROUTER)
        inputs = make_socket(self._context, zmq.ROUTER)
        outputs = make_socket(self._context, zmq.PULL)
        inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            port = handshake.bind_to_random_port("tcp://127.0.0.1")
            base = socket_dir() / f"enginelink-{os.getpid()}-{self.name}"
            in_path, out_path = Path(f"{base}-in.sock"), Path(f"{base}-out.sock")
            self._paths = [in_path, out_path]
            inputs.bind(f"ipc://{in_path}")
            outputs.bind(f"ipc://{out_path}")
            argv, env = self.launcher.command(f"tcp://127.0.0.1:{port}")
            self._journal_handshake("launch", {"argv": self.launcher.redacted(argv), "handshake_port": port})
            async with trio.open_nursery() as nursery:
                self.process = await trio.lowlevel.open_process(
                    argv, env={**os.environ, **env}, start_new_session=True
                )
                nursery.start_soon(self._watch_process)
                with trio.fail_after(self.startup_timeout_s):
                    await self._handshake(handshake, inputs, f"ipc://{in_path}", f"ipc://{out_path}")
                self._input = inputs
                self.step(LinkEvent.HANDSHAKE_DONE)
                task_status.started()
                await self._receive_loop(outputs)
        except trio.TooSlowError:
            self._fail(f"engine did not complete the handshake within {self.startup_timeout_s:g} s")
            raise LinkFailed(self.machine.failure) from None
        finally:
            self._input = None
            for sock in (handshake, inputs, outputs):
                sock.close(linger=0)
            await self.stop_engine()
            for path in self._paths:
                path.unlink(missing_ok=True)

    async def stop_engine(self) -> None:
        """SIGTERM the engine's process group, SIGKILL after a grace period."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        with trio.CancelScope(shield=True):
            _signal_group(process, signal.SIGTERM)
            with trio.move_on_after(ENGINE_TERM_GRACE_S):
                await process.wait()
            if process.returncode is None:
                _signal_group(process, signal.SIGKILL)
                await process.wait()

    # -- internals -----------------------------------------------------------------

    def _journal_handshake(self, step: str, message: dict) -> None:
        self.journal.append(
            trio.current_time(), link_stream(self.name), KIND_ENGINE_HANDSHAKE, {"step": step, "message": message}
        )

    async def _handshake(self, handshake, inputs, in_address: str, out_address: str) -> None:
        identity, payload = await recv_multipart(handshake)
        hello = msgspec.msgpack.decode(payload)
        self._journal_handshake("hello", hello)
        if not isinstance(hello, dict) or hello.get("status") != "HELLO":
            raise LinkFailed(f"engine sent {hello!r} instead of HELLO on the handshake socket")
        self._identity = identity
        init = vllm_wire.encode_handshake_init(
            vllm_wire.HandshakeInit(addresses=vllm_wire.HandshakeAddresses(inputs=[in_address], outputs=[out_address]))
        )
        handshake.send_multipart([identity, init])
        self._journal_handshake("init", {"inputs": [in_address], "outputs": [out_address]})
        # The ready response (input socket) and READY (handshake socket) come
        # within the same 0.1 s, in either order: poll both.
        got_ready = got_ready_response = False
        while not (got_ready and got_ready_response):
            if not got_ready_response:
                try:
                    _, payload = inputs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    self.ready = msgspec.msgpack.decode(payload)
                    self._journal_handshake("ready", self.ready)
                    got_ready_response = True
            if not got_ready:
                try:
                    _, payload = handshake.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    message = msgspec.msgpack.decode(payload)
                    self._journal_handshake("READY", message)
                    got_ready = isinstance(message, dict) and message.get("status") == "READY"
            await trio.sleep(HANDSHAKE_POLL_S)
        self.journal.append(
            trio.current_time(),
            link_stream(self.name),
            KIND_ENGINE_FACTS,
            {"link": self.name, "pid": self.process.pid if self.process else None, "facts": self.ready},
        )

    async def _receive_loop(self, outputs: zmq.Socket) -> None:
        journal_append = self.journal.append
        decode = self.codec.decode_output
        stream = engine_stream(0)
        while True:
            frames = await recv_multipart(outputs)
            handled = 0
            while frames is not None:
                now = trio.current_time()
                self.frames_received += 1
                journal_append(now, stream, KIND_ENGINE_FRAME, frames[0])
                try:
                    batch = decode(frames)
                except WireError as error:
                    self._fail(f"engine sent a frame enginelink cannot read: {error}")
                    return
                if isinstance(batch, EngineDead):
                    self._fail("engine reported ENGINE_CORE_DEAD")
                    return
                if batch.utility is not None:
                    waiter = self._utility_waiters.get(batch.utility.call_id)
                    if waiter is not None:
                        waiter[1].append(batch.utility)
                        waiter[0].set()
                if batch.outputs:
                    self.on_batch(batch, now)
                handled += 1
                if handled >= FRAMES_PER_WAKEUP:
                    break
                try:
                    frames = outputs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    frames = None
            await trio.lowlevel.checkpoint()

    async def _watch_process(self) -> None:
        process = self.process
        await process.wait()
        if self.machine.live:
            self._fail(f"engine process {process.pid} exited with status {process.returncode}")

    def _fail(self, message: str) -> None:
        if not self.machine.live:
            return
        now = trio.current_time()
        self.journal.append(now, link_stream(self.name), KIND_ERROR, {"whose": "engine", "code": "UNAVAILABLE", "message": message})
        self.step(LinkEvent.FAIL, message)
        self.on_failure(message, now)


def _signal_group(process: trio.Process, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass

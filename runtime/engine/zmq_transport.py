"""The ZeroMQ transport of an engine link: vLLM's headless wire (and TokenSpeed's and the MLX engine's).

Its part of the link's lifetime (``EngineLink.run`` calls it):

- ``start``: remove stale ipc socket files (only those nothing live is bound
  to); bind the handshake ROUTER, the input ROUTER and the output PULL (ipc
  sockets in a private 0700 directory; a TCP handshake on loopback for an
  engine that dials only TCP); launch the engine in its own process group
  (``EngineLink.launch``: its output relayed with secrets hidden, its
  process watched, its start-up bounded), which dials the handshake socket;
  feed every rank's handshake messages (HELLO → init addresses → ready
  response on the input socket and READY on the handshake socket, in either
  order) to the link's handshake machine; read the engine's facts file;
  close the handshake socket (nobody may reach it any more);
- ``send``: one request frame set to one DP rank's identity, never blocking
  (``ROUTER_MANDATORY``: an unknown identity raises);
- ``receive``: the receive loop, each output frame handed to the link once;
- ``wait_disconnected``: returns when the engine's connection to the output
  socket dropped (a socket monitor; only connections that completed the
  ZMTP handshake count, so a stranger probing for stale files is ignored);
- ``stop_process``: all of the engine's processes stopped, bounded;
- ``close``: close every socket; ``remove_files``: remove its files.

Frames from anyone but the engine on the handshake socket are ignored and
journaled (``runtime/engine/handshake_gate.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from enginelink.runtime.engine.engine_processes import process_state, stop_engine_processes

from enginelink.runtime.engine.socket_files import SOCKET_PREFIX, remove_stale_files, socket_dir
from enginelink.runtime.engine.handshake_gate import (
    HANDSHAKE_MESSAGE_MAX_BYTES,
    HandshakeGate,
    bound_handshake_socket,
    bound_input_socket,
    poll_engine_from,
    receive_from_engine,
)
from enginelink.runtime.engine.link_errors import LinkFailed
from enginelink.runtime.engine.zmq_trio import has_message, make_socket, recv_multipart, wait_fd

log = logging.getLogger("enginelink.link")

# Frames handled per wake-up before yielding, so writers get to coalesce.
FRAMES_PER_WAKEUP = 64
# ... and the engine outputs those frames may carry together before the loop yields: an output's fan-out
# costs microseconds (about ten with top-20 logprobs on a slow core, tens when it carries a long
# prompt's logprobs), so 64 frames of 256 sequences asking for logprobs held the event loop a quarter
# of a second against a zero-cost engine (issue 38); 256 is one full batch of 256 sequences. A frame is
# never split: one frame of any size per wake-up, as at a real engine's pace; a zero-cost engine's
# small frames (2-3 outputs each) never reach it.
OUTPUTS_PER_WAKEUP = 256
# ... and, opt-in, the longest a wake-up may hold its frames' writes (RequestHub.hold_writes) while it
# reads more: ENGINELINK_HELD_WRITES_BUDGET_MS (default 0: no bound but the two counts). Why: a
# servicer behind a real engine (a saturated machine: docs/benchmarks-history.md, issue 36) found dozens of
# frames per wake-up, each carrying a finished call or two, and wrote nothing, not even those
# calls' completes, until it had read them all; meanwhile the next calls could not come in, and the
# engine ran 20 of 32 requests. Past the budget the wake-up writes what it read and yields
# (handlers admit the next calls), then reads on. Opt-in until a quiet machine measures it: each
# write it adds costs CPU, and on the saturated box its effect was lost in the noise.
HELD_WRITES_BUDGET_ENV = "ENGINELINK_HELD_WRITES_BUDGET_MS"


def held_writes_budget_s(env=os.environ) -> float:
    """The budget in seconds (infinite when 0 or unset); ValueError names the knob."""
    raw = env.get(HELD_WRITES_BUDGET_ENV, "").strip()
    try:
        ms = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{HELD_WRITES_BUDGET_ENV}={raw!r}: expected milliseconds (0: off)") from None
    if ms < 0:
        raise ValueError(f"{HELD_WRITES_BUDGET_ENV}={raw!r}: must not be negative")
    return ms / 1000 if ms else float("inf")


def _budget_at_import() -> float:
    # Read at import (every entry point: serve, the vLLM plugin, headless) and never raising here: the CLI
    # imports this module to build its parser, and `enginelink serve` refuses a bad value at start
    # (exit 2 naming the knob, tools/serve.py) instead of a traceback from an import.
    try:
        return held_writes_budget_s()
    except ValueError:
        return float("inf")


# Read by each wake-up (this module's receive_frames, MemoryTransport.receive), so a test may set it.
HELD_WRITES_BUDGET_S = _budget_at_import()
# The handshake is a one-off: polling it keeps the code simple.
HANDSHAKE_POLL_S = 0.01
# Where the link asks an engine to write the config facts its ready response lacks.
ENGINE_FACTS_ENV = "ENGINELINK_ENGINE_FACTS"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
for _event in _HANDSHAKE_FAILED:
    MONITOR_EVENTS |= _event


def link_paths(name: str, *suffixes: str) -> list[Path]:
    """This process's socket files of link ``name`` (``enginelink-<pid>-<name>-<suffix>``), stale ones removed first."""
    directory = socket_dir()
    for path in remove_stale_files(directory):
        log.info("removed stale %s (nothing was bound to it)", path)
    base = directory / f"{SOCKET_PREFIX}{os.getpid()}-{name}"
    return [Path(f"{base}-{suffix}") for suffix in suffixes]


async def receive_frames(outputs: zmq.Socket, link) -> None:
    """Hand each output frame to the link until it says the link failed.

    Asks EVENTS before each read instead of reading until zmq.Again: at one
    frame per wake-up (every engine step) the loop then costs one trio step
    and no exception per frame, where it cost two and three."""
    fd = outputs.getsockopt(zmq.FD)
    clock = trio.current_time
    while True:
        handled = 0
        over_budget = False
        started = clock()
        link.wakeup_outputs = 0  # counted by link.handle_frames
        while handled < FRAMES_PER_WAKEUP and link.wakeup_outputs < OUTPUTS_PER_WAKEUP and has_message(outputs):
            try:
                frames = outputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # EVENTS said a message was there; do not trust it blindly
                break
            if not link.handle_frames(frames):
                link.on_frames_done(clock())
                return
            handled += 1
            if clock() - started >= HELD_WRITES_BUDGET_S:
                over_budget = True
                break
        if handled:
            link.last_frame_at = clock()
            link.on_frames_done(link.last_frame_at)
        if handled == FRAMES_PER_WAKEUP or link.wakeup_outputs >= OUTPUTS_PER_WAKEUP or over_budget:
            await trio.lowlevel.checkpoint()  # more waiting: let the writers and handlers run first
        else:
            await wait_fd(fd)


async def wait_disconnected(monitor: zmq.Socket) -> None:
    """Return when a connection that completed the ZMTP handshake drops.

    A bare connect (another process probing for stale socket files) fails its
    handshake and is ignored. Events queue in the monitor from before the
    launch, so they are read here in the order they happened."""
    unresolved: list[int] = []  # accepted fds, oldest first, handshake not yet done
    engine_fds: set[int] = set()
    while True:
        event = parse_monitor_message(await recv_multipart(monitor))
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            unresolved.append(value)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if unresolved:
                engine_fds.add(unresolved.pop(0))
        elif kind in _HANDSHAKE_FAILED:
            if unresolved:
                unresolved.pop(0)
        elif kind == zmq.EVENT_DISCONNECTED:
            if value in unresolved:
                unresolved.remove(value)
            if value in engine_fds:
                return


class IpcSockets:
    """An engine's ipc sockets and files, as both ZeroMQ transports own them: made, watched, closed, removed."""

    def __init__(self) -> None:
        self._context = zmq.Context.instance()
        self._sockets: list[zmq.Socket] = []
        self.paths: list[Path] = []
        self.outputs: zmq.Socket | None = None  # the output PULL, once the engine is up
        self._monitor: zmq.Socket | None = None

    def socket(self, kind: int) -> zmq.Socket:
        sock = make_socket(self._context, kind)
        self._sockets.append(sock)
        return sock

    def watch(self, outputs: zmq.Socket) -> None:
        """Monitor the output socket's connections (``wait_disconnected``), from before the launch."""
        self._monitor = outputs.get_monitor_socket(MONITOR_EVENTS)
        self._sockets.append(self._monitor)

    async def receive(self, link) -> None:
        await receive_frames(self.outputs, link)

    async def wait_disconnected(self) -> None:
        await wait_disconnected(self._monitor)

    def close(self) -> None:
        """Close every socket (before the engine is stopped, so nothing more is sent to it)."""
        self.outputs = None
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []

    def remove_files(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)


# An engine says HELLO within seconds of its start (vLLM's EngineCore before it loads the model), so a
# handshake still silent this long is journaled, and again at twice the wait, up to the last report.
HELLO_WAIT_REPORT_S = 30.0
HELLO_WAIT_LAST_REPORT_S = 960.0


async def first_from_engine(link, handshake: zmq.Socket, gate: HandshakeGate) -> tuple[bytes, bytes]:
    """The engine's first handshake message; while none comes, a journaled ``waiting`` step now and then
    that says what the wait looks like from here (the engine's process state, the handshake file), so a
    start that hangs before its HELLO can be told apart from one that is slow. Not progress: the
    start-up bound runs on."""
    report_after_s, waited_s = HELLO_WAIT_REPORT_S, 0.0
    while True:
        with trio.move_on_after(report_after_s - waited_s):
            return await receive_from_engine(handshake, gate)
        waited_s = report_after_s
        pid = link.process.pid if link.process is not None else None
        endpoint = handshake.getsockopt_string(zmq.LAST_ENDPOINT)
        seen = {"after_s": waited_s, "engine_pid": pid, "engine_state": process_state(pid) if pid else None,
                "handshake": endpoint}  # fmt: skip
        if endpoint.startswith("ipc://"):
            seen["handshake_file"] = Path(endpoint[len("ipc://"):]).is_socket()
        link.journal_handshake("waiting", seen, progress=False)
        log.info("no HELLO from engine %s %g s after its launch (process state %s, handshake %s%s)", pid,
                    waited_s, seen["engine_state"], endpoint,
                    "" if seen.get("handshake_file", True) else ": its socket file is gone")  # fmt: skip
        if report_after_s >= HELLO_WAIT_LAST_REPORT_S:
            return await receive_from_engine(handshake, gate)
        report_after_s *= 2


class ZmqTransport:
    """vLLM's headless wire over ipc sockets, to an engine process in its own process group."""

    idle_probes = True  # the wire has a side-effect-free utility call (machines/liveness.py)

    def __init__(self, launcher) -> None:
        self.launcher = launcher
        self.ipc = IpcSockets()
        self._input: zmq.Socket | None = None
        self._identities: dict[int, bytes] = {}

    async def start(self, link, nursery: trio.Nursery) -> LinkFailed | None:
        """Bind, launch, handshake; the failure if the engine did not come up."""
        ipc = self.ipc
        handshake, inputs, outputs = ipc.socket(zmq.ROUTER), ipc.socket(zmq.ROUTER), ipc.socket(zmq.PULL)
        inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bound_input_socket(inputs)
        in_path, out_path, hs_path, facts_path = ipc.paths = link_paths(
            link.name, "in.sock", "out.sock", "hs.sock", "facts.json")
        link.facts_path = facts_path
        facts_path.unlink(missing_ok=True)
        bound_handshake_socket(handshake)
        hs_address = f"ipc://{hs_path}"
        if getattr(self.launcher, "handshake_transport", "ipc") == "tcp":
            # An engine that dials only TCP (TokenSpeed: --data-parallel-address/-rpc-port):
            # a loopback port, the one the launcher pins or a free one; its INIT still names
            # the ipc data sockets.
            handshake.bind(f"tcp://127.0.0.1:{getattr(self.launcher, 'handshake_port', None) or '*'}")
            hs_address = handshake.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            handshake.bind(hs_address)
        inputs.bind(f"ipc://{in_path}")
        outputs.bind(f"ipc://{out_path}")
        ipc.watch(outputs)
        argv, env = self.launcher.command(hs_address)
        await link.launch(nursery, argv, {**env, ENGINE_FACTS_ENV: str(facts_path)},
                          {"handshake": hs_address, "handshake_message_max_bytes": HANDSHAKE_MESSAGE_MAX_BYTES})
        failure = await link.run_handshake(
            lambda: self._handshake(link, handshake, inputs, f"ipc://{in_path}", f"ipc://{out_path}"))
        # The engine is up (or gone): nobody may reach the handshake socket any more.
        handshake.close(linger=0)
        hs_path.unlink(missing_ok=True)
        if failure is not None:
            return failure
        link.read_facts(facts_path)
        failure = link.check_compatible()
        if failure is None:
            self._identities = {rank: link.handshake_wire.identity(rank) for rank in link.ranks.ranks}
            self._input, ipc.outputs = inputs, outputs
        return failure

    def send(self, frames: list[bytes], rank: int) -> None:
        if self._input is None:
            raise LinkFailed("engine link is not connected")
        identity = self._identities.get(rank)
        if identity is None:
            raise LinkFailed(f"the engine has no DP rank {rank}")
        self._input.send_multipart([identity, *frames], zmq.NOBLOCK)

    async def receive(self, link) -> None:
        await self.ipc.receive(link)

    async def wait_disconnected(self) -> None:
        await self.ipc.wait_disconnected()

    async def stop_process(self, process, grace_s: float) -> None:
        """Stop all of the engine, bounded (``engine_processes.stop_engine_processes``); we never outlive it."""
        await stop_engine_processes(process, grace_s)

    def close(self) -> None:
        self._input = None
        self.ipc.close()

    def remove_files(self) -> None:
        self.ipc.remove_files()

    async def _handshake(self, link, handshake, inputs, in_address: str, out_address: str) -> None:
        machine = link.new_handshake(in_address, out_address)
        gate = HandshakeGate(link.process.pid, link.journal_handshake, machine.identities, machine.is_hello)
        try:
            await self._handshake_with(link, machine, gate, handshake, inputs)
        finally:
            summary = gate.summary()
            if summary is not None:
                link.journal_handshake("strangers", summary)

    @staticmethod
    async def _handshake_with(link, machine, gate: HandshakeGate, handshake, inputs) -> None:
        """Feed the machine every rank's messages until it is done (``machines/handshake.py``).

        The ranks start together and their steps interleave, so each message is
        filed by the identity that sent it; a rank's ready response and READY
        come within the same 0.1 s in either order, so both sockets are polled.
        """

        def send_init(identity: bytes, payload: bytes) -> None:
            handshake.send_multipart([identity, payload])

        first = await first_from_engine(link, handshake, gate)  # nothing to poll for before the first HELLO
        while machine.done is None:
            judged = first or poll_engine_from(handshake, gate)
            first = None
            if judged is not None:
                link.apply_handshake(machine.on_status(*judged), send_init)
            response = poll_engine_from(inputs, gate) if machine.done is None else None
            if response is not None:
                link.apply_handshake(machine.on_ready_response(*response), send_init)
            if judged is None and response is None:
                await trio.sleep(HANDSHAKE_POLL_S)

"""An engine link in memory: the sim engine core behind the real vLLM wire, on trio's clock.

What it is for: deterministic simulation of the whole servicer (``tests/sim``).
``MemoryLink(...)`` is an ``EngineLink`` whose transport (``MemoryTransport``)
is memory instead of ZMQ sockets and whose engine process is a trio task
instead of a process. Only the transport is replaced: handshake journaling,
``step``, ``utility``, the frame handling and every watch of the supervision
(start-up bound, process, dropped connection, silence, idle probe:
``supervision.py``) are the production link's own code, so the simulation
exercises them.

Theory of operation:
- the wire: ``send`` puts the frames the hub's ``VllmCodec`` encoded on a
  bounded channel; the engine task decodes them with the engine side of
  ``wire/vllm.py`` (``SimEngineCore.handle_input``) and puts the core's
  encoded output frames on a second bounded channel, which the link's
  receive loop journals and decodes exactly as ``EngineLink`` does. With
  ``latency_s`` each frame arrives that much later, in order, both ways;
- the engine task is ``tools/sim_engine.py``'s loop on trio's clock: read
  every input already there, step the core when the last step's cost has
  passed, else wait for an input or that moment. Under ``MockClock`` the
  cost model (``SimConfig.step_us``, ``prefill_us_per_token``) is virtual
  time, so a run is exact and instant;
- the handshake goes over a third pair of channels with the real messages
  (HELLO, init, ready response, READY; each tagged with the socket it
  would come on), after ``startup_delay_s``, and the link feeds them to the
  same handshake machine as ``EngineLink`` (``machines/handshake.py``).

Faults (call them from a trio task; each is what the engine would do):
``kill(status)`` the engine process exits (the watcher fails the link);
``core_dead()`` it sends ENGINE_CORE_DEAD, then exits; ``silence()`` it stops
reading and answering but stays alive (the silence supervision must notice);
``garbage()`` one output frame no codec can read; ``stray()`` one well-formed
frame for engine ids nobody asked for (late outputs); ``disconnect()`` the
engine core exits while its launcher process lives (vLLM's EngineCore
killed): its sockets close, so sends to it fail as ROUTER_MANDATORY makes
them fail, and the transport reports the dropped connection to the
supervision (``wait_disconnected``), which fails the link after
``DISCONNECT_GRACE_S``;
``hang_startup`` (a constructor flag) it never sends its ready response;
``poison_token`` (an option) an ADD whose prompt holds that token kills the
engine as a segfault would (status -11), at every start it is sent to;
``starts_ok`` (an option) only that many starts come up, every later one
dies before its ready response (an engine that cannot start again).

Restarts (docs/resume.md): every ``start`` is a new engine process: fresh
channels, a fresh sim core (an empty prefix cache), a new pid
(``MemoryEngineOptions.pid`` + the starts before it), as a relaunch would
be; the test bookkeeping (``engine_tokens`` per ADD, ``send_seq``, frame
counts) spans them all.

Rules: no I/O, no threads, time only from ``trio.current_time()``; every
channel is bounded; ``engine_tokens`` (what the engine produced, per ADD) is
bookkeeping for tests and never read by the servicer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import trio
import zmq

from enginelink.machines.sim_core import SimConfig, SimEngineCore, SimHooks, ready_response
from enginelink.runtime.engine.engine_link import EngineLink
from enginelink.runtime.engine.link_errors import LinkFailed
from enginelink.runtime.engine.supervision import Supervision
from enginelink.runtime.engine import zmq_transport
from enginelink.runtime.engine.zmq_transport import FRAMES_PER_WAKEUP, OUTPUTS_PER_WAKEUP
from enginelink.wire import vllm
from enginelink.wire.engine import EngineDead, WireError

# Frames in flight per direction; the real sockets' default high-water mark.
FRAMES_IN_FLIGHT_MAX = 1000
# What a garbage frame looks like: 0xc1 is never valid msgpack.
GARBAGE_FRAME = b"\xc1enginelink-sim-garbage"
# The status an engine killed by a signal exits with (SIGKILL).
KILLED_STATUS = -9
# The status of an engine a poison request crashed (SIGSEGV).
POISONED_STATUS = -11


@dataclass
class MemoryEngineOptions:
    startup_delay_s: float = 0.0  # between the handshake init and the ready response
    latency_s: float = 0.0  # one-way wire latency, both directions
    hang_startup: bool = False  # never send the ready response (process stays alive)
    pid: int = 4242  # the engine "process" id the journal records (a restart's: + the starts before it)
    poison_token: int | None = None  # an ADD whose prompt holds it kills the engine (status -11)
    starts_ok: int | None = None  # None: every start comes up; else the later ones die before ready
    argv: list[str] = field(default_factory=lambda: ["enginelink", "sim-engine", "--in-memory"])


class _SimProcess:
    """What the link and its supervision read of a ``trio.Process``: pid, returncode, wait()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._gone = trio.Event()

    def exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._gone.set()

    async def wait(self) -> int:
        await self._gone.wait()
        return self.returncode


def MemoryLink(*, name: str, config: SimConfig, journal, supervision: Supervision | None = None,
               options: "MemoryEngineOptions | None" = None, hooks: SimHooks | None = None,
               transport: "MemoryTransport | None" = None) -> EngineLink:
    """An ``EngineLink`` to the sim core in memory (its transport: ``link.transport``, with the faults)."""
    transport = transport or MemoryTransport(config, options, hooks)
    link = EngineLink(name=name, codec=vllm.VllmCodec(), journal=journal, supervision=supervision,
                      transport=transport)
    link.expected_ranks = (config.engine_index,)  # one engine core, one rank
    return link


class MemoryTransport:
    # The sim core answers vLLM's side-effect-free utility call: the idle probe runs, as in production.
    idle_probes = True

    def __init__(self, config: SimConfig, options: MemoryEngineOptions | None = None,
                 hooks: SimHooks | None = None) -> None:
        self.config = config
        self.options = options or MemoryEngineOptions()
        self.hooks = hooks
        self.link: EngineLink | None = None
        self.starts = 0
        self._new_engine()
        self.send_seq = 0
        # Test bookkeeping: tokens the engine produced per ADD (by send sequence number).
        self.engine_tokens: dict[int, list[int]] = {}
        self.frames_sent_by_engine = 0
        self.inputs_refused = 0  # inputs the engine could not take (WireError), as sim_engine logs them

    def _new_engine(self) -> None:
        """A new engine process's state: its core, its wire, its flags (each start has its own)."""
        self.core = SimEngineCore(self.config, self.hooks)
        self.process: _SimProcess | None = None
        self._connected = False
        self._engine_scope: trio.CancelScope | None = None
        self._engine_running = False
        self._core_gone = False  # the engine core exited, its launcher lives on (``disconnect``)
        self._disconnected = trio.Event()
        self._exit_status = 0
        self._silent = False
        # Each direction: (due time, item) on the wire, delivered in order once due.
        # Inputs are (send sequence number, frames): the number ties an ADD to what the engine made of it.
        self._to_engine_tx, self._to_engine_wire = trio.open_memory_channel(FRAMES_IN_FLIGHT_MAX)
        self._engine_inbox_tx, self._engine_inbox = trio.open_memory_channel(FRAMES_IN_FLIGHT_MAX)
        self._from_engine_tx, self._from_engine_wire = trio.open_memory_channel(FRAMES_IN_FLIGHT_MAX)
        self._link_inbox_tx, self._link_inbox = trio.open_memory_channel(FRAMES_IN_FLIGHT_MAX)
        self._hs_to_link_tx, self._hs_to_link_rx = trio.open_memory_channel(4)
        self._hs_to_engine_tx, self._hs_to_engine_rx = trio.open_memory_channel(4)
        self._engine_current: dict[str, int] = {}

    # -- the transport ---------------------------------------------------------------

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        """Send one request frame set to the engine; never blocks (as a NOBLOCK socket send).

        One engine core, one rank (its ``engine_index``): the simulation runs no DP."""
        if not self._connected:
            raise LinkFailed("engine link is not connected")
        if rank != self.config.engine_index:
            raise LinkFailed(f"the engine has no DP rank {rank}")
        if self._core_gone or (self.process is not None and self.process.returncode is not None):
            # The ROUTER (ROUTER_MANDATORY) no longer knows the engine's identity.
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        seq = self.send_seq + 1
        try:
            self._to_engine_tx.send_nowait((trio.current_time() + self.options.latency_s, (seq, list(frames))))
        except trio.WouldBlock:
            raise zmq.Again() from None
        self.send_seq = seq

    async def start(self, link: EngineLink, nursery: trio.Nursery) -> LinkFailed | None:
        """Launch the engine task and hand-shake; the failure if it did not come up."""
        self.link = link
        opts = self.options
        if self.starts:
            self._new_engine()
        self.starts += 1
        link.journal_handshake("launch", {"argv": list(opts.argv), "handshake_port": 0})
        self.process = _SimProcess(opts.pid + self.starts - 1)
        link.adopt(nursery, self.process)
        nursery.start_soon(self._deliver, self._to_engine_wire, self._engine_inbox_tx)
        nursery.start_soon(self._deliver, self._from_engine_wire, self._link_inbox_tx)
        nursery.start_soon(self._engine_process)
        failure = await link.run_handshake(self._handshake)
        if failure is not None:
            return failure
        link.read_facts(None)
        failure = link.check_compatible()
        if failure is None:
            self._connected = True
        return failure

    async def receive(self, link: EngineLink) -> None:
        """``zmq_transport.receive_frames`` reading the memory channel: the same frame and output caps and the same
        opt-in held-writes budget (``ENGINELINK_HELD_WRITES_BUDGET_MS``) end a wake-up. Under trio's
        ``MockClock`` a wake-up takes no virtual time, so the budget never ends one there."""
        rx = self._link_inbox
        clock = trio.current_time
        while True:
            frames = await rx.receive()
            handled = 0
            started = clock()
            link.wakeup_outputs = 0  # counted by link.handle_frames
            while frames is not None:
                if not link.handle_frames(frames):
                    link.on_frames_done(clock())
                    return
                handled += 1
                if (handled >= FRAMES_PER_WAKEUP or link.wakeup_outputs >= OUTPUTS_PER_WAKEUP
                        or clock() - started >= zmq_transport.HELD_WRITES_BUDGET_S):
                    break
                try:
                    frames = rx.receive_nowait()
                except trio.WouldBlock:
                    frames = None
            link.last_frame_at = trio.current_time()
            link.on_frames_done(link.last_frame_at)
            await trio.lowlevel.checkpoint()

    async def wait_disconnected(self) -> None:
        await self._disconnected.wait()

    async def stop_process(self, process, grace_s: float) -> None:
        """SIGTERM: the sim engine exits at once with status 0; wait until it has."""
        if process.returncode is None:
            self._end_engine(0)
        await process.wait()

    def close(self) -> None:
        self._connected = False

    def remove_files(self) -> None:
        """No files: memory."""

    # -- faults ----------------------------------------------------------------------

    @property
    def engine_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None and not self._core_gone

    def kill(self, status: int = KILLED_STATUS) -> bool:
        """The engine process exits with ``status``; False if it was not running."""
        if not self.engine_alive:
            return False
        self._end_engine(status)
        return True

    def core_dead(self) -> bool:
        """vLLM's engine core says ENGINE_CORE_DEAD, then its process exits 1."""
        if not self.engine_alive or self._silent:
            return False
        self._emit_nowait(vllm.encode_dead())
        self._end_engine(1)
        return True

    def silence(self) -> bool:
        """The engine stops reading and answering; its process stays alive."""
        if not self.engine_alive or self._silent:
            return False
        self._silent = True
        return True

    def disconnect(self) -> bool:
        """The engine core exits; its launcher process stays alive (until stopped)."""
        if not self.engine_alive:
            return False
        self._core_gone = True
        if self._engine_scope is not None:
            self._engine_scope.cancel()
        self._disconnected.set()  # the supervision's watch_disconnect hears it (once the link serves)
        return True

    def garbage(self) -> bool:
        """One output frame nobody can decode."""
        if not self.engine_alive or self._silent:
            return False
        return self._emit_nowait([GARBAGE_FRAME])

    def stray(self) -> bool:
        """One well-formed output frame for engine ids nobody asked for."""
        if not self.engine_alive or self._silent:
            return False
        out = vllm.EngineCoreOutputs(
            self.config.engine_index,
            [vllm.EngineCoreOutput("sim-stray", [5, 6, 7], finish_reason=None)],
            timestamp=trio.current_time(),
        )
        return self._emit_nowait(vllm.encode_outputs(out))

    # -- the wire ------------------------------------------------------------------------

    @staticmethod
    async def _deliver(wire: trio.MemoryReceiveChannel, inbox: trio.MemorySendChannel) -> None:
        """Hand each item on when it is due (latency), in order."""
        async for due, item in wire:
            await trio.sleep_until(due)
            await inbox.send(item)

    # -- the engine "process" ----------------------------------------------------------

    def _end_engine(self, status: int) -> None:
        """The engine process exits with ``status`` (its task first, if it still runs)."""
        self._exit_status = status
        if self._engine_running:
            self._engine_scope.cancel()
        else:
            self.process.exited(status)

    async def _engine_process(self) -> None:
        if self.process.returncode is not None:
            return
        self._engine_running = True
        try:
            with trio.CancelScope() as self._engine_scope:
                await self._engine_handshake()
                await self._engine_serve()
        finally:
            self._engine_running = False
            if not self._core_gone:
                self.process.exited(self._exit_status)

    async def _engine_handshake(self) -> None:
        """The engine's side: HELLO and READY on the handshake socket, the ready response on the input one."""
        opts = self.options
        identity = self.link.handshake_wire.identity(self.config.engine_index)
        hello = vllm.HandshakeStatus(status="HELLO", local=False, headless=True)
        await self._hs_to_link_tx.send(("handshake", identity, vllm.encode_handshake_status(hello)))
        vllm.decode_handshake_init(await self._hs_to_engine_rx.receive())
        await trio.sleep(opts.startup_delay_s)
        if opts.hang_startup:
            await trio.sleep_forever()
        if opts.starts_ok is not None and self.starts > opts.starts_ok:
            self._exit_status = 1  # it cannot come up any more: it dies before its ready response
            self._engine_scope.cancel()
            await trio.lowlevel.checkpoint()
        await self._hs_to_link_tx.send(("input", identity, vllm.encode_ready_response(ready_response(self.config))))
        ready = vllm.HandshakeStatus(status="READY", local=False, headless=True)
        await self._hs_to_link_tx.send(("handshake", identity, vllm.encode_handshake_status(ready)))

    async def _engine_serve(self) -> None:
        """``sim_engine._serve`` on trio's clock."""
        core = self.core
        next_step = -math.inf
        rx = self._engine_inbox
        while True:
            if self._silent:
                await trio.sleep_forever()
            while True:  # everything that has arrived by now
                try:
                    item = rx.receive_nowait()
                except trio.WouldBlock:
                    break
                await self._engine_input(item)
                if self._silent:
                    break
            if self._silent:
                continue
            now = trio.current_time()
            wake_at = math.inf  # idle: wait for an input
            if core.has_work and now >= next_step:
                messages, cost_s = core.step(now)
                for message in messages:
                    await self._emit(message)
                next_step = now + cost_s
                if messages or cost_s > 0:
                    await trio.lowlevel.checkpoint()
                    continue
                # A free step that scheduled nothing: stepping again at once would spin.
            elif core.has_work:
                wake_at = next_step  # between steps: the last one's cost is not paid yet
            item = None
            with trio.move_on_at(wake_at):
                item = await rx.receive()
            if item is not None:  # handled outside the deadline: a step never cuts an input in half
                await self._engine_input(item)

    async def _engine_input(self, item: tuple[int, list[bytes]]) -> None:
        seq, frames = item
        if len(frames) < 2:
            self.inputs_refused += 1
            return
        self._track_input(seq, frames)
        if self._poisoned(frames):
            self._exit_status = POISONED_STATUS
            self._engine_scope.cancel()
            await trio.sleep_forever()  # the cancellation takes it at once
        try:
            messages = self.core.handle_input(frames[0], frames[1], trio.current_time())
        except WireError:
            self.inputs_refused += 1
            return
        for message in messages:
            await self._emit(message)

    def _poisoned(self, frames: list[bytes]) -> bool:
        poison = self.options.poison_token
        if poison is None:
            return False
        try:
            message = vllm.decode_input(frames[0], frames[1])
        except WireError:
            return False
        return isinstance(message, vllm.AddRequest) and poison in (message.request.prompt_token_ids or ())

    def _track_input(self, seq: int, frames: list[bytes]) -> None:
        """Test bookkeeping: which ADD an engine id stands for now."""
        try:
            message = vllm.decode_input(frames[0], frames[1])
        except WireError:
            return
        match message:
            case vllm.AddRequest(request=request) if request.request_id not in self._engine_current:
                self._engine_current[request.request_id] = seq
                self.engine_tokens[seq] = []
            case vllm.AbortRequest(request_ids=ids):
                for rid in ids:
                    self._engine_current.pop(rid, None)

    def _account(self, message: list[bytes]) -> None:
        """Test bookkeeping: the tokens in one output frame, per ADD."""
        raw = vllm.decode_outputs(message)
        if isinstance(raw, EngineDead):
            return
        for out in raw.outputs:
            seq = self._engine_current.get(out.request_id)
            if seq is None:
                continue
            self.engine_tokens[seq].extend(out.new_token_ids)
            if out.finish_reason is not None:
                del self._engine_current[out.request_id]

    async def _emit(self, message: list[bytes]) -> None:
        self._account(message)
        self.frames_sent_by_engine += 1
        await self._from_engine_tx.send((trio.current_time() + self.options.latency_s, message))

    def _emit_nowait(self, message: list[bytes]) -> bool:
        try:
            self._from_engine_tx.send_nowait((trio.current_time() + self.options.latency_s, message))
        except trio.WouldBlock:
            return False
        self.frames_sent_by_engine += 1
        return True

    # -- the handshake ------------------------------------------------------------------

    async def _handshake(self) -> None:
        """The handshake machine fed from the memory "sockets" (``ZmqTransport._handshake_with``'s loop)."""
        link = self.link
        machine = link.new_handshake("memory://in", "memory://out")

        def send_init(identity: bytes, payload: bytes) -> None:
            self._hs_to_engine_tx.send_nowait(payload)

        while machine.done is None:
            socket, identity, payload = await self._hs_to_link_rx.receive()
            if socket == "input":
                link.apply_handshake(machine.on_ready_response(identity, payload), send_init)
            else:
                link.apply_handshake(machine.on_status(identity, payload), send_init)

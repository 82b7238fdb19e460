"""One engine link: sockets, the engine process, the handshake, and the receive loop.

Lifetime (one nursery): remove stale ipc socket files (only those nothing live
is bound to); bind the handshake ROUTER, the input ROUTER and the output PULL
(ipc sockets in a private 0700 directory); launch the engine in its own
session, which dials the handshake socket; the handshake (HELLO → init
addresses → ready response on the input socket and READY on the handshake
socket, in either order) is decided by the sans-io handshake machine
(``machines/handshake.py``, the same one the memory link feeds), which also
checks the engine's version against the launch check; this file only moves
its messages and journals its steps; close the handshake socket; then the
link is up and the receive loop decodes each output frame once, journals it
as received, and hands it to the hub.
Frames from anyone but the engine on the handshake socket are ignored and
journaled (``runtime/engine/handshake_gate.py``).

Supervision (the reference servicer's knobs, see ``Supervision``):
- start-up: the handshake may be silent for ``startup_timeout_s``, extended
  while the engine process lives, never beyond ``startup_ceiling_s`` (0 = no
  ceiling); the engine process exiting ends the start-up at once;
- running: the engine is dead when its process exits, it says
  ENGINE_CORE_DEAD, it drops its connection to our sockets (its EngineCore
  died while its launcher still runs), or it stays silent with requests in
  flight for ``silence_timeout_s`` + pending prefill tokens ÷
  ``prefill_tokens_per_s``. Then the link fails and every open request ends
  with UNAVAILABLE;
- stopping: SIGTERM to the engine's launcher (vLLM's process manager stops
  its EngineCore and Worker processes in order) and SIGCONT to its session,
  SIGTERM to what the launcher leaves behind, SIGKILL to every process of
  the session after ``stop_grace_s``, and wait until none is left (none may
  outlive us); bounded by ``stop_grace_s`` + ``ENGINE_KILL_WAIT_S``.

Data parallelism: a launch with ``--data-parallel-size N`` runs N engine
ranks; each runs the handshake on its own identity (the rank, 2 bytes
little-endian), and the link waits for every rank's HELLO, ready response
and READY. All ranks share the three sockets, the process session and this
link's one machine: one rank dying fails the link (docs/architecture.md,
"Data-parallel ranks"). ``send(frames, rank)`` routes to a rank's identity;
the hub picks the rank (``machines/ranks.py``). ``ready`` is the first
rank's ready response, ``rank_ready`` every rank's.

Rules: no request I/O outside this file and the hub; the machines (link,
handshake) decide, this file only feeds them events; every handshake message
is journaled; every transition goes through ``step``, and ``on_transition``
hears each one (readiness follows the link's state: ``runtime/lifetime/readiness.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, assert_never

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from enginelink.journal.records import (
    KIND_ENGINE_FACTS,
    KIND_ENGINE_FRAME,
    KIND_ENGINE_HANDSHAKE,
    KIND_ERROR,
    KIND_TRANSITION,
    engine_stream,
    link_stream,
)
from enginelink.machines.handshake import Action as HandshakeAction
from enginelink.machines.handshake import EngineHandshake, HandshakeDone, HandshakeRefused, Record, SendInit
from enginelink.machines.link import LinkEvent, LinkMachine, LinkState
from enginelink.machines.ranks import RankTable
from enginelink.machines.liveness import PROBE_METHOD, IdleProbe, ProbeFailed, ProbeSend, ProbeTiming, ProbeWait
from enginelink.runtime.engine.engine_process import (
    ENGINE_NICE_DEFAULT,
    ENGINE_STOP_GRACE_S,
    PLACEMENT_DEFAULT,
    SERVICER_SCHED_DEFAULT,
    SOCKET_PREFIX,
    describe_placement,
    describe_priority,
    lower_priority,
    place_front_end,
    run_threads_as_batch,
    remove_stale_files,
    socket_dir,
    stop_session,
)
from enginelink.runtime.engine.engine_output import RELAY_DRAIN_S, EngineOutputRelay, Redactor
from enginelink.runtime.engine.handshake_gate import (
    HANDSHAKE_MESSAGE_MAX_BYTES,
    HandshakeGate,
    bound_handshake_socket,
    bound_input_socket,
    poll_engine_from,
    receive_from_engine,
)
from enginelink.runtime.engine.launchers import EngineLauncher, launch_secrets, refused_arguments
from enginelink.runtime.engine.zmq_trio import has_message, make_socket, recv_multipart, wait_fd
from enginelink.wire import codecs
from enginelink.wire.engine import EngineCodec, EngineDead, HandshakeWire, OutputBatch, WireError

log = logging.getLogger("enginelink.link")

# The journal stream of engine output frames: every rank's, in the order received
# (each frame names its rank, ``engine_index``), so one stream keeps the link's order.
ENGINE_STREAM = engine_stream(0)
# Frames handled per wake-up before yielding, so writers get to coalesce.
FRAMES_PER_WAKEUP = 64
# ... and the engine outputs those frames may carry together before the loop yields: an output's fan-out
# costs microseconds (about ten with top-20 logprobs on a slow core, tens when it carries a long
# prompt's logprobs), so 64 frames of 256 sequences asking for logprobs held the event loop a quarter
# of a second against a zero-cost engine (issue 38); 256 is one full batch of 256 sequences. A frame is
# never split: one frame of any size per wake-up, as at a real engine's pace; a zero-cost engine's
# small frames (2-3 outputs each) never reach it.
OUTPUTS_PER_WAKEUP = 256
# The handshake is a one-off: polling it keeps the code simple.
HANDSHAKE_POLL_S = 0.01
# When the engine drops its connection, how long the process watcher gets to
# report the exit itself (with its status) before the drop fails the link.
DISCONNECT_GRACE_S = 0.2
# What the journal's engine.facts record keeps of each DP rank's own ready response.
RANK_FACTS_SHOWN = ("data_parallel_rank", "data_parallel_size", "instance_id", "num_gpu_blocks", "max_num_seqs")
# Where the link asks an engine to write the config facts its ready response lacks.
ENGINE_FACTS_ENV = "ENGINELINK_ENGINE_FACTS"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
for _event in _HANDSHAKE_FAILED:
    _MONITOR_EVENTS |= _event


@dataclass(frozen=True)
class Supervision:
    """How long an engine may take, or stay quiet, before it counts as dead."""

    startup_timeout_s: float = 1800.0  # SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS
    startup_ceiling_s: float = 14400.0  # SMG_VLLM_SERVICER_STARTUP_CEILING_SECS; 0 = none
    silence_timeout_s: float = 300.0  # SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS
    prefill_tokens_per_s: float = 2000.0  # SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC
    stop_grace_s: float = ENGINE_STOP_GRACE_S  # ENGINELINK_ENGINE_STOP_GRACE_SECS
    # ENGINELINK_IDLE_PROBE_SECS / ENGINELINK_IDLE_PROBE_TIMEOUT_SECS (machines/liveness.py)
    idle_probe: ProbeTiming = ProbeTiming()

    def silence_limit_s(self, pending_prefill_tokens: int) -> float:
        return self.silence_timeout_s + pending_prefill_tokens / self.prefill_tokens_per_s


class LinkFailed(Exception):
    """The engine link failed; the message says why (whose fault: the engine's)."""


class EngineIncompatible(LinkFailed):
    """The engine that answered is not what the launch check verified (exit 2)."""


class EngineArgsRefused(LinkFailed):
    """The engine exited 2 before the handshake: its argument parser refused its arguments (exit 2)."""


class EngineLink:
    # Whether the idle liveness probe runs (a utility call when idle); a wire whose control calls all
    # have side effects turns it off (SglangLink).
    idle_probes = True

    def __init__(
        self,
        *,
        name: str,
        launcher: EngineLauncher,
        codec: EngineCodec,
        journal,
        startup_timeout_s: float | None = None,
        supervision: Supervision | None = None,
        engine_nice: int = ENGINE_NICE_DEFAULT,
        servicer_sched: str = SERVICER_SCHED_DEFAULT,
        placement: str = PLACEMENT_DEFAULT,
        handshake_wire: HandshakeWire | None = None,
    ) -> None:
        self.name = name
        self.engine_nice = engine_nice
        self.servicer_sched = servicer_sched
        self.placement = placement
        self.launcher = launcher
        self.codec = codec
        # How this wire's handshake reads (machines/handshake.py); the codec's own by default.
        # None on a wire with no handshake (SGLang's: runtime/engine/sglang_link.py).
        self.handshake_wire = handshake_wire or (
            codecs.handshake(codec.name) if codecs.readiness(codec.name) == "handshake" else None)
        self.journal = journal
        supervision = supervision or Supervision()
        if startup_timeout_s is not None:
            supervision = Supervision(**{**supervision.__dict__, "startup_timeout_s": startup_timeout_s})
        self.supervision = supervision
        self.machine = LinkMachine(name, trio.current_time())
        self.ready: dict = {}  # the first rank's ready response (and the engine's facts)
        self.rank_ready: dict[int, dict] = {}  # every rank's ready response
        self._handshake_result: HandshakeDone | None = None
        # The DP ranks the launch runs (runtime/kv_config.engine_ranks: the engine arguments).
        self.expected_ranks: tuple[int, ...] = tuple(getattr(launcher, "ranks", None) or (0,))
        self.ranks = RankTable()  # filled at the handshake; the hub picks ranks from it
        self.process: trio.Process | None = None
        self._relay: EngineOutputRelay | None = None
        # The launch's redactor once it knows the secrets; before that (and for a link
        # with no process of ours, the simulation's) the credential-shaped patterns only.
        self._redactor = Redactor()
        self.on_batch: Callable[[OutputBatch, float], None] = lambda batch, now: None
        # After each wake-up's frames (the hub writes what it held: RequestHub.hold_writes).
        self.on_frames_done: Callable[[float], None] = lambda now: None
        self.on_failure: Callable[[str, float], None] = lambda message, now: None
        # Hears every transition, after it is journaled (readiness follows the state).
        self.on_transition: Callable[[LinkState], None] = lambda state: None
        # (requests in flight, prompt tokens not yet prefilled), for the silence limit.
        self.load_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._context = zmq.Context.instance()
        self._identities: dict[int, bytes] = {}  # rank -> its identity on the input ROUTER
        self._input: zmq.Socket | None = None
        self._paths: list[Path] = []
        self._next_call_id = 1
        self._utility_waiters: dict[int, tuple[trio.Event, list]] = {}
        self._startup_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._handshake_done = False
        # The exit status the link's failure asks of the servicer: 2 when the engine
        # refused the operator's arguments (a restart would only repeat it), else 1.
        self.failure_status = 1
        self._facts_path: Path | None = None
        self._progress_at = trio.current_time()
        self._stop_done: trio.Event | None = None
        self.last_frame_at = trio.current_time()
        # When each DP rank last sent a frame (set for every rank at the handshake): the
        # idle probe asks every rank, and one frozen rank among live ones must not pass.
        self.rank_heard_at: dict[int, float] = {}
        self.frames_received = 0
        self.wakeup_outputs = 0  # engine outputs handled in the current wake-up (OUTPUTS_PER_WAKEUP)
        self.idle_probe = IdleProbe(self.supervision.idle_probe)
        self._probe_call_id: int | None = None  # the outstanding idle probe's utility call

    # -- public --------------------------------------------------------------------

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        """Send one request frame set to one DP rank of the engine; never blocks."""
        if self._input is None:
            raise LinkFailed("engine link is not connected")
        identity = self._identities.get(rank)
        if identity is None:
            raise LinkFailed(f"the engine has no DP rank {rank}")
        self._input.send_multipart([identity, *frames], zmq.NOBLOCK)

    def step(self, event: LinkEvent, reason: str | None = None) -> None:
        now = trio.current_time()
        transition = self.machine.handle(event, now, reason)
        payload = transition.payload()
        if reason:
            payload["reason"] = reason
        self.journal.append(now, link_stream(self.name), KIND_TRANSITION, payload)
        self.on_transition(self.machine.state)

    async def utility(self, method: str, args: list, timeout_s: float, rank: int | None = None) -> object:
        """Call an engine utility method on one rank, or on every rank (``rank`` None) as vLLM's DP
        client does (``call_utility_async``: all engines, the first one's answer); raises LinkFailed
        when a rank refuses or does not answer within ``timeout_s``."""
        ranks = [rank] if rank is not None else list(self.ranks.ranks or (self._first_rank,))
        calls: dict[int, tuple[int, trio.Event, list]] = {}
        try:
            for target in ranks:
                call_id = self._next_call_id
                self._next_call_id += 1
                done, box = trio.Event(), []
                self._utility_waiters[call_id] = (done, box)
                calls[target] = (call_id, done, box)
                self.send(self.codec.encode_utility(call_id, method, args), target)
            with trio.move_on_after(timeout_s):
                for _, done, _ in calls.values():
                    await done.wait()
        finally:
            for call_id, _, _ in calls.values():
                self._utility_waiters.pop(call_id, None)
        results = []
        for target, (_, _, box) in calls.items():
            who = "engine" if len(ranks) == 1 else f"engine DP rank {target}"
            if not box:
                raise LinkFailed(f"{who} did not answer {method} within {timeout_s:g} s")
            if box[0].failure:
                raise LinkFailed(f"{who} refused {method}: {box[0].failure}")
            results.append(box[0].result)
        return results[0]

    @property
    def _first_rank(self) -> int:
        return self.ranks.ranks[0] if self.ranks.ranks else self.expected_ranks[0]

    # -- lifetime ------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind, launch, handshake (then ``started``), receive until the engine goes."""
        handshake = make_socket(self._context, zmq.ROUTER)
        inputs = make_socket(self._context, zmq.ROUTER)
        outputs = make_socket(self._context, zmq.PULL)
        inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bound_input_socket(inputs)
        monitor = None
        try:
            directory = socket_dir()
            for path in remove_stale_files(directory):
                log.info("removed stale %s (nothing was bound to it)", path)
            base = directory / f"{SOCKET_PREFIX}{os.getpid()}-{self.name}"
            in_path, out_path = Path(f"{base}-in.sock"), Path(f"{base}-out.sock")
            hs_path, facts_path = Path(f"{base}-hs.sock"), Path(f"{base}-facts.json")
            self._paths = [in_path, out_path, hs_path, facts_path]
            self._facts_path = facts_path
            facts_path.unlink(missing_ok=True)
            bound_handshake_socket(handshake)
            hs_address = f"ipc://{hs_path}"
            if getattr(self.launcher, "handshake_transport", "ipc") == "tcp":
                # An engine that dials only TCP (TokenSpeed: --data-parallel-address/-rpc-port):
                # a free loopback port; its INIT still names the ipc data sockets.
                handshake.bind("tcp://127.0.0.1:*")
                hs_address = handshake.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                handshake.bind(hs_address)
            inputs.bind(f"ipc://{in_path}")
            outputs.bind(f"ipc://{out_path}")
            monitor = outputs.get_monitor_socket(_MONITOR_EVENTS)
            argv, env = self.launcher.command(hs_address)
            engine_env = {**os.environ, **env, ENGINE_FACTS_ENV: str(facts_path)}
            # Secrets of the launch (argv's and the environment's), hidden wherever they appear.
            self._redactor = redactor = Redactor(launch_secrets(argv, engine_env))
            shown_argv = [redactor.line(arg) for arg in self.launcher.redacted(argv)]
            self._journal_handshake("launch", {"argv": shown_argv, "handshake": hs_address,
                                               "handshake_message_max_bytes": HANDSHAKE_MESSAGE_MAX_BYTES})
            failure: LinkFailed | None = None
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for warning in getattr(self.launcher, "warnings", ()):
                    log.warning("%s", warning)
                # Both of the engine's streams on one pipe, relayed with its secrets hidden.
                self.process = await trio.lowlevel.open_process(
                    argv, env=engine_env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                self._process_started(nursery, redactor)
                failure = await self._start_up(handshake, inputs, in_path, out_path, facts_path)
                # The engine is up (or gone): nobody may reach the handshake socket any more.
                handshake.close(linger=0)
                hs_path.unlink(missing_ok=True)
                if failure is None:
                    if self.placement == "auto":
                        # After the handshake: vLLM binds its compute threads while it loads.
                        placement = place_front_end(self.process.pid)
                        self._journal_handshake("placement", placement)
                        log.info("placement: %s", describe_placement(placement))
                    self._input = inputs
                    await self._serve_outputs(nursery, task_status, outputs, monitor)
                nursery.cancel_scope.cancel()
            # Raised outside the nursery, so callers see it bare, not in an ExceptionGroup.
            if failure is not None:
                raise failure
        finally:
            self._input = None
            for sock in (handshake, inputs, outputs, monitor):
                if sock is not None:
                    sock.close(linger=0)
            await self._stop_engine_relaying()
            for path in self._paths:
                path.unlink(missing_ok=True)

    async def _stop_engine_relaying(self) -> None:
        """Stop the engine while its last words are still relayed (it must never block on the pipe)."""
        relay = self._relay
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                if relay is not None and not relay.done:
                    nursery.start_soon(relay.pump)
                await self.stop_engine()
                nursery.cancel_scope.deadline = trio.current_time() + RELAY_DRAIN_S
            if relay is not None and not relay.done:  # a stray still holds the pipe: stop reading it
                await relay.stream.aclose()

    async def stop_engine(self) -> None:
        """Stop the engine once (``_end_process``), shielded; later callers wait for that one stop."""
        process = self.process
        if process is None:
            return
        if self._stop_done is not None:
            with trio.CancelScope(shield=True):
                await self._stop_done.wait()
            return
        self._stop_done = trio.Event()
        with trio.CancelScope(shield=True):
            try:
                await self._end_process(process)
            finally:
                self._stop_done.set()

    async def _end_process(self, process) -> None:
        """Stop the engine's whole session, bounded (``engine_process.stop_session``); we never outlive it."""
        await stop_session(process, self.supervision.stop_grace_s)

    # -- internals: start-up -------------------------------------------------------

    def _journal_handshake(self, step: str, message: dict, rank: int | None = None) -> None:
        self._progress_at = trio.current_time()
        payload = {"step": step, "message": message}
        if rank is not None:
            payload["rank"] = rank
        self.journal.append(trio.current_time(), link_stream(self.name), KIND_ENGINE_HANDSHAKE, payload)

    async def _supervise_startup(self) -> None:
        """Bound the handshake: silence extended while the process lives, and a ceiling."""
        sup = self.supervision
        started = trio.current_time()
        ceiling = started + sup.startup_ceiling_s if sup.startup_ceiling_s > 0 else math.inf
        while not self._handshake_done and self.machine.live:
            deadline = min(self._progress_at + sup.startup_timeout_s, ceiling)
            await trio.sleep_until(deadline)
            if self._handshake_done or not self.machine.live:
                return
            now = trio.current_time()
            if now >= ceiling:
                self._fail(
                    f"engine did not complete the handshake within the start-up ceiling of "
                    f"{sup.startup_ceiling_s:g} s (SMG_VLLM_SERVICER_STARTUP_CEILING_SECS)"
                )
                return
            if now >= self._progress_at + sup.startup_timeout_s:
                if self.process is not None and self.process.returncode is None:
                    log.info("engine still starting after %.0f s (its process is alive): waiting on", now - started)
                    self._journal_handshake("startup_extended", {"after_s": now - started})
                else:
                    self._fail(
                        f"engine did not complete the handshake within {sup.startup_timeout_s:g} s "
                        "(SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS)"
                    )
                    return

    async def _run_handshake(self, handshake) -> LinkFailed | None:
        """Run ``handshake()`` inside the start-up scope (supervision cancels it); the failure, if any."""
        with trio.CancelScope() as self._startup_scope:
            try:
                await handshake()
            except (LinkFailed, HandshakeRefused) as error:
                self._fail(f"engine broke the handshake: {error}")
            else:
                self._handshake_done = True
                now = trio.current_time()
                self.rank_heard_at = {rank: now for rank in self.rank_ready or (0,)}
        if not self._handshake_done:
            return LinkFailed(self.machine.failure or "engine start-up was cancelled")
        return None

    def _new_handshake(self, inputs: str, outputs: str) -> EngineHandshake:
        """The handshake machine of this start: every expected rank, the launch check's version."""
        return EngineHandshake(self.handshake_wire, self.expected_ranks, [inputs], [outputs],
                               expected_version=getattr(self.launcher, "checked_version", None) or None)

    def _apply(self, actions: list[HandshakeAction], send_init) -> None:
        """Carry out the handshake machine's actions; ``send_init(identity, payload)`` is the transport's."""
        for action in actions:
            match action:
                case Record(step=step, message=message, rank=rank):
                    self._journal_handshake(step, message, rank)
                case SendInit(identity=identity, payload=payload):
                    send_init(identity, payload)
                case HandshakeDone(ready=ready):
                    self._handshake_result = action
                    self.rank_ready = dict(ready)
                    self.ready = dict(ready[action.ranks[0]])
                    self.ranks.set_ranks(action.ranks)
                    self._identities = {rank: self.handshake_wire.identity(rank) for rank in action.ranks}
                case unreachable:
                    assert_never(unreachable)

    def _check_compatible(self) -> LinkFailed | None:
        """After the facts are recorded: the machine's verdict on the engine's version and wire."""
        result = self._handshake_result
        if result is not None and result.incompatible:
            self._fail(result.incompatible)
            return EngineIncompatible(result.incompatible)
        return None

    async def _serve_outputs(self, nursery, task_status, outputs: zmq.Socket, monitor: zmq.Socket) -> None:
        """The engine is up on any wire: the link serves, its watchers start, and the outputs are read until it ends."""
        self.step(LinkEvent.HANDSHAKE_DONE)
        task_status.started()
        nursery.start_soon(self._watch_disconnect, monitor)
        nursery.start_soon(self._watch_silence)
        if self.idle_probes:
            nursery.start_soon(self._probe_while_idle)  # returns at once on a wire without control calls
        await self._receive_loop(outputs)

    def _process_started(self, nursery, redactor: Redactor) -> None:
        """What every engine wire does once its process is started (vLLM's here, SGLang's in
        ``sglang_link.py``): relay its output with secrets hidden, lower its priority and journal
        it, then watch the process and supervise its start-up."""
        self._relay = EngineOutputRelay(self.process.stdout, redactor)
        nursery.start_soon(self._relay.pump)
        priority = lower_priority(self.process.pid, self.engine_nice)
        if self.servicer_sched == "batch":
            priority["servicer"] = run_threads_as_batch()
        self._journal_handshake("priority", priority)
        log.info("engine process %d started, %s", self.process.pid, describe_priority(priority))
        nursery.start_soon(self._watch_process)
        nursery.start_soon(self._supervise_startup)

    async def _start_up(self, handshake, inputs, in_path: Path, out_path: Path, facts_path: Path) -> LinkFailed | None:
        """Handshake and check the engine; the failure, if it did not come up."""
        failure = await self._run_handshake(
            lambda: self._handshake(handshake, inputs, f"ipc://{in_path}", f"ipc://{out_path}"))
        if failure is not None:
            return EngineArgsRefused(str(failure)) if self.failure_status == 2 else failure
        self._read_facts(facts_path)
        return self._check_compatible()

    async def _handshake(self, handshake, inputs, in_address: str, out_address: str) -> None:
        machine = self._new_handshake(in_address, out_address)
        gate = HandshakeGate(self.process.pid, self._journal_handshake, machine.identities, machine.is_hello)
        try:
            await self._handshake_with(machine, gate, handshake, inputs)
        finally:
            summary = gate.summary()
            if summary is not None:
                self._journal_handshake("strangers", summary)

    async def _handshake_with(self, machine: EngineHandshake, gate: HandshakeGate, handshake, inputs) -> None:
        """Feed the machine every rank's messages until it is done (``machines/handshake.py``).

        The ranks start together and their steps interleave, so each message is
        filed by the identity that sent it; a rank's ready response and READY
        come within the same 0.1 s in either order, so both sockets are polled.
        """

        def send_init(identity: bytes, payload: bytes) -> None:
            handshake.send_multipart([identity, payload])

        first = await receive_from_engine(handshake, gate)  # nothing to poll for before the first HELLO
        while machine.done is None:
            judged = first or poll_engine_from(handshake, gate)
            first = None
            if judged is not None:
                self._apply(machine.on_status(*judged), send_init)
            response = poll_engine_from(inputs, gate) if machine.done is None else None
            if response is not None:
                self._apply(machine.on_ready_response(*response), send_init)
            if judged is None and response is None:
                await trio.sleep(HANDSHAKE_POLL_S)

    def _read_facts(self, facts_path: Path) -> None:
        """Merge the engine's own config facts into ``ready`` where the response lacks them."""
        try:
            facts = json.loads(facts_path.read_text())
        except (OSError, ValueError):
            facts = {}
        if isinstance(facts, dict):
            for ready in (self.ready, *self.rank_ready.values()):
                for key, value in facts.items():
                    ready.setdefault(key, value)
        self.journal.append(
            trio.current_time(),
            link_stream(self.name),
            KIND_ENGINE_FACTS,
            {"link": self.name, "pid": self.process.pid if self.process else None, "facts": self.ready,
             "ranks": self.rank_facts()},
        )

    def rank_facts(self) -> list[dict]:
        """Each DP rank as the journal and ``inspect`` show it: what tells one rank's engine core apart."""
        return [{"rank": rank, **{key: ready.get(key) for key in RANK_FACTS_SHOWN}}
                for rank, ready in sorted(self.rank_ready.items())]

    # -- internals: running --------------------------------------------------------

    async def _receive_loop(self, outputs: zmq.Socket) -> None:
        # Asks EVENTS before each read instead of reading until zmq.Again: at
        # one frame per wake-up (every engine step) the loop then costs one
        # trio step and no exception per frame, where it cost two and three.
        fd = outputs.getsockopt(zmq.FD)
        while True:
            handled = 0
            self.wakeup_outputs = 0  # counted by _handle_frames
            while handled < FRAMES_PER_WAKEUP and self.wakeup_outputs < OUTPUTS_PER_WAKEUP and has_message(outputs):
                try:
                    frames = outputs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:  # EVENTS said a message was there; do not trust it blindly
                    break
                if not self._handle_frames(frames):
                    self.on_frames_done(trio.current_time())
                    return
                handled += 1
            if handled:
                self.last_frame_at = trio.current_time()
                self.on_frames_done(self.last_frame_at)
            if handled == FRAMES_PER_WAKEUP or self.wakeup_outputs >= OUTPUTS_PER_WAKEUP:
                await trio.lowlevel.checkpoint()  # more waiting: let the writers run first
            else:
                await wait_fd(fd)

    def _handle_frames(self, frames: list[bytes]) -> bool:
        """One output frame: journal it as received, decode it once, dispatch it.

        Returns False when the frame failed the link (unreadable, or the
        engine's ENGINE_CORE_DEAD); the receive loop then ends.
        """
        now = trio.current_time()
        self.frames_received += 1
        try:
            batch = self.codec.decode_output(frames)
        except WireError as error:
            self.journal.append(now, ENGINE_STREAM, KIND_ENGINE_FRAME, frames[0])
            self._fail(f"engine sent a frame enginelink cannot read: {error}")
            return False
        if isinstance(batch, EngineDead):
            self.journal.append(now, ENGINE_STREAM, KIND_ENGINE_FRAME, frames[0])
            self._fail("engine reported ENGINE_CORE_DEAD")
            return False
        self.rank_heard_at[batch.engine_index] = now
        if batch.utility is None or batch.utility.call_id != self._probe_call_id or batch.outputs:
            # An idle probe's answer is not journaled: one every few seconds would
            # fill an idle servicer's journal and push real history out of it.
            seq = self.journal.append(now, ENGINE_STREAM, KIND_ENGINE_FRAME, frames[0])
            if len(frames) == 1:  # the journal keeps frames[0]: only then is this decode exactly its
                self.journal.note_decoded(seq, batch)  # the live fold's, instead of decoding it again
        if batch.utility is not None:
            waiter = self._utility_waiters.get(batch.utility.call_id)
            if waiter is not None:
                waiter[1].append(batch.utility)
                waiter[0].set()
        if batch.outputs or batch.stats is not None:
            self.wakeup_outputs += len(batch.outputs)
            self.on_batch(batch, now)
        return True

    async def _watch_process(self) -> None:
        process = self.process
        await process.wait()
        if self.machine.live and self._stop_done is None:
            refusal = None if self._handshake_done else refused_arguments(process, self._facts_path, self._redactor.line)
            if refusal is not None:
                self.failure_status = 2
            self._fail(refusal or f"engine process {process.pid} exited with status {process.returncode}")

    async def _watch_disconnect(self, monitor: zmq.Socket) -> None:
        """The engine's connection to our output socket dropped: its engine core is gone.

        Only connections that completed the ZMTP handshake count: a bare
        connect (another process probing for stale socket files) fails its
        handshake and is ignored. Events queue in the monitor from before the
        launch, so they are read here in the order they happened.
        """
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
                if value not in engine_fds or self._stop_done is not None:
                    continue
                # Let the process watcher report a plain exit with its status first.
                await trio.sleep(DISCONNECT_GRACE_S)
                if self.machine.live and self._stop_done is None:
                    pid = self.process.pid if self.process else "?"
                    self._fail(
                        f"engine closed its output connection (its engine core exited) while its "
                        f"launcher process {pid} still runs"
                    )
                return

    async def _watch_silence(self) -> None:
        """Fail the link when the engine says nothing for too long with requests in flight."""
        sup = self.supervision
        check_s = max(0.05, min(1.0, sup.silence_timeout_s / 4))
        busy_since: float | None = None
        while self.machine.live:
            await trio.sleep(check_s)
            in_flight, prefill_tokens = self.load_probe()
            now = trio.current_time()
            if not in_flight:
                busy_since = None
                continue
            if busy_since is None:
                busy_since = now
            quiet_s = now - max(self.last_frame_at, busy_since)
            limit_s = sup.silence_limit_s(prefill_tokens)
            if quiet_s > limit_s:
                self._fail(
                    f"engine sent nothing for {quiet_s:.1f} s with {in_flight} requests in flight "
                    f"(limit {limit_s:.1f} s: SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS "
                    f"+ {prefill_tokens} pending prefill tokens at SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC)"
                )
                return

    async def _probe_while_idle(self) -> None:
        """Ask an idle engine whether it lives; fail the link when it does not answer (machines/liveness.py)."""
        timing = self.supervision.idle_probe
        if timing.interval_s <= 0:
            return  # ENGINELINK_IDLE_PROBE_SECS=0: no probes
        if not getattr(self.codec, "control_calls", True):
            # A wire with no utility calls (TokenSpeed 0.1.1) has no probe to send: its engine's death
            # shows as its process exiting or ENGINE_CORE_DEAD; a frozen idle engine goes unseen until
            # a request meets the silence timeout.
            log.info("idle liveness probes off: the %s wire has no control calls to probe with", self.codec.name)
            return
        # Woken this often besides the machine's own times, to see answers and new requests.
        check_s = max(0.05, min(1.0, timing.interval_s / 4, timing.timeout_s / 4))
        while self.machine.live:
            now = trio.current_time()
            idle = self.machine.state is LinkState.SERVING and not self.load_probe()[0]
            # The quietest rank decides: every rank gets the probe, and each must answer it.
            quiet_rank, heard_at = min(self.rank_heard_at.items(), key=lambda item: item[1],
                                       default=(0, self.last_frame_at))
            match self.idle_probe.poll(now, idle=idle, last_frame_at=heard_at):
                case ProbeSend():
                    self._send_probe()
                case ProbeFailed(unanswered_s=unanswered_s):
                    who = "engine" if len(self.rank_heard_at) <= 1 else f"engine DP rank {quiet_rank}"
                    self._fail(
                        f"{who} answered no liveness probe ({PROBE_METHOD}) for {unanswered_s:.1f} s while idle "
                        f"(limit ENGINELINK_IDLE_PROBE_TIMEOUT_SECS={timing.timeout_s:g}): it is frozen or gone"
                    )
                    return
                case ProbeWait(until=until):
                    await trio.sleep_until(min(until, now + check_s))
                case unreachable:
                    assert_never(unreachable)

    def _send_probe(self) -> None:
        """One probe to every rank (one call id): an idle engine is silent on every rank."""
        call_id = self._next_call_id
        self._next_call_id += 1
        self._probe_call_id = call_id
        frames = self.codec.encode_utility(call_id, PROBE_METHOD, [])
        for rank in self.ranks.ranks or (0,):
            try:
                self.send(frames, rank)
            except (zmq.ZMQError, LinkFailed) as error:
                # Unanswered, it fails the link at its timeout; the log says why it went unanswered.
                log.warning("idle probe not sent to DP rank %d: %s", rank, error)

    def _fail(self, message: str) -> None:
        if not self.machine.live:
            return
        now = trio.current_time()
        self.journal.append(now, link_stream(self.name), KIND_ERROR, {"whose": "engine", "code": "UNAVAILABLE", "message": message})
        self.step(LinkEvent.FAIL, message)
        if self._startup_scope is not None and not self._handshake_done:
            self._startup_scope.cancel()
        self.on_failure(message, now)
        if self._handshake_done and self._nursery is not None:
            # Nothing the engine sends matters any more: stop it now (run's finally).
            self._nursery.cancel_scope.cancel()

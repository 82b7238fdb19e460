"""One engine link: the link machine, a transport, and the supervision every transport shares.

An engine link is three parts, none specialised by subclassing:

- the **link machine** (``machines/link.py``) and the handshake machine
  (``machines/handshake.py``) decide; this class feeds them events, journals
  every step and transition (``step``, ``journal_handshake``), and calls
  ``on_transition`` after each (readiness follows the state);
- a **transport** moves the bytes and owns how the engine is reached: the
  ZeroMQ sockets of vLLM's headless wire (``zmq_transport.py``; TokenSpeed
  and the MLX engine speak it too), SGLang's PUSH/PULL with its ready pipe
  (``sglang_link.py``), or memory channels to the sim core on trio's clock
  (``memory_link.py``, the simulation). A transport has ``start(link,
  nursery)`` (bind, launch through ``link.launch``, hand-shake through
  ``link.run_handshake``), ``send(frames, rank)``, ``receive(link)`` (each
  output frame to ``link.handle_frames``), ``wait_disconnected()``,
  ``stop_process(process, grace_s)``, ``close()``, ``remove_files()`` and
  ``idle_probes`` (whether its wire has a side-effect-free call to probe an
  idle engine with);
- the **supervision** (``supervision.py``): the start-up bound, the process
  and disconnect watches, the silence limit and the idle probe, the same
  for every transport, so the simulation runs the production supervision;
  beside it the engine's process as the link runs it (``link_process.py``:
  launched in its own process group, output relayed, stopped within a bound) and what
  follows a death when restarts are on (``restarts.py``).

Lifetime (``run``, one nursery): the transport starts the engine and the
handshake (then ``started``); the link serves, its watches run, and the
transport's receive loop decodes each output frame once (``handle_frames``:
journaled as received, dispatched to the hub) until the engine goes.
Stopping: the transport closes its sockets, then all of the engine's processes
is stopped while its last words are still relayed, bounded
(``engine_processes.stop_engine_processes``; none of them may outlive us).

Restarts (docs/resume.md, ``restarts.py``): with a restart budget, an engine
that dies while it serves is a crash (``restarting``), not a failure; the
composition calls ``run`` again, each call one start of the engine with the
same arguments and its per-start state fresh, the link's machine, ranks and
counters its own.

Data parallelism: a launch with ``--data-parallel-size N`` runs N engine
ranks, each handshaking on its own identity; the link waits for every
rank's HELLO, ready response and READY. All ranks share the transport, the
engine's processes and this link's one machine: one rank dying fails the link
(docs/architecture.md, "Data-parallel ranks"). ``send(frames, rank)``
routes to a rank; the hub picks the rank (``machines/ranks.py``). ``ready``
is the first rank's ready response, ``rank_ready`` every rank's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, assert_never

import trio

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
from enginelink.machines.resume import RestartBudget
from enginelink.runtime.engine import link_process, restarts
from enginelink.runtime.engine.engine_output import EngineOutputRelay, Redactor
from enginelink.runtime.engine.placement import ENGINE_NICE_DEFAULT, PLACEMENT_DEFAULT, SERVICER_SCHED_DEFAULT
from enginelink.runtime.engine.launchers import EngineLauncher
from enginelink.runtime.engine.link_errors import EngineArgsRefused, EngineIncompatible, LinkFailed
from enginelink.runtime.engine.supervision import Supervision, Supervisor
from enginelink.runtime.engine.zmq_transport import FRAMES_PER_WAKEUP, ZmqTransport  # noqa: F401 - tests read it here
from enginelink.wire import codecs
from enginelink.wire.engine import EngineCodec, EngineDead, HandshakeWire, OutputBatch, WireError

__all__ = ["EngineArgsRefused", "EngineIncompatible", "EngineLink", "LinkFailed", "Supervision"]

log = logging.getLogger("enginelink.link")

# The journal stream of engine output frames: every rank's, in the order received
# (each frame names its rank, ``engine_index``), so one stream keeps the link's order.
ENGINE_STREAM = engine_stream(0)
# What the journal's engine.facts record keeps of each DP rank's own ready response.
RANK_FACTS_SHOWN = ("data_parallel_rank", "data_parallel_size", "instance_id", "num_gpu_blocks", "max_num_seqs")


class EngineLink:
    def __init__(
        self,
        *,
        name: str,
        codec: EngineCodec,
        journal,
        launcher: EngineLauncher | None = None,
        transport=None,
        startup_timeout_s: float | None = None,
        supervision: Supervision | None = None,
        engine_nice: int = ENGINE_NICE_DEFAULT,
        servicer_sched: str = SERVICER_SCHED_DEFAULT,
        placement: str = PLACEMENT_DEFAULT,
        handshake_wire: HandshakeWire | None = None,
    ) -> None:
        self.name = name
        # Engine restarts (docs/resume.md; the composition sets it from its policy): None when off,
        # an engine death then fails the link.
        self.restart_budget: RestartBudget | None = None
        self.starts = 0  # starts of the engine so far (1 + restarts)
        self.last_crash: str | None = None  # why the engine last died with a restart to follow
        self.crashed_start = -1  # the start (``starts``) whose death became that crash (restarts.crash_or_fail)
        self.engine_nice = engine_nice
        self.servicer_sched = servicer_sched
        self.placement = placement
        self.launcher = launcher
        self.transport = transport if transport is not None else ZmqTransport(launcher)
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
        self.supervisor = Supervisor(self, supervision)
        self.machine = LinkMachine(name, trio.current_time())
        self.ready: dict = {}  # the first rank's ready response (and the engine's facts)
        self.rank_ready: dict[int, dict] = {}  # every rank's ready response
        self._handshake_result: HandshakeDone | None = None
        # The DP ranks the launch runs (runtime/kv_config.engine_ranks: the engine arguments).
        self.expected_ranks: tuple[int, ...] = tuple(getattr(launcher, "ranks", None) or (0,))
        self.ranks = RankTable()  # filled at the handshake; the hub picks ranks from it
        self.process = None  # the engine's trio.Process (the simulation's stand-in in memory)
        self._relay: EngineOutputRelay | None = None
        # The launch's redactor once it knows the secrets; before that (and for a link
        # with no process of ours, the simulation's) the credential-shaped patterns only.
        self.redactor = Redactor()
        self.on_batch: Callable[[OutputBatch, float], None] = lambda batch, now: None
        # After each wake-up's frames (the hub writes what it held: RequestHub.hold_writes).
        self.on_frames_done: Callable[[float], None] = lambda now: None
        self.on_failure: Callable[[str, float], None] = lambda message, now: None
        # The engine died and will be started again (restarts on): the hub holds the open calls.
        self.on_crash: Callable[[str, float], None] = lambda message, now: None
        # Hears every transition, after it is journaled (readiness follows the state).
        self.on_transition: Callable[[LinkState], None] = lambda state: None
        # (requests in flight, prompt tokens not yet prefilled), for the silence limit.
        self.load_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._next_call_id = 1
        # call id -> (answered, replies, replies expected: more than one where one message reaches every rank)
        self._utility_waiters: dict[int, tuple[trio.Event, list, int]] = {}
        self._startup_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self.handshake_done = False
        # The exit status the link's failure asks of the servicer: 2 when the engine
        # refused the operator's arguments (a restart would only repeat it), else 1.
        self.failure_status = 1
        self.facts_path: Path | None = None  # where the engine writes the facts its ready response lacks
        self.progress_at = trio.current_time()  # the start-up's last sign of life
        self._stop_done: trio.Event | None = None
        self.last_frame_at = trio.current_time()
        # When each DP rank last sent a frame (set for every rank at the handshake): the
        # idle probe asks every rank, and one frozen rank among live ones must not pass.
        self.rank_heard_at: dict[int, float] = {}
        self.frames_received = 0
        self.probe_answers = 0  # frames that were only an idle probe's answer: not journaled
        self.wakeup_outputs = 0  # engine outputs handled in the current wake-up (zmq_transport.OUTPUTS_PER_WAKEUP)

    # -- public --------------------------------------------------------------------

    @property
    def idle_probe(self):
        return self.supervisor.idle_probe

    @property
    def stopping(self) -> bool:
        """The engine is being stopped on purpose: its exit and dropped connection are no failure."""
        return self._stop_done is not None

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        """Send one request frame set to one DP rank of the engine; never blocks."""
        self.transport.send(frames, rank)

    def step(self, event: LinkEvent, reason: str | None = None) -> None:
        now = trio.current_time()
        transition = self.machine.handle(event, now, reason)
        payload = transition.payload()
        if reason:
            payload["reason"] = reason
        self.journal.append(now, link_stream(self.name), KIND_TRANSITION, payload)
        self.on_transition(self.machine.state)

    def next_call_id(self) -> int:
        call_id = self._next_call_id
        self._next_call_id += 1
        return call_id

    async def utility(self, method: str, args: list, timeout_s: float, rank: int | None = None) -> object:
        """Call an engine utility method on one rank, or on every rank (``rank`` None) as vLLM's DP
        client does (``call_utility_async``: all engines, the first one's answer); raises LinkFailed
        when a rank refuses or does not answer within ``timeout_s``."""
        ranks = [rank] if rank is not None else list(self.ranks.ranks or (self._first_rank,))
        # A transport whose one control message reaches every rank (SGLang's DP controller fans it out,
        # each rank answering under the same id) is sent it once, and every rank's answer is awaited.
        fan_out = getattr(self.transport, "control_fan_out", 1)
        replies = 1
        if rank is None and fan_out > 1:
            ranks, replies = ranks[:1], fan_out
        calls: dict[int, tuple[int, trio.Event, list]] = {}
        try:
            for target in ranks:
                call_id = self.next_call_id()
                done, box = trio.Event(), []
                self._utility_waiters[call_id] = (done, box, replies)
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
            if replies > 1:
                who = "an engine DP rank" if len(box) == replies else f"{replies - len(box)} of the engine's DP ranks"
            if len(box) < replies:
                raise LinkFailed(f"{who} did not answer {method} within {timeout_s:g} s")
            for reply in box:
                if reply.failure:
                    raise LinkFailed(f"{who} refused {method}: {reply.failure}")
            results.append(box[0].result)
        return results[0]

    @property
    def _first_rank(self) -> int:
        return self.ranks.ranks[0] if self.ranks.ranks else self.expected_ranks[0]

    # -- lifetime ------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine through the transport (then ``started``), receive until the engine goes."""
        transport = self.transport
        if self.starts:
            self._new_start()
        self.starts += 1
        started = False
        try:
            failure: LinkFailed | None = None
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                failure = await transport.start(self, nursery)
                if failure is not None and self.failure_status == 2:
                    failure = EngineArgsRefused(str(failure))
                if failure is None:
                    self._place_front_end()
                    # A restart goes back to serving by itself (or not at all: a drain began meanwhile).
                    if self.machine.state is not LinkState.RESTARTING and self.machine.state is not LinkState.DRAINING:
                        self.step(LinkEvent.HANDSHAKE_DONE)
                    task_status.started()
                    started = True
                    self.supervisor.serving(nursery, transport)
                    await transport.receive(self)
                nursery.cancel_scope.cancel()
            if failure is None and not started:  # the engine died during a restart's start (``restarts.crash``)
                failure = LinkFailed(self.last_crash or "engine start-up was cancelled")
            # Raised outside the nursery, so callers see it bare, not in an ExceptionGroup.
            if failure is not None:
                raise failure
        finally:
            transport.close()
            await self._stop_engine_relaying()
            transport.remove_files()

    # The engine's process (link_process.py) and what follows its death (restarts.py), as methods.
    launch = link_process.launch
    adopt = link_process.adopt
    _place_front_end = link_process.place_front_end
    _stop_engine_relaying = link_process.stop_engine_relaying
    stop_engine = link_process.stop_engine
    _new_start = restarts.new_start

    # -- the start-up (the transports call these) ------------------------------------

    def journal_handshake(self, step: str, message: dict, rank: int | None = None, progress: bool = True) -> None:
        """One step of the start-up in the journal; a step of the engine's (``progress``) renews the start-up bound."""
        if progress:
            self.progress_at = trio.current_time()
        payload = {"step": step, "message": message}
        if rank is not None:
            payload["rank"] = rank
        self.journal.append(trio.current_time(), link_stream(self.name), KIND_ENGINE_HANDSHAKE, payload)

    async def run_handshake(self, handshake) -> LinkFailed | None:
        """Run ``handshake()`` inside the start-up scope (supervision cancels it); the failure, if any."""
        with trio.CancelScope() as self._startup_scope:
            try:
                await handshake()
            except (LinkFailed, HandshakeRefused) as error:
                self.fail(f"engine broke the handshake: {error}")
            else:
                self.handshake_done = True
                now = trio.current_time()
                self.rank_heard_at = {rank: now for rank in self.rank_ready or (0,)}
        if not self.handshake_done:
            return LinkFailed(self.machine.failure or "engine start-up was cancelled")
        return None

    def new_handshake(self, inputs: str, outputs: str) -> EngineHandshake:
        """The handshake machine of this start: every expected rank, the launch check's version."""
        return EngineHandshake(self.handshake_wire, self.expected_ranks, [inputs], [outputs],
                               expected_version=getattr(self.launcher, "checked_version", None) or None)

    def apply_handshake(self, actions: list[HandshakeAction], send_init) -> None:
        """Carry out the handshake machine's actions; ``send_init(identity, payload)`` is the transport's."""
        for action in actions:
            match action:
                case Record(step=step, message=message, rank=rank):
                    self.journal_handshake(step, message, rank)
                case SendInit(identity=identity, payload=payload):
                    send_init(identity, payload)
                case HandshakeDone(ready=ready):
                    self._handshake_result = action
                    self.rank_ready = dict(ready)
                    self.ready = dict(ready[action.ranks[0]])
                    self.ranks.set_ranks(action.ranks)
                case unreachable:
                    assert_never(unreachable)

    def check_compatible(self) -> LinkFailed | None:
        """After the facts are recorded: the machine's verdict on the engine's version and wire."""
        result = self._handshake_result
        if result is not None and result.incompatible:
            self.fail(result.incompatible)
            return EngineIncompatible(result.incompatible)
        return None

    def read_facts(self, facts_path: Path | None) -> None:
        """Merge the engine's own config facts into ``ready`` where the response lacks them, then what the
        launch itself says (``launcher.launch_facts``: the engine's arguments read by the servicer, e.g.
        its PD role); journal them."""
        facts = {}
        if facts_path is not None:
            try:
                facts = json.loads(facts_path.read_text())
            except (OSError, ValueError):
                facts = {}
        if isinstance(facts, dict):
            facts = {**getattr(self.launcher, "launch_facts", {}), **facts}
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

    # -- running -----------------------------------------------------------------------

    def handle_frames(self, frames: list[bytes]) -> bool:
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
            self.fail(f"engine sent a frame enginelink cannot read: {error}")
            return False
        if isinstance(batch, EngineDead):
            self.journal.append(now, ENGINE_STREAM, KIND_ENGINE_FRAME, frames[0])
            self.fail("engine reported ENGINE_CORE_DEAD")
            return False
        self.rank_heard_at[batch.engine_index] = now
        if batch.utility is None or not self.supervisor.is_probe_answer(batch.utility.call_id) or batch.outputs:
            seq = self.journal.append(now, ENGINE_STREAM, KIND_ENGINE_FRAME, frames[0])
            if len(frames) == 1:  # the journal keeps frames[0]: only then is this decode exactly its
                self.journal.note_decoded(seq, batch)  # the live fold's, instead of decoding it again
        else:
            # An idle probe's answer is not journaled: one every few seconds would
            # fill an idle servicer's journal and push real history out of it.
            self.probe_answers += 1
        if batch.utility is not None:
            waiter = self._utility_waiters.get(batch.utility.call_id)
            if waiter is not None:
                waiter[1].append(batch.utility)
                if len(waiter[1]) >= waiter[2]:
                    waiter[0].set()
        if batch.outputs or batch.stats is not None:
            self.wakeup_outputs += len(batch.outputs)
            self.on_batch(batch, now)
        return True

    def fail(self, message: str) -> None:
        if not self.machine.live:
            return
        now = trio.current_time()
        message = restarts.crash_or_fail(self, message, now)
        if message is None:  # a crash, with a restart to follow
            return
        self.journal.append(now, link_stream(self.name), KIND_ERROR, {"whose": "engine", "code": "UNAVAILABLE", "message": message})
        self.step(LinkEvent.FAIL, message)
        if self._startup_scope is not None and not self.handshake_done:
            self._startup_scope.cancel()
        self.on_failure(message, now)
        if self.handshake_done and self._nursery is not None:
            # Nothing the engine sends matters any more: stop it now (run's finally).
            self._nursery.cancel_scope.cancel()

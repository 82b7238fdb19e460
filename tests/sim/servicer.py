"""The servicer core in memory: journal, link, hub, app, warm-up, drain and failure, on trio's clock.

``SimServicer.serve`` is ``runtime/lifetime/server.py``'s ``serve`` without the
sockets: the servicer is built by the same ``runtime/compose.compose`` and
runs the same lifetime (``Servicer.run``: run.start → link up → warm-up →
serving, then a signal → drain, exit 0, or the link failing → every open
call UNAVAILABLE, exit 1; then engine stopped, handlers closed, run.stop).
What differs is what ``Composition`` takes as parameters:

- the engine link is a ``MemoryLink`` (the sim engine core in a trio task);
- the front (the gRPC server) is a nursery of handler tasks running
  ``runtime.generate.generate`` (the handler's own loop) with a ``TrioWake``;
  closing the server cancels them, as grpclib's ``Server.close`` does;
- signals come from a memory channel; wall time is a fixed fake start, so
  every journal byte depends on the seed alone;
- ``ObservedHub`` is the real ``RequestHub`` that also remembers each call
  it admitted and which ADD frames carried it (checks only; it changes nothing).
"""

from __future__ import annotations

import signal
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import trio

from enginelink.machines.warmup import WarmupSetting
from enginelink.runtime.lifetime.compose import Composition, JournalPlan, Servicer, compose
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.errors import ServicerError
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.requests.hub import Call, RequestHub
from enginelink.runtime.engine.engine_link import EngineLink
from enginelink.runtime.engine.memory_link import MemoryLink
from enginelink.runtime.engine.model_dir import ModelFacts
from enginelink.runtime.context.submit import TrioWake
from tests.sim.scenario import ClientPlan, Scenario

FAKE_WALL_START = 1_700_000_000.0  # the run's "wall clock" at trio time 0
FAKE_PID = 31337
LINK_NAME = "vllm-0"
# The journal's ring must hold a whole run: the checks read every record.
RING_RECORDS_MAX = 2_000_000


@dataclass
class Admission:
    """A call the hub admitted, and the send sequence numbers of its ADD frames (one per choice)."""

    call: Call
    add_seqs: list[int]
    at: float
    # Each resume after an engine restart: {choice index: (its ADD's send sequence number, tokens re-prefilled)}.
    resumes: list[dict[int, tuple[int, int]]] = field(default_factory=list)


class ObservedHub(RequestHub):
    def __init__(self, *, shell: EngineLink, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shell = shell
        self.admissions: list[Admission] = []
        self.by_wake: dict[object, Admission] = {}
        self.by_call: dict[int, Admission] = {}
        resumed = self.core.resumed

        def observed_resumed(call, sends, now, actions) -> None:
            # Every continuation of the call went out just now, one ADD each, in order: the last ones sent.
            last = self.shell.transport.send_seq
            first = last - len(sends) + 1
            self.by_call[id(call)].resumes.append({choice.index: (first + i, len(spec.prompt_token_ids) - call.prompt_tokens)
                                                   for i, (choice, spec) in enumerate(sends)})
            resumed(call, sends, now, actions)

        self.core.resumed = observed_resumed

    def admit(self, spec, now, *, wake=None):
        first = self.shell.transport.send_seq + 1
        call = super().admit(spec, now, wake=wake)
        admission = Admission(call, list(range(first, self.shell.transport.send_seq + 1)), now)
        self.admissions.append(admission)
        self.by_call[id(call)] = admission
        if wake is not None:
            self.by_wake[wake] = admission
        return call


@dataclass
class Observation:
    """What one client saw."""

    plan: ClientPlan
    attempt: int = 0  # 0, then 1.. for the client's retries of the same request
    outcome: str | None = None  # "ok", a status name, "cancelled", "closed", "unreachable"; None: never arrived
    error: str = ""
    messages: list = field(default_factory=list)
    started_at: float | None = None
    ended_at: float | None = None
    admission: Admission | None = None


@dataclass
class FaultRecord:
    at: float
    kind: str
    applied: bool
    link_state: str
    in_flight: int = 0  # calls open in the hub when it struck


@dataclass(frozen=True)
class ClientContract:
    """What the simulated clients speak: a contract's edge (``runtime/requests/contract.py``), its request
    for a plan, and a client's view of its messages as the checks read them (vLLM's GenerateResponse)."""

    edge: object
    request: Callable[[ClientPlan], object]
    view: Callable[[object], object]


VLLM_CLIENTS = ClientContract(VLLM_EDGE, ClientPlan.request, lambda message: message)


class SimServicer:
    def __init__(self, sc: Scenario, model: ModelFacts, tokenizer, contract: ClientContract = VLLM_CLIENTS) -> None:
        self.sc = sc
        self.contract = contract
        self.model = model
        self.parts: Servicer = compose(Composition(
            model=model,
            served_model_name="test-model",
            new_link=lambda journal: MemoryLink(name=LINK_NAME, config=sc.sim, journal=journal,
                                                supervision=sc.supervision, options=sc.engine),
            new_hub=lambda shell, **kwargs: ObservedHub(shell=shell, **kwargs),
            warmup=WarmupSetting(sc.warmup_level, sc.warmup_budget_s),
            drain_s=sc.drain_s,
            journal=JournalPlan(None, ring_records_max=RING_RECORDS_MAX, ring_bytes_max=1 << 30),
            tokenizer=tokenizer,
            run_record={"pid": FAKE_PID, "argv": ["enginelink", "serve", "--sim", str(sc.seed)], "engine": "vllm",
                        "port": 0, "version": "sim"},
            wall_clock=lambda: FAKE_WALL_START,
            snapshot_interval_s=sc.snapshot_interval_s,
            edge=contract.edge,
            resume=sc.resume,
        ))  # fmt: skip
        self.parts.on_failed = self._link_failed
        self.journal, self.link, self.hub, self.app = self.parts.journal, self.parts.link, self.parts.hub, self.parts.app
        self.readiness = self.parts.readiness
        self.signals_tx, self.signals_rx = trio.open_memory_channel(4)
        self.accepting = False
        self.closing = False
        self.sigterm_sent_at: float | None = None
        self.link_failed_at: float | None = None
        self.faults: list[FaultRecord] = []
        self.aborts: list[tuple[float, list[str], int]] = []
        self._handlers: trio.Nursery | None = None
        self._handlers_done = trio.Event()

    @property
    def exit_status(self) -> int | None:
        return self.parts.exit_status

    @property
    def reason(self) -> str:
        return self.parts.reason

    @property
    def serving_at(self) -> float | None:
        return self.parts.serving_at

    def _link_failed(self, message: str, now: float) -> None:
        self.link_failed_at = now

    # -- the lifetime (server.serve, in memory) ------------------------------------------

    async def serve(self) -> int:
        return await self.parts.run(self, lambda: nullcontext(self.signals_rx))

    # -- the front: what grpclib's server is to server.py ---------------------------------

    async def start(self, servicer: Servicer, nursery: trio.Nursery) -> None:
        self._handlers = await nursery.start(self._host_handlers)
        self.accepting = True  # "gRPC bound"

    def close(self) -> None:
        """grpclib's Server.close: no new calls, every running handler cancelled."""
        self.accepting = False
        self.closing = True
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()

    async def wait_closed(self) -> None:
        await self._handlers_done.wait()

    async def _host_handlers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as handlers:
                task_status.started(handlers)
                await trio.sleep_forever()
        finally:
            self._handlers_done.set()

    # -- clients --------------------------------------------------------------------------

    async def client(self, attempts: list[Observation]) -> None:
        """One client: its call, then its retries of the same request, each as soon as the last ended."""
        await trio.sleep_until(attempts[0].plan.at)
        for obs in attempts:
            if obs.attempt:
                await trio.sleep(obs.plan.retry_after_s)
            if not self.accepting:
                obs.outcome = "unreachable"
                return
            done = trio.Event()
            self._handlers.start_soon(self._handler, obs, done)
            await done.wait()

    async def _handler(self, obs: Observation, done: trio.Event) -> None:
        plan = obs.plan
        obs.started_at = trio.current_time()
        wake = TrioWake()

        async def send(message) -> None:
            if plan.slow_s:
                await trio.sleep(plan.slow_s)
            obs.messages.append(self.contract.view(message))

        try:
            with trio.CancelScope() as scope:
                if plan.cancel_after_s is not None:
                    scope.deadline = obs.started_at + plan.cancel_after_s
                try:
                    await generate(self.app, self.contract.request(plan), wake=wake, send=send,
                                   edge=self.contract.edge)
                    obs.outcome = "ok"
                except ServicerError as error:
                    obs.outcome = error.status.name
                    obs.error = str(error)
                except Exception as error:  # noqa: BLE001 - our bug: the handler would answer INTERNAL
                    obs.outcome = "INTERNAL"
                    obs.error = f"{type(error).__name__}: {error}"
            if scope.cancelled_caught:
                obs.outcome = "cancelled" if not self.closing else "closed"
        finally:
            if obs.outcome is None:
                obs.outcome = "closed"  # cancelled by the server's close, from outside the handler
            obs.ended_at = trio.current_time()
            obs.admission = self.hub.by_wake.get(wake)
            done.set()

    async def abort_rpc(self, at: float, request_ids: list[str]) -> None:
        await trio.sleep_until(at)
        if self.accepting:
            aborted = self.hub.abort(list(request_ids), "abort_rpc", trio.current_time())
            self.aborts.append((trio.current_time(), list(request_ids), aborted))

    # -- the operator and the engine's bad luck ------------------------------------------

    async def sigterm(self, at: float) -> None:
        await trio.sleep_until(at)
        try:
            self.signals_tx.send_nowait(signal.SIGTERM)
            self.sigterm_sent_at = trio.current_time()
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass

    async def fault(self, at: float, kind: str) -> None:
        await trio.sleep_until(at)
        link = self.link
        state = link.machine.state.value
        applied = {
            "kill": link.transport.kill, "core_dead": link.transport.core_dead, "garbage": link.transport.garbage,
            "disconnect": link.transport.disconnect,
            "silence": link.transport.silence, "stray": link.transport.stray,
        }[kind]()  # fmt: skip
        self.faults.append(FaultRecord(trio.current_time(), kind, applied, state, len(self.hub.calls)))

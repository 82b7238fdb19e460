"""One composition of the servicer, for the server on sockets and the simulation in memory.

``compose(Composition)`` builds the parts — journal, engine link, request
hub, app, KV relay, metrics, readiness — and wires them (batches and
failure into the hub, loads, readiness following the link). ``Servicer.run``
is the lifetime both share (DESIGN "Start", "Drain", "Engine death"):

    journal running, run.start → metrics endpoint → front open (gRPC bound:
    NOT_SERVING) → KV relay subscribed → link up (handshake) → warm-up →
    serving; then a signal → drain (exit 0), the link failing → every open
    call UNAVAILABLE (exit 1), or bring-up refusing (``core.Exit``); finally
    NOT_SERVING, KV streams ended, engine stopped, front closed, run.stop.

With engine restarts on (``Composition.resume``, docs/resume.md) an engine
that dies while serving takes the link to ``restarting`` and ``_run_engine``
starts it again: the same launch, the warm-up as configured, then every held
call re-submitted (``RequestHub.resume_held``) and the link back to
``serving``; the held calls wait no longer than the resume timeout
(``_resume_deadline``). Each start is one ``EngineLink.run``.

What differs between ``runtime/lifetime/server.py`` and ``tests/sim/servicer.py`` is a
parameter, never a copy: the link (``EngineLink`` on ZMQ sockets and a real
process, or ``MemoryLink`` over the sim core), the hub's class (the
simulation observes admissions), the front (a grpclib server, or a nursery
of in-memory handlers: anything with ``start``/``close``/``wait_closed``),
where signals come from (the OS, or a memory channel), and the wall clock
(``time.time``, or a fixed fake start so every journal byte depends on the
seed alone). Time itself is trio's in both (``MockClock`` in the simulation).

Rules: one nursery for the lifetime; every part is built before anything
runs, so a refused configuration touches nothing; readiness is never set by
hand (``runtime/lifetime/readiness.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Protocol

import trio

from enginelink.journal.files import JOURNAL_KEEP_DEFAULT, JournalLock
from enginelink.journal.journal import RING_BYTES_MAX, RING_RECORDS_MAX, Journal
from enginelink.journal.records import KIND_RUN_START, KIND_RUN_STOP
from enginelink.machines.link import LinkEvent, LinkState
from enginelink.machines.resume import RestartBudget, ResumePolicy
from enginelink.machines.warmup import WarmupSetting
from enginelink.runtime.lifetime import core
from enginelink.runtime.context.app import App
from enginelink.runtime.engine.engine_link import EngineArgsRefused, EngineIncompatible, EngineLink, LinkFailed
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.inputs import input_limits
from enginelink.runtime.contracts.shared.media import MediaService, media_settings
from enginelink.runtime.kv.kv_config import KvPlan
from enginelink.runtime.kv.kv_loads import LoadSource
from enginelink.runtime.kv.kv_metrics import KvRelayCollector
from enginelink.runtime.kv.kv_relay import KvRelayError, KvRelayShell, wall_sequence_base
from enginelink.runtime.context.link_stats import link_stats, resume_stats
from enginelink.runtime.context.metrics import Metrics, serve_metrics

from enginelink.runtime.engine.model_dir import ModelFacts
from enginelink.runtime.context.rank_metrics import RankCollector
from enginelink.runtime.lifetime.readiness import Readiness, StatusSink
from enginelink.runtime.lifetime.snapshots import SNAPSHOT_INTERVAL_S, run_snapshots
from enginelink.runtime.lifetime.warmup import warm_up
from enginelink.runtime.rpc.fastpath import MAX_CONCURRENT_STREAMS

log = logging.getLogger("enginelink")

# After close, how long the front's handlers get to end (grpclib's wait_closed).
CLOSE_WAIT_S = 2.0


@dataclass(frozen=True)
class JournalPlan:
    """The journal to open: on disk (``path``, its lock, runs kept) or in memory (``path`` None)."""

    path: Any = None
    lock: JournalLock | None = None
    keep: int = JOURNAL_KEEP_DEFAULT
    ring_records_max: int = RING_RECORDS_MAX
    ring_bytes_max: int = RING_BYTES_MAX

    def open(self) -> Journal:
        return Journal(self.path, lock=self.lock, keep=self.keep,
                       ring_records_max=self.ring_records_max, ring_bytes_max=self.ring_bytes_max)  # fmt: skip


class Front(Protocol):
    """Where calls come in: the gRPC server, or the simulation's in-memory handlers."""

    async def start(self, servicer: "Servicer", nursery: trio.Nursery) -> None:
        """Accept calls (health answers NOT_SERVING until the link serves)."""

    def close(self) -> None:
        """No new calls; running handlers are cancelled."""

    async def wait_closed(self) -> None:
        """Until every handler has ended."""


@dataclass
class Composition:
    """What one servicer is built from; the server's and the simulation's differ only here."""

    model: ModelFacts
    served_model_name: str
    # The engine link, given the journal: EngineLink (sockets, process) or MemoryLink.
    new_link: Callable[[Journal], EngineLink]
    warmup: WarmupSetting
    drain_s: float
    journal: JournalPlan = field(default_factory=JournalPlan)
    tokenizer: object | None = None
    # What run.start says besides the times: pid, argv, engine, port, version.
    run_record: dict = field(default_factory=dict)
    where: str = ""  # for the "serving" log line: host:port
    # Wall time now (the run's wall time at its start); trio's clock is the only other.
    wall_clock: Callable[[], float] = time.time
    snapshot_interval_s: float = SNAPSHOT_INTERVAL_S
    kv_events: KvPlan | None = None  # None: KV events off
    # /metrics on host:port (None: no endpoint), on listeners the caller bound (so a port in use exits 2 first).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    metrics_listeners: list | None = None
    readiness_sink: StatusSink | None = None  # grpclib's ServiceStatus for the health service
    # The contract served (runtime/requests/contract.py): its edge encodes the hub's messages; None: the core's own.
    edge: object | None = None
    # The hub, given the link and RequestHub's keyword arguments (the simulation observes it).
    new_hub: Callable[..., RequestHub] = lambda engine_link, **kwargs: RequestHub(**kwargs)
    # (model dir, the vLLM python's resolver, the engine's arguments) for media refs' processor helper;
    # None: no processor here.
    media_processor: tuple[str, Callable[[], str], list[str]] | None = None
    # Which setting decided --mm-processor ("flag"; None: the variable's or the default, as media.py reads it).
    media_source: str | None = None
    # Trace continuation (--otlp-traces-endpoint: runtime/lifetime/tracing.py); None: off.
    tracing: Any = None
    # Engine restarts and resuming the open streams (docs/resume.md); off by default. The link gets
    # its restart budget from it, the hub its resumption.
    resume: ResumePolicy = field(default_factory=ResumePolicy)


@dataclass
class Servicer:
    """The composed parts and the one lifetime that runs them."""

    plan: Composition
    journal: Journal
    link: EngineLink
    hub: RequestHub
    app: App
    readiness: Readiness
    metrics: Metrics | None = None
    kv_relay: KvRelayShell | None = None
    on_failed: Callable[[str, float], None] | None = None  # hears the link's failure (the simulation)
    serving_at: float | None = None
    exit_status: int | None = None
    reason: str = ""

    async def run(self, front: Front, signals: Callable[[], AbstractContextManager[AsyncIterator[int]]],
                  task_status=trio.TASK_STATUS_IGNORED) -> int:  # fmt: skip
        """Run until drained (0), failed (1) or refused (2); ``task_status.started(app)`` once serving."""
        exit_status, reason = 1, "unknown"
        async with trio.open_nursery() as nursery:
            await self._start_recording(nursery)
            await self._start_metrics(nursery)
            await front.start(self, nursery)
            if self.app.media is not None:
                nursery.start_soon(self.app.media.run)  # under --mm-processor redis: the sidecar's hello watch
            failed = trio.Event()
            core.connect(self.link, self.hub, self.app, failed, self.on_failed)
            try:
                with signals() as received:
                    bring_up = functools.partial(self._bring_up, nursery, task_status)
                    exit_status, reason = await core.wait_for_end(received, failed, self.link, bring_up)
                    if exit_status == 0:
                        await core.drain(self.app, self.plan.drain_s)
                    else:
                        await trio.sleep(core.FAIL_FLUSH_S)
            except core.Exit as stop:
                exit_status, reason = stop.status, stop.reason
            finally:
                await self._stop(front, exit_status, reason)
                nursery.cancel_scope.cancel()
        self.exit_status, self.reason = exit_status, reason
        log.info("exiting with status %d: %s", exit_status, reason)
        return exit_status

    # -- the steps ---------------------------------------------------------------------------

    async def _start_recording(self, nursery: trio.Nursery) -> None:
        """The journal's flusher, the run.start record, periodic snapshots."""
        await nursery.start(self.journal.run)
        self.journal.append(self.app.run_start_trio, "run", KIND_RUN_START, {
            "wall_time": self.app.run_start_wall, "trio_time": self.app.run_start_trio, **self.plan.run_record,
        })  # fmt: skip
        nursery.start_soon(functools.partial(run_snapshots, self.journal, interval_s=self.plan.snapshot_interval_s))

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        """Bound before the engine starts, so a scrape during start-up says "starting"."""
        if self.metrics is not None:
            plan = self.plan
            await nursery.start(functools.partial(serve_metrics, self.metrics, plan.metrics_host, plan.metrics_port,
                                                  listeners=plan.metrics_listeners))

    async def _bring_up(self, nursery: trio.Nursery, task_status) -> None:
        """KV relay, handshake, warm-up, then serving: raced against signals and failure."""
        link, app = self.link, self.app
        if self.kv_relay is not None:
            # Subscribed before the engine starts: the history starts with its first batch.
            try:
                await nursery.start(self.kv_relay.run)
            except KvRelayError as error:
                raise core.Exit(2, str(error)) from None
        try:
            await nursery.start(self._run_engine)
        except LinkFailed as error:
            # 2: the engine is not the release the launch check verified,
            # or it refused its arguments (a typo a restart would repeat).
            refused = isinstance(error, (EngineIncompatible, EngineArgsRefused))
            raise core.Exit(2 if refused else 1, str(error)) from None
        app.loads.served = link.ranks.ranks  # GetLoads names every DP rank from now
        if self.kv_relay is not None:
            await self.kv_relay.after_handshake(link.ready)
        if link.machine.state is LinkState.WARMING_UP:
            await warm_up(self.plan.warmup, link=link, hub=self.hub, limits=app.limits)
        if link.machine.can(LinkEvent.WARMUP_DONE):
            link.step(LinkEvent.WARMUP_DONE)  # health SERVING: readiness follows the link
            self.serving_at = trio.current_time()
            log.info("serving %s on %s", self.plan.served_model_name, self.plan.where or "memory")
            task_status.started(app)

    # -- the engine's starts ----------------------------------------------------------------

    async def _run_engine(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The engine's first start (``started`` once it is up; a failure raised bare), then, each time
        it dies with restarts on, its restart and the held calls' resumption."""
        link = self.link
        failure: LinkFailed | None = None
        async with trio.open_nursery() as engine:
            try:
                await engine.start(link.run)
            except LinkFailed as error:
                failure = error
            else:
                task_status.started()
        if failure is not None:
            raise failure
        while link.machine.state is LinkState.RESTARTING:
            await self._restart()

    async def _restart(self) -> None:
        """One start of the engine after a crash: up, warm-up, the held calls re-submitted, serving;
        returns when that engine is gone again (or failed to start: another crash, or the end)."""
        link, hub = self.link, self.hub
        async with trio.open_nursery() as engine:

            async def run_link(task_status=trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await link.run(task_status)
                finally:  # this start's engine is gone: its warm-up and the deadline go with it
                    engine.cancel_scope.cancel()

            deadline = trio.CancelScope()
            engine.start_soon(self._resume_deadline, deadline)
            crashes = link.restart_budget.restarts  # a crash of this start's engine counts one more
            try:
                await engine.start(run_link)
            except LinkFailed:
                return  # it died starting: another crash (the loop goes on) or the link failed
            if link.machine.state is LinkState.RESTARTING:  # not if a drain began meanwhile
                await warm_up(self.plan.warmup, link=link, hub=hub, limits=self.app.limits)
            # Not if this start's engine is gone already (it may die before this task runs again, its
            # link.run still unwinding), nor if a drain began meanwhile.
            gone = engine.cancel_scope.cancel_called or link.restart_budget.restarts != crashes
            if not gone and link.machine.can(LinkEvent.RESTARTED):
                resumed = hub.resume_held(trio.current_time())
                log.warning("engine restarted: %d held request(s) resumed", resumed)
                link.step(LinkEvent.RESTARTED)  # health SERVING again
            deadline.cancel()

    async def _resume_deadline(self, scope: trio.CancelScope) -> None:
        """Fail each held call once it has waited the resume timeout (until ``scope`` is cancelled)."""
        hub, timeout_s = self.hub, self.plan.resume.resume_timeout_s
        with scope:
            while hub.held:  # none is held anew while restarting: once none is left, none will be
                await trio.sleep_until(min(call.held_at for call in hub.held.values()) + timeout_s)
                hub.fail_held(f"the engine did not come back within ENGINELINK_RESUME_TIMEOUT_SECS={timeout_s:g} s "
                              "of its crash; the request was not resumed; retry", trio.current_time(),
                              waited_s=timeout_s)

    async def _stop(self, front: Front, exit_status: int, reason: str) -> None:
        """NOT_SERVING, KV streams ended, engine stopped, front closed, run.stop; shielded."""
        self.readiness.close()
        if self.kv_relay is not None:
            self.kv_relay.close()  # every KV event stream ends UNAVAILABLE
        with trio.CancelScope(shield=True):
            await self.link.stop_engine()
            if self.app.media is not None:
                await self.app.media.aclose()  # the media processor helper, if one was started
            front.close()
            with trio.move_on_after(CLOSE_WAIT_S):
                await front.wait_closed()
            if self.app.tracing is not None:
                await self.app.tracing.aclose()  # every call's span ended: the queued ones get a bounded send
            self.journal.append(trio.current_time(), "run", KIND_RUN_STOP, {"exit_status": exit_status, "reason": reason})


def compose(plan: Composition) -> Servicer:
    """Build every part of one servicer and wire them; nothing runs yet (call inside trio)."""
    journal = plan.journal.open()
    link = plan.new_link(journal)
    if plan.resume.enabled:
        link.restart_budget = RestartBudget(plan.resume)
    metrics = Metrics(plan.served_model_name) if plan.metrics_port is not None else None
    hub = plan.new_hub(
        link,
        link=link.machine,
        codec=link.codec,
        send_frames=link.send,
        journal=journal,
        edge=plan.edge,
        ranks=link.ranks,
        tokenizer=plan.tokenizer,
        cached_tokens=link.codec.cached_tokens,
        metrics=metrics,
        resume=plan.resume,
    )
    run_start_trio = trio.current_time()
    app = App(link=link, hub=hub, journal=journal, model=plan.model, served_model_name=plan.served_model_name,
              run_start_wall=plan.wall_clock(), run_start_trio=run_start_trio,
              media=MediaService(_media_settings(plan), registry=metrics.registry if metrics is not None else None,
                                 labels={"model": plan.served_model_name, "rank": "0"},
                                 model_dir=plan.media_processor[0] if plan.media_processor else None,
                                 processor_python=plan.media_processor[1] if plan.media_processor else None,
                                 engine_args=list(plan.media_processor[2]) if plan.media_processor else None))
    if plan.tracing is not None:
        from enginelink.runtime.lifetime.tracing import Tracing  # imports OpenTelemetry: only when tracing

        app.tracing = Tracing(plan.tracing, wall_time=app.wall_time, decode=link.codec.decode_output)
        app.tracing.attach(journal)
    readiness = Readiness(link.machine.state, plan.readiness_sink)
    link.on_transition = readiness.follow
    kv_relay = _kv_relay(plan, journal, link, hub, app)
    servicer = Servicer(plan, journal, link, hub, app, readiness, metrics, kv_relay)
    if metrics is not None:
        _watch(metrics, servicer)
    return servicer


def _media_settings(plan: Composition):
    settings = media_settings()
    return replace(settings, processor_source=plan.media_source) if plan.media_source else settings


def _kv_relay(plan: Composition, journal: Journal, link: EngineLink, hub: RequestHub, app: App) -> KvRelayShell | None:
    if plan.kv_events is None:
        return None
    loads = LoadSource(
        app.loads,
        limits=lambda: (app.max_num_seqs, app.kv_capacity_tokens),
        last_frame_at=lambda: link.last_frame_at if link.ready else None,
        in_flight_since=hub.oldest_admitted_at,
        prefill_pending=lambda: core.pending_prefill_tokens(hub),
    )
    return KvRelayShell(plan.kv_events, journal, loads, wall_time=app.wall_time,
                        sequence_base=wall_sequence_base(app.run_start_wall))  # fmt: skip


def _watch(metrics: Metrics, servicer: Servicer) -> None:
    """What /metrics reads of the parts (the front adds its own: gRPC, the asyncio loop)."""
    link, hub = servicer.link, servicer.hub
    metrics.watch_state(lambda: link.machine.state)
    metrics.watch_in_flight(lambda: hub.active_requests)
    metrics.add_gauges("journal", servicer.journal.stats)
    metrics.add_gauges("link", lambda: link_stats(link, hub, MAX_CONCURRENT_STREAMS))
    metrics.add_gauges("input_max", input_limits)  # the ENGINELINK_MAX_* request-input bounds
    metrics.add_gauges("resume", lambda: resume_stats(link, hub))  # engine restarts (docs/resume.md)
    metrics.add_collector(lambda labels: RankCollector(link.ranks, servicer.app.loads, labels))
    if servicer.app.tracing is not None:
        metrics.add_gauges("trace", servicer.app.tracing.stats)
    if servicer.kv_relay is not None:
        relay = servicer.kv_relay
        metrics.add_collector(lambda labels: KvRelayCollector(relay, labels))

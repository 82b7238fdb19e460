"""The servicer's lifetime: one trio nursery around journal, gRPC server and engine link.

Order (DESIGN "Start"): the journal's lock → the gRPC and metrics ports bound →
the journal (the last run's file set aside, a new one opened) → gRPC serving
(health NOT_SERVING, HealthCheck "Engine is starting") → engine launched and
handshaken → warm-up → serving. The lock and the binds come first so that a
start that cannot work (a journal another servicer owns, a port in use)
exits 2 (``core.Exit``) having touched no journal file.
Then the servicer waits for one of: a signal (SIGTERM/SIGINT → drain, exit 0)
or the link failing (every open call ends UNAVAILABLE, exit 1 so the
supervisor restarts the pair).

grpclib runs on asyncio inside trio via trio-asyncio; the only trio↔asyncio
crossings are start/stop of the server and rare utility calls, never per token.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health

from enginelink.journal.files import (
    JOURNAL_KEEP_DEFAULT, JournalBusy, JournalLock, read_run_file, remove_run_file, write_run_file,
)
from enginelink.journal.journal import Journal
from enginelink.journal.records import KIND_RUN_START, KIND_RUN_STOP
from enginelink.machines.link import LinkEvent, LinkState
from enginelink.machines.liveness import ProbeTiming
from enginelink.machines.warmup import WarmupLevel, WarmupSetting
from enginelink.runtime import core
from enginelink.runtime.aio_loop import run_ready_callbacks_together
from enginelink.runtime.app import App
from enginelink.runtime.engine_process import ENGINE_NICE_DEFAULT, PLACEMENT_DEFAULT, SERVICER_SCHED_DEFAULT
from enginelink.runtime.engine_link import EngineArgsRefused, EngineIncompatible, EngineLink, LinkFailed, Supervision
from enginelink.runtime.grpc_limits import GrpcLimits
from enginelink.runtime.grpc_transport import MAX_CONCURRENT_STREAMS, CoalescingServer, FrameWrites
from enginelink.runtime.grpc_vllm import VllmEngineService
from enginelink.runtime.hub import RETIRED_ENGINE_IDS_MAX, RequestHub
from enginelink.runtime.kv_config import KvPlan
from enginelink.runtime.kv_loads import LoadSource
from enginelink.runtime.kv_metrics import KvRelayCollector
from enginelink.runtime.kv_relay import KvRelayError, KvRelayShell, wall_sequence_base
from enginelink.runtime.launchers import EngineLauncher
from enginelink.runtime.metrics import Metrics, serve_metrics
from enginelink.runtime.rank_metrics import RankCollector
from enginelink.runtime.model_dir import ModelFacts, load_tokenizer
from enginelink.runtime.snapshots import run_snapshots
from enginelink.runtime.inputs import input_limits
from enginelink.runtime.warmup import warm_up
from enginelink.wire import codecs

log = logging.getLogger("enginelink")



@dataclass
class ServeConfig:
    launcher: EngineLauncher
    model: ModelFacts
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 50051
    journal_path: Path | None = None
    journal_keep: int = JOURNAL_KEEP_DEFAULT  # previous runs' journals kept (ENGINELINK_JOURNAL_KEEP)
    startup_timeout_s: float = 1800.0
    startup_ceiling_s: float = 14400.0  # 0 = no ceiling
    silence_timeout_s: float = 300.0
    prefill_tokens_per_s: float = 2000.0
    drain_s: float = 5.0
    engine_stop_grace_s: float = 5.0  # after SIGTERM, before SIGKILL to the engine's session
    idle_probe_s: float = 5.0  # an idle engine quiet this long gets a liveness probe; 0 = none
    idle_probe_timeout_s: float = 30.0  # an unanswered probe fails the link after this
    engine_nice: int = ENGINE_NICE_DEFAULT  # nice levels below the servicer
    servicer_sched: str = SERVICER_SCHED_DEFAULT  # the servicer's policy once the engine runs
    placement: str = PLACEMENT_DEFAULT  # keep off the CPUs the engine binds (engine_process.place_front_end)
    warmup: WarmupSetting = field(default_factory=lambda: WarmupSetting(WarmupLevel.FULL, 300.0))
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # no endpoint unless asked
    kv_events: KvPlan | None = None  # None: KV events off (SubscribeKvEvents is UNIMPLEMENTED)
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)  # message size, connections (grpc_limits.py)
    argv: list[str] = field(default_factory=list)


async def serve(config: ServeConfig, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run until drained (0) or failed (1); ``task_status.started(app)`` once serving.

    Raises ``core.Exit(2, reason)`` before touching any journal file when the
    journal is another live process's or a port cannot be bound.
    """
    lock = None
    if config.journal_path is not None:
        try:
            lock = JournalLock(config.journal_path).acquire()
        except JournalBusy as error:
            raise core.Exit(2, str(error)) from None
    try:
        grpc_sock = _bind_grpc(config.host, config.port)
        try:
            metrics_listeners = None
            if config.metrics_port is not None:
                try:
                    metrics_listeners = await trio.open_tcp_listeners(config.metrics_port, host=config.metrics_host)
                except OSError as error:
                    raise core.Exit(2, _bind_refused("metrics", config.metrics_host, config.metrics_port, error)) from None
            journal = Journal(config.journal_path, lock=lock, keep=config.journal_keep)
            if config.journal_path is None:
                return await _serve(config, journal, grpc_sock, metrics_listeners, task_status)
            write_run_file(config.port, config.journal_path, host=config.host)
            try:
                return await _serve(config, journal, grpc_sock, metrics_listeners, task_status)
            finally:
                remove_run_file(config.port)  # only a killed servicer's stays, for the post-mortem
        finally:
            grpc_sock.close()  # the server closed it as it stopped; not if it never started
    finally:
        if lock is not None:
            lock.release()


def _bind_grpc(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (the first address ``host`` resolves to), or ``core.Exit(2)``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise core.Exit(2, f"gRPC address {host}:{port}: {error.strerror or error}") from None
    try:
        # What asyncio's create_server sets: reuse a port in TIME_WAIT, v6 means v6 only.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError as error:
        sock.close()
        raise core.Exit(2, _bind_refused("gRPC", host, port, error)) from None
    return sock


def _bind_refused(what: str, host: str, port: int, error: OSError) -> str:
    """One line: which port, why, and (when enginelink knows it) which process holds it."""
    if error.errno == errno.EADDRINUSE:
        holder = ""
        recorded = read_run_file(port)
        if recorded and isinstance(recorded.get("pid"), int) and _alive(recorded["pid"]):
            holder = f" by process {recorded['pid']} (an enginelink servicer, journal {recorded['journal']})"
        return (f"{what} port {host}:{port} is in use{holder}; stop that one first, "
                f"or pick another --{'metrics-' if what == 'metrics' else ''}port")
    return f"cannot bind the {what} port {host}:{port}: {error.strerror or error}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


async def _serve(config: ServeConfig, journal: Journal, grpc_sock: socket.socket, metrics_listeners,
                 task_status) -> int:
    run_start_trio = trio.current_time()
    run_start_wall = time.time()
    codec = codecs.get(config.launcher.engine)
    exit_status = 1
    reason = "unknown"
    async with trio_asyncio.open_loop() as loop:
        loop_stats = run_ready_callbacks_together(loop)  # runtime/aio_loop.py: less trio per gRPC call
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            journal.append(
                run_start_trio,
                "run",
                KIND_RUN_START,
                {
                    "wall_time": run_start_wall,
                    "trio_time": run_start_trio,
                    "pid": os.getpid(),
                    "argv": config.launcher.redacted(config.argv),
                    "engine": config.launcher.engine,
                    "port": config.port,
                    "version": _version(),
                },
            )
            nursery.start_soon(run_snapshots, journal)
            link = EngineLink(
                name=f"{config.launcher.engine}-0",
                launcher=config.launcher,
                codec=codec,
                journal=journal,
                supervision=Supervision(
                    startup_timeout_s=config.startup_timeout_s,
                    startup_ceiling_s=config.startup_ceiling_s,
                    silence_timeout_s=config.silence_timeout_s,
                    prefill_tokens_per_s=config.prefill_tokens_per_s,
                    stop_grace_s=config.engine_stop_grace_s,
                    idle_probe=ProbeTiming(config.idle_probe_s, config.idle_probe_timeout_s),
                ),
                engine_nice=config.engine_nice,
                servicer_sched=config.servicer_sched,
                placement=config.placement,
            )
            metrics = Metrics(config.served_model_name) if config.metrics_port is not None else None
            hub = RequestHub(
                link=link.machine,
                codec=codec,
                send_frames=link.send,
                journal=journal,
                edge=VllmEngineService.edge,  # the contract served: its edge encodes the hub's messages
                ranks=link.ranks,
                tokenizer=_tokenizer_or_none(config.model),
                cached_tokens=codec.cached_tokens,
                metrics=metrics,
            )
            if metrics is not None:
                metrics.watch_state(lambda: link.machine.state)
                metrics.watch_in_flight(lambda: hub.active_requests)
                metrics.add_gauges("journal", journal.stats)
                metrics.add_gauges("link", lambda: _link_stats(link, hub))
                metrics.add_gauges("input_max", input_limits)  # the ENGINELINK_MAX_* request-input bounds
                metrics.add_gauges("asyncio", lambda: loop_stats)
                # Bound before the engine starts, so a scrape during start-up says "starting".
                await nursery.start(functools.partial(
                    serve_metrics, metrics, config.metrics_host, config.metrics_port, listeners=metrics_listeners))
            app = App(
                link=link,
                hub=hub,
                journal=journal,
                model=config.model,
                served_model_name=config.served_model_name,
                run_start_wall=run_start_wall,
                run_start_trio=run_start_trio,
            )
            if metrics is not None:
                metrics.add_collector(lambda labels: RankCollector(link.ranks, app.loads, labels))
            kv_relay = None
            if config.kv_events is not None:
                loads = LoadSource(
                    app.loads,
                    limits=lambda: (app.max_num_seqs, app.kv_capacity_tokens),
                    last_frame_at=lambda: link.last_frame_at if link.ready else None,
                    in_flight_since=hub.oldest_admitted_at,
                    prefill_pending=lambda: core.pending_prefill_tokens(hub),
                )
                kv_relay = KvRelayShell(config.kv_events, journal, loads, wall_time=app.wall_time,
                                        sequence_base=wall_sequence_base(run_start_wall))  # fmt: skip
                if metrics is not None:
                    metrics.add_collector(lambda labels: KvRelayCollector(kv_relay, labels))
            readiness = ServiceStatus()
            readiness.set(False)
            frame_writes = FrameWrites()
            hub.end_of_batch = frame_writes.flush  # the direct path's writes go out once per engine frame
            engine_service = VllmEngineService(app, frame_writes, kv_relay)
            if metrics is not None:
                metrics.add_gauges("grpc", frame_writes.stats)
            # grpclib names the service by the servicer object; "" (overall) gets
            # the same check, so liveness and readiness agree.
            health = Health({engine_service: [readiness]})
            server = CoalescingServer([engine_service, health], limits=config.grpc_limits)
            if metrics is not None:
                metrics.add_gauges("grpc", server.guard.read)
            await trio_asyncio.aio_as_trio(server.start)(sock=grpc_sock)
            log.info("gRPC bound on %s:%d (health NOT_SERVING until the engine is up)", config.host, config.port)

            failed = trio.Event()
            core.connect(link, hub, app, readiness, failed)
            try:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

                    async def bring_up() -> None:
                        """Handshake, warm-up, then readiness: raced against signals and failure."""
                        if kv_relay is not None:
                            # Subscribed before the engine starts: the history starts with its first batch.
                            try:
                                await nursery.start(kv_relay.run)
                            except KvRelayError as error:
                                raise core.Exit(2, str(error)) from None
                        try:
                            await nursery.start(link.run)
                        except LinkFailed as error:
                            # 2: the engine is not the release the launch check verified,
                            # or it refused its arguments (a typo a restart would repeat).
                            refused = isinstance(error, (EngineIncompatible, EngineArgsRefused))
                            raise core.Exit(2 if refused else 1, str(error)) from None
                        app.loads.served = link.ranks.ranks  # GetLoads names every DP rank from now
                        if kv_relay is not None:
                            await kv_relay.after_handshake(link.ready)
                        if link.machine.state is LinkState.WARMING_UP:
                            await warm_up(config.warmup, link=link, hub=hub, limits=app.limits)
                        if link.machine.can(LinkEvent.WARMUP_DONE):
                            link.step(LinkEvent.WARMUP_DONE)
                            readiness.set(True)
                            log.info("serving %s on %s:%d", config.served_model_name, config.host, config.port)
                            task_status.started(app)

                    exit_status, reason = await core.wait_for_end(signals, failed, link, bring_up)
                    if exit_status == 0:
                        await core.drain(app, readiness, config.drain_s)
                    else:
                        await trio.sleep(core.FAIL_FLUSH_S)
            except core.Exit as stop:
                exit_status, reason = stop.status, stop.reason
            finally:
                readiness.set(False)
                if kv_relay is not None:
                    kv_relay.close()  # every KV event stream ends UNAVAILABLE
                with trio.CancelScope(shield=True):
                    await link.stop_engine()
                    server.close()
                    with trio.move_on_after(2):
                        await trio_asyncio.aio_as_trio(server.wait_closed)()
                    journal.append(trio.current_time(), "run", KIND_RUN_STOP, {"exit_status": exit_status, "reason": reason})
                nursery.cancel_scope.cancel()
    log.info("exiting with status %d: %s", exit_status, reason)
    return exit_status


def _tokenizer_or_none(model: ModelFacts):
    if not model.tokenizer_path:
        return None
    try:
        return load_tokenizer(model.tokenizer_path)
    except Exception as error:  # a broken tokenizer only disables stop strings
        print(f"enginelink: cannot load the tokenizer ({error}); stop strings will be refused", file=sys.stderr)
        return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("enginelink")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class LinkStats:
    frames_received: int
    late_outputs: int
    in_flight_max: int
    # The hub's other bounds and what they caught (runtime/hub.py).
    retired_engine_ids: int
    retired_engine_ids_max: int
    renamed_calls: int
    send_errors: int
    # The gRPC side: streams one connection may carry, and the direct write path.
    max_concurrent_streams: int
    direct_writes: int
    direct_handovers: int
    # Supervision: liveness probes sent to the idle engine, their bounds, the stop's grace.
    idle_probes: int
    idle_probe_interval_seconds: float
    idle_probe_timeout_seconds: float
    engine_stop_grace_seconds: float
    # Stop strings of the calls that ended: text matched, automaton steps (<= 2 per character).
    stop_chars: int = 0
    stop_steps: int = 0
    # Calls failed because the engine's logprob arrays could not be read (the engine's fault).
    logprob_errors: int = 0
    # PD: refused decode legs sent to the engine pre-aborted, so the prefill side frees its KV.
    kv_releases: int = 0


def _link_stats(link: EngineLink, hub: RequestHub) -> LinkStats:
    sup = link.supervision
    return LinkStats(
        link.frames_received, hub.late_outputs, hub.in_flight_max,
        len(hub.retired), RETIRED_ENGINE_IDS_MAX, hub.renamed, hub.send_errors,
        MAX_CONCURRENT_STREAMS, hub.direct_writes, hub.direct_handovers,
        link.idle_probe.probes_sent, sup.idle_probe.interval_s, sup.idle_probe.timeout_s, sup.stop_grace_s,
        hub.stop_chars, hub.stop_steps, hub.logprob_errors, hub.kv_releases,
    )

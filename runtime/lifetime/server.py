"""The servicer's lifetime on sockets: ports, the journal's files, a grpclib server.

Order (DESIGN "Start"): the journal's lock → the gRPC and metrics ports bound →
the journal (the last run's file set aside, a new one opened) → gRPC serving
(health NOT_SERVING, HealthCheck "Engine is starting") → engine launched and
handshaken → warm-up → serving. The lock and the binds come first so that a
start that cannot work (a journal another servicer owns, a port in use)
exits 2 (``core.Exit``) having touched no journal file.
Then the servicer waits for one of: a signal (SIGTERM/SIGINT → drain, exit 0)
or the link failing (every open call ends UNAVAILABLE, exit 1 so the
supervisor restarts the pair).

Everything after the binds is ``runtime/lifetime/compose.py``'s, shared with the
simulation: this file adds what only a real server has — the ports and the
run file (``_claim``), an ``EngineLink`` launching a real engine
(``_new_link``), the grpclib server with its health service (``GrpcFront``),
the OS's signals and the wall clock.

grpclib runs on asyncio inside trio via trio-asyncio; the only trio↔asyncio
crossings are start/stop of the server and rare utility calls, never per token.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health

from enginelink.journal.files import (
    JOURNAL_KEEP_DEFAULT, JournalBusy, JournalLock, read_run_file, remove_run_file, write_run_file,
)
from enginelink.machines.liveness import ProbeTiming
from enginelink.machines.resume import ResumePolicy
from enginelink.machines.warmup import WarmupLevel, WarmupSetting
from enginelink.runtime.lifetime import core
from enginelink.runtime.lifetime.gc_policy import GcPolicy
from enginelink.journal.ring import RING_RECORDS_MAX
from enginelink.runtime.context.metrics import task_counts
from enginelink.runtime.lifetime.compose import Composition, JournalPlan, Servicer, compose
from enginelink.runtime.contracts.shared.media import media_record, media_settings
from enginelink.runtime.engine.placement import ENGINE_NICE_DEFAULT, PLACEMENT_DEFAULT, SERVICER_SCHED_DEFAULT
from enginelink.runtime.engine.engine_link import EngineLink, Supervision
from enginelink.runtime.engine.engine_processes import become_subreaper
from enginelink.runtime.rpc.grpc_limits import GrpcLimits
from enginelink.runtime.rpc.fastpath import FrameWrites, GrpcServer, run_ready_callbacks_together
from enginelink.runtime.rpc.reflection import with_reflection
from enginelink.runtime.lifetime.engines import CONTRACTS
from enginelink.runtime.kv.kv_config import KvPlan
from enginelink.runtime.engine.launchers import EngineLauncher
from enginelink.runtime.engine.model_dir import ModelFacts, load_tokenizer
from enginelink.wire import codecs

log = logging.getLogger("enginelink")

@dataclass
class ServeConfig:
    launcher: EngineLauncher
    model: ModelFacts
    served_model_name: str
    # The directory the model's facts were read from (a Hub id's snapshot: runtime/engine/model_source.py);
    # None: the launcher's. The media processor reads the model's processor files there.
    model_dir: Path | None = None
    # "flag" where --mm-processor decided (the GetServerInfo label and the start-up line say which setting did).
    media_source: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    journal_path: Path | None = None
    journal_keep: int = JOURNAL_KEEP_DEFAULT  # previous runs' journals kept (ENGINELINK_JOURNAL_KEEP)
    journal_ring_records: int = RING_RECORDS_MAX  # the in-memory ring's records (ENGINELINK_JOURNAL_RING_RECORDS)
    startup_timeout_s: float = 1800.0
    startup_ceiling_s: float = 14400.0  # 0 = no ceiling
    silence_timeout_s: float = 300.0
    prefill_tokens_per_s: float = 2000.0
    drain_s: float = 5.0
    engine_stop_grace_s: float = 5.0  # after SIGTERM, before SIGKILL to all of the engine
    idle_probe_s: float = 5.0  # an idle engine quiet this long gets a liveness probe; 0 = none
    idle_probe_timeout_s: float = 30.0  # an unanswered probe fails the link after this
    engine_nice: int = ENGINE_NICE_DEFAULT  # nice levels below the servicer
    servicer_sched: str = SERVICER_SCHED_DEFAULT  # the servicer's policy once the engine runs
    placement: str = PLACEMENT_DEFAULT  # keep off the CPUs the engine binds (placement.place_front_end)
    warmup: WarmupSetting = field(default_factory=lambda: WarmupSetting(WarmupLevel.FULL, 300.0))
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # no endpoint unless asked
    kv_events: KvPlan | None = None  # None: KV events off (SubscribeKvEvents is UNIMPLEMENTED)
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)  # message size, connections (grpc_limits.py)
    fast_path: bool = True  # ENGINELINK_FAST_PATH: off, grpclib's own send path only (runtime/rpc/fastpath.py)
    gc_policy: GcPolicy = field(default_factory=GcPolicy)  # set at SERVING (runtime/lifetime/gc_policy.py)
    argv: list[str] = field(default_factory=list)
    # The wire's codec and the contract served (runtime/lifetime/engines.py, ``serve --wire``).
    codec: str = "vllm"
    contract: str = "vllm"
    # Engine restarts and resuming the open streams (docs/resume.md); off by default.
    resume: ResumePolicy = field(default_factory=ResumePolicy)
    otlp_traces_endpoint: str | None = None  # trace continuation's collector (runtime/lifetime/tracing.py); None: off


async def serve(config: ServeConfig, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run until drained (0) or failed (1); ``task_status.started(app)`` once serving.

    Raises ``core.Exit(2, reason)`` before touching any journal file when the
    journal is another live process's or a port cannot be bound.
    """
    lock = _lock_journal(config)
    try:
        grpc_sock = _bind_grpc(config.host, config.port)
        try:
            metrics_listeners = await _bind_metrics(config)
            if config.journal_path is None:
                return await _serve(config, JournalPlan(None, lock, config.journal_keep, config.journal_ring_records), grpc_sock,
                                    metrics_listeners, task_status)  # fmt: skip
            write_run_file(config.port, config.journal_path, host=config.host)
            try:
                return await _serve(config, JournalPlan(config.journal_path, lock, config.journal_keep,
                                                             config.journal_ring_records), grpc_sock,
                                    metrics_listeners, task_status)  # fmt: skip
            finally:
                remove_run_file(config.port)  # only a killed servicer's stays, for the post-mortem
        finally:
            grpc_sock.close()  # the server closed it as it stopped; not if it never started
    finally:
        if lock is not None:
            lock.release()


def _lock_journal(config: ServeConfig) -> JournalLock | None:
    """The journal's lock, or ``core.Exit(2)`` when another live servicer holds it."""
    if config.journal_path is None:
        return None
    try:
        return JournalLock(config.journal_path).acquire()
    except JournalBusy as error:
        raise core.Exit(2, str(error)) from None


async def _bind_metrics(config: ServeConfig) -> list | None:
    """The metrics port's listeners (None: no endpoint), or ``core.Exit(2)``."""
    if config.metrics_port is None:
        return None
    try:
        return await trio.open_tcp_listeners(config.metrics_port, host=config.metrics_host)
    except OSError as error:
        raise core.Exit(2, _bind_refused("metrics", config.metrics_host, config.metrics_port, error)) from None


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


async def _serve(config: ServeConfig, journal: JournalPlan, grpc_sock: socket.socket, metrics_listeners,
                 task_status) -> int:
    status = ServiceStatus()  # the health service's; readiness (runtime/lifetime/readiness.py) sets it
    servicer = compose(_composition(config, journal, metrics_listeners, status))
    async with trio_asyncio.open_loop() as loop:
        loop_stats = run_ready_callbacks_together(loop)  # runtime/rpc/fastpath.py: less trio per gRPC call
        if servicer.metrics is not None:
            servicer.metrics.add_gauges("asyncio", lambda: loop_stats)
            servicer.metrics.add_gauges("gc", config.gc_policy.stats)
            servicer.metrics.add_gauges("tasks", lambda: task_counts(loop))
        front = GrpcFront(config, grpc_sock, status)
        signals = lambda: trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)  # noqa: E731
        return await servicer.run(front, signals, _OnServing(task_status, config.gc_policy.apply))


class _OnServing:
    """The serve task's status: ``on_serving`` runs once serving begins, before the caller hears of it."""

    def __init__(self, task_status, on_serving) -> None:
        self.task_status, self.on_serving = task_status, on_serving

    def started(self, value=None) -> None:
        self.on_serving()
        self.task_status.started(value)


def _composition(config: ServeConfig, journal: JournalPlan, metrics_listeners, status: ServiceStatus) -> Composition:
    """The parts of a servicer on sockets, from its configuration."""
    return Composition(
        model=config.model,
        served_model_name=config.served_model_name,
        new_link=lambda journal: _new_link(config, journal),
        warmup=config.warmup,
        drain_s=config.drain_s,
        journal=journal,
        tokenizer=_tokenizer_or_none(config.model),
        run_record={
            "pid": os.getpid(),
            "argv": config.launcher.redacted(config.argv),
            "engine": config.launcher.engine,
            "port": config.port,
            "version": _version(),
            "media": media_record(media_settings(), config.media_source),  # enginelink inspect shows the bounds
        },
        where=f"{config.host}:{config.port}",
        media_processor=_media_processor(config.launcher, config.model_dir),
        media_source=config.media_source,
        kv_events=config.kv_events,
        metrics_host=config.metrics_host,
        metrics_port=config.metrics_port,
        metrics_listeners=metrics_listeners,
        readiness_sink=status,
        edge=CONTRACTS[config.contract].service.edge,  # the contract served: its edge encodes the hub's messages
        resume=config.resume,
        tracing=_tracing(config),
    )


def _tracing(config: ServeConfig):
    """--otlp-traces-endpoint's plan: a span per Generate call, to that collector; None: off."""
    if not config.otlp_traces_endpoint:
        return None
    from enginelink.runtime.lifetime.tracing import TracingPlan

    return TracingPlan(config.otlp_traces_endpoint, rpc_service=CONTRACTS[config.contract].health_name,
                       model=config.served_model_name)


def _new_link(config: ServeConfig, journal) -> EngineLink:
    """The engine link: the engine's process through the contract's transport, supervised.

    The servicer adopts the orphans of its engine's processes (a child subreaper), so that one which
    left the engine's process group and outlived its parent is still found and stopped."""
    become_subreaper()
    return EngineLink(
        name=f"{config.launcher.engine}-0",
        launcher=config.launcher,
        transport=CONTRACTS[config.contract].transport(config.launcher, config.model.max_position_embeddings),
        codec=codecs.get(config.codec, getattr(config.launcher, "wire_release", None)),  # the vLLM release checked
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


class GrpcFront:
    """The grpclib server: the engine service, grpc.health.v1 and server reflection, on the bound socket."""

    def __init__(self, config: ServeConfig, sock: socket.socket, status: ServiceStatus) -> None:
        self.config = config
        self.sock = sock
        self.status = status
        self.server: GrpcServer | None = None

    async def start(self, servicer: Servicer, nursery: trio.Nursery) -> None:
        config, metrics = self.config, servicer.metrics
        frame_writes = FrameWrites(config.fast_path)
        servicer.hub.end_of_batch = frame_writes.flush  # the direct path's writes go out once per engine frame
        engine_service = CONTRACTS[config.contract].service(servicer.app, frame_writes, servicer.kv_relay)
        if hasattr(engine_service, "configure"):  # a contract that reads the launch (its server_args, ...)
            engine_service.configure(config.launcher)
        # grpclib names the service by the servicer object; "" (overall) gets
        # the same check, so liveness and readiness agree.
        health = Health({engine_service: [self.status]})
        self.server = server = GrpcServer(with_reflection([engine_service, health]), limits=config.grpc_limits,
                                          fast_path=config.fast_path)
        if metrics is not None:
            metrics.add_gauges("grpc", frame_writes.stats)
            metrics.add_gauges("grpc", server.guard.read)
        await trio_asyncio.aio_as_trio(server.start)(sock=self.sock)
        log.info("gRPC bound on %s:%d (health NOT_SERVING until the engine is up)", config.host, config.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def wait_closed(self) -> None:
        if self.server is not None:
            await trio_asyncio.aio_as_trio(self.server.wait_closed)()


def _media_processor(launcher, model_dir: Path | None = None) -> tuple[str, object, list[str]] | None:
    """(model dir, the vLLM venv's python, the engine's arguments) for the media processor helper: a real vLLM
    engine's only. The helper builds the model's config from the engine's own arguments, as the engine does."""
    python, model_dir = getattr(launcher, "python", None), model_dir or getattr(launcher, "model_dir", None)
    if launcher.engine != "vllm" or not python or model_dir is None:
        return None
    return str(model_dir), lambda: python, list(getattr(launcher, "extra_args", None) or [])


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


async def serve_headless(config: ServeConfig, lane, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """``enginelink headless``: the same servicer with the router's ZMQ lane as its front
    (``runtime/contracts/sglang/router_front.py``), no gRPC port; ``lane`` is its ``LaneConfig``.

    The journal, metrics, engine link, hub and warm-up are ``serve``'s; the run file is keyed by the
    router's handshake port, so ``enginelink inspect --port <that port>`` finds the journal."""
    from enginelink.runtime.contracts.sglang.router_front import RouterFront
    from enginelink.runtime.contracts.sglang.lane_edge import LANE_EDGE

    port = int(lane.handshake_address.rsplit(":", 1)[1])
    lock = _lock_journal(config)
    try:
        metrics_listeners = await _bind_metrics(config)
        plan = JournalPlan(config.journal_path, lock, config.journal_keep)
        status = ServiceStatus()  # readiness still follows the link (metrics); no health service reads it
        composition = dataclasses.replace(_composition(config, plan, metrics_listeners, status), edge=LANE_EDGE,
                                          where=f"the router's ZMQ lane at {lane.handshake_address}")
        composition.run_record["port"] = port
        servicer = compose(composition)
        front = RouterFront(lane)

        def on_serving() -> None:
            config.gc_policy.apply()
            front.on_serving()

        if config.journal_path is not None:
            write_run_file(port, config.journal_path, host="zmq")
        try:
            async with trio_asyncio.open_loop():
                signals = lambda: trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)  # noqa: E731
                return await servicer.run(front, signals, _OnServing(task_status, on_serving))
        finally:
            if config.journal_path is not None:
                remove_run_file(port)
    finally:
        if lock is not None:
            lock.release()

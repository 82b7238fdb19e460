"""The sim engine's process, whatever wire it speaks: its lifetime, its engine loop, its KV publisher.

``sim_engine.py`` (vLLM's wire) and ``sim_wire_shell.py`` (TokenSpeed's and
SGLang's) connect their sockets as their engine does and then hand them to
``serve``: the same polling, step timing, KV publishing, signals and parent
watch for every wire. Plain blocking pyzmq: this is its own process, outside
trio. (Its own module so that the two shells import it and not each other.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Protocol

import zmq

from enginelink.machines.sim_core import SimConfig, SimHooks
from enginelink.tools.sim_kv import KvEventHooks, SimKvFaults, SimKvPublisher
from enginelink.wire import kv_engines, kv_events
from enginelink.wire.engine import WireError

HANDSHAKE_TIMEOUT_S = 300.0  # vLLM's HANDSHAKE_TIMEOUT_MINS
IDLE_POLL_MS = 100  # how often an idle engine checks for signals and its parent


class Wire(Protocol):
    """A sim core on its wire (``sim_engine._VllmWire``, ``machines/sim_wires.py``'s personalities)."""

    @property
    def has_work(self) -> bool: ...

    def handle(self, frames: list[bytes], now: float) -> list[list[bytes]]: ...

    def step(self, now: float) -> tuple[list[list[bytes]], float]: ...


class Lifetime:
    """Why the process should stop, if it should: a signal or the parent gone."""

    def __init__(self, ignore_sigterm: bool = False) -> None:
        self.parent = os.getppid()
        self.signalled: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        if ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = signal.Signals(signum).name

    def reason(self) -> str | None:
        if self.signalled:
            return self.signalled
        if os.getppid() != self.parent:
            return "parent process exited"
        return None


def log(message: str) -> None:
    # Our stderr is a pipe to the servicer: once it is gone (the reason we may be
    # stopping), a line is lost rather than an exception thrown mid-shutdown.
    with contextlib.suppress(OSError):
        print(f"sim-engine[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


# The stray child: deaf to SIGTERM, in a process group of its own (still a child
# of the engine's), gone by itself only after STRAY_LIFETIME_S (so a failed
# test leaks nothing for long).
STRAY_LIFETIME_S = 300
_STRAY = f"""
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.setpgid(0, 0)
time.sleep({STRAY_LIFETIME_S})
"""


def start_stray_child() -> int:
    import subprocess

    return subprocess.Popen([sys.executable, "-c", _STRAY]).pid


def start_bound_thread(cpu: int) -> None:
    bound = threading.Event()

    def compute() -> None:
        os.sched_setaffinity(0, {cpu})  # 0: the calling thread
        bound.set()
        threading.Event().wait()  # lives as long as the engine (daemon)

    threading.Thread(target=compute, name="sim-compute", daemon=True).start()
    bound.wait()


class KvSockets:
    def __init__(self, hooks: KvEventHooks, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        self.hooks = hooks
        self.pub = pub
        self.replay = replay

    def flush(self) -> None:
        for message in self.hooks.take_messages():
            self.pub.send_multipart(message)

    def serve_replay(self) -> None:
        while self.replay is not None:
            try:
                identity, *frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                start = kv_events.parse_replay_request(frames)
            except WireError as exc:
                log(f"ignored a KV replay request: {exc}")
                continue
            for reply in self.hooks.publisher.replay(start):
                self.replay.send_multipart([identity, *reply])


def kv_publisher(
    ctx: zmq.Context, args: argparse.Namespace, config: SimConfig
) -> tuple[SimHooks | None, KvSockets | None, dict | None]:
    """The KV-event publisher of this rank, when --kv-events-config turns it on."""
    cfg = args.kv_events_config
    if cfg is None or not cfg.publishing:
        return None, None, cfg.to_dict() if cfg is not None else None
    faults = SimKvFaults(
        skip_seqs=args.kv_fault_skip, drop_seqs=args.kv_fault_drop, restart_after_batches=args.kv_fault_restart_after,
        replay_topic=not args.kv_replay_no_topic and kv_engines.replay_has_topic(args.wire),
    )  # fmt: skip
    publisher = SimKvPublisher(cfg, args.rank, faults, dialect=args.wire)
    hooks = KvEventHooks(publisher, config.block_size, time.time() - time.monotonic())
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(cfg.hwm)
    pub.setsockopt(zmq.LINGER, 1000)
    endpoint = kv_events.endpoint_for_rank(cfg.endpoint, args.rank)
    resolved = cfg.to_dict()
    if kv_engines.pub_binds(cfg, endpoint):
        pub.bind(endpoint)
        resolved["endpoint"] = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        pub.connect(endpoint)
        resolved["endpoint"] = endpoint
    replay = None
    if cfg.replay_endpoint:
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.bind(kv_events.endpoint_for_rank(cfg.replay_endpoint, args.rank))
        resolved["replay_endpoint"] = replay.getsockopt_string(zmq.LAST_ENDPOINT)
    return hooks, KvSockets(hooks, pub, replay), resolved


def serve(core: Wire, inputs: zmq.Socket, outputs: zmq.Socket, life: Lifetime,
          kv: "KvSockets | list[KvSockets] | None" = None) -> str:  # fmt: skip
    """The engine loop of any wire (``core``: handle, step, has_work); returns why it stopped.

    ``kv``: the rank's KV-event sockets, or every rank's (SGLang's DP ranks in one process)."""
    next_step = 0.0  # monotonic time the current step's cost runs out
    publishers = kv if isinstance(kv, list) else [kv] if kv is not None else []
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    for publisher in publishers:
        if publisher.replay is not None:
            poller.register(publisher.replay, zmq.POLLIN)
    while True:
        if (reason := life.reason()) is not None:
            return reason
        if core.has_work:
            timeout_ms = max(0.0, next_step - time.monotonic()) * 1000
        else:
            timeout_ms = IDLE_POLL_MS
        ready = dict(poller.poll(timeout_ms))
        for publisher in publishers:
            if publisher.replay is not None and publisher.replay in ready:
                publisher.serve_replay()
        if inputs in ready:
            while True:  # drain everything that is already here
                try:
                    frames = inputs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    messages = core.handle(frames, time.monotonic())
                except WireError as exc:
                    log(f"ignored input: {exc}")
                    continue
                for message in messages:
                    outputs.send_multipart(message)
                log_notes(core)
        now = time.monotonic()
        if core.has_work and now >= next_step:
            messages, cost_s = core.step(now)
            for message in messages:
                outputs.send_multipart(message)
            for publisher in publishers:
                publisher.flush()
            next_step = now + cost_s


def log_notes(core) -> None:
    """What the personalities asked to have logged (the PD rooms a leg took), once each."""
    for personality in getattr(core, "ranks", None) or [core]:
        notes = getattr(personality, "notes", None)
        while notes:
            log(notes.pop(0))

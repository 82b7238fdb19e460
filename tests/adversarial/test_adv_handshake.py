"""Attacks on the engine handshake socket: garbage, a fake HELLO, huge frames, another user.

The handshake socket must be reachable only by the engine enginelink
launched (ipc in the private socket directory), ignore and journal a
stranger's frame instead of failing or stalling the start-up, bound what a
peer may send (``ZMQ_MAXMSGSIZE``), and be gone once the engine is up.

The link-level tests drive ``EngineLink`` with the sim engine, whose HELLO
is held (``--hello-gate``) until the attack was seen, so the attack always
lands before the engine's own handshake. The serve-level test measures the
servicer's memory while a stranger pushes hundreds of MB at it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import msgspec
import pytest
import trio
import zmq

from enginelink.runtime.engine import engine_link as el
from enginelink.runtime.engine.handshake_gate import HANDSHAKE_MESSAGE_MAX_BYTES, STRANGER_RECORDS_MAX
from enginelink.runtime.engine.launchers import SimLauncher
from enginelink.wire.vllm import VllmCodec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness import VLLM_SERVICE, Servicer, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

HELLO = msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True})
READY = msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True})
ENGINE_IDENTITY = b"\x00\x00"  # rank 0, what the real engine uses
OTHER_UID = 54321


class RecordingJournal:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, object]] = []

    def append(self, now, stream, kind, payload) -> None:
        self.records.append((stream, kind, payload))

    def note_decoded(self, seq, decoded) -> None:  # the live fold's feed (Journal.note_decoded): none here
        pass

    def steps(self, step: str) -> list[dict]:
        return [p["message"] for _, kind, p in self.records if kind == "engine.handshake" and p["step"] == step]


@pytest.fixture
def sockets():
    # Short: ipc paths must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="el-adv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _link(test_model_dir, sockets: Path, gate: Path, monkeypatch) -> el.EngineLink:
    monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(sockets))
    launcher = SimLauncher(model_dir=test_model_dir, extra_args=["--hello-gate", str(gate)])
    return el.EngineLink(name="vllm-0", launcher=launcher, codec=VllmCodec(), journal=RecordingJournal(),
                         supervision=el.Supervision(startup_timeout_s=WAIT_S, startup_ceiling_s=2 * WAIT_S,
                                                    stop_grace_s=5),
                         servicer_sched="normal")


# Bounds that only keep a broken run from hanging: what these tests check is what reaches the link, not
# how fast. A loaded CI box (load 30-60 on two cores) once ran past 20 s and 30 s here in a passing run.
WAIT_S = 120.0


async def _wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    with trio.move_on_after(timeout_s):
        while not (result := predicate()):
            await trio.sleep(0.02)
        return result
    raise AssertionError(f"{what}: not seen within {timeout_s:.0f} s")


def _handshake_path(sockets: Path) -> Path | None:
    found = list(sockets.glob("enginelink-*-hs.sock"))
    return found[0] if found else None


_strangers_context: zmq.Context | None = None


@pytest.fixture(autouse=True)
def strangers_context():
    """The strangers' own zmq context, a new one per test, destroyed after it (its sockets with it).

    Not ``zmq.Context.instance()``: the servicer's link uses that one, and so do the other in-process
    link tests on this xdist worker. Once, three tests in a row here waited 20-30 s for stranger
    messages that never reached the link; a context of their own keeps an earlier test's leftovers out
    of it."""
    global _strangers_context
    _strangers_context = zmq.Context()
    try:
        yield _strangers_context
    finally:
        _strangers_context.destroy(linger=0)
        _strangers_context = None


def _stranger(address: str, identity: bytes | None = None) -> zmq.Socket:
    assert _strangers_context is not None
    sock = _strangers_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def _start(nursery: trio.Nursery, link) -> trio.Event:
    """Start ``link`` in ``nursery``; the event is set once it is up."""
    up = trio.Event()

    async def run_link():
        await nursery.start(link.run)
        up.set()

    nursery.start_soon(run_link)
    return up


async def _attack_then_start(link, sockets: Path, gate: Path, attack) -> list:
    """Run ``attack(address)`` once the handshake socket exists, before the engine's HELLO;
    release the engine once the link has journaled what the attack expects; return the strangers."""
    async with trio.open_nursery() as nursery:
        up = _start(nursery, link)
        path = await _wait_for(lambda: _handshake_path(sockets), "handshake socket")
        expected, sockets_used = attack(f"ipc://{path}")
        await _wait_for(lambda: len(link.journal.steps("stranger")) >= expected, "the strangers journaled")
        assert not link.journal.steps("hello")  # nothing of the attack was taken for the engine
        gate.touch()
        await _wait_for(lambda: up.is_set(), "the engine up once its HELLO was let through")
        assert link.machine.live and link.ready  # started, not failed
        # Once the engine is up, the handshake socket is gone.
        assert not path.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe, pytest.raises(OSError):
            probe.connect(str(path))
        nursery.cancel_scope.cancel()
    return sockets_used


async def test_garbage_before_hello_is_ignored_and_journaled(test_model_dir, sockets, tmp_path, monkeypatch):
    link = _link(test_model_dir, sockets, tmp_path / "go", monkeypatch)

    def attack(address):
        plain = _stranger(address)
        plain.send(b"\xc1 not msgpack at all")
        posing = _stranger(address, ENGINE_IDENTITY)  # even with the engine's own identity
        posing.send(msgspec.msgpack.encode([1, 2, 3]))
        posing.send_multipart([b"two", b"frames"])
        return 3, [plain, posing]

    used = await _attack_then_start(link, sockets, tmp_path / "go", attack)
    strangers = link.journal.steps("stranger")
    assert len(strangers) == 3
    assert sorted(s["reason"] for s in strangers) == sorted(
        [f"pid {os.getpid()} is not one of the engine's processes"] * 2 + ["not one frame"])
    assert sorted(s["bytes"] for s in strangers) == sorted([len(b"\xc1 not msgpack at all"), 4, 9])
    assert all(s["peer"].endswith(f":{os.getpid()}") for s in strangers)  # who sent it, for the operator
    assert len(link.journal.steps("hello")) == 1  # the engine's own
    for sock in used:
        sock.close()


async def test_a_fake_hello_and_ready_from_a_stranger_are_ignored(test_model_dir, sockets, tmp_path, monkeypatch):
    link = _link(test_model_dir, sockets, tmp_path / "go", monkeypatch)
    impostors = []

    def attack(address):
        for identity in (ENGINE_IDENTITY, b"\x01\x00", None):
            sock = _stranger(address, identity)
            sock.send(HELLO)
            sock.send(READY)
            impostors.append(sock)
        return 6, impostors

    await _attack_then_start(link, sockets, tmp_path / "go", attack)
    assert len(link.journal.steps("hello")) == 1
    inits = link.journal.steps("init")
    assert len(inits) == 1
    for sock in impostors:  # the init (our socket addresses) went to the engine alone
        assert sock.poll(0) == 0
        sock.close()


async def test_a_flood_of_strangers_is_journaled_within_bounds(test_model_dir, sockets, tmp_path, monkeypatch):
    link = _link(test_model_dir, sockets, tmp_path / "go", monkeypatch)
    flood = 200

    def attack(address):
        sock = _stranger(address)
        for index in range(flood):
            sock.send(HELLO if index % 2 else b"junk")
        return STRANGER_RECORDS_MAX, [sock]

    used = await _attack_then_start(link, sockets, tmp_path / "go", attack)
    assert len(link.journal.steps("stranger")) == STRANGER_RECORDS_MAX
    summary = link.journal.steps("strangers")
    # All of them were read and counted (the socket's queue bounds what was still waiting).
    assert len(summary) == 1 and STRANGER_RECORDS_MAX < summary[0]["strangers"] <= flood
    used[0].close()


async def test_an_oversized_frame_is_refused_before_it_is_buffered(test_model_dir, sockets, tmp_path, monkeypatch):
    link = _link(test_model_dir, sockets, tmp_path / "go", monkeypatch)

    def attack(address):
        big = _stranger(address)
        big.send(b"x" * (HANDSHAKE_MESSAGE_MAX_BYTES + 1))  # libzmq drops this peer
        small = _stranger(address)
        small.send(b"after the big one")
        return 1, [big, small]

    used = await _attack_then_start(link, sockets, tmp_path / "go", attack)
    # Only the small frame ever reached the link.
    assert [s["bytes"] for s in link.journal.steps("stranger")] == [len(b"after the big one")]
    for sock in used:
        sock.close()


def test_another_user_cannot_reach_the_handshake_socket(sockets, tmp_path):
    # The directory is 0700: a process of another uid cannot connect to a socket inside.
    os.chmod(sockets, 0o700)
    path = sockets / "enginelink-1-vllm-0-hs.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        # A forked child that becomes another user (no exec: that user may not read our venv).
        child = os.fork()
        if child == 0:
            status = 3
            try:
                os.setgid(OTHER_UID)
                os.setuid(OTHER_UID)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(str(path))
                status = 1  # connected: the side door is open
            except PermissionError:
                status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user reached the socket (or the probe broke)"
    finally:
        listener.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _serving(servicer: Servicer) -> bool:
    health = health_pb2_grpc.HealthStub(servicer.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=1)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _push(address: str, chunk: bytes, times: int, identity: bytes | None = None) -> int:
    """Send ``chunk`` ``times`` over fresh connections (a peer that breaks a bound is dropped at once)."""
    for _ in range(times):
        sock = _stranger(address, identity)
        sock.send(chunk, copy=False)
        sock.close(linger=2000)  # libzmq hands the frame over before the close completes
    return len(chunk) * times


@pytest.mark.slow
def test_serve_holds_its_memory_while_a_stranger_pushes_hundreds_of_mb(tmp_path, test_model_dir):
    gate = tmp_path / "go"
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--hello-gate", str(gate)],
                        env={"SMG_VLLM_SERVICER_WARMUP": "off"})
    chunk = b"y" * (8 * 1024 * 1024)
    hello = None
    try:
        servicer.start(wait_serving=False)
        path = wait_until(lambda: _handshake_path(servicer.socket_dir), 30, "handshake socket")
        before = _rss_bytes(servicer.process.pid)
        # During start-up: 256 MB at the handshake socket, and a fake HELLO it must not wait on.
        assert _push(f"ipc://{path}", chunk, 32) == 256 * 1024 * 1024
        hello = _stranger(f"ipc://{path}", ENGINE_IDENTITY)
        hello.send(HELLO)
        wait_until(lambda: "ignored a frame on the engine handshake socket" in servicer.log(), 30, "stranger logged")
        assert servicer.process.poll() is None
        during = _rss_bytes(servicer.process.pid)
        gate.touch()
        wait_until(lambda: _serving(servicer), 60, "servicer SERVING")
        # After start-up the handshake socket is gone; the input socket, never read again, bounds its peers.
        assert not path.exists()
        inputs = next(servicer.socket_dir.glob("enginelink-*-in.sock"))
        _push(f"ipc://{path}", chunk, 8)
        _push(f"ipc://{inputs}", chunk, 16, identity=b"\x07\x07")
        after = _rss_bytes(servicer.process.pid)
        assert _serving(servicer)
    finally:
        if hello is not None:
            hello.close()
        servicer.stop()
    assert during - before < 32 * 1024 * 1024, (before, during)
    assert after - during < 32 * 1024 * 1024, (during, after)


async def test_a_silent_start_is_journaled_as_waiting_without_renewing_the_start_up_bound(test_model_dir, sockets,
                                                                                         tmp_path, monkeypatch):
    """An engine that says no HELLO: the link journals what the wait looks like (the engine's process state,
    whether the handshake file is there), twice as late each time, and the start-up bound runs on."""
    from enginelink.runtime.engine import zmq_transport

    monkeypatch.setattr(zmq_transport, "HELLO_WAIT_REPORT_S", 0.5)
    monkeypatch.setattr(zmq_transport, "HELLO_WAIT_LAST_REPORT_S", 1.0)
    gate = tmp_path / "go"
    link = _link(test_model_dir, sockets, gate, monkeypatch)
    async with trio.open_nursery() as nursery:
        up = _start(nursery, link)
        waits = await _wait_for(lambda: len(link.journal.steps("waiting")) >= 2 and link.journal.steps("waiting"),
                                "two waiting steps")
        assert [w["after_s"] for w in waits] == [0.5, 1.0]  # the last report: no third
        first = waits[0]
        assert first["engine_pid"] == link.process.pid and first["engine_state"] in ("R", "S")
        assert first["handshake"] == f"ipc://{_handshake_path(sockets)}" and first["handshake_file"] is True
        # The engine said nothing: only the launch steps renewed the bound.
        assert link.progress_at < trio.current_time() - 0.5
        gate.touch()
        await _wait_for(lambda: up.is_set(), "the engine up once its HELLO was let through")
        assert len(link.journal.steps("waiting")) == 2 and len(link.journal.steps("hello")) == 1
        nursery.cancel_scope.cancel()

"""Engine supervision: start-up bounds, silence, stale socket files, no orphans.

The start-up tests drive ``EngineLink`` directly with stand-in engines (a
process that never dials the handshake, one that exits at once): real
processes, real time, bounded to about a second each. The silence test runs
``enginelink serve`` over a sim engine whose steps take 30 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass

import grpc
import pytest
import trio

from enginelink.runtime.engine import engine_link as el
from enginelink.runtime.engine import engine_processes
from enginelink.runtime.engine import socket_files
from enginelink.runtime.engine.launchers import redact_args
from enginelink.wire.vllm import VllmCodec
from tests.harness import VENV_BIN, Servicer, alive, engine_pid, free_port, generate_request
from tests.test_lifecycle import StreamReader

PROMPT = [318, 283, 1552, 10, 90, 305]


class RecordingJournal:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, object]] = []

    def append(self, now, stream, kind, payload) -> None:
        self.records.append((stream, kind, payload))

    def note_decoded(self, seq, decoded) -> None:  # the live fold's feed (Journal.note_decoded): none here
        pass


@dataclass
class ScriptLauncher:
    """A stand-in engine: ``python -c CODE``, in its own process group like a real one."""

    code: str
    engine: str = "vllm"

    def command(self, handshake_address: str):
        return [sys.executable, "-c", self.code], {}

    def redacted(self, argv):
        return redact_args(argv)


def make_link(launcher, socket_dir, monkeypatch, **supervision) -> el.EngineLink:
    monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(socket_dir))
    # servicer_sched="normal": the link runs inside pytest, whose threads must keep their policy.
    return el.EngineLink(name="vllm-0", launcher=launcher, codec=VllmCodec(), journal=RecordingJournal(),
                         supervision=el.Supervision(**supervision), servicer_sched="normal")


@pytest.mark.process
async def test_startup_ceiling_bounds_an_engine_that_never_dials(socket_dir, monkeypatch):
    # The engine lives (so the start-up timeout keeps extending) but never says HELLO.
    launcher = ScriptLauncher("import os, time\nos.fork() or time.sleep(60)\ntime.sleep(60)")
    link = make_link(launcher, socket_dir, monkeypatch, startup_timeout_s=0.3, startup_ceiling_s=1.2, stop_grace_s=2)
    started = trio.current_time()
    with pytest.raises(el.LinkFailed) as failed:
        await link.run()
    took = trio.current_time() - started
    assert "start-up ceiling of 1.2 s" in str(failed.value)
    assert 1.2 <= took < 4.0
    steps = [p["step"] for _, kind, p in link.journal.records if kind == "engine.handshake"]
    assert steps.count("startup_extended") >= 2
    # All of the engine (the forked child too) is gone.
    assert engine_processes.engine_members(link.process.pid) == []
    assert not list(socket_dir.iterdir()), "socket files left behind"


@pytest.mark.process
async def test_an_engine_that_exits_during_startup_fails_at_once(socket_dir, monkeypatch):
    link = make_link(ScriptLauncher("import sys; sys.exit(3)"), socket_dir, monkeypatch,
                     startup_timeout_s=60, startup_ceiling_s=0)
    started = trio.current_time()
    with pytest.raises(el.LinkFailed) as failed:
        await link.run()
    assert "exited with status 3" in str(failed.value)
    assert trio.current_time() - started < 5


def _stale_socket(path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()  # the file stays, nothing listens


def test_stale_files_go_and_live_ones_stay(tmp_path):
    dead_pid = 2**22 + 12345  # above pid_max's default: never a live process
    old = time.time() - 60
    stale = tmp_path / f"enginelink-{dead_pid}-vllm-0-in.sock"
    _stale_socket(stale)
    stale_facts = tmp_path / f"enginelink-{dead_pid}-vllm-0-facts.json"
    stale_facts.write_text("{}")
    live = tmp_path / f"enginelink-{dead_pid + 1}-vllm-0-out.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live))
    listener.listen()
    mine = tmp_path / f"enginelink-{os.getpid()}-vllm-0-in.sock"
    _stale_socket(mine)  # its owner (this process) lives: never probed, never removed
    young = tmp_path / f"enginelink-{dead_pid}-vllm-1-in.sock"
    _stale_socket(young)
    other = tmp_path / "someone-else.sock"
    _stale_socket(other)
    for path in (stale, stale_facts, live, mine, other):
        os.utime(path, (old, old), follow_symlinks=False)
    try:
        removed = socket_files.remove_stale_files(tmp_path)
    finally:
        listener.close()
    assert sorted(removed) == sorted([stale, stale_facts])
    assert all(p.exists() for p in (live, mine, young, other))


@pytest.mark.process
def test_an_unreaped_or_unnamed_owner_is_not_alive(tmp_path):
    """A zombie holds no socket any more: its files are leftovers like a dead process's."""
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_bytes().rsplit(b")", 1)[-1].split()[0] != b"Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert socket_files.pid_alive(os.getpid())
        assert not socket_files.pid_alive(child.pid)  # exited, not yet reaped
        assert not socket_files.pid_alive(-1) and not socket_files.pid_alive(0) and not socket_files.pid_alive(None)
    finally:
        child.wait()
    dead_owned = tmp_path / f"enginelink-{child.pid}-vllm-0-facts.json"
    dead_owned.write_text("{}")
    old = time.time() - 60
    os.utime(dead_owned, (old, old))
    assert socket_files.remove_stale_files(tmp_path) == [dead_owned]


@pytest.mark.process
def test_silence_with_requests_in_flight_fails_the_link(tmp_path, test_model_dir):
    # Steps of 5 s: the first token comes at once, then the engine says nothing
    # (and only notices the SIGTERM that stops it when the step is over).
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--step-us", "5000000"],
                        env={"SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS": "1", "SMG_VLLM_SERVICER_WARMUP": "off"}).start()
    try:
        time.sleep(1.5)  # idle silence is no failure
        assert servicer.process.poll() is None
        reader = StreamReader(servicer.stub, generate_request("quiet", PROMPT, stream=True, max_tokens=10,
                                                              ignore_eos=True))
        started = time.monotonic()
        reader.start()
        reader.join(10)
        assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "sent nothing for" in reader.error.details()
        assert 1.0 <= time.monotonic() - started < 4.0
        assert servicer.wait(20) == 1
    finally:
        servicer.stop()


@pytest.mark.process
def test_supervision_knobs_are_validated(tmp_path, test_model_dir):
    bad = (("SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS", "0"),
           ("SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC", "-5"),
           ("SMG_VLLM_SERVICER_STARTUP_CEILING_SECS", "soon"),
           ("ENGINELINK_ENGINE_STOP_GRACE_SECS", "-1"),
           ("ENGINELINK_IDLE_PROBE_SECS", "often"),
           ("ENGINELINK_IDLE_PROBE_TIMEOUT_SECS", "0"))
    # One servicer per bad knob, all at once (each its own port and journal): they only start and refuse.
    starts = [subprocess.Popen(
        [str(VENV_BIN / "enginelink"), "serve", "--model", str(test_model_dir), "--port", str(free_port()),
         "--journal", str(tmp_path / f"j-{number}.sqlite")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, knob: value},
    ) for number, (knob, value) in enumerate(bad)]
    try:
        for (knob, _), start in zip(bad, starts):
            _, stderr = start.communicate(timeout=60)
            assert start.returncode == 2, (knob, stderr)
            assert knob in stderr
    finally:
        for start in starts:
            if start.poll() is None:
                start.kill()
                start.wait()


@pytest.mark.process
def test_sigkill_of_the_servicer_leaves_no_engine_behind(tmp_path, test_model_dir):
    # The engine watches its parent: when enginelink dies without cleaning up, the engine goes too.
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env={"SMG_VLLM_SERVICER_WARMUP": "off"}).start()
    try:
        pid = engine_pid(servicer.journal)
        servicer.process.send_signal(signal.SIGKILL)
        servicer.wait(10)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the engine outlived a SIGKILLed servicer"
    finally:
        servicer.stop()


def test_a_servicer_that_cannot_adopt_orphans_says_what_it_cannot_stop(monkeypatch, caplog):
    """Where prctl refuses (or there is none), the servicer goes on and the operator reads what is lost."""

    class RefusingLibc:
        def prctl(self, *args):
            engine_processes.ctypes.set_errno(1)  # EPERM
            return -1

    monkeypatch.setattr(engine_processes, "_subreaper", False)
    monkeypatch.setattr(engine_processes.ctypes, "CDLL", lambda *args, **kwargs: RefusingLibc())
    with caplog.at_level("WARNING", logger="enginelink.link"):
        engine_processes.become_subreaper()
    assert engine_processes._subreaper is False
    assert ("cannot adopt the engine's orphans (prctl PR_SET_CHILD_SUBREAPER: Operation not permitted): a process "
            "of the engine that leaves its process group and outlives its parent will not be stopped with it; "
            "stop it by hand if one is left") in caplog.text

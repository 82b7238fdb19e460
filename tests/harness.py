"""Test harness: real processes on 127.0.0.1, started and stopped by the tests.

``Servicer`` runs ``enginelink serve`` exactly as a user would (a subprocess
of the project's venv, its own journal file) and waits until grpc.health.v1
says SERVING. ``Router`` runs the real SMG router (``smg launch``) in front of
it. Both are always killed at the end, whatever the test did.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pb_grpc

from enginelink.journal.records import KIND_ENGINE_FACTS
from enginelink.journal.store import open_reader

VENV_BIN = Path(sys.executable).parent
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
# vLLM's offline ``LLM``, the reference the real-engine tests compare with, runs its engine inside its own
# process: V1 multiprocessing off, and so (vLLM's CPU platform forces the multiprocess executor only while
# it is on) no EngineCore and no Worker process beside it. The answers are the same tokens and logprobs;
# a start costs a third of the CPU (16 CPU-s instead of 49 for the tiny model on this box: two processes
# fewer to import torch, and no Worker spinning on its shared-memory queue), on a suite that is CPU-bound.
# Only the reference: every engine enginelink serves is vLLM's default, multiprocess. Its threads are not
# bound (vLLM binds a rank-0 worker to core 0, where every engine's Worker in the suite runs): one process
# that schedules, runs the model and detokenizes, pinned beside them, ran a third slower. Same answers.
OFFLINE_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


# Listening ports for the tests' servers come from below the kernel's ephemeral range, one slice per
# xdist worker. A port the kernel hands out for bind(0) lies in that range, and so does the source port
# of every outgoing connection on the box (grpc clients, routers, engines): a CI run lost a servicer
# whose port an outgoing connection had taken between the pick and its bind ("port ... is in use").
_PORTS_FIRST, _PORTS_END = 20000, 32768  # Linux's ip_local_port_range starts at 32768 by default
_PORT_SLICES = 16


def _port_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % _PORT_SLICES if worker[2:].isdigit() else 0
    size = (_PORTS_END - _PORTS_FIRST) // _PORT_SLICES
    return range(_PORTS_FIRST + index * size, _PORTS_FIRST + (index + 1) * size)


_port_cursor = int.from_bytes(os.urandom(2), "big")  # where this worker looks next in its slice


def free_port() -> int:
    """A tcp port on 127.0.0.1 free now and not handed out before by this worker (while its slice lasts)."""
    global _port_cursor
    ports = _port_slice()  # read at the call: xdist names the worker in the environment
    for step in range(len(ports)):
        index = (_port_cursor + step) % len(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", ports[index]))
            except OSError:
                continue
        _port_cursor = index + 1
        return ports[index]
    raise RuntimeError(f"no free tcp port in {ports} for this test worker")


class Pidfd:
    """One process, held by a pidfd: a signal reaches that process or nobody, never a later one that
    reused its pid. A test that signals a pid after the process may have died (a frozen engine the
    servicer killed, continued in a ``finally``) otherwise signals whatever has the number now: pid_max is
    32,768 on this box, the suite's processes and threads cycle through it in minutes, and a stray
    SIGCONT once woke another test's deliberately stopped EngineCore (tests/vllm/test_vllm_resume.py)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)

    def send(self, sig: int) -> bool:
        """Signal the process; False when it has exited already."""
        try:
            signal.pidfd_send_signal(self.fd, sig)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Pidfd:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


@contextmanager
def frozen(pid: int):
    """The process stopped (SIGSTOP) for the block, and continued (SIGCONT) whatever the block did
    (unless it died meanwhile: the SIGCONT goes by pidfd, so never to a process that took its pid)."""
    with Pidfd(pid) as process:
        process.send(signal.SIGSTOP)
        try:
            yield
        finally:
            process.send(signal.SIGCONT)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as error:  # the thing is not up yet
            last_error = error
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s} s (last error: {last_error!r})")


def wait_not_serving(servicer, timeout_s: float, what: str, interval_s: float = 0.02):
    """Until the servicer's overall health (service "") answers NOT_SERVING; a call that fails is tried again."""
    health = health_pb2_grpc.HealthStub(servicer.channel)
    wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s, what, interval_s=interval_s)


class ReferenceAnswers:
    """A reference subprocess's answers (one JSON object a line on its stdout), for ``OfflineVllm``/``OfflineMlx``.

    One thread reads every line into a queue, so a wait that times out loses
    nothing: the line it waited for is there for the next wait (a reader thread
    per wait, left blocked after its timeout, ate the next line, and every later
    wait then missed its own answer and timed out too). Answers are matched by
    their case id; a late answer to a call that already gave up is dropped.
    """

    def __init__(self, process: subprocess.Popen, what: str, log_path: Path) -> None:
        self.what, self.log_path = what, log_path
        self._lines: queue.Queue[str] = queue.Queue()
        self._ready = False
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # its output ended

    def _next(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        if not line:
            if line == "":
                self._lines.put("")  # still ended for the next wait
            tail = self.log_path.read_text(errors="replace")[-3000:]
            said = "ended its output" if line == "" else f"gave no answer within {timeout_s} s"
            raise RuntimeError(f"{self.what} {said}:\n{tail}")
        return json.loads(line)

    def ask(self, stdin, cases: list[dict], ready_timeout_s: float, timeout_s: float) -> dict[str, dict]:
        """Send ``cases`` (each with an "id") and wait for each one's answer: {case id: answer}."""
        with self._lock:
            if not self._ready:
                assert self._next(ready_timeout_s) == {"ready": True}
                self._ready = True
            for case in cases:
                stdin.write(json.dumps(case) + "\n")
            stdin.flush()
            wanted, answers = {case["id"] for case in cases}, {}
            while wanted - answers.keys():
                answer = self._next(timeout_s)
                if answer.get("id") in wanted:
                    answers[answer["id"]] = answer
        return answers


def end_process(process: subprocess.Popen, ask_to_stop, timeout_s: float = 20.0) -> None:
    """``ask_to_stop()`` a process still running, wait ``timeout_s`` for it, then kill it."""
    if process.poll() is not None:
        return
    ask_to_stop()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Servicer:
    """``enginelink serve`` in a subprocess, with a grpcio channel to it."""

    # The contract it serves: ``stub`` is its stub (MLX's: tests/mlx); health is checked for
    # ``health_service``, given to __init__ (an instance attribute: a subclass passes its own).
    stub_class = pb_grpc.VllmEngineStub

    def __init__(self, tmp: Path, model_dir: Path | None = None, extra: list[str] | None = None,
                 engine_args: list[str] | None = None, env: dict[str, str] | None = None,
                 health_service: str = VLLM_SERVICE) -> None:
        self.port = free_port()
        self.health_service = health_service  # the contract's service name (serve --wire)
        self.journal = tmp / f"journal-{self.port}.sqlite"
        self.log_path = tmp / f"servicer-{self.port}.log"
        argv = [str(VENV_BIN / "enginelink"), "serve", "--port", str(self.port), "--journal", str(self.journal)]
        if model_dir is not None:
            argv += ["--model", str(model_dir)]
        argv += extra or []
        if engine_args:
            argv += ["--", *engine_args]
        self.argv = argv
        # Its own ipc socket directory, short enough for ipc paths and not shared
        # with other tests or a servicer the user runs (the default is one per user).
        self.socket_dir = Path(tempfile.mkdtemp(prefix="el-sock-"))
        # Its own state dir too: the run file (serve-<port>.json) goes there, not in the user's.
        self.state_home = tmp / "state"
        self.env = {**os.environ, "SMG_ZMQ_SOCKET_DIR": str(self.socket_dir),
                    "XDG_STATE_HOME": str(self.state_home), **(env or {})}
        self.process: subprocess.Popen | None = None
        self._told_to_stop = False  # stop_soon sent SIGTERM: stop() only waits
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.VllmEngineStub | None = None

    def start(self, timeout_s: float = 60.0, wait_serving: bool = True) -> "Servicer":
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = self.stub_class(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)

        def serving() -> bool:
            if self.process.poll() is not None:
                return True  # ends the wait at once; reported below with its log (wait_until would retry a raise)
            reply = health.Check(health_pb2.HealthCheckRequest(service=self.health_service), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        if wait_serving:
            try:
                try:
                    wait_until(serving, timeout_s, "servicer SERVING")
                except TimeoutError as error:  # alive but not serving: its log says how far it got
                    raise TimeoutError(f"{error}; its log ends:\n{self.log()[-3000:]}") from None
                if self.process.poll() is not None:
                    raise RuntimeError(f"servicer exited with {self.process.returncode} before SERVING:\n"
                                       f"{self.log()[-4000:]}")
            except BaseException:
                # Not left running for the rest of the run (``with Servicer(...)`` does not
                # reach ``__exit__`` when ``start`` raises); its log stays for the report.
                end_process(self.process, lambda: self.process.send_signal(signal.SIGTERM))
                raise
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.process.wait(timeout=timeout_s)

    def socket_files(self) -> list[str]:
        """The files in this servicer's ipc socket directory (its own are removed at exit)."""
        return sorted(path.name for path in self.socket_dir.iterdir()) if self.socket_dir.exists() else []

    def stop(self) -> int | None:
        if self.channel is not None:
            self.channel.close()
        try:
            if self.process is None:
                return None
            ask = (lambda: None) if self._told_to_stop else (lambda: self.process.send_signal(signal.SIGTERM))
            end_process(self.process, ask)
            self._log.close()
            return self.process.returncode
        finally:
            shutil.rmtree(self.socket_dir, ignore_errors=True)  # what a SIGKILLed servicer left

    def stop_soon(self) -> None:
        """SIGTERM it now and ``stop()`` it later (``reap_stopped``, at the latest at the session's end).

        For a shared fixture's teardown: no test looks at this servicer any
        more, so its drain and its engine's stop need not hold up the next
        test. A test that checks how a servicer ends calls ``stop()``.
        """
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self._told_to_stop = True
        _STOPPING.append(self)

    def __enter__(self) -> "Servicer":
        # ``with Servicer(...).start() as s`` started a second one here, and the first was never stopped: it
        # outlived the suite (found still serving 26 minutes after a full run).
        return self if self.process is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# Servicers told to stop (``stop_soon``) and not yet waited for.
_STOPPING: list[Servicer] = []


@contextmanager
def shared(servicer: Servicer, **start_args):
    """A shared fixture's servicer: started, and at teardown stopped without waiting (``stop_soon``)."""
    try:
        yield servicer.start(**start_args)
    finally:
        servicer.stop_soon()


def reap_stopped() -> None:
    """Wait for every servicer ``stop_soon`` told to stop (killing any that outlast the usual wait)."""
    while _STOPPING:
        _STOPPING.pop().stop()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Router:
    """The real SMG router (``smg launch``) in front of one gRPC worker, all on 127.0.0.1.

    Ready when ``GET /readiness`` answers 200, i.e. the worker is registered
    and healthy. ``stop()`` kills it outright by default: on SIGTERM it drains
    for ~5 s, which a finished test does not need.
    """

    def __init__(self, tmp: Path, worker_port: int, model_dir: Path, *, log_level: str = "debug",
                 health_check_interval_s: int = 3, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.prometheus_port = free_port()
        self.log_path = tmp / f"router-{self.port}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_url = f"grpc://127.0.0.1:{worker_port}"
        smg = VENV_BIN / "smg"
        self.argv = [
            str(smg), "launch",
            "--worker-urls", self.worker_url,
            "--model-path", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            "--health-check-interval-secs", str(health_check_interval_s),
            "--log-level", log_level,
            *(extra or []),
        ]
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 30.0) -> "Router":
        if not Path(self.argv[0]).exists():
            raise RuntimeError(f"the SMG router is not installed at {self.argv[0]}; run tools/setup-env --test")
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=1) as reply:
                    return reply.status == 200
            except urllib.error.HTTPError:  # 503 until the worker is registered and healthy
                return False

        try:
            wait_until(ready, timeout_s, "router /readiness 200", interval_s=0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def log(self) -> str:
        """The router's log with its colour codes removed."""
        if not self.log_path.exists():
            return ""
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))

    def stop(self, graceful: bool = False) -> int | None:
        """SIGKILL, or with ``graceful`` SIGTERM (it drains ~5 s) and SIGKILL after 8 s."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            if graceful:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=8)
                except subprocess.TimeoutExpired:
                    pass
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        return self.process.returncode

    def __enter__(self) -> "Router":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ListJournal:
    """A journal that keeps its appends in a list, for tests of code that journals (the hub)."""

    def __init__(self) -> None:
        self.records: list[tuple[float, str, str, object]] = []

    def append(self, now, stream, kind, payload) -> None:
        self.records.append((now, stream, kind, payload))

    def note_decoded(self, seq, decoded) -> None:
        """The live fold's decode hand-off (``Journal.note_decoded``): no snapshot task here, nothing kept."""


def generate_request(request_id: str, input_ids: list[int], *, stream: bool = False, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=input_ids),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


def engine_pid(journal: Path) -> int:
    """The engine's pid, from the servicer's ``engine.facts`` journal record."""

    def find():
        with open_reader(journal) as reader:
            records = reader.records(kinds=[KIND_ENGINE_FACTS])
        return records[-1].payload["pid"] if records else None

    return wait_until(find, 5, "engine.facts record in the journal")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc; those that go meanwhile are skipped)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def scrape(port: int) -> dict[str, float]:
    """One Prometheus scrape of 127.0.0.1:port/metrics as {sample name with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples

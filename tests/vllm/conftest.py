"""Fixtures of the real-engine suite: vLLM 0.32 on CPU, started by the tests.

Every engine here is ``enginelink serve --engine vllm`` over the tiny test
model, with a short context (``--max-model-len 1024``: long requests last
seconds, short ones milliseconds) and ``--enforce-eager``
so a start costs ~20 s on 2 cores. One servicer serves the whole session's
generation, abort and router tests (``vllm_stack``); a second one, without
warm-up and with vLLM's own structured-outputs configuration, serves the
configured-backend and the KV-event tests (``vllm_quiet``); the lifecycle,
DP, PD, pooling and launcher tests start their own.
vLLM's offline ``LLM`` API runs beside it in a subprocess of the vLLM venv
(``offline_llm.py``) as the reference the outputs are compared with; it
loads while the servicer's engine starts.

Without a vLLM installation (tools/setup-vllm) these tests are skipped, unless
``ENGINELINK_REQUIRE_VLLM=1`` (tools/run-tests sets it), where that fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from enginelink.runtime.contracts.vllm.launch import default_vllm_python
from enginelink.runtime.engine.launchers import LauncherError
from tests.harness import OFFLINE_VLLM_ENV, Pidfd, ReferenceAnswers, Servicer, children, end_process, wait_until
from tests.vllm.vision_offline import build_vision_model, run_offline

# --max-logprobs -1: the logprobs tests ask for the whole vocabulary (vLLM's default is 20).
ENGINE_ARGS = ["--max-model-len", "1024", "--enforce-eager", "--max-logprobs", "-1"]
MAX_MODEL_LEN = 1024
# A hung start still fails, with its log; but at the suite's start this box runs five engine scopes' starts
# and four other workers at once, and the session's stack took over 300 s to serve there (twice, 2026-12-07).
START_TIMEOUT_S = 600.0
# vllm_quiet's --structured-outputs-config: the backend enginelink sends must be the configured
# one, and compact JSON (disable_any_whitespace) keeps a random-weight model from spending its
# tokens on the whitespace the default grammar allows between JSON tokens.
STRUCTURED_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
OFFLINE_SCRIPT = Path(__file__).with_name("offline_llm.py")


def vllm_python_or_skip() -> str:
    try:
        python = default_vllm_python()
    except LauncherError as error:
        python, reason = None, str(error)
    else:
        reason = f"{python} is missing"
    if python is None or not Path(python).exists():
        if os.environ.get("ENGINELINK_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here: {reason}")
        pytest.skip(f"no vLLM installation (run tools/setup-vllm): {reason}")
    return python


def vllm_servicer(tmp: Path, model_dir: Path, engine_args: list[str] | None = None,
                  env: dict[str, str] | None = None) -> Servicer:
    return Servicer(tmp, model_dir=model_dir, extra=["--engine", "vllm"],
                    engine_args=engine_args or ENGINE_ARGS, env=env)


class OfflineVllm:
    """vLLM's offline ``LLM`` in a subprocess: ``run(cases)`` answers them in order."""

    def __init__(self, python: str, model_dir: Path, log_path: Path, llm_kwargs: dict | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        kwargs = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "max_logprobs": -1, **(llm_kwargs or {})}
        self.process = subprocess.Popen(
            [python, str(OFFLINE_SCRIPT), str(model_dir), json.dumps(kwargs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                 **OFFLINE_VLLM_ENV},
        )
        self._answers = ReferenceAnswers(self.process, "offline vLLM", log_path)

    # A hang guard, not a pace: the reference runs its whole engine in one process, and the rest of a 1,024-token
    # context took it over 120 s on the suite's loaded two cores.
    ANSWER_TIMEOUT_S = 600.0

    def run(self, cases: list[dict], timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, list[dict]]:
        """{case id: outputs} for cases {"id", "prompt_token_ids", "sampling"}."""
        answers = self.answers(cases, timeout_s)
        return {case_id: answer["outputs"] for case_id, answer in answers.items()}

    def answers(self, cases: list[dict], timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, dict]:
        """{case id: the whole answer} ("prompt_tokens", "outputs"; or "error" where vLLM refused it)."""
        return self._answers.ask(self.process.stdin, cases, START_TIMEOUT_S, timeout_s)

    def close(self) -> None:
        end_process(self.process, self.process.stdin.close)  # end of input: the script exits
        self._log.close()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory, test_model_dir, vllm_python):
    """(servicer, offline vLLM): one real engine behind enginelink, one on its own."""
    tmp = tmp_path_factory.mktemp("vllm")
    offline = OfflineVllm(vllm_python, test_model_dir, tmp / "offline-llm.log")
    # A short drain: the session's end has nothing in flight to wait for.
    # fast warm-up: tests/vllm/test_vllm_warmup.py checks what it did.
    # Placement on: tests/vllm/test_vllm_admin.py checks it against the real Worker's binding.
    servicer = vllm_servicer(tmp, test_model_dir, env={"ENGINELINK_DRAIN_SECS": "0.5", "ENGINELINK_WARMUP": "fast",
                                                       "ENGINELINK_PLACEMENT": "auto"})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer, offline
    finally:
        servicer.stop()
        offline.close()


@pytest.fixture(scope="session")
def vllm_quiet(tmp_path_factory, test_model_dir, vllm_python):
    """A second engine behind enginelink: no warm-up (its KV history holds only the tests' batches,
    from batch 0), vLLM's own --structured-outputs-config (STRUCTURED_CONFIG). One engine start
    for tests/vllm/test_vllm_constraints.py's configured backend and test_vllm_kv_events.py."""
    servicer = vllm_servicer(tmp_path_factory.mktemp("vllm-quiet"), test_model_dir,
                             engine_args=[*ENGINE_ARGS, "--structured-outputs-config", json.dumps(STRUCTURED_CONFIG)],
                             env={"ENGINELINK_DRAIN_SECS": "0.5", "ENGINELINK_WARMUP": "off"})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer
    finally:
        servicer.stop()


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory, vllm_python):
    """The vision test model (BLIP-2), built twice and compared: the image modules' one build."""
    return build_vision_model(tmp_path_factory.mktemp("vision-model"), vllm_python)


@pytest.fixture(scope="session")
def vision_offline(vision_model, vllm_python):
    """vLLM offline on the vision model and two images: the image modules' one reference run."""
    return run_offline(vision_model, vllm_python)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def engine_core_pid(launcher: int) -> int:
    """The EngineCore: the launcher itself for one engine without DP (it runs vLLM's core in-process and
    titles itself ``VLLM::EngineCore``), else the launcher's child that multiprocessing spawned for it."""

    def find():
        if b"EngineCore" in _cmdline(launcher):
            return launcher
        for pid in children(launcher):
            cmdline = _cmdline(pid)
            if b"spawn_main" in cmdline or b"EngineCore" in cmdline:
                return pid
        return None

    return wait_until(find, 5, "the EngineCore process")


def engine_worker_pid(core: int) -> int:
    """The EngineCore's Worker (/proc): its one child titled ``VLLM::Worker``, which runs the model."""

    def find():
        found = [pid for pid in children(core) if b"Worker" in _cmdline(pid)]
        return found[0] if len(found) == 1 else None

    return wait_until(find, 10, f"the one Worker of the EngineCore {core}")


# The burst timer: its own process, holding the engine's pidfds (inherited), one burst per line read.
BURSTER = """
import ctypes, signal, struct, sys, time
# A 0.1 ms EEVDF slice for this process (sched_attr.sched_runtime of SCHED_OTHER, Linux 6.12+; older kernels
# ignore it): sched_getattr, then sched_setattr with the slice (x86_64's syscall numbers; others keep theirs).
ATTR = struct.Struct("IIQiIQQQII")
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(ATTR.size)
if __import__("platform").machine() == "x86_64" and libc.syscall(315, 0, buf, ATTR.size, 0) == 0:
    attr = list(ATTR.unpack(buf.raw))
    attr[0], attr[5] = ATTR.size, 100_000
    libc.syscall(314, 0, ctypes.c_char_p(ATTR.pack(*attr)), 0)
fds = [int(fd) for fd in sys.argv[1:]]
def send(sig):
    for fd in fds:
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            pass
for line in sys.stdin:
    send(signal.SIGCONT)
    began = time.monotonic()
    time.sleep(float(line))
    send(signal.SIGSTOP)
    print(f"stopped {time.monotonic() - began:.3f}", flush=True)
"""


class StoppedEngine:
    """An EngineCore and its Worker, both stopped (SIGSTOP) until ``run_for`` lets them run a burst.

    With the EngineCore alone stopped, the Worker had already run ahead of the stop; and a burst timed on
    what a client had read came seconds late on a loaded box, where the client and the servicer lag the
    engine: 2,040-token streams ended before the test acted on them. Stopped by default, the engine only
    runs the bursts the test gives it, so a stream cannot end behind the test's back. The bursts are timed
    by a process of its own, in a session of its own: a session is a scheduling group (the kernel's
    autogroups), and the test's session holds the whole suite's workers and servicers (and, since the
    engines run in their servicers' session, the engines; before that each engine had a session of its
    own), so on a busy box a timer in the test's session, sleeping or even spinning, got the CPU seconds
    late (0.2 s bursts that lasted 0.55-4.2 s, one of which let the engine write four
    whole 2,000-token streams). It needs both a session of its own and a 0.1 ms EEVDF slice: under 8 busy
    loops, the slice alone gave bursts up to 4.2 s, the session alone up to 1.15 s, both 0.20-0.27 s. The
    signals go by pidfd (a pid the suite's process churn reused once received another test's SIGCONT)."""

    def __init__(self, launcher: int) -> None:
        self.core = Pidfd(engine_core_pid(launcher))
        self.worker = Pidfd(engine_worker_pid(self.core.pid))
        self.processes = (self.core, self.worker)
        self.bursts: list[float] = []  # each burst's length, as the timer measured it
        self.stop()
        self._burster = subprocess.Popen([sys.executable, "-c", BURSTER, str(self.core.fd), str(self.worker.fd)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         pass_fds=(self.core.fd, self.worker.fd), start_new_session=True)

    def stop(self) -> None:
        for process in self.processes:
            process.send(signal.SIGSTOP)

    def run_for(self, seconds: float) -> None:
        """Both continued for ``seconds``, then stopped again."""
        self._burster.stdin.write(f"{seconds}\n")
        self._burster.stdin.flush()
        said = self._burster.stdout.readline().split()
        assert said[:1] == ["stopped"], "the burst timer died"
        self.bursts.append(float(said[1]))  # how long the engine ran: what a failure should show

    def run_until(self, done, what: str, burst_s: float = 0.2, bursts: int = 10, settle_s: float = 5.0):
        """Bursts until ``done()`` holds, each followed by up to ``settle_s`` for the servicer and the client
        to read what it made; at most ``bursts`` (10 of 0.2 s: a few hundred of the tiny model's tokens)."""
        for _ in range(bursts):
            self.run_for(burst_s)
            try:
                return wait_until(done, settle_s, what, interval_s=0.05)
            except TimeoutError:
                continue
        raise AssertionError(f"{what} not reached in {bursts} bursts of {burst_s} s")

    def kill_core(self) -> None:
        """SIGKILL the EngineCore; the Worker continued, to notice its death as vLLM's Worker does."""
        self.core.send(signal.SIGKILL)
        self.worker.send(signal.SIGCONT)

    def close(self) -> None:
        """The burst timer ended; both processes continued (a no-op for one that is gone), the pidfds closed."""
        if self._burster.poll() is None:
            self._burster.stdin.close()
            self._burster.wait(10)
        self._burster.stdout.close()
        for process in self.processes:
            process.send(signal.SIGCONT)
            process.close()

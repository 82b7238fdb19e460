"""The real ``sglang serve --smg-grpc-mode`` hands over to enginelink (issue 19 item 2).

SGLang 0.5.23's own launcher, from the SGLang venv (``tools/setup-sglang``,
enginelink installed into it by ``tools/setup-sglang-plugin``), run as an
operator runs it, up to the engine launch, which is as far as a machine
without a CUDA GPU goes:

- SGLang's own parser runs first: a bad flag is its argparse error, exit 2;
- SGLang resolves its arguments before any gRPC code: on a machine without an
  accelerator that needs ``--device cpu``, else SGLang stops there;
- selected (``SMG_SGLANG_SERVICER_IMPL=enginelink``), ``sglang serve ...
  --smg-grpc-mode`` and ``python -m sglang.launch_server ... --grpc-mode`` run
  ``enginelink serve --engine sglang`` in the launcher's process: the gRPC
  port answers NOT_SERVING / "Engine is starting" while the scheduler starts,
  the scheduler gets SGLang's arguments (journal), and when its launch fails
  (here: the struct-only venv lacks SGLang's server stack) enginelink exits 1
  saying so; with no GPU at all it refuses before anything starts (exit 2);
- not selected, the reference's path runs: SGLang's own "gRPC mode requires
  the smg-grpc-servicer package";
- the worker probe reads a real multi-node ``sglang serve`` command line
  (``--dist-init-addr``), as ``/proc`` shows it, against a loopback store.

The scheduler is held at its start by a wrapper interpreter until the test
has seen the health answers, so that check does not race the launch.
Each run imports SGLang's server stack (torch): tens of seconds on a loaded box.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc

from enginelink.journal.store import open_reader
from tests.harness import Servicer, free_port, wait_until
from tests.wire.engine_venvs import side_python_or_skip

pytestmark = [pytest.mark.process, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
RUN_TIMEOUT_S = 600.0  # one launcher run: SGLang's imports, enginelink's release check, the scheduler's start
WHERE_IS_THE_PLUGIN = """
import json
from importlib.metadata import entry_points
import enginelink.tools.sglang_plugin as plugin
print(json.dumps([[e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "enginelink"],
                  plugin.__file__]))
"""
# The engine's interpreter, held at the scheduler's start (sglang_headless.py) until GATE exists.
GATE_WRAPPER = """#!/bin/sh
case "$1" in
    *sglang_headless.py) while [ ! -e '{gate}' ]; do sleep 0.05; done ;;
esac
exec '{python}' "$@"
"""


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The SGLang venv's interpreter, with this checkout's enginelink plugin installed beside SGLang."""
    python = side_python_or_skip("sglang")
    found = subprocess.run([python, "-c", WHERE_IS_THE_PLUGIN], capture_output=True, text=True, timeout=120)
    entry, module = json.loads(found.stdout.strip().splitlines()[-1]) if found.returncode == 0 else ([], "")
    if entry != ["enginelink.tools.sglang_plugin:register"] or Path(module).resolve() != REPO / "tools" / "sglang_plugin.py":
        message = (f"this checkout's enginelink is not installed in the SGLang venv of {python} "
                   f"(found {entry} at {module or found.stderr[-500:]}): run tools/setup-sglang-plugin")
        if os.environ.get("ENGINELINK_REQUIRE_SGLANG") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def launcher_env(tmp_path: Path, socket_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "SMG_ZMQ_SOCKET_DIR": str(socket_dir), "XDG_STATE_HOME": str(tmp_path / "state"), **extra}
    for name in ("SMG_SGLANG_SERVICER_IMPL", "ENGINELINK_SGLANG_PYTHON", "ENGINELINK_SGLANG_VENV",
                 "ENGINELINK_SGLANG_GPU_GLOB", "SGLANG_PLUGINS"):
        if name not in extra:
            env.pop(name, None)
    return env


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)


def journal(path: Path) -> list[tuple[str, dict]]:
    with open_reader(path) as reader:
        return [(rec.kind, rec.payload) for rec in reader.records()]


def sglang_port() -> int:
    """A free port SGLang takes in gRPC mode: it derives its native gRPC port, --port + 10000, and checks it."""
    for _ in range(100):
        port = free_port()
        if port + 10000 <= 65535:
            return port
    raise AssertionError("no free port below 55536")


def assert_enginelink_never_started(done: subprocess.CompletedProcess, tmp_path: Path) -> None:
    """No ``enginelink serve`` line (its refusals start so), no listener, no journal in its state directory."""
    assert "enginelink serve:" not in done.stderr and "gRPC bound" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "state" / "enginelink").exists()


def serve_command(python: str, model: Path, port: int, *flags: str) -> list[str]:
    return [str(Path(python).parent / "sglang"), "serve", "--model-path", str(model), *flags,
            "--host", "127.0.0.1", "--port", str(port)]


def test_a_bad_flag_is_sglangs_own_parser_error(sglang_python, test_model_dir, tmp_path, socket_dir):
    done = run(serve_command(sglang_python, test_model_dir, sglang_port(), "--smg-grpc-mode", "--no-such-flag", "3"),
               launcher_env(tmp_path, socket_dir, SMG_SGLANG_SERVICER_IMPL="enginelink"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "sglang serve: error: unrecognized arguments: --no-such-flag 3" in done.stderr
    assert_enginelink_never_started(done, tmp_path)


def test_without_an_accelerator_sglang_stops_at_its_own_argument_resolution(sglang_python, test_model_dir,
                                                                            tmp_path, socket_dir):
    """Before any gRPC code: SGLang resolves --device (``get_device``), which needs one, or ``--device cpu``.

    (The venv's torch is a CPU build, so this holds on a GPU machine too.)"""
    done = run(serve_command(sglang_python, test_model_dir, sglang_port(), "--smg-grpc-mode"),
               launcher_env(tmp_path, socket_dir, SMG_SGLANG_SERVICER_IMPL="enginelink"))
    assert done.returncode == 1
    assert ("RuntimeError: No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or platform plugin is available."
            in done.stderr), done.stderr[-3000:]
    assert_enginelink_never_started(done, tmp_path)


@pytest.mark.parametrize("form", ["sglang serve --smg-grpc-mode", "python -m sglang.launch_server --grpc-mode"])
def test_the_real_launcher_hands_over_to_enginelink_up_to_the_engine_launch(form, sglang_python, test_model_dir,
                                                                           tmp_path, socket_dir):
    gate = tmp_path / "scheduler-may-start"
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(GATE_WRAPPER.format(gate=gate, python=sglang_python))
    wrapper.chmod(0o755)
    fake_gpu = tmp_path / "dev" / "nvidia0"  # past enginelink's no-GPU refusal, to the scheduler's launch
    fake_gpu.parent.mkdir()
    fake_gpu.touch()
    launcher = Servicer(tmp_path, health_service=SGLANG_SERVICE)
    launcher.port = sglang_port()
    launcher.env = launcher_env(
        tmp_path, socket_dir, SMG_SGLANG_SERVICER_IMPL="enginelink", ENGINELINK_SGLANG_PYTHON=str(wrapper),
        ENGINELINK_SGLANG_GPU_GLOB=str(fake_gpu.parent / "nvidia[0-9]*"), ENGINELINK_ENGINE_NICE="0")
    grpc_flag = form.split()[-1]
    sglang_args = ["--model-path", str(test_model_dir), "--host", "127.0.0.1", "--port", str(launcher.port),
                   "--device", "cpu", "--mem-fraction-static", "0.5", grpc_flag]
    if form.startswith("sglang serve"):
        launcher.argv = [str(Path(sglang_python).parent / "sglang"), "serve", *sglang_args]
    else:
        launcher.argv = [sglang_python, "-m", "sglang.launch_server", *sglang_args]
    launcher.journal = tmp_path / "state" / "enginelink" / f"journal-{launcher.port}.sqlite"
    try:
        launcher.start(wait_serving=False)
        health = health_pb2_grpc.HealthStub(launcher.channel)
        scheduler = pb_grpc.SglangSchedulerStub(launcher.channel)

        def answered_or_exited() -> bool:
            if launcher.process.poll() is not None:
                return True
            return health.Check(health_pb2.HealthCheckRequest(service=SGLANG_SERVICE), timeout=5) is not None

        wait_until(answered_or_exited, RUN_TIMEOUT_S, "the launcher's gRPC port", interval_s=0.5)
        assert launcher.process.poll() is None, launcher.log()[-3000:]
        # The scheduler is held at its start: the servicer is up, the engine is not.
        assert health.Check(health_pb2.HealthCheckRequest(service=SGLANG_SERVICE), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        reply = scheduler.HealthCheck(pb.HealthCheckRequest(), timeout=30)
        assert (reply.healthy, reply.message) == (False, "Engine is starting")
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(scheduler.Generate(pb.GenerateRequest(request_id="early", tokenized=pb.TokenizedInput(
                input_ids=[5, 6, 7])), timeout=30)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.touch()
        status = launcher.wait(timeout_s=RUN_TIMEOUT_S)
        log = launcher.log()
        assert status == 1, log[-3000:]
        assert f"gRPC bound on 127.0.0.1:{launcher.port} (health NOT_SERVING until the engine is up)" in log
        # The scheduler dies before it is ready: the link sees its ready pipe close or its process exit first,
        # whichever the machine schedules first (CI saw both); either way the launch failed and it says so.
        failed = re.search(r"exiting with status 1: (engine link failed: (engine broke the handshake: the engine "
                           r"closed its ready pipe without reporting ready|engine process \d+ exited with status 1))", log)
        assert failed, log[-3000:]
        assert "sglang_headless.py" in log  # the scheduler's own traceback, in the launcher's output
        records = journal(launcher.journal)
        start = next(payload for kind, payload in records if kind == "run.start")
        # The launcher's own command line (python -m shows the module's file as argv[0]).
        assert start["argv"][-len(sglang_args):] == sglang_args
        assert Path(start["argv"][0]).name == ("sglang" if form.startswith("sglang serve") else "launch_server.py")
        assert (start["engine"], start["port"]) == ("sglang", launcher.port)
        launch = next(payload["message"] for kind, payload in records
                      if kind == "engine.handshake" and payload["step"] == "launch")
        scheduler_args = launch["argv"][launch["argv"].index("--") + 1:]
        # The model and SGLang's other arguments go to the scheduler; the listener and gRPC flags stay ours
        # (and enginelink adds its KV-event publisher's address). No --skip-tokenizer-init: the scheduler keeps
        # its tokenizer, which its grammar backend is built from (runtime/contracts/sglang/launch.py).
        assert scheduler_args[:-2] == ["--model-path", str(test_model_dir),
                                       "--device", "cpu", "--mem-fraction-static", "0.5"]
        assert scheduler_args[-2] == "--kv-events-config"
        assert launch["argv"][:2] == [str(wrapper), str(REPO / "runtime" / "contracts" / "sglang" / "sglang_headless.py")]
        assert records[-1] == ("run.stop", {"exit_status": 1, "reason": failed.group(1)})
    finally:
        gate.touch()
        launcher.stop()


def test_with_no_gpu_enginelink_refuses_before_anything_starts(sglang_python, test_model_dir, tmp_path, socket_dir):
    """What an operator of this CPU-only box sees: the launcher's own SGLang checked, then the refusal.

    ``ENGINELINK_SGLANG_VENV`` names nothing: the scheduler's interpreter is the launcher's own, so that
    is not what stops it (else: "no SGLang installation at ...")."""
    no_gpu = tmp_path / "dev"  # an empty /dev: enginelink's check finds no CUDA device
    no_gpu.mkdir()
    done = run(serve_command(sglang_python, test_model_dir, sglang_port(), "--smg-grpc-mode", "--device", "cpu"),
               launcher_env(tmp_path, socket_dir, SMG_SGLANG_SERVICER_IMPL="enginelink",
                            ENGINELINK_SGLANG_VENV=str(tmp_path / "no-such-venv"),
                            ENGINELINK_SGLANG_GPU_GLOB=str(no_gpu / "nvidia[0-9]*")))
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("enginelink serve: the SGLang scheduler needs a CUDA GPU (sglang-kernel ships CUDA binaries only) "
            f"and this machine has none ({no_gpu}/nvidia[0-9]* matches nothing)") in done.stderr
    assert "no SGLang installation" not in done.stderr and "gRPC bound" not in done.stderr


def test_the_references_flags_on_sglangs_parser_reach_the_servicer(sglang_python, test_model_dir, tmp_path,
                                                                   socket_dir):
    """``--servicer-impl enginelink`` selects with no variable set, and the reference's ``--metrics-*`` flags
    parse on SGLang's own parser and reach the servicer: its start-up lines, and its metrics listener, up
    before the scheduler's launch fails (this venv has no SGLang server stack); ``SMG_SGLANG_SERVICER_*``
    names are read; ``--servicer-impl python`` beats the variable (and, the reference's plugin not installed
    here, nothing adds its flag: SGLang's own parser refuses it)."""
    fake_gpu = tmp_path / "dev" / "nvidia0"  # past enginelink's no-GPU refusal, to the scheduler's launch
    fake_gpu.parent.mkdir()
    fake_gpu.touch()
    port = sglang_port()
    done = run(serve_command(sglang_python, test_model_dir, port, "--smg-grpc-mode", "--device", "cpu",
                             "--servicer-impl", "enginelink", "--metrics-port", str(port + 1),
                             "--metrics-host", "127.0.0.1"),
               launcher_env(tmp_path, socket_dir, ENGINELINK_SGLANG_GPU_GLOB=str(fake_gpu.parent / "nvidia[0-9]*"),
                            SMG_SGLANG_SERVICER_DRAIN_SECS="4", SMG_SGLANG_SERVICER_HANDSHAKE_PORT="5000",
                            ENGINELINK_ENGINE_NICE="0"))
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]  # the scheduler's launch failed, after the servicer came up
    assert "servicer implementation: enginelink (source=flag)" in said
    assert (f"metrics_port={port + 1} (--metrics-port), metrics_host=127.0.0.1 (--metrics-host), "
            "drain_s=4 (SMG_SGLANG_SERVICER_DRAIN_SECS)") in said
    assert ("SMG_SGLANG_SERVICER_HANDSHAKE_PORT cannot apply to enginelink: the SGLang scheduler reports ready "
            "on a pipe") in said
    assert f"metrics on http://127.0.0.1:{port + 1}/metrics" in said
    records = journal(tmp_path / "state" / "enginelink" / f"journal-{port}.sqlite")
    launch = next(payload["message"] for kind, payload in records
                  if kind == "engine.handshake" and payload["step"] == "launch")
    assert not {"--servicer-impl", "--metrics-port", "--metrics-host"} & set(launch["argv"])  # not the scheduler's
    done = run(serve_command(sglang_python, test_model_dir, sglang_port(), "--smg-grpc-mode", "--device", "cpu",
                             "--servicer-impl", "python"),
               launcher_env(tmp_path / "second", socket_dir, SMG_SGLANG_SERVICER_IMPL="enginelink"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "sglang serve: error: unrecognized arguments: --servicer-impl python" in done.stderr
    assert_enginelink_never_started(done, tmp_path / "second")


def test_not_selected_the_reference_path_runs(sglang_python, test_model_dir, tmp_path, socket_dir):
    """The plugin is installed but inert: SGLang's own gRPC entry point imports the reference package."""
    done = run(serve_command(sglang_python, test_model_dir, sglang_port(), "--smg-grpc-mode", "--device", "cpu"),
               launcher_env(tmp_path, socket_dir))
    assert done.returncode == 1
    assert ("ImportError: gRPC mode requires the smg-grpc-servicer package. If not installed, run: "
            "pip install smg-grpc-servicer[sglang]." in done.stderr), done.stderr[-3000:]
    assert_enginelink_never_started(done, tmp_path)


def test_the_worker_probe_reads_the_leader_off_a_real_sglang_serve_command_line(tmp_path):
    """A multi-node worker's ``sglang serve`` as the kernel shows it: the venv's interpreter, the script, its flags."""
    python = side_python_or_skip("sglang")
    store = socket.create_server(("127.0.0.1", 0))
    port = store.getsockname()[1]
    worker = subprocess.Popen([str(Path(python).parent / "sglang"), "serve", "--model-path", "/models/m",
                               "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}",
                               "--tp-size", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Popen returns once the exec happened, yet CI once read a command line of fewer than three words
        # there: read until the kernel shows the script's (bounded), the real one, not the test's.
        cmdline = wait_until(lambda: (lambda line: line if len(line.split(b"\0")) > 3 else None)(
            Path(f"/proc/{worker.pid}/cmdline").read_bytes()), 10, "the worker's command line")
    finally:
        worker.kill()
        worker.wait(timeout=60)
    words = cmdline.split(b"\0")
    assert Path(words[1].decode()).name == "sglang" and words[2] == b"serve", words  # python, the script, serve
    root = tmp_path / "proc"
    (root / "1").mkdir(parents=True)
    (root / "1" / "cmdline").write_bytes(cmdline)  # the pod's PID 1 is the engine
    (root / "net").symlink_to("/proc/net")  # this network namespace's real TCP tables
    try:
        with socket.create_connection(("127.0.0.1", port)), store.accept()[0]:
            alive = probe_isolated("--engine", "sglang", "--proc-root", str(root))
            assert alive.returncode == 0, alive.stdout + alive.stderr
            assert f"to the leader's store 127.0.0.1:{port} (store port {port} from --dist-init-addr in" in alive.stdout
    finally:
        store.close()
    dead = probe_isolated("--engine", "sglang", "--proc-root", str(root))
    assert dead.returncode == 1 and "NOT alive" in dead.stdout, dead.stdout + dead.stderr


def probe_isolated(*args: str) -> subprocess.CompletedProcess:
    """The probe as a kubelet runs it: ``python3 -I -m enginelink.tools.worker_probe``."""
    return subprocess.run([sys.executable, "-I", "-m", "enginelink.tools.worker_probe", *args],
                          capture_output=True, text=True, timeout=60)

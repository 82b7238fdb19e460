"""``ts serve``'s engine module (``TS_SERVE_ENGINE_MODULE=enginelink.tools.tokenspeed_entry``).

What ``ts serve`` passes (its own ``tokenspeed.cli._proc.engine_argv``, asked in the
TokenSpeed venv when ``tools/setup-tokenspeed`` built it) becomes ``enginelink serve
--engine tokenspeed``; end to end the engine is the stand-in interpreter of
``test_tokenspeed_launch.py`` (the sim's TokenSpeed personality where TokenSpeed's
module would run: the real engine needs a GPU), and the servicer answers
``grpc.health.v1`` ``""`` SERVING, which is what ``ts serve`` waits for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from enginelink.tools.tokenspeed_entry import translate
from tests.harness import end_process, free_port, wait_until
from tests.test_tokenspeed_launch import ENGINE_MODULE, LAYOUT_FILE, STAND_IN
from tests.wire.engine_venvs import side_python_or_skip

MODULE = "enginelink.tools.tokenspeed_entry"


def test_ts_serves_command_line_becomes_serve_engine_tokenspeed():
    assert translate(["--host", "127.0.0.1", "--port", "50051", "--model-path", "/m", "--tp-size", "1",
                      "--rl-control-port", "4242"]) == [
        "serve", "--engine", "tokenspeed", "--host", "127.0.0.1", "--port", "50051", "--model", "/m",
        "--servicer-impl-source", "TS_SERVE_ENGINE_MODULE", "--", "--tp-size", "1", "--rl-control-port", "4242"]
    assert translate(["--host=0.0.0.0", "--port=1", "--model=/w"]) == [
        "serve", "--engine", "tokenspeed", "--host", "0.0.0.0", "--port", "1", "--model", "/w",
        "--servicer-impl-source", "TS_SERVE_ENGINE_MODULE"]


def test_the_references_servicer_flags_reach_the_servicer():
    """``python -m smg_grpc_servicer.tokenspeed`` takes --servicer-impl, --metrics-port and --metrics-host ahead of
    TokenSpeed's flags: here they are enginelink serve's, and never reach the engine's arguments."""
    serve_args = translate(["--host", "h", "--port", "1", "--model-path", "/m", "--metrics-port", "9100",
                            "--metrics-host=0.0.0.0", "--servicer-impl", "enginelink", "--tp-size", "2"])
    assert serve_args == ["serve", "--engine", "tokenspeed", "--host", "h", "--port", "1", "--model", "/m",
                          "--metrics-port", "9100", "--metrics-host", "0.0.0.0",
                          "--servicer-impl-source", "TS_SERVE_ENGINE_MODULE", "--", "--tp-size", "2"]
    for impl in ("rust", "python"):
        with pytest.raises(ValueError, match=f"--servicer-impl {impl} asks for the reference servicer's"):
            translate(["--host", "h", "--port", "1", "--model-path", "/m", "--servicer-impl", impl])


@pytest.mark.process
@pytest.mark.parametrize("argv, words", [
    (["--port", "1", "--model-path", "/m"], "--host is missing"),
    (["--host", "h", "--port", "x", "--model-path", "/m"], "not a port number"),
    (["--host", "h", "--port", "1"], "--model-path is missing"),
    (["--host", "h", "--port", "1", "--model-path"], "--model-path needs a value"),
    (["--host", "h", "--port", "1", "--model-path", "/m", "--servicer-impl=rust"], "asks for the reference"),
])
def test_a_command_line_it_cannot_read_exits_2_saying_why(argv, words):
    done = subprocess.run([sys.executable, "-m", MODULE, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert words in done.stderr and "usage:" in done.stderr


@pytest.mark.process
def test_it_imports_the_standard_library_only():
    """It runs under the TokenSpeed venv's python, where enginelink's dependencies are not installed."""
    code = (f"import sys; import {MODULE}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'trio', 'grpclib', 'grpc', 'google', "
            "'msgspec', 'zmq', 'smg_grpc_proto', 'transitions'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _ts_engine_argv(host: str, port: int, args: list[str]) -> list[str]:
    """What ts serve runs for its engine, from TokenSpeed's own code when its venv is here."""
    python = side_python_or_skip("tokenspeed")
    code = ("import json, sys; from tokenspeed.cli._proc import engine_argv; "
            "print(json.dumps(engine_argv(json.loads(sys.argv[1]), host=sys.argv[2], port=int(sys.argv[3]))))")
    done = subprocess.run([python, "-c", code, json.dumps(args), host, str(port)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TS_SERVE_ENGINE_MODULE": MODULE})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_ts_serve_starts_enginelink_as_its_engine(tmp_path, test_model_dir, socket_dir):
    port = free_port()
    argv = _ts_engine_argv("127.0.0.1", port, ["--model-path", str(test_model_dir), "--step-us", "1000"])
    assert argv[1:3] == ["-m", MODULE]
    # enginelink is not installed in the TokenSpeed venv here: the same module run by this venv's python.
    stand_in = tmp_path / "ts-python"
    stand_in.write_text(STAND_IN.replace("{python}", sys.executable).replace("{module}", ENGINE_MODULE))
    stand_in.chmod(0o755)
    env = {**os.environ, "ENGINELINK_TOKENSPEED_PYTHON": str(stand_in),
           "ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(LAYOUT_FILE), "TS_STAND_IN_ARGV": str(tmp_path / "argv.json"),
           "ENGINELINK_WARMUP": "off", "XDG_STATE_HOME": str(tmp_path / "state"), "SMG_ZMQ_SOCKET_DIR": str(socket_dir)}
    log = open(tmp_path / "entry.log", "wb")
    process = subprocess.Popen([sys.executable, *argv[1:]], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:  # what ts serve's wait_grpc_serving asks
                assert process.poll() is None, (tmp_path / "entry.log").read_text()
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, 60, "health '' SERVING")
            replies = list(pb_grpc.TokenSpeedSchedulerStub(channel).Generate(pb.GenerateRequest(
                request_id="via-ts", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)), timeout=30))
            assert replies[-1].complete.completion_tokens == 2
        engine = json.loads((tmp_path / "argv.json").read_text())
        assert engine[engine.index("--model-path") + 1] == str(test_model_dir)
        # The operator's engine args, then the KV-event publisher enginelink turns on (TokenSpeed's own form).
        assert engine[-4:-1] == ["--step-us", "1000", "--kv-events-config"]
        assert json.loads(engine[-1])["enable_kv_cache_events"] is True
    finally:
        end_process(process, lambda: process.send_signal(signal.SIGTERM))
        log.close()
    assert process.returncode == 0, (tmp_path / "entry.log").read_text()

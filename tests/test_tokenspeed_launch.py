"""``enginelink serve --engine tokenspeed``: the launch recipe, the release check, and the whole launch path.

The real TokenSpeed engine needs a CUDA/ROCm/NPU device, so it cannot start here.
What can be shown: the argv ``ts serve --headless``'s module gets; the refusals
(exit 2, one line) of engine arguments enginelink owns and of a release whose
structs drifted; the real 0.1.1 venv's layout accepted (when ``tools/setup-tokenspeed``
built it); and the launch path end to end (TCP handshake, the ready response's
``tokenspeed-0.1.1`` checked against the release check) with a stand-in
interpreter that runs the sim engine's TokenSpeed personality where
TokenSpeed's module would run, reached through ``ENGINELINK_TOKENSPEED_PYTHON``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from enginelink.runtime.contracts.shared import engine_compat
from enginelink.runtime.engine.launchers import LauncherError
from enginelink.runtime.contracts.tokenspeed.launch import ENGINE_MODULE, TokenSpeedLauncher, check_engine_args
from tests.harness import Servicer, free_port
from tests.router.test_router_e2e import journal
from tests.test_operator import refused_with_one_line, serve
from tests.wire.engine_venvs import LAYOUTS, side_python_or_skip

LAYOUT_FILE = LAYOUTS / "tokenspeed-0.1.1.json"
SERVICE = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"

# Stands in for the TokenSpeed venv's python: takes what the launcher passes to TokenSpeed's
# module, writes it down, and runs the sim engine's TokenSpeed personality on that handshake.
STAND_IN = """#!{python}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["TS_STAND_IN_ARGV"], "w") as out:
    json.dump(argv, out)
assert argv[:2] == ["-m", "{module}"], argv
def value(flag):
    return argv[argv.index(flag) + 1]
extra = [a for a in argv[2:] if a not in ("--zmq-msgpack", "--skip-tokenizer-init")]
for flag in ("--model-path", "--data-parallel-address", "--data-parallel-rpc-port"):
    i = extra.index(flag)
    del extra[i:i + 2]
os.execv(sys.executable, [sys.executable, "-m", "enginelink.tools.sim_engine", "--wire", "tokenspeed",
         "--handshake", "tcp://%s:%s" % (value("--data-parallel-address"), value("--data-parallel-rpc-port")),
         "--model", value("--model-path"), *extra])
"""


def test_the_command_is_ts_serve_headless_module_on_a_tcp_handshake():
    launcher = TokenSpeedLauncher(python="/ts/bin/python", model_dir=Path("/models/m"), release="0.1.1",
                                  extra_args=["--tp-size", "2", "--enable-output-logprobs"])
    argv, env = launcher.command("tcp://127.0.0.1:40123")
    assert argv == ["/ts/bin/python", "-m", ENGINE_MODULE, "--model-path", "/models/m",
                    "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "40123",
                    "--zmq-msgpack", "--skip-tokenizer-init", "--tp-size", "2", "--enable-output-logprobs"]
    assert env == {}
    assert launcher.handshake_transport == "tcp"
    assert launcher.checked_version == "tokenspeed-0.1.1"
    with pytest.raises(LauncherError, match="TCP handshake"):
        launcher.command("ipc:///tmp/hs.sock")
    shown = launcher.redacted([*argv, "--api-key", "s3cret", "--hf-token=t0k"])
    assert "s3cret" not in shown and "--hf-token=t0k" not in shown


@pytest.mark.parametrize("args", [["--model-path", "/x"], ["--data-parallel-rpc-port=30500"],
                                  ["--data-parallel-address", "0.0.0.0"]])
def test_flags_enginelink_owns_are_refused_in_the_engine_arguments(args):
    with pytest.raises(LauncherError, match="set by enginelink"):
        check_engine_args(args)
    check_engine_args(["--tp-size", "2"])


@pytest.mark.process
def test_serve_refuses_an_owned_flag_and_a_drifted_release_in_one_line(tmp_path, test_model_dir):
    line = refused_with_one_line(serve(tmp_path, "--engine", "tokenspeed", "--model", test_model_dir, "--",
                                       "--data-parallel-rpc-port", "1"))
    assert "--data-parallel-rpc-port is set by enginelink" in line

    drifted = json.loads(LAYOUT_FILE.read_text())
    drifted["version"] = "0.1.2"
    drifted["structs"]["TokenizedGenerateReqInput"]["fields"][0]["name"] = "request_id"
    path = tmp_path / "ts-0.1.2.json"
    path.write_text(json.dumps(drifted))
    line = refused_with_one_line(serve(tmp_path, "--engine", "tokenspeed", "--model", test_model_dir,
                                       env={"ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(path),
                                            "ENGINELINK_TOKENSPEED_PYTHON": "/opt/ts/bin/python"}))
    assert "TokenSpeed 0.1.2" in line and "'request_id'" in line and "Supported TokenSpeed releases: 0.1.1" in line

    line = refused_with_one_line(serve(tmp_path, "--engine", "vllm", "--wire", "tokenspeed", "--model",
                                       test_model_dir))
    assert "--engine vllm does not speak --wire tokenspeed; it speaks: vllm" in line  # engines.py, the one table

    long_dir = tmp_path / ("d" * 80)
    long_dir.mkdir(mode=0o700)
    line = refused_with_one_line(serve(tmp_path, "--engine", "tokenspeed", "--model", test_model_dir,
                                       env={"ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(LAYOUT_FILE),
                                            "ENGINELINK_TOKENSPEED_PYTHON": "/opt/ts/bin/python",
                                            "SMG_ZMQ_SOCKET_DIR": str(long_dir)}))
    assert "ipc socket directory" in line and "SMG_ZMQ_SOCKET_DIR" in line


@pytest.mark.process
def test_the_launch_path_end_to_end_through_a_stand_in_interpreter(tmp_path, test_model_dir):
    stand_in = tmp_path / "ts-python"
    stand_in.write_text(STAND_IN.replace("{python}", sys.executable).replace("{module}", ENGINE_MODULE))
    stand_in.chmod(0o755)
    recorded = tmp_path / "argv.json"
    env = {"ENGINELINK_TOKENSPEED_PYTHON": str(stand_in), "ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(LAYOUT_FILE),
           "TS_STAND_IN_ARGV": str(recorded), "ENGINELINK_WARMUP": "off"}
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "tokenspeed"],
                        engine_args=["--step-us", "1000"], env=env, health_service=SERVICE)
    with servicer:
        argv = json.loads(recorded.read_text())
        port = argv[argv.index("--data-parallel-rpc-port") + 1]
        assert argv[argv.index("--data-parallel-address") + 1] == "127.0.0.1" and port.isdigit()
        # The operator's engine args, then the KV-event publisher enginelink turns on (TokenSpeed's own form).
        assert argv[-4:-1] == ["--step-us", "1000", "--kv-events-config"]
        assert json.loads(argv[-1])["enable_kv_cache_events"] is True
        stub = pb_grpc.TokenSpeedSchedulerStub(servicer.channel)
        replies = list(stub.Generate(pb.GenerateRequest(
            request_id="launched", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)), timeout=30))
        assert replies[-1].complete.finish_reason == "length" and len(replies[-1].complete.output_ids) == 3
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).tokenspeed_version == "0.1.1"
        with pytest.raises(grpc.RpcError) as caught:  # a vLLM client finds no vLLM service here
            servicer.stub.HealthCheck(vllm_pb.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The link bound the TCP handshake it handed the engine, and journaled it.
        launches = [p["message"] for _, _, kind, p in journal(servicer)
                    if kind == "engine.handshake" and p["step"] == "launch"]
        assert launches and launches[-1]["handshake"] == f"tcp://127.0.0.1:{port}"


@pytest.mark.process
def test_the_reference_handshake_port_pins_the_handshake(tmp_path, test_model_dir):
    """SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT: the TCP port TokenSpeed's ranks dial, as the reference pins it;
    a port already taken is refused before anything starts."""
    stand_in = tmp_path / "ts-python"
    stand_in.write_text(STAND_IN.replace("{python}", sys.executable).replace("{module}", ENGINE_MODULE))
    stand_in.chmod(0o755)
    recorded = tmp_path / "argv.json"
    pinned = free_port()
    env = {"ENGINELINK_TOKENSPEED_PYTHON": str(stand_in), "ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(LAYOUT_FILE),
           "TS_STAND_IN_ARGV": str(recorded), "ENGINELINK_WARMUP": "off",
           "SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT": str(pinned)}
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "tokenspeed"], env=env,
                  health_service=SERVICE) as servicer:
        argv = json.loads(recorded.read_text())
        assert argv[argv.index("--data-parallel-rpc-port") + 1] == str(pinned)
        launches = [p["message"] for _, _, kind, p in journal(servicer)
                    if kind == "engine.handshake" and p["step"] == "launch"]
        assert launches[-1]["handshake"] == f"tcp://127.0.0.1:{pinned}"
        assert f"handshake_port={pinned} (SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT)" in servicer.log()
        # Taken (by the servicer above): one line, exit 2.
        line = refused_with_one_line(serve(tmp_path, "--engine", "tokenspeed", "--model", test_model_dir,
                                           "--port", free_port(), env=env))
        assert f"SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT={pinned}: the handshake port is not free" in line


@pytest.mark.process
def test_the_installed_0_1_1_release_passes_the_launch_check(tmp_path):
    python = side_python_or_skip("tokenspeed")
    version, warning = engine_compat.check_installed("tokenspeed", python)
    assert (version, warning) == ("0.1.1", None)
    assert TokenSpeedLauncher(python=python, model_dir=tmp_path, release=version).checked_version == \
        "tokenspeed-0.1.1"


def test_without_enable_output_logprobs_a_logprob_request_is_refused_before_the_engine():
    from enginelink.runtime.errors import ClientError
    from enginelink.runtime.requests.validate import EngineLimits
    from enginelink.runtime.contracts.tokenspeed.service import TokenSpeedSchedulerService

    limits = EngineLimits(max_model_len=64, vocab_size=100, eos_token_ids=(2,))
    asks = pb.GenerateRequest(request_id="lp", tokenized=pb.TokenizedInput(input_ids=[5, 6]), return_logprob=True,
                              sampling_params=pb.SamplingParams(max_new_tokens=2))
    for engine_args, served in ((["--tp-size", "1"], False), (["--enable-output-logprobs"], True)):
        launcher = TokenSpeedLauncher(python="/ts/bin/python", model_dir=Path("/m"), extra_args=engine_args)
        assert launcher.output_logprobs is served
        service = TokenSpeedSchedulerService(app=None, frame_writes=None)
        service.configure(launcher)
        # The engine's arguments, and the grammar labels they resolve to (no --grammar-backend: none).
        assert service.server_args == {"engine_args": engine_args, "grammar_backend": "none",
                                       "constrained_decoding_start": "first_token"}
        if served:
            assert service.edge.validate(asks, limits, 0.0).specs[0].sampling.logprobs == 0
        else:
            with pytest.raises(ClientError) as refused:
                service.edge.validate(asks, limits, 0.0)
            assert refused.value.field == "return_logprob"
            assert "started without --enable-output-logprobs" in str(refused.value)


@pytest.mark.process
def test_the_engines_kv_events_are_turned_on_in_its_dialect_and_relayed(tmp_path, test_model_dir):
    """Issue 33 item 5: `serve --engine tokenspeed` turns TokenSpeed's publisher on (its own config form, which
    TokenSpeed's own factory reads as enabled) and SubscribeKvEvents relays it (the stand-in runs the sim's
    TokenSpeed personality, which publishes as TokenSpeed's publisher does)."""
    from tests.kv.kv_client import KvSubscription, prompt

    stand_in = tmp_path / "ts-python"
    stand_in.write_text(STAND_IN.replace("{python}", sys.executable).replace("{module}", ENGINE_MODULE))
    stand_in.chmod(0o755)
    recorded = tmp_path / "argv.json"
    env = {"ENGINELINK_TOKENSPEED_PYTHON": str(stand_in), "ENGINELINK_TOKENSPEED_LAYOUT_FILE": str(LAYOUT_FILE),
           "TS_STAND_IN_ARGV": str(recorded), "ENGINELINK_WARMUP": "off"}
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "tokenspeed"], env=env,
                  health_service=SERVICE) as servicer:
        servicer.stub = pb_grpc.TokenSpeedSchedulerStub(servicer.channel)
        argv = json.loads(recorded.read_text())
        text = argv[argv.index("--kv-events-config") + 1]
        assert json.loads(text)["enable_kv_cache_events"] is True
        ids = prompt(5, 32)
        with KvSubscription(servicer, 0) as sub:
            list(servicer.stub.Generate(pb.GenerateRequest(
                request_id="kv", tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=1)), timeout=30))
            (batch,) = sub.wait(lambda s: s.kv_batches(), what="the engine's first batch")
            (stored,) = [e.stored for e in batch.events if e.WhichOneof("data") == "stored"]
            assert [t for block in stored.blocks for t in block.token_ids] == ids  # two 16-token blocks
    python = engine_compat.default_python("tokenspeed")
    if Path(python).exists():  # TokenSpeed's own factory reads the text enginelink gave it as publishing
        probe = ("import sys\nfrom tokenspeed.runtime.pd.kv_events import EventPublisherFactory as F\n"
                 "print(F.is_enabled(sys.argv[1]))\n")
        import subprocess

        done = subprocess.run([python, "-c", probe, text], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]

"""``serve --engine sglang``: the launch a real SGLang scheduler gets, and the refusals before it.

The scheduler cannot run on a CPU-only machine (``reference/sglang-wire.md`` §7),
so these check what can be checked here: the argv and environment the link
starts it with, every refusal (exit 2, naming the cause) that comes before the
engine, the release check against a drifted layout, and, with the struct-only
SGLang venv (``tools/setup-sglang``), that SGLang's own parser takes our
arguments and that the names the headless script calls exist in the release.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from enginelink.runtime.engine.launchers import LauncherError
from enginelink.runtime.contracts.sglang.launch import SGLANG_HEADLESS_SCRIPT, SglangLauncher
from enginelink.wire import sglang
from tests.wire.engine_venvs import side_python_or_skip

ENGINELINK = Path(sys.executable).parent / "enginelink"


def _launcher(tmp_path, *extra: str) -> SglangLauncher:
    return SglangLauncher(python="/opt/sgl/bin/python", model_dir=tmp_path / "model", extra_args=list(extra),
                          checked_version="0.5.23")


def test_the_scheduler_command_names_our_addresses_the_model_and_msgpack_ipc(tmp_path):
    launcher = _launcher(tmp_path, "--tp-size", "2", "--hf-token", "s3cret")
    argv, env = launcher.scheduler_command("ipc:///d/in.sock", "ipc:///d/out.sock", 7, environ={})
    assert argv[:2] == ["/opt/sgl/bin/python", str(SGLANG_HEADLESS_SCRIPT)]
    ours, theirs = argv[2:argv.index("--")], argv[argv.index("--") + 1:]
    assert ours == ["--scheduler-input-ipc", "ipc:///d/in.sock", "--tokenizer-ipc", "ipc:///d/out.sock",
                    "--ready-fd", "7"]
    # No --skip-tokenizer-init: the scheduler keeps its tokenizer, so SGLang builds its grammar backend
    # (tests/sglang/test_sglang_grammar.py); its ranks name a grammar's aborts.
    assert theirs == ["--model-path", str(tmp_path / "model"), "--tp-size", "2"]
    assert env == {"HF_TOKEN": "s3cret", "SGLANG_USE_PICKLE_IPC": "0",  # the token never on a command line
                   "SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS": "1"}
    # The operator's own choice of the attribution is kept, and so is a --skip-tokenizer-init they give.
    operator = _launcher(tmp_path, "--skip-tokenizer-init")
    argv, env = operator.scheduler_command("ipc:///d/in.sock", "ipc:///d/out.sock", 7,
                                           environ={"SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS": "0"})
    assert argv[-1] == "--skip-tokenizer-init" and env["SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS"] == "0"


@pytest.mark.parametrize("args, words", [
    (["--model-path", "/elsewhere"], "--model-path: enginelink sets it itself"),
    (["--port", "1"], "--port: enginelink sets it itself"),
    (["--dp-size", "two"], "--dp-size two: expected a count of data-parallel ranks (>= 1)"),
    (["--data-parallel-size=0"], "--data-parallel-size 0: expected a count"),
])
def test_arguments_enginelink_owns_or_cannot_drive_are_refused(tmp_path, args, words):
    with pytest.raises(LauncherError, match=re.escape(words)):
        _launcher(tmp_path, *args).check_args({"ENGINELINK_SGLANG_GPU_GLOB": str(tmp_path)})


def test_data_parallel_ranks_are_accepted_and_counted(tmp_path):
    """``--dp-size N`` runs SGLang's own DP controller in front of N ranks (it was refused before)."""
    from enginelink.runtime.kv.kv_config import engine_ranks

    for args in (["--dp-size", "2"], ["--dp", "2"], ["--data-parallel-size=2"]):
        _launcher(tmp_path, *args).check_args({"ENGINELINK_SGLANG_GPU_GLOB": str(tmp_path)})
        assert engine_ranks("sglang", args) == (0, 1)
    assert engine_ranks("sglang", []) == (0,)


def test_no_cuda_device_is_refused_in_words_and_one_passes(tmp_path):
    with pytest.raises(LauncherError, match="needs a CUDA GPU .* --engine sim --wire sglang"):
        _launcher(tmp_path).check_args({"ENGINELINK_SGLANG_GPU_GLOB": str(tmp_path / "nvidia[0-9]*")})
    (tmp_path / "nvidia0").touch()
    _launcher(tmp_path, "--tp-size", "1").check_args({"ENGINELINK_SGLANG_GPU_GLOB": str(tmp_path / "nvidia[0-9]*")})


def _serve(tmp_path, socket_dir, test_model_dir, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENGINELINK), "serve", "--port", "0", "--model", str(test_model_dir), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SMG_ZMQ_SOCKET_DIR": str(socket_dir),
                               "XDG_STATE_HOME": str(tmp_path / "state"), **(env or {})})


def _layout_file(tmp_path, drift: bool) -> str:
    layout = json.loads(json.dumps(sglang.LAYOUT))
    if drift:
        fields = layout["structs"]["AbortReq"]["fields"]
        fields[0], fields[1] = fields[1], fields[0]  # a release that swapped two positions
    path = tmp_path / f"layout-{drift}.json"
    path.write_text(json.dumps(layout))
    return str(path)


@pytest.mark.process
def test_serve_refuses_a_wire_the_engine_does_not_speak(tmp_path, socket_dir, test_model_dir):
    done = _serve(tmp_path, socket_dir, test_model_dir, "--engine", "vllm", "--wire", "sglang")
    assert done.returncode == 2 and "--engine vllm does not speak --wire sglang; it speaks: vllm" in done.stderr
    for value in ("soon", "0", "-3"):
        done = _serve(tmp_path, socket_dir, test_model_dir, "--engine", "sim", "--wire", "sglang",
                      env={"SGLANG_HEALTH_CHECK_TIMEOUT": value})
        assert done.returncode == 2 and f"SGLANG_HEALTH_CHECK_TIMEOUT={value!r}" in done.stderr, done.stderr


@pytest.mark.process
def test_serve_engine_sglang_refuses_before_any_engine_starts(tmp_path, socket_dir, test_model_dir):
    python = tmp_path / "sgl" / "bin" / "python"
    done = _serve(tmp_path, socket_dir, test_model_dir, "--engine", "sglang", env={"ENGINELINK_SGLANG_PYTHON": str(python)})
    assert done.returncode == 2 and "no SGLang installation" in done.stderr and "tools/setup-sglang" in done.stderr
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # an interpreter is there; its layout comes from the test hook
    drifted = _serve(tmp_path, socket_dir, test_model_dir, "--engine", "sglang", env={
        "ENGINELINK_SGLANG_PYTHON": str(python), "ENGINELINK_SGLANG_LAYOUT_FILE": _layout_file(tmp_path, True)})
    assert drifted.returncode == 2 and "AbortReq" in drifted.stderr and "0.5.23" in drifted.stderr, drifted.stderr
    no_gpu = _serve(tmp_path, socket_dir, test_model_dir, "--engine", "sglang", env={
        "ENGINELINK_SGLANG_PYTHON": str(python), "ENGINELINK_SGLANG_LAYOUT_FILE": _layout_file(tmp_path, False),
        "ENGINELINK_SGLANG_GPU_GLOB": str(tmp_path / "nvidia[0-9]*")})
    assert no_gpu.returncode == 2 and "needs a CUDA GPU" in no_gpu.stderr, no_gpu.stderr


@pytest.mark.process
def test_sglangs_own_parser_takes_our_arguments_and_the_script_calls_names_the_release_has(tmp_path,
                                                                                          test_model_dir):
    python = side_python_or_skip("sglang")
    argv, _ = SglangLauncher(python=python, model_dir=test_model_dir, extra_args=["--tp-size", "1"]) \
        .scheduler_command("ipc:///x/in", "ipc:///x/out", 3)
    theirs = argv[argv.index("--") + 1:]
    probe = ("import json, sys\nfrom sglang.srt.server_args import prepare_server_args\n"
             "a = prepare_server_args(json.loads(sys.argv[1]))\n"
             "print(json.dumps([a.skip_tokenizer_init, a.model_path]))\n")
    done = subprocess.run([python, "-c", probe, json.dumps(theirs)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, str(test_model_dir)]
    # The engine module imports the server's whole stack (uvloop, ...), which the struct-only venv lacks:
    # its source is read instead, for every name the headless script calls.
    find = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
    root = Path(subprocess.run([python, "-c", find], capture_output=True, text=True, timeout=60).stdout.strip())
    engine_src = (root / "srt" / "entrypoints" / "engine.py").read_text()
    for name in ("configure_logger", "_set_envs_and_config", "load_plugins", "resolve_auto_parsers", "publish"):
        assert re.search(rf"\b{name}\b", engine_src), name
    assert "def _launch_scheduler_processes(" in engine_src and "def wait_for_ready" in engine_src
    scheduler_src = (root / "srt" / "managers" / "scheduler.py").read_text()
    assert "def run_scheduler_process(" in scheduler_src
    server_args_src = (root / "srt" / "server_args.py").read_text()
    for field in ("scheduler_input_ipc_name", "tokenizer_ipc_name", "detokenizer_ipc_name"):
        assert f"    {field}: str" in server_args_src, field


# build_config in a process of its own (grpclib's and grpcio's protos cannot share a descriptor pool), with the
# release check stood in for: the scheduler's argv after `--`, and what the relay's plan follows.
KV_ARGV = """
import argparse, json, sys
from enginelink.runtime.contracts.sglang.launch import SglangLauncher
from enginelink.tools import serve
serve._sglang_launcher = lambda model_dir, engine_args: SglangLauncher("/sgl/bin/python", model_dir, engine_args)
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
args = parser.parse_args(["--engine", "sglang", "--model", sys.argv[1]])
args.engine_args = sys.argv[2:]
config = serve.build_config(args)
argv, _ = config.launcher.scheduler_command("ipc:///x/in", "ipc:///x/out", 3)
plan = config.kv_events
print(json.dumps([argv[argv.index("--") + 1:], plan and [[r.pub, r.sub_binds, r.replay] for r in plan.ranks]]))
"""
# SGLang's own reading of those arguments: its parser, then its publisher factory (constructors recorded).
SGLANG_KV_PROBE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.disaggregation.kv_events import EventPublisherFactory as F
a = prepare_server_args(json.loads(sys.argv[1]))
made = {}
F._registry = {k: (lambda k: lambda **kw: made.update(kind=k, **kw))(k) for k in F._registry}
F.create(a.kv_events_config)
print(json.dumps({k: made.get(k) for k in ("kind", "endpoint", "replay_endpoint", "topic")}))
"""


@pytest.mark.process
@pytest.mark.parametrize("given", [None, {"publisher": "zmq", "endpoint": "tcp://*:5557",
                                          "replay_endpoint": "tcp://*:5558"}], ids=["default", "reference_example"])
def test_sglangs_kv_publisher_is_on_in_its_own_config_form_and_the_relay_follows_it(tmp_path, socket_dir,
                                                                                    test_model_dir, given):
    """Issue 33 item 5: without a flag enginelink turns SGLang's publisher on in SGLang's own form; the reference's
    example form (no vLLM switch) is kept and relayed, where it used to be read as "not publishing"."""
    extra = [] if given is None else ["--kv-events-config", json.dumps(given)]
    done = subprocess.run([sys.executable, "-c", KV_ARGV, str(test_model_dir), *extra], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "SMG_ZMQ_SOCKET_DIR": str(socket_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ranks = json.loads(done.stdout.strip().splitlines()[-1])
    text = theirs[theirs.index("--kv-events-config") + 1]
    config = json.loads(text)
    assert "enable_kv_cache_events" not in config and config["publisher"] == "zmq"
    if given is None:
        assert ranks == [[config["endpoint"], False, config["replay_endpoint"]]]
        assert config["endpoint"].startswith(f"ipc://{socket_dir}/")
    else:
        assert config == given and ranks == [["tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5558"]]
    python = side_python_or_skip("sglang")
    probe = subprocess.run([python, "-c", SGLANG_KV_PROBE, json.dumps(theirs)], capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    made = json.loads(probe.stdout.strip().splitlines()[-1])
    assert made == {"kind": "zmq", "endpoint": config["endpoint"], "replay_endpoint": config["replay_endpoint"],
                    "topic": config.get("topic", "")}

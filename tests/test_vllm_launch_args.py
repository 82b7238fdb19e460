"""What ``enginelink serve --engine vllm`` hands its headless engine: the capture cap and multi-node flags.

On CPU the capture cap has no effect (no CUDA graphs); what a user sees is the
engine's effective command line (``inspect`` and the journal show it), which
is what these tests read. A multi-node engine's leader gets its flags as given;
a worker node's rank is refused, with the command that node runs instead.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from enginelink.runtime.contracts.vllm.capture_cap import CAPTURE_CAP_ENV
from tests.harness import free_port
from tests.test_operator import refused_with_one_line
from tests.test_operator import serve as serve_process

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)


# build_config in a process of its own: the servicer's gRPC stack (grpclib's health protos) and
# the test harness's (grpcio's) cannot share one protobuf descriptor pool.
ENGINE_ARGV = """
import argparse, json, sys
from enginelink.runtime.contracts.vllm.launch import VllmLauncher
from enginelink.tools import serve
serve._vllm_launcher = lambda model_dir, engine_args, *_: VllmLauncher("/venv/bin/python", model_dir, engine_args)
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
args = parser.parse_args(["--engine", "vllm", "--model", sys.argv[1]])
args.engine_args = sys.argv[2:]
command, _env = serve.build_config(args).launcher.command("ipc:///private/hs.sock")
print(json.dumps(command[command.index("--"):]))
"""


@pytest.fixture
def vllm_argv(monkeypatch, socket_dir, test_model_dir):
    """The headless engine's argv for ``serve --engine vllm -- ARGS``, without a vLLM installation."""
    monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(socket_dir))

    def argv(*engine_args: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", ENGINE_ARGV, str(test_model_dir), *engine_args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    return argv


def test_the_derived_cap_is_in_the_engines_arguments(vllm_argv, monkeypatch):
    argv = vllm_argv("--max-num-seqs", "32", "--max-num-batched-tokens", "2048")
    assert argv[argv.index("--max-cudagraph-capture-size") + 1] == "512"
    monkeypatch.setenv(CAPTURE_CAP_ENV, "256")
    argv = vllm_argv("--max-num-seqs", "32")
    assert argv[argv.index("--max-cudagraph-capture-size") + 1] == "256"


@pytest.mark.parametrize("engine_args", [
    ["--max-num-seqs", "32", "--enforce-eager"],
    ["--max-num-seqs", "32", "--max-cudagraph-capture-size", "64"],
    ["--max-num-seqs", "32", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
    ["--max-model-len", "1024"],
])
def test_the_engines_default_is_kept_where_it_is_the_better_one(vllm_argv, engine_args):
    argv = vllm_argv(*engine_args)
    assert argv.count("--max-cudagraph-capture-size") == engine_args.count("--max-cudagraph-capture-size")


def test_the_opt_out_keeps_the_engines_default(vllm_argv, monkeypatch):
    monkeypatch.setenv(CAPTURE_CAP_ENV, "engine")
    assert "--max-cudagraph-capture-size" not in vllm_argv("--max-num-seqs", "32")


def test_a_multi_node_leader_gets_its_flags_as_given(vllm_argv):
    flags = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.7", "--master-port", "29555",
             "--tensor-parallel-size", "2", "--enforce-eager"]
    argv = vllm_argv(*flags)
    assert " ".join(flags) in " ".join(argv)


def test_a_bad_capture_cap_knob_exits_2_before_any_engine(tmp_path, test_model_dir):
    done = serve_process(tmp_path, "--model", test_model_dir, "--engine", "vllm", "--port", free_port(), "--",
                         "--max-num-seqs", "32", env={CAPTURE_CAP_ENV: "lots"})
    assert CAPTURE_CAP_ENV in refused_with_one_line(done)


@pytest.mark.parametrize("rank_flag", [["--node-rank", "1"], ["--node-rank=1"], ["-r", "1"]])
def test_a_worker_nodes_rank_is_refused_with_the_command_that_node_runs(tmp_path, test_model_dir, rank_flag):
    done = serve_process(tmp_path, "--model", test_model_dir, "--engine", "vllm", "--port", free_port(), "--",
                         "--nnodes", "2", *rank_flag, "--master-addr", "127.0.0.1")
    line = refused_with_one_line(done)
    assert "node rank 0" in line and "vllm serve MODEL --headless" in line

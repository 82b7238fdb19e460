"""GetServerInfo's grammar labels on TokenSpeed, from the engine's resolved arguments (issue 33 item 1).

SGLang's are checked against SGLang's own resolution in
``tests/sglang/test_sglang_grammar.py`` and through the router in
``tests/router/test_router_sglang.py``. Here: TokenSpeed's, through a served
sim worker, and our reading of its arguments against TokenSpeed 0.1.1's own
parser (the TokenSpeed venv) where it is installed.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc

from enginelink.runtime.engine.grammar_labels import sglang_labels, tokenspeed_labels
from tests.harness import Servicer
from tests.wire.engine_venvs import side_python_or_skip

SERVICE = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
ARGVS = ([], ["--reasoning-parser", "kimi_k25"], ["--grammar-backend", "xgrammar", "--reasoning-parser=minimax"],
         ["--grammar-backend=none"])


def test_sglang_labels_follow_the_resolved_arguments():
    assert sglang_labels({}) == {"grammar_backend": "xgrammar", "constrained_decoding_start": "first_token"}
    assert sglang_labels({"skip_tokenizer_init": True, "grammar_backend": "xgrammar"})["grammar_backend"] == "none"
    assert sglang_labels({"grammar_backend": "llguidance", "reasoning_parser": "qwen3"}) == {
        "grammar_backend": "llguidance", "engine_reasoning_parser": "qwen3",
        "constrained_decoding_start": "after_reasoning"}
    # An "auto" the engine has not resolved names no parser and no start (the router then fits either).
    assert sglang_labels({"reasoning_parser": "auto"}) == {"grammar_backend": "xgrammar"}


@pytest.mark.process
def test_a_tokenspeed_worker_advertises_its_arguments_labels(tmp_path, test_model_dir):
    engine_args = ["--grammar-backend", "xgrammar", "--reasoning-parser", "kimi_k25",
                   "--constrained-decoding", "always"]
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "tokenspeed"],
                  engine_args=engine_args, health_service=SERVICE, env={"ENGINELINK_WARMUP": "off"}).start() as s:
        info = pb_grpc.TokenSpeedSchedulerStub(s.channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    args = dict(info.server_args)
    assert args["grammar_backend"] == "xgrammar" and args["engine_reasoning_parser"] == "kimi_k25"
    assert args["constrained_decoding_start"] == "first_token"  # TokenSpeed's grammar runs from the first token
    assert info.constrained_decoding == "always"


@pytest.mark.process
@pytest.mark.slow
def test_our_reading_of_tokenspeed_arguments_is_tokenspeeds_own():
    python = side_python_or_skip("tokenspeed")
    probe = ("import argparse, json, sys\nfrom tokenspeed.runtime.utils.server_args import ServerArgs\n"
             "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\nout = []\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    a = p.parse_args(['--model-path', '/m', *argv]); out.append([a.grammar_backend, a.reasoning_parser])\n"
             "print('RESULT ' + json.dumps(out))\n")
    done = subprocess.run([python, "-c", probe, json.dumps(ARGVS)], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    for argv, (backend, parser) in zip(ARGVS, json.loads(lines[-1].removeprefix("RESULT "))):
        labels, _ = tokenspeed_labels(argv)
        assert labels["grammar_backend"] == backend and labels.get("engine_reasoning_parser") == parser, argv

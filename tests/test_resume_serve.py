"""Engine restarts as an operator runs them: ``enginelink serve --engine-restarts N`` (docs/resume.md).

A real servicer process in front of the sim engine process, on each wire
the link speaks (vLLM's headless ZeroMQ wire, TokenSpeed's, SGLang's pipe
and PUSH/PULL): the engine process is SIGKILLed while greedy streams run;
the servicer starts it again with the same arguments and resumes each
stream, which completes with its full count and equals an uninterrupted
run (the sim's tokens depend on the context alone, as a greedy model's do).
Then the knobs: flags, then ``ENGINELINK_*`` variables, then the defaults.
"""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from enginelink.journal import records as r
from enginelink.journal.store import open_reader
from enginelink.machines.resume import ResumePolicy
from enginelink.tools import serve
from enginelink.tools.serve import ConfigError, _resume_policy
from tests.harness import Servicer, engine_pid, generate_request, wait_until
from tests.test_lifecycle import StreamReader

PROMPT = [318, 283, 1552, 10, 90, 305]
TOKENS = 300
SLOW_ENGINE = ["--step-us", "10000"]  # 100 steps/s: the kill lands in the middle of the streams
HEALTH = {"vllm": "vllm.grpc.engine.VllmEngine", "tokenspeed": "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
          "sglang": "sglang.grpc.scheduler.SglangScheduler"}


def _journal(path) -> list[r.Record]:
    with open_reader(path) as reader:
        return list(reader.iter_records(after_seq=0))


@pytest.mark.process  # a servicer and its sim engine: the full suite only (tests/fast_loop.py)
@pytest.mark.parametrize("wire", ["vllm", "tokenspeed", "sglang"])
def test_an_engine_killed_under_greedy_streams_is_restarted_and_every_stream_completes_whole(tmp_path, test_model_dir,
                                                                                             wire):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, health_service=HEALTH[wire],
                        extra=["--wire", wire, "--engine-restarts", "2", "--resume-timeout", "60"],
                        engine_args=SLOW_ENGINE, env={"ENGINELINK_WARMUP": "off"}).start()
    try:
        stub = _stub(servicer, wire)
        first = engine_pid(servicer.journal)
        requests = [_request(wire, f"s-{i}") for i in range(3)]
        readers = [StreamReader(stub, request) for request in requests]
        for reader in readers:
            reader.start()
        wait_until(lambda: all(len(_tokens(wire, reader.messages)) >= 20 for reader in readers), 30,
                   "every stream some way in")
        os.kill(first, signal.SIGKILL)
        for reader in readers:
            reader.join(60)
        resumed = [_tokens(wire, reader.messages) for reader in readers]
        for reader, tokens in zip(readers, resumed):
            assert reader.error is None, f"{reader.request.request_id}: {reader.error}\n{servicer.log()[-3000:]}"
            assert len(tokens) == TOKENS
        # The same requests again, on the restarted engine, uninterrupted: token for token the same.
        for i, tokens in enumerate(resumed):
            again = StreamReader(stub, _request(wire, f"again-{i}"))
            again.run()
            assert _tokens(wire, again.messages) == tokens
        assert engine_pid(servicer.journal) != first
    finally:
        servicer.stop()
    records = _journal(servicer.journal)
    kinds = [rec.kind for rec in records]
    assert kinds.count(r.KIND_ENGINE_RESTART) == 1
    assert kinds.count(r.KIND_ENGINE_HELD) == kinds.count(r.KIND_ENGINE_RESUME) == 3
    for rec in records:
        if rec.kind == r.KIND_ENGINE_RESUME:
            assert 0 < rec.payload["reprefilled"][0] < TOKENS
            assert rec.payload["prompt_tokens"][0] == len(PROMPT) + rec.payload["reprefilled"][0]


def _stub(servicer: Servicer, wire: str):
    if wire == "vllm":
        return servicer.stub
    if wire == "sglang":
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as grpc_mod

        return grpc_mod.SglangSchedulerStub(servicer.channel)
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as grpc_mod

    return grpc_mod.TokenSpeedSchedulerStub(servicer.channel)


def _request(wire: str, request_id: str):
    if wire == "vllm":
        return generate_request(request_id, PROMPT, stream=True, temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    if wire == "sglang":
        from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    else:
        from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
                              sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=TOKENS,
                                                                ignore_eos=True))


def _tokens(wire: str, messages) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


# -- the knobs ------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_restart_knobs_come_from_flags_then_variables(monkeypatch):
    for name in ("ENGINELINK_ENGINE_RESTARTS", "ENGINELINK_ENGINE_RESTART_WINDOW_SECS", "ENGINELINK_RESUME_TIMEOUT_SECS",
                 "ENGINELINK_RESUME_MEDIA_ITEMS_MAX"):
        monkeypatch.delenv(name, raising=False)
    assert _resume_policy(_args()) == ResumePolicy()
    assert not ResumePolicy().enabled  # off by default
    monkeypatch.setenv("ENGINELINK_ENGINE_RESTARTS", "3")
    monkeypatch.setenv("ENGINELINK_ENGINE_RESTART_WINDOW_SECS", "120")
    monkeypatch.setenv("ENGINELINK_RESUME_TIMEOUT_SECS", "45")
    monkeypatch.setenv("ENGINELINK_RESUME_MEDIA_ITEMS_MAX", "0")
    assert _resume_policy(_args()) == ResumePolicy(3, 120.0, 45.0, 0)
    assert _resume_policy(_args("--engine-restarts", "1", "--engine-restart-window", "10", "--resume-timeout", "5")) \
        == ResumePolicy(1, 10.0, 5.0, 0)
    for bad in (("--engine-restarts", "-1"), ("--engine-restarts", "101"), ("--resume-timeout", "0")):
        with pytest.raises(ConfigError, match="engine restarts"):
            _resume_policy(_args(*bad))
    monkeypatch.setenv("ENGINELINK_ENGINE_RESTARTS", "many")
    with pytest.raises(ConfigError, match="ENGINELINK_ENGINE_RESTARTS"):
        _resume_policy(_args())

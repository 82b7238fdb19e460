"""SubscribeKvEvents on SGLang's and TokenSpeed's contracts, the sim publishing as each engine does.

``serve --engine sim --wire sglang|tokenspeed``: the sim's publisher reads
``--kv-events-config`` in that engine's dialect and encodes its batches as
that engine's publisher does (``wire/kv_engines.py``: SGLang, one
BlockStored per page, replay replies with the topic; TokenSpeed, tag-first
arrays, replay replies without it). Through a real servicer and a grpcio
client on the contract's own stub: the history from the engine's first
batch, a cursor resumed inside the window, live batches, a snapshot once
the window has rolled, and a batch the publisher never sent on its PUB
repaired from its replay socket. KV events off answers UNIMPLEMENTED in
the engine's own words.
"""

from __future__ import annotations

import json

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg_pb, sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts_pb, tokenspeed_scheduler_pb2_grpc as ts_grpc

from enginelink.journal.records import KIND_ENGINE_HANDSHAKE, KIND_KV_BATCH
from enginelink.journal.store import open_reader
from tests.harness import Servicer, free_port, wait_until
from tests.kv.conftest import sequence_base
from tests.kv.kv_client import Chain, KvSubscription, newest_sequence, prompt

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

BLOCK = 16
NO_WARMUP = {"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.2"}


class SglangServicer(Servicer):
    stub_class = sg_grpc.SglangSchedulerStub

    def __init__(self, tmp, model_dir, engine_args=None, env=None) -> None:
        super().__init__(tmp, model_dir=model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                         engine_args=engine_args, env={**NO_WARMUP, **(env or {})},
                         health_service="sglang.grpc.scheduler.SglangScheduler")  # fmt: skip

    def generate(self, request_id: str, ids: list[int]) -> None:
        replies = list(self.stub.Generate(sg_pb.GenerateRequest(
            request_id=request_id, tokenized=sg_pb.TokenizedInput(input_ids=ids),
            sampling_params=sg_pb.SamplingParams(temperature=0, max_new_tokens=1)), timeout=30))
        assert replies[-1].WhichOneof("response") == "complete", replies


class TokenSpeedServicer(Servicer):
    stub_class = ts_grpc.TokenSpeedSchedulerStub

    def __init__(self, tmp, model_dir, engine_args=None, env=None) -> None:
        super().__init__(tmp, model_dir=model_dir, extra=["--engine", "sim", "--wire", "tokenspeed"],
                         engine_args=engine_args, env={**NO_WARMUP, **(env or {})},
                         health_service="tokenspeed.grpc.scheduler.TokenSpeedScheduler")  # fmt: skip

    def generate(self, request_id: str, ids: list[int]) -> None:
        replies = list(self.stub.Generate(ts_pb.GenerateRequest(
            request_id=request_id, tokenized=ts_pb.TokenizedInput(input_ids=ids),
            sampling_params=ts_pb.SamplingParams(temperature=0.0, max_new_tokens=1)), timeout=30))
        assert replies[-1].WhichOneof("response") == "complete", replies


def launch_argv(servicer) -> list[str]:
    return open_reader(servicer.journal).records(kinds=[KIND_ENGINE_HANDSHAKE], limit=1)[0].payload["message"]["argv"]


def sources(servicer) -> dict[int, str]:
    with open_reader(servicer.journal) as reader:
        return {r.payload["seq"]: r.payload["source"] for r in reader.records(kinds=[KIND_KV_BATCH])}


def test_sglangs_own_config_form_relays_history_live_and_a_batch_repaired_from_its_replay(tmp_path, test_model_dir):
    # The reference's example form (no vLLM switch), on loopback tcp: SGLang's PUB connects, the relay's SUB binds.
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "t"}
    text = json.dumps(config)
    servicer = SglangServicer(tmp_path, test_model_dir, ["--kv-events-config", text, "--kv-fault-drop", "2"]).start()
    try:
        argv = launch_argv(servicer)
        assert argv.count("--kv-events-config") == 1  # kept as given: nothing of ours added
        assert json.loads(argv[argv.index("--kv-events-config") + 1]) == config
        base = sequence_base(servicer)
        prompts = [prompt(60 + i, 2 * BLOCK) for i in range(5)]
        with KvSubscription(servicer, 0) as sub:
            for i, p in enumerate(prompts[:4]):
                servicer.generate(f"s{i}", p)
            sub.wait(lambda s: newest_sequence(s.snapshot()) == base + 3, what="four batches")
            batches = sub.kv_batches()
            assert [b.sequence_number for b in batches] == [base + i for i in range(4)]  # 2 among them, repaired
            stored = [e.stored for b in batches for e in b.events if e.WhichOneof("data") == "stored"]
            assert stored and all(len(s.blocks) == 1 for s in stored)  # SGLang publishes one BlockStored a page
            chain = Chain().apply(batches)
            assert [chain.prefix_of(p, BLOCK) for p in prompts[:4]] == [2, 2, 2, 2]
            with KvSubscription(servicer, base + 1) as resumed:  # a cursor inside the window: after it, exactly
                resumed.wait(lambda s: newest_sequence(s.snapshot()) == base + 3, what="the resumed history")
                servicer.generate("s4", prompts[4])  # live, to both
                resumed.wait(lambda s: newest_sequence(s.snapshot()) == base + 4, what="the live batch")
                assert [b.sequence_number for b in resumed.kv_batches()] == [base + 2, base + 3, base + 4]
            sub.wait(lambda s: newest_sequence(s.snapshot()) == base + 4, what="the live batch")
        # The journal is written behind the streams (a loaded box showed the stream first): wait for the record.
        wait_until(lambda: 2 in sources(servicer), 10, "batch 2 journaled")
        assert sources(servicer)[2] == "replay"  # the publisher kept it for replay but never sent it on its PUB
    finally:
        servicer.stop()


def test_tokenspeeds_default_config_relays_a_snapshot_once_the_window_rolled_and_a_repaired_batch(
        tmp_path, test_model_dir):  # fmt: skip
    servicer = TokenSpeedServicer(tmp_path, test_model_dir, ["--kv-fault-drop", "1"],
                                  env={"SMG_KV_EVENT_HISTORY_BATCHES": "3"}).start()  # fmt: skip
    try:
        argv = launch_argv(servicer)
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"  # TokenSpeed's dialect
        base = sequence_base(servicer)
        prompts = [prompt(80 + i, 2 * BLOCK) for i in range(6)]
        for i, p in enumerate(prompts[:5]):
            servicer.generate(f"t{i}", p)
        wait_until(lambda: len(sources(servicer)) == 5, 10, "five batches relayed")
        assert sources(servicer)[1] == "replay"  # repaired: TokenSpeed's replay replies carry no topic frame
        with KvSubscription(servicer, 0) as fresh:  # the window holds 3 of 5: a snapshot of the live set
            fresh.wait(lambda s: s.kv_batches() and s.kv_batches()[-1].HasField("snapshot") and
                       s.kv_batches()[-1].snapshot.index + 1 == s.kv_batches()[-1].snapshot.count,
                       what="every snapshot chunk")  # fmt: skip
            chunks = fresh.kv_batches()
            assert chunks[0].snapshot.unknown_before == 0  # nothing was lost: the set is whole
            chain = Chain().apply(fresh.kv_batches())
            assert [chain.prefix_of(p, BLOCK) for p in prompts[:5]] == [2] * 5
        with KvSubscription(servicer, base + 3) as resumed:  # inside the window (3 of them): after it, exactly
            resumed.wait(lambda s: newest_sequence(s.snapshot()) == base + 4, what="the resumed history")
            servicer.generate("t5", prompts[5])
            resumed.wait(lambda s: newest_sequence(s.snapshot()) == base + 5, what="the live batch")
            assert [b.sequence_number for b in resumed.kv_batches()] == [base + 4, base + 5]
    finally:
        servicer.stop()


@pytest.mark.parametrize("contract", ["sglang", "tokenspeed"])
def test_kv_events_off_answers_unimplemented_in_the_engines_words(tmp_path, test_model_dir, contract):
    cls, knob, words = {
        "sglang": (SglangServicer, "SMG_SGLANG_SERVICER_KV_EVENTS", "Start SGLang with --kv-events-config "
                   "'{\"publisher\": \"zmq\"}'"),
        "tokenspeed": (TokenSpeedServicer, "SMG_TOKENSPEED_SERVICER_KV_EVENTS", "Start TokenSpeed with "
                       "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'"),
    }[contract]
    servicer = cls(tmp_path, test_model_dir, env={knob: "0"}).start()
    try:
        assert "--kv-events-config" not in launch_argv(servicer)
        sub = KvSubscription(servicer, 0)
        assert sub.wait_end() == grpc.StatusCode.UNIMPLEMENTED
        assert sub.details() == f"KV cache events not enabled. {words}"
    finally:
        servicer.stop()

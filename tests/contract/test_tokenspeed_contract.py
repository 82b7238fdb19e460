"""The ``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` contract, end to end on the sim's TokenSpeed personality.

``enginelink serve --engine sim --wire tokenspeed``: the real servicer process, the
sim engine speaking TokenSpeed 0.1.1's headless wire (``BatchTokenIDOutSlim``
columns), a grpcio client of TokenSpeed's own stubs. Assertions are what a client
sees (messages, statuses, their words) and, where the client cannot see it (which
engine ids a call used, what the engine was told), the servicer's journal,
read-only. Waits are bounded polls.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from enginelink.wire.engine import FinishReason
from enginelink.wire.tokenspeed import TokenSpeedCodec
from tests.contract.helpers import CALL_TIMEOUT_S, SLOW_ENGINE_ARGS, new_id, prompt
from tests.harness import Servicer, shared, wait_until
from tests.router.test_router_e2e import journal

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

SERVICE = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"


@pytest.fixture(scope="module")
def ts(tmp_path_factory, test_model_dir):
    servicer = Servicer(tmp_path_factory.mktemp("ts-contract"), model_dir=test_model_dir,
                        extra=["--engine", "sim", "--wire", "tokenspeed"], engine_args=SLOW_ENGINE_ARGS,
                        health_service=SERVICE,
                        # Idle probes due within 0.2 s: a link that tried one on this wire would fail at once.
                        env={"ENGINELINK_WARMUP": "fast", "ENGINELINK_IDLE_PROBE_SECS": "0.2"})
    with shared(servicer) as running:
        running.ts = pb_grpc.TokenSpeedSchedulerStub(running.channel)
        yield running


def request(request_id: str, ids: list[int], *, stream: bool = False, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream)


def generate(ts, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(ts.ts.Generate(req, timeout=CALL_TIMEOUT_S))


def by_kind(replies, kind: str, index: int = 0) -> list:
    return [getattr(r, kind) for r in replies if r.WhichOneof("response") == kind and getattr(r, kind).index == index]


def refused(ts, req: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        generate(ts, req)
    return caught.value


# -- Generate ------------------------------------------------------------------------------


def test_streamed_chunks_carry_the_id_and_running_counts_and_match_the_whole_answer(ts):
    ids = prompt(1)
    whole = generate(ts, request(new_id("ts-whole"), ids, temperature=0.0, max_new_tokens=6, ignore_eos=True))
    (complete,) = by_kind(whole, "complete")
    assert complete.finish_reason == "length" and complete.completion_tokens == 6 and len(complete.output_ids) == 6

    rid = new_id("ts-stream")
    replies = generate(ts, request(rid, ids, stream=True, temperature=0.0, max_new_tokens=6, ignore_eos=True))
    assert {r.request_id for r in replies} == {rid}
    chunks = by_kind(replies, "chunk")
    assert [t for c in chunks for t in c.token_ids] == list(complete.output_ids)
    # TokenSpeed's counts are running totals: each chunk's count is every token so far.
    running = 0
    for chunk in chunks:
        running += len(chunk.token_ids)
        assert chunk.completion_tokens == running
        assert chunk.prompt_tokens == len(ids)
    (end,) = by_kind(replies, "complete")
    assert replies[-1].WhichOneof("response") == "complete"
    assert end.completion_tokens == 6 and end.finish_reason == "length"


def test_an_explicit_temperature_zero_is_kept_and_an_unset_one_samples(ts):
    ids = prompt(2)
    greedy = [list(by_kind(generate(ts, request(new_id("ts-t0"), ids, temperature=0.0, max_new_tokens=12,
                                                ignore_eos=True)), "complete")[0].output_ids) for _ in range(2)]
    assert greedy[0] == greedy[1]
    # Unset temperature is the engine's default (1.0), seeded: reproducible, and not the greedy answer.
    sampled = [list(by_kind(generate(ts, request(new_id("ts-seed"), ids, max_new_tokens=12, ignore_eos=True,
                                                 sampling_seed=7)), "complete")[0].output_ids) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert sampled[0] != greedy[0]


def _greedy(ts, ids, n_tokens=8) -> list[int]:
    return list(by_kind(generate(ts, request(new_id("ts-probe"), ids, temperature=0.0, max_new_tokens=n_tokens,
                                             ignore_eos=True)), "complete")[0].output_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_matched_stop_token_is_trimmed_unless_no_stop_trim(ts, stream):
    ids = prompt(3)
    full = _greedy(ts, ids)
    stop = next(t for i, t in enumerate(full) if i >= 2 and t not in full[:i])  # first seen at position i
    at = full.index(stop)
    for keep in (False, True):
        replies = generate(ts, request(new_id("ts-stop"), ids, stream=stream, temperature=0.0, max_new_tokens=8,
                                       stop_token_ids=[stop], no_stop_trim=keep))
        (complete,) = by_kind(replies, "complete")
        tokens = [t for c in by_kind(replies, "chunk") for t in c.token_ids] if stream else list(complete.output_ids)
        assert complete.finish_reason == "stop"
        assert complete.matched_token_id == stop
        expected = full[:at + 1] if keep else full[:at]
        assert tokens == expected, (keep, stop, full)
        assert complete.completion_tokens == len(expected)


def test_logprobs_come_per_chunk_one_per_token(ts):
    req = request(new_id("ts-lp"), prompt(4), stream=True, temperature=0.0, max_new_tokens=5, ignore_eos=True)
    req.return_logprob = True
    replies = generate(ts, req)
    chunks = by_kind(replies, "chunk")
    assert chunks
    for chunk in chunks:
        assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)
        assert len(chunk.output_logprobs.token_logprobs) == len(chunk.token_ids)
        assert all(v <= 0.0 for v in chunk.output_logprobs.token_logprobs)
        assert not chunk.output_logprobs.top_logprobs


# -- n > 1: child ids ----------------------------------------------------------------------


def test_n_2_runs_as_child_ids_and_answers_both_choices(ts):
    rid = new_id("ts-n2")
    replies = generate(ts, request(rid, prompt(5), temperature=0.0, max_new_tokens=4, ignore_eos=True, n=2))
    assert {r.request_id for r in replies} == {rid}
    assert [len(by_kind(replies, "complete", i)) for i in (0, 1)] == [1, 1]
    sent = wait_until(lambda: [p for _, st, kind, p in journal(ts) if kind == "engine.request" and st == f"req/{rid}"],
                      10, "the call's engine requests in the journal")
    assert sent[0]["request_ids"] == [f"{rid}-n0", f"{rid}-n1"]

    streamed = generate(ts, request(new_id("ts-n2s"), prompt(5), stream=True, temperature=0.0, max_new_tokens=4,
                                    ignore_eos=True, n=2))
    for index in (0, 1):
        assert sum(len(c.token_ids) for c in by_kind(streamed, "chunk", index)) == 4
        assert by_kind(streamed, "complete", index)[0].completion_tokens == 4


def _engine_aborted(ts, engine_ids: set[str]) -> set[str]:
    """The engine ids the engine answered with an ``abort`` entry (TokenSpeed does, for an ABORT it got)."""
    codec, seen = TokenSpeedCodec(), set()
    for _, _, kind, payload in journal(ts):
        if kind == "engine.frame":
            batch = codec.decode_output([payload])
            seen.update(o.request_id for o in getattr(batch, "outputs", ())
                        if o.request_id in engine_ids and o.finish_reason == FinishReason.ABORT)
    return seen


def test_abort_ends_every_child_and_a_second_abort_finds_nothing(ts):
    rid = new_id("ts-abort")
    call = ts.ts.Generate(request(rid, prompt(6), stream=True, temperature=0.0, max_new_tokens=400,
                                  ignore_eos=True, n=2), timeout=CALL_TIMEOUT_S)
    first = next(call)
    assert first.request_id == rid
    reply = ts.ts.Abort(pb.AbortRequest(request_id=rid, reason="test"), timeout=CALL_TIMEOUT_S)
    assert reply.success, reply.message
    rest = list(call)
    finishes = {r.complete.index: r.complete.finish_reason for r in [first, *rest]
                if r.WhichOneof("response") == "complete"}
    assert finishes == {0: "abort", 1: "abort"}
    children = {f"{rid}-n0", f"{rid}-n1"}
    wait_until(lambda: _engine_aborted(ts, children) == children, 10, "the engine's abort entries for both children")

    again = ts.ts.Abort(pb.AbortRequest(request_id=rid), timeout=CALL_TIMEOUT_S)
    assert not again.success and again.message == f"Request {rid} not found"
    unknown = ts.ts.Abort(pb.AbortRequest(request_id=new_id("never")), timeout=CALL_TIMEOUT_S)
    assert not unknown.success


def test_a_client_that_cancels_aborts_every_child(ts):
    rid = new_id("ts-cancel")
    call = ts.ts.Generate(request(rid, prompt(7), stream=True, temperature=0.0, max_new_tokens=400,
                                  ignore_eos=True, n=3), timeout=CALL_TIMEOUT_S)
    next(call)
    call.cancel()
    children = {f"{rid}-n{i}" for i in range(3)}
    wait_until(lambda: _engine_aborted(ts, children) == children, 10, "the engine's abort entries for all 3 children")
    aborts = [p for _, st, kind, p in journal(ts) if kind == "client.abort" and st == f"req/{rid}"]
    assert aborts and aborts[0]["reason"] == "client_gone"


# -- refused before the engine -----------------------------------------------------------------


@pytest.mark.parametrize("field, make, words", [
    ("top_logprobs_num", lambda rid: pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=[5, 6]), return_logprob=True, top_logprobs_num=3,
        sampling_params=pb.SamplingParams(max_new_tokens=2)), "top_logprobs_num > 0"),
    ("logprob_start_len", lambda rid: pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=[5, 6]), logprob_start_len=0,
        sampling_params=pb.SamplingParams(max_new_tokens=2)), "prompt logprobs"),
    ("top_k", lambda rid: request(rid, [5, 6], top_k=200, max_new_tokens=2), "fused kernel limit"),
    ("repetition_penalty", lambda rid: request(rid, [5, 6], repetition_penalty=3.0, max_new_tokens=2),
     "repetition_penalty must be in (0, 2]"),
    ("tokenized", lambda rid: pb.GenerateRequest(request_id=rid), "tokenized"),
    ("empty prompt", lambda rid: request(rid, []), "must not be empty"),
    ("mm_inputs", lambda rid: pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=[5]), mm_inputs=pb.MultimodalInputs(
            items=[pb.MultimodalItem(content_hash=b"x")])), "multimodal"),
    ("logit_bias", lambda rid: request(rid, [5], logit_bias={"x1": 1.0}), "not a token id"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_what_the_engine_would_pre_abort_is_refused_before_it(ts, field, make, words):
    rid = new_id("ts-refuse")
    error = refused(ts, make(rid))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert words in error.details()
    # Nothing reached the engine: no engine request was journaled for it.
    assert not [1 for _, st, kind, _ in journal(ts) if st == f"req/{rid}" and kind == "engine.request"]


# -- the rest of the service ---------------------------------------------------------------


def test_health_v1_names_this_service_and_every_other_engine_service_is_unimplemented(ts):
    health = health_pb2_grpc.HealthStub(ts.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert ts.ts.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    with pytest.raises(grpc.RpcError) as caught:
        vllm_engine_pb2_grpc.VllmEngineStub(ts.channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    sglang = ts.channel.unary_unary("/sglang.grpc.scheduler.SglangScheduler/HealthCheck",
                                    request_serializer=lambda m: b"", response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as caught:
        sglang(None, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_model_server_info_and_loads_speak_tokenspeed(ts, test_model_dir):
    info = ts.ts.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == test_model_dir.name and info.vocab_size == 4096
    assert info.max_req_input_len == info.max_context_length - 1
    server = ts.ts.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert server.tokenspeed_version == "0.1.1"
    assert server.server_args["constrained_decoding_start"] == "first_token"
    assert list(server.server_args["engine_args"])[:2] == ["--step-us", "20000"]
    assert server.max_total_num_tokens > 0 and server.start_time.seconds > 0
    loads = ts.ts.GetLoads(pb.GetLoadsRequest(), timeout=5)
    assert loads.version == "0.1.1" and loads.dp_rank_count == 1
    assert loads.loads[0].max_total_num_tokens == server.max_total_num_tokens
    assert loads.aggregate.total_reqs == loads.loads[0].num_total_reqs
    assert ts.ts.GetLoads(pb.GetLoadsRequest(dp_rank=5), timeout=5).dp_rank_count == 0


def test_control_calls_have_no_path_on_tokenspeed_0_1_1(ts):
    for call, message in ((ts.ts.FlushCache, common_pb2.FlushCacheRequest(timeout_s=1.0)),
                          (ts.ts.StartProfile, common_pb2.StartProfileRequest()),
                          (ts.ts.StopProfile, common_pb2.StopProfileRequest())):
        with pytest.raises(grpc.RpcError) as caught:
            call(message, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "no control replies" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        ts.ts.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1.0), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_tokenizer_sends_the_bundle(ts):
    chunks = list(ts.ts.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
    assert chunks and sum(len(c.data) for c in chunks) > 0


def test_an_idle_link_sends_no_probe_the_wire_cannot_carry(ts):
    """TokenSpeed 0.1.1 has no utility calls, so no idle liveness probe: the servicer stays up while idle."""
    wait_until(lambda: "idle liveness probes off: the tokenspeed wire" in ts.log(), 10, "the probes-off log line")
    health = health_pb2_grpc.HealthStub(ts.channel)
    for _ in range(5):  # the module ran a minute with idle gaps past the 0.2 s interval: still serving
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert ts.ts.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    assert ts.process.poll() is None
    assert "Traceback" not in ts.log()

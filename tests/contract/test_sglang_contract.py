"""The SglangScheduler contract on ``serve --engine sim --wire sglang``: what a client of it sees.

The servicer drives the sim engine's SGLang personality over SGLang's own
scheduler wire; every assertion is on the gRPC answers (and, for the abort,
the journal), with SGLang's semantics (``reference/sglang-contract.md`` §1-§3):
cumulative counts, per-chunk logprob deltas, one complete per choice (the
streamed one repeating the last delta), matched stop ids and strings,
refusals naming the field before the engine sees the request.
"""

from __future__ import annotations

import itertools
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer

from enginelink.journal.store import open_reader
from tests.harness import Servicer, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
TIMEOUT_S = 30
_ids = itertools.count(1)
_run = uuid.uuid4().hex[:6]


def new_id(prefix: str) -> str:
    return f"{prefix}-{_run}-{next(_ids)}"


@pytest.fixture(scope="module")
def sgl(tmp_path_factory, test_model_dir):
    # 5 ms per engine step: a 200-token request is still running when an Abort arrives.
    servicer = Servicer(tmp_path_factory.mktemp("sglang-contract"), model_dir=test_model_dir,
                        extra=["--engine", "sim", "--wire", "sglang"], engine_args=["--step-us", "5000"],
                        health_service=SERVICE).start()
    try:
        servicer.sgl = pb_grpc.SglangSchedulerStub(servicer.channel)
        servicer.tokenizer = Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))
        yield servicer
    finally:
        servicer.stop()


def request(prompt=(5, 6, 7, 8), *, stream=False, request_id=None, **sampling) -> pb.GenerateRequest:
    extra = {k: sampling.pop(k) for k in ("return_logprob", "top_logprobs_num", "logprob_start_len")
             if k in sampling}
    sampling.setdefault("temperature", 0)
    return pb.GenerateRequest(request_id=request_id or new_id("g"), tokenized=pb.TokenizedInput(input_ids=list(prompt)),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream, **extra)


def run(servicer, req) -> tuple[dict[int, list], dict[int, list]]:
    chunks: dict[int, list] = {}
    completes: dict[int, list] = {}
    for reply in servicer.sgl.Generate(req, timeout=TIMEOUT_S):
        kind = reply.WhichOneof("response")
        body = getattr(reply, kind)
        (chunks if kind == "chunk" else completes).setdefault(body.index, []).append(body)
    return chunks, completes


def greedy(servicer, prompt, n_tokens: int) -> list[int]:
    _, completes = run(servicer, request(prompt, max_new_tokens=n_tokens, ignore_eos=True))
    return list(completes[0][0].output_ids)


# -- the service ----------------------------------------------------------------------------


def test_health_serves_the_sglang_service_and_other_contracts_are_unimplemented(sgl):
    health = health_pb2_grpc.HealthStub(sgl.channel)
    for name in ("", SERVICE):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as vllm:
        vllm_engine_pb2_grpc.VllmEngineStub(sgl.channel).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=5)
    assert vllm.value.code() == grpc.StatusCode.UNIMPLEMENTED
    reply = sgl.sgl.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert (reply.healthy, reply.message) == (True, "OK")


# -- Generate ---------------------------------------------------------------------------------


def test_streamed_chunks_are_deltas_with_running_counts_and_equal_the_whole(sgl):
    prompt = (11, 12, 13, 14, 15)
    whole = greedy(sgl, prompt, 12)
    chunks, completes = run(sgl, request(prompt, stream=True, max_new_tokens=12, ignore_eos=True))
    tokens = [t for c in chunks[0] for t in c.token_ids]
    assert tokens == whole
    counts = [c.completion_tokens for c in chunks[0]]
    assert counts == list(itertools.accumulate(len(c.token_ids) for c in chunks[0]))  # cumulative
    assert all(c.prompt_tokens == len(prompt) for c in chunks[0])
    (complete,) = completes[0]
    assert complete.finish_reason == "length" and complete.completion_tokens == 12
    assert list(complete.output_ids) == list(chunks[0][-1].token_ids)  # the streamed complete repeats the last delta


@pytest.mark.parametrize("stream, n", [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_every_response_names_its_request_id_as_the_references_do(sgl, stream, n):
    req = request(stream=stream, max_new_tokens=5, ignore_eos=True, n=n, temperature=1.0)
    replies = list(sgl.sgl.Generate(req, timeout=TIMEOUT_S))
    assert sum(r.WhichOneof("response") == "complete" for r in replies) == n
    assert {r.request_id for r in replies} == {req.request_id}  # chunks (the fast path's bytes too) and completes


def test_n_2_gives_one_complete_per_choice(sgl):
    chunks, completes = run(sgl, request(stream=True, max_new_tokens=6, ignore_eos=True, n=2, temperature=1.0))
    assert sorted(completes) == [0, 1] and all(len(v) == 1 for v in completes.values())
    for index in (0, 1):
        assert sum(len(c.token_ids) for c in chunks[index]) == 6 == completes[index][0].completion_tokens
    _, whole = run(sgl, request(max_new_tokens=6, ignore_eos=True, n=2))
    assert [len(whole[i][0].output_ids) for i in (0, 1)] == [6, 6]
    assert whole[0][0].output_ids == whole[1][0].output_ids  # greedy: both choices agree


def test_stop_token_id_is_matched_and_named(sgl):
    prompt = (21, 22, 23)
    whole = greedy(sgl, prompt, 10)
    stop = whole[4]
    cut = whole.index(stop)
    _, completes = run(sgl, request(prompt, max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop]))
    (complete,) = completes[0]
    assert complete.finish_reason == "stop"
    assert complete.WhichOneof("matched_stop") == "matched_token_id" and complete.matched_token_id == stop
    assert list(complete.output_ids)[:cut] == whole[:cut] and len(complete.output_ids) in (cut, cut + 1)


@pytest.mark.parametrize("no_stop_trim", [False, True], ids=["trimmed", "kept"])
def test_stop_string_cuts_the_output(sgl, no_stop_trim):
    """A stop string that is one whole generated token: the output ends with the token that completed the
    match and names the string (token ids cannot be cut mid-token; the router trims the text by
    ``matched_stop_str`` and ``no_stop_trim``), and nothing after it is generated for the client."""
    prompt = (31, 32, 33, 34)
    tokens = greedy(sgl, prompt, 16)
    decode = lambda ids: sgl.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = decode(tokens)
    for i in range(4, 14):
        before = decode(tokens[:i])
        piece = decode(tokens[:i + 1])[len(before):]
        if piece.strip() and "\ufffd" not in piece and text.find(piece) == len(before):
            break
    else:
        pytest.fail(f"no usable one-token stop string in {text!r}")
    _, completes = run(sgl, request(prompt, max_new_tokens=16, ignore_eos=True, stop=[piece], no_stop_trim=no_stop_trim))
    (complete,) = completes[0]
    assert complete.finish_reason == "stop" and complete.matched_stop_str == piece
    assert list(complete.output_ids) == tokens[:i + 1]
    assert complete.completion_tokens == i + 1


def _eos_prompt(sgl) -> list[int]:
    for k in range(300):
        prompt = [40 + k, 41 + k, 42 + k]
        _, completes = run(sgl, request(prompt, max_new_tokens=8))
        if completes[0][0].finish_reason == "stop" and len(completes[0][0].output_ids) < 6:
            return prompt
    pytest.fail("no prompt in 300 hit EOS within 6 greedy tokens")


def test_min_new_tokens_and_ignore_eos_reach_the_engine(sgl):
    prompt = _eos_prompt(sgl)
    _, ignored = run(sgl, request(prompt, max_new_tokens=8, ignore_eos=True))
    assert ignored[0][0].finish_reason == "length" and ignored[0][0].completion_tokens == 8
    _, held = run(sgl, request(prompt, max_new_tokens=8, min_new_tokens=6))
    assert held[0][0].completion_tokens >= 6


def test_logprobs_are_per_chunk_deltas_and_prompt_logprobs_come_once(sgl):
    prompt = (51, 52, 53, 54)
    chunks, completes = run(sgl, request(prompt, stream=True, max_new_tokens=6, ignore_eos=True, return_logprob=True,
                                         top_logprobs_num=2, logprob_start_len=0))
    for chunk in chunks[0]:
        assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)  # this chunk's positions only
        assert all(len(top.values) == 2 for top in chunk.output_logprobs.top_logprobs)
    with_input = [c for c in chunks[0] if len(c.input_logprobs.token_ids)]
    assert len(with_input) == 1 and with_input[0] is chunks[0][0]
    first = with_input[0].input_logprobs
    assert list(first.token_ids) == list(prompt)
    assert not first.token_logprobs[0].HasField("value") and all(p.HasField("value") for p in first.token_logprobs[1:])
    _, whole = run(sgl, request(prompt, max_new_tokens=6, ignore_eos=True, return_logprob=True, top_logprobs_num=1))
    assert list(whole[0][0].output_logprobs.token_ids) == list(whole[0][0].output_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_logprobs_from_any_start_position_are_the_schedulers_slice(sgl, stream):
    """Issue 33 item 7: ``logprob_start_len`` N > 0 returns prompt positions N.. (N's own value unset, as the
    scheduler's slice starts), the same values the whole prompt's have there; at the prompt's end, none."""
    prompt = (61, 62, 63, 64, 65, 66, 67)

    def input_logprobs(start: int):
        chunks, completes = run(sgl, request(prompt, stream=stream, max_new_tokens=2, ignore_eos=True,
                                             return_logprob=True, top_logprobs_num=2, logprob_start_len=start))
        return chunks[0][0].input_logprobs if stream else completes[0][0].input_logprobs

    whole = input_logprobs(0)
    values = [p.value for p in whole.token_logprobs[1:]]
    for start in (1, 3, 6):
        part = input_logprobs(start)
        assert list(part.token_ids) == list(prompt[start:])
        assert not part.token_logprobs[0].HasField("value")
        assert [p.value for p in part.token_logprobs[1:]] == values[start:]
        assert [list(t.token_ids) for t in part.top_logprobs[1:]] == [list(t.token_ids) for t in whole.top_logprobs[start + 1:]]
    assert not len(input_logprobs(len(prompt)).token_ids)  # nothing left to return


REFUSALS = [
    ("no tokenized input", dict(tokenized=None), "tokenized"),
    ("empty prompt", dict(prompt=()), "tokenized.input_ids"),
    ("id outside the vocabulary", dict(prompt=(5, 10**9)), "tokenized.input_ids"),
    ("temperature below 0", dict(temperature=-1.0), "sampling_params.temperature"),
    ("top_p above 1", dict(top_p=1.5), "sampling_params.top_p"),
    ("top_k below -1", dict(top_k=-5), "sampling_params.top_k"),
    ("min_p above 1", dict(min_p=2.0), "sampling_params.min_p"),
    ("max_new_tokens over the context", dict(max_new_tokens=10**6), "sampling_params.max_new_tokens"),
    ("min_new_tokens over max", dict(max_new_tokens=4, min_new_tokens=9), "sampling_params.min_new_tokens"),
    ("n too large", dict(n=1000), "sampling_params.n"),
    ("logit bias key not an id", dict(logit_bias={"x": 1.0}), "sampling_params.logit_bias"),
    ("logit bias out of range", dict(logit_bias={"5": 500.0}), "sampling_params.logit_bias"),
    ("bad JSON schema", dict(json_schema="{not json"), "sampling_params.json_schema"),
    ("blank grammar", dict(ebnf_grammar="   "), "sampling_params.ebnf_grammar"),
    ("hidden states", dict(return_hidden_states=True), "return_hidden_states"),
    # SGLang's own flag is off on this worker: its scheduler would run no processor.
    ("custom logit processor without --enable-custom-logit-processor", dict(custom_logit_processor="{}"),
     "custom_logit_processor"),
    ("too many top logprobs", dict(return_logprob=True, top_logprobs_num=10**6), "top_logprobs_num"),
    # SGLang's scheduler aborts a start past the prompt ("is higher than the number of input tokens").
    ("prompt logprobs from past the prompt", dict(return_logprob=True, logprob_start_len=4), "logprob_start_len"),
    ("DP rank out of range", dict(data_parallel_rank=3), "data_parallel_rank"),
]


@pytest.mark.parametrize("mutation, field", [(m, f) for _, m, f in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_input_is_refused_before_the_engine_naming_the_field(sgl, mutation, field):
    mutation = dict(mutation)
    top = {k: mutation.pop(k) for k in ("return_hidden_states", "custom_logit_processor", "return_logprob",
                                        "top_logprobs_num", "data_parallel_rank", "logprob_start_len")
           if k in mutation}
    prompt = mutation.pop("prompt", (5, 6, 7))
    no_input = mutation.pop("tokenized", "keep") is None
    req = request(prompt, **mutation)
    for key, value in top.items():
        setattr(req, key, value)
    if no_input:
        req.ClearField("tokenized")
    with pytest.raises(grpc.RpcError) as refused:
        run(sgl, req)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.details()
    # Refused before the engine: journaled as the client's error, and no engine request for it.
    mine = wait_until(lambda: [(kind, p) for st, kind, p in _journal(sgl) if st == f"req/{req.request_id}"] or None,
                      10, "the refusal journaled")
    assert [kind for kind, _ in mine] == ["error"] and mine[0][1]["whose"] == "client"


# -- Abort, control ----------------------------------------------------------------------------


def _journal(servicer):
    with open_reader(servicer.journal) as reader:
        return [(rec.stream, rec.kind, rec.payload) for rec in reader.records()]


def test_abort_rpc_ends_the_stream_with_an_abort_complete(sgl):
    request_id = new_id("abort")
    call = sgl.sgl.Generate(request(stream=True, request_id=request_id, max_new_tokens=1000, ignore_eos=True),
                            timeout=TIMEOUT_S)
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    # A flush while the request runs: the scheduler refuses in its own words.
    flush = sgl.sgl.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT_S)
    assert not flush.success and flush.message.startswith("Cache not flushed")
    reply = sgl.sgl.Abort(pb.AbortRequest(request_id=request_id, reason="test"), timeout=5)
    assert reply.success
    rest = list(call)
    assert rest[-1].WhichOneof("response") == "complete" and rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 1000
    refused = sgl.sgl.Abort(pb.AbortRequest(request_id="smg-warmup-health-1"), timeout=5)
    assert not refused.success and "reserved" in refused.message
    wait_until(lambda: any(kind == "client.abort" and st == f"req/{request_id}" for st, kind, _ in _journal(sgl)),
               10, "the abort journaled")


def test_flush_loads_profile_and_tokenizer(sgl):
    wait_until(lambda: sgl.sgl.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_requests == 0, 10, "idle")
    assert sgl.sgl.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT_S).success
    started = sgl.sgl.StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT_S)
    stopped = sgl.sgl.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT_S)
    again = sgl.sgl.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT_S)
    assert (started.success, stopped.success, again.success) == (True, True, False)
    assert "not in progress" in again.message
    loads = sgl.sgl.GetLoads(pb.GetLoadsRequest(dp_rank=0, include=["all"]), timeout=5)
    assert loads.version == "0.5.23" and [x.dp_rank for x in loads.loads] == [0]
    assert loads.loads[0].max_total_num_tokens > 0
    with pytest.raises(grpc.RpcError) as bad_rank:
        sgl.sgl.GetLoads(pb.GetLoadsRequest(dp_rank=5), timeout=5)
    assert bad_rank.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    chunks = list(sgl.sgl.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT_S))
    assert chunks and chunks[-1].sha256 and sum(len(c.data) for c in chunks) > 0
    info = sgl.sgl.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert (info.sglang_version, info.server_type) == ("0.5.23", "grpc") and info.max_total_num_tokens > 0


def test_kv_events_of_the_sglang_run_are_relayed(sgl):
    call = sgl.sgl.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=TIMEOUT_S)
    run(sgl, request((61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77), max_new_tokens=4))
    batch = next(call)
    assert batch.events or batch.HasField("snapshot")
    call.cancel()


def test_a_pooling_engine_embeds_and_its_health_probe_is_an_embedding(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                        engine_args=["--runner", "pooling"], health_service=SERVICE).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(servicer.channel)
        reply = stub.Embed(pb.EmbedRequest(request_id=new_id("e"), tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])),
                           timeout=TIMEOUT_S)
        assert reply.prompt_tokens == 3 and reply.embedding_dim == len(reply.embedding) > 0
        assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).is_generation
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT_S).healthy
        with pytest.raises(grpc.RpcError) as generate:
            list(stub.Generate(request(), timeout=TIMEOUT_S))
        assert generate.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as texts:
            stub.Embed(pb.EmbedRequest(request_id=new_id("e"), texts=["a"], is_cross_encoder=True), timeout=5)
        assert texts.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is_cross_encoder" in texts.value.details()
    finally:
        servicer.stop()


def test_the_journal_tools_read_an_sglang_run(sgl):
    """``journal verify``/``show``/``replay`` and ``inspect`` on this servicer's journal: SGLang frames decode."""
    import subprocess
    import sys
    from pathlib import Path

    run(sgl, request(stream=True, max_new_tokens=4, ignore_eos=True))
    enginelink = str(Path(sys.executable).parent / "enginelink")

    def tool(*args: str) -> str:
        done = subprocess.run([enginelink, *args, "--journal", str(sgl.journal)], capture_output=True, text=True,
                              timeout=120, env={**__import__("os").environ, "XDG_STATE_HOME": str(sgl.state_home)})
        assert done.returncode == 0, done.stderr
        return done.stdout

    verified = tool("journal", "verify")
    assert "all invariants hold" in verified and "tokens" in verified
    shown = tool("journal", "show", "--kind", "engine.frame")
    assert "outputs" in shown and "undecodable" not in shown
    assert "sglang-0" in tool("journal", "replay")
    assert "engine wire sglang" in tool("inspect")


def test_the_health_probes_ids_are_the_servicers(sgl):
    with pytest.raises(grpc.RpcError) as taken:
        run(sgl, request(request_id="smg-warmup-health-7", max_new_tokens=2))
    assert taken.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in taken.value.details()
    futures = [sgl.sgl.HealthCheck.future(pb.HealthCheckRequest(), timeout=TIMEOUT_S) for _ in range(4)]
    assert all(f.result().healthy for f in futures)  # concurrent checks: each answered, none refused
    probes = wait_until(lambda: [p for st, kind, p in _journal(sgl)
                                 if kind == "client.sent" and st.startswith("req/smg-warmup-health-")] or None,
                        10, "the health probes journaled")  # the journal flushes every 50 ms
    assert all(p["finish_reason"] == "length" and p["tokens_sent"] == 1 for p in probes)


def test_lora_ids_and_custom_logit_processors_reach_a_scheduler_that_runs_them(tmp_path, test_model_dir):
    # The sim runs neither; what is checked is that the worker takes them where SGLang's own flag is on
    # (the bytes in the scheduler's own fields: tests/wire/test_sglang_codec.py against the real structs).
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                  engine_args=["--enable-custom-logit-processor"], health_service=SERVICE).start() as s:
        stub = pb_grpc.SglangSchedulerStub(s.channel)
        assert dict(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).server_args)[
            "enable_custom_logit_processor"] is True
        request = pb.GenerateRequest(request_id="lora-proc", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                                     sampling_params=pb.SamplingParams(max_new_tokens=3, ignore_eos=True),
                                     lora_id="adapter-a", custom_logit_processor='{"callable": "x"}',
                                     require_reasoning=True)
        (reply,) = list(stub.Generate(request, timeout=10))
        assert reply.complete.finish_reason == "length" and len(reply.complete.output_ids) == 3

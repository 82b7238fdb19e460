"""End to end on SGLang's contract: an HTTP client → the real SMG router → ``serve --engine sim --wire sglang``.

The router detects the worker as SGLang (``SglangScheduler`` answers, every
other engine service is UNIMPLEMENTED) and drives it with SGLang's
GenerateRequest; the servicer drives the sim engine's SGLang personality over
SGLang's own scheduler wire (msgpack, no handshake, a ready report on a pipe).
Assertions are what the router's user sees, and, where the router hides it,
what the servicer journaled and what the engine's frames carried.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from enginelink.journal.store import open_reader
from enginelink.wire.sglang import SglangCodec
from tests.harness import Router, Servicer, wait_until
from tests.router.openai_http import DONE, SSEStream, get, post, stream

pytestmark = pytest.mark.router

SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "def foo(x):"
HELLO_TEMPLATE_TOKENS = 13  # "hello" under the test model's chat template


def _stack(tmp: Path, model_dir: Path, engine_args: list[str] | None = None):
    servicer = Servicer(tmp, model_dir=model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                        engine_args=engine_args, health_service=SGLANG_SERVICE).start()
    try:
        router = Router(tmp, servicer.port, model_dir).start()
    except BaseException:
        servicer.stop()
        raise
    stub = pb_grpc.SglangSchedulerStub(servicer.channel)
    return SimpleNamespace(servicer=servicer, router=router, url=router.url, model=model_dir.name, stub=stub,
                           tokenizer=Tokenizer.from_file(str(model_dir / "tokenizer.json")))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, test_model_dir):
    s = _stack(tmp_path_factory.mktemp("router-sglang"), test_model_dir)
    try:
        yield s
    finally:
        s.router.stop()
        s.servicer.stop()


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory, test_model_dir):
    s = _stack(tmp_path_factory.mktemp("router-sglang-slow"), test_model_dir, ["--step-us", "20000"])
    try:
        yield s
    finally:
        s.router.stop()
        s.servicer.stop()


def ok(reply):
    status, body = reply
    assert status == 200, body
    return body


def streamed(reply):
    status, events = reply
    assert status == 200, events
    assert events and events[-1] == DONE, events[-3:]
    chunks = events[:-1]
    assert all(isinstance(c, dict) and "error" not in c for c in chunks), chunks
    return chunks


def journal(servicer: Servicer):
    with open_reader(servicer.journal) as reader:
        return [(rec.seq, rec.stream, rec.kind, rec.payload) for rec in reader.records()]


def direct_greedy(stack, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The servicer's own tokens for a greedy request on SGLang's contract (no router)."""
    request = pb.GenerateRequest(request_id=f"direct-{len(prompt_ids)}-{max_new_tokens}",
                                 tokenized=pb.TokenizedInput(input_ids=prompt_ids),
                                 sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                                                                   ignore_eos=True))
    (reply,) = list(stack.stub.Generate(request, timeout=30))
    assert reply.complete.completion_tokens == max_new_tokens
    return list(reply.complete.output_ids)


# -- detection -------------------------------------------------------------------------------


def test_router_detects_an_sglang_worker(stack):
    status, workers = get(stack.url, "/workers")
    assert status == 200
    (worker,) = workers["workers"]
    assert worker["runtime_type"] == "sglang"
    assert worker["is_healthy"] is True
    assert f"Detected backend: sglang for {stack.router.worker_url}" in stack.router.log()


# -- chat and completions, streamed and not ----------------------------------------------------


def test_chat_non_streaming(stack):
    body = ok(post(stack.url, CHAT, {"model": stack.model, "messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 8, "ignore_eos": True, "temperature": 0}))
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {**body["usage"], "prompt_tokens": HELLO_TEMPLATE_TOKENS, "completion_tokens": 8,
                             "total_tokens": 8 + HELLO_TEMPLATE_TOKENS}


def test_chat_streaming_equals_non_streaming_with_usage(stack):
    request = {"model": stack.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
               "ignore_eos": True, "temperature": 0}
    whole = ok(post(stack.url, CHAT, request))["choices"][0]["message"]["content"]
    chunks = streamed(stream(stack.url, CHAT, {**request, "stream_options": {"include_usage": True}}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # The usage chunk counts what SGLang's chunks report as their running total.
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_completions_streamed_and_not_equal_the_servicers_tokens(stack):
    request = {"model": stack.model, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    body = ok(post(stack.url, COMPLETIONS, request))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16
    chunks = streamed(stream(stack.url, COMPLETIONS, request))
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    prompt_ids = stack.tokenizer.encode(PROMPT).ids
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert stack.tokenizer.decode(direct_greedy(stack, prompt_ids, 16), skip_special_tokens=True) == choice["text"]


def test_n_2_gives_two_choices_streamed_and_not(stack):
    request = {"model": stack.model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "n": 2}
    body = ok(post(stack.url, COMPLETIONS, request))
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 16
    chunks = streamed(stream(stack.url, COMPLETIONS, request))
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None}
    assert finished == {0: "length", 1: "length"}


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_stop_string_cuts_the_text(stack, streaming):
    request = {"model": stack.model, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    full = ok(post(stack.url, COMPLETIONS, request))["choices"][0]["text"]
    for start in range(len(full) // 3, len(full) - 4):
        stop = full[start:start + 4]
        if "\ufffd" not in stop and stop.strip() and full.find(stop) == start:
            break
    else:
        pytest.fail(f"no usable stop string in {full!r}")
    request["stop"] = [stop]
    if streaming:
        chunks = streamed(stream(stack.url, COMPLETIONS, request))
        text, finish = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
    else:
        (choice,) = ok(post(stack.url, COMPLETIONS, request))["choices"]
        text, finish = choice["text"], choice["finish_reason"]
    assert finish == "stop"
    assert text == full[:start], (stop, full)


def test_logprobs_one_entry_per_token_streamed_and_not(stack):
    request = {"model": stack.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
               "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = ok(post(stack.url, CHAT, request))["choices"][0]["logprobs"]["content"]
    assert len(whole) == 5
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in whole)
    chunks = streamed(stream(stack.url, CHAT, request))
    entries = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
               for e in c["choices"][0]["logprobs"]["content"]]
    # Per-chunk deltas (as SGLang's scheduler sends them), not cumulative: one entry per token.
    assert [(e["token"], round(e["logprob"], 5)) for e in entries] == [(e["token"], round(e["logprob"], 5))
                                                                        for e in whole]


# -- a client that hangs up ------------------------------------------------------------------


def test_client_disconnect_aborts_the_engine_request(slow_stack):
    servicer = slow_stack.servicer
    s = SSEStream(slow_stack.url, COMPLETIONS, {"model": slow_stack.model, "prompt": PROMPT, "max_tokens": 200,
                                                 "ignore_eos": True, "temperature": 0})
    assert s.status == 200
    router_id = s.headers["x-request-id"]
    got = []
    for payload in s.data():
        assert payload != DONE, "the slow stream ended before the client hung up"
        got.append(payload)
        if len(got) == 2:
            break
    s.hang_up()
    wait_until(lambda: slow_stack.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).active_requests == 0,
               10, "active_requests == 0 after the client hung up")

    def aborted():
        records = journal(servicer)
        streams = {st for _, st, kind, _ in records if kind == "client.generate" and st.startswith(f"req/{router_id}")}
        if len(streams) != 1:
            return None
        (st,) = streams
        mine = [r for r in records if r[1] == st]
        return (st, mine, records) if any(kind == "client.sent" for _, _, kind, _ in mine) else None

    st, mine, _ = wait_until(aborted, 10, "the journal records the aborted request")
    request_id = st.removeprefix("req/")
    aborts = [p for _, _, kind, p in mine if kind == "client.abort"]
    assert len(aborts) == 1 and aborts[0]["reason"] in ("abort_rpc", "client_gone"), aborts
    (sent,) = [p for _, _, kind, p in mine if kind == "client.sent"]
    assert sent["finish_reason"] == "abort" and sent["tokens_sent"] < 200

    # SGLang answers an AbortReq with an abort entry for that request: the engine let it go.
    codec = SglangCodec()

    def engine_aborted():
        for _, _, kind, payload in journal(servicer):
            if kind == "engine.frame":
                batch = codec.decode_output([payload])
                if any(o.request_id == request_id and o.abort is not None for o in getattr(batch, "outputs", ())):
                    return True
        return None

    wait_until(engine_aborted, 10, "the engine's abort entry for the request")


def test_unary_rpcs_the_router_uses(stack):
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == stack.model and info.max_req_input_len == info.max_context_length - 1
    assert stack.stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    loads = stack.stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=5)
    assert loads.dp_rank_count == 1 and [load.dp_rank for load in loads.loads] == [0]
    with pytest.raises(grpc.RpcError) as bad:
        stack.stub.GetLoads(pb.GetLoadsRequest(include=["everything"]), timeout=5)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "everything" in bad.value.details()
    with pytest.raises(grpc.RpcError) as lora:
        stack.stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=5)
    assert lora.value.code() == grpc.StatusCode.UNIMPLEMENTED
    servicer_log = stack.servicer.log()
    for bad_word in ("Traceback", "ERROR", "CRITICAL"):
        assert bad_word not in servicer_log, servicer_log[-3000:]


# -- structured outputs ----------------------------------------------------------------------


def test_a_json_schema_request_through_the_router_reaches_the_scheduler_with_its_grammar_backend(stack):
    # The sim scheduler enforces nothing (a real one does: tests/sglang/test_sglang_grammar.py); what is
    # checked here is the path: the router's json_schema reaches the scheduler's sampling params, under the
    # grammar backend the worker advertises from its resolved arguments.
    info = stack.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    labels = dict(info.server_args)
    assert labels["grammar_backend"] == "xgrammar" and labels["constrained_decoding_start"] == "first_token"
    assert labels["skip_tokenizer_init"] is False and "engine_reasoning_parser" not in labels
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = {"model": stack.model, "messages": [{"role": "user", "content": "json please"}], "max_tokens": 6,
               "ignore_eos": True, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    (choice,) = ok(post(stack.url, CHAT, request))["choices"]
    assert choice["finish_reason"] == "length"

    def constrained():
        return [p for _, _, kind, p in journal(stack.servicer) if kind == "client.generate" and p.get("constraint")]

    (record,) = wait_until(constrained, 10, "the constrained call in the journal")
    assert record["constraint"] == "sampling_params.json_schema" and record["grammar_backend"] == "xgrammar"


def test_a_worker_without_a_grammar_backend_refuses_constraints_ahead_of_the_scheduler(tmp_path, test_model_dir):
    s = _stack(tmp_path, test_model_dir, ["--skip-tokenizer-init", "--reasoning-parser", "qwen3"])
    try:
        labels = dict(s.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).server_args)
        assert labels["grammar_backend"] == "none" and labels["engine_reasoning_parser"] == "qwen3"
        assert labels["constrained_decoding_start"] == "after_reasoning"
        request = pb.GenerateRequest(request_id="no-grammar", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                                     sampling_params=pb.SamplingParams(max_new_tokens=4, regex="[0-9]+"))
        with pytest.raises(grpc.RpcError) as refused:
            list(s.stub.Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grammar_backend none" in refused.value.details()
        status, body = post(s.url, CHAT, {"model": s.model, "messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert status == 400 and "grammar backend" in str(body), body
    finally:
        s.router.stop()
        s.servicer.stop()


# -- cache_aware routing by KV events across two SGLang workers --------------------------------


def test_cache_aware_routing_follows_two_sglang_workers_kv_events(tmp_path, test_model_dir):
    """Each prefix is generated directly on one worker (the router never sees it); requests sharing it
    then land on that worker, which only its KV events (SGLang's contract's SubscribeKvEvents) can tell."""
    from tests.kv.kv_client import prompt
    from tests.kv.test_kv_router import PREFIX, PRIMED, prompt_lengths, router_metric

    workers = [Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                        health_service=SGLANG_SERVICE, env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.2"})
               for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.start()
        router = Router(tmp_path, workers[0].port, test_model_dir, extra=["--policy", "cache_aware"])
        router.argv.insert(router.argv.index(router.worker_url) + 1, f"grpc://127.0.0.1:{workers[1].port}")
        router.start()
        stubs = [pb_grpc.SglangSchedulerStub(w.channel) for w in workers]
        prefixes = [prompt(300 + i, PREFIX) for i in range(PRIMED)]
        for i, p in enumerate(prefixes):
            list(stubs[i % 2].Generate(pb.GenerateRequest(
                request_id=f"prime-{i}", tokenized=pb.TokenizedInput(input_ids=p),
                sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=1)), timeout=30))
        for w in workers:
            wait_until(lambda: router_metric(router, "smg_kv_event_batches_total", w.port, disposition="applied") >= 3,
                       15, f"the router applying {w.port}'s batches")  # fmt: skip
        for i, p in enumerate(prefixes):
            body = {"model": test_model_dir.name, "input_ids": p + prompt(400 + i, 8 + i),
                    "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
            status, reply = post(router.url, "/generate", body)
            assert status == 200, reply
        for i in range(PRIMED):
            length = PREFIX + 8 + i
            holder, other = workers[i % 2], workers[1 - i % 2]
            assert wait_until(lambda: length in prompt_lengths(holder), 5, f"request {i} on its prefix's worker")
            assert length not in prompt_lengths(other)
        assert "Detected backend: sglang" in router.log()
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()

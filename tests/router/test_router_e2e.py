"""End to end: an HTTP client → the real SMG router → ``enginelink serve`` → the sim engine.

Everything runs on 127.0.0.1 and is started and stopped by this module: one
servicer + router pair for the plain tests, and one over a slow engine
(``--step-us 20000``, 50 tokens/s) for the client that hangs up mid-stream.
Assertions are what a user of the router sees (HTTP status, choices, text,
finish reasons, usage), and, where the router hides it, what the servicer
journaled. Waits are bounded polls, never sleeps a result depends on.

The sim engine's greedy output is a hash of the prompt: temperature 0 makes
every request here reproducible, so "streamed == not streamed" and "router
text == the servicer's own tokens decoded" are exact comparisons.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.journal.store import open_reader
from enginelink.wire.vllm import VllmCodec
from tests.harness import Router, Servicer, generate_request, wait_until
from tests.router.openai_http import DONE, SSEStream, get, post, stream

pytestmark = pytest.mark.router

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "def foo(x):"
# "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" under the test model's template.
HELLO_TEMPLATE_TOKENS = 13


# -- fixtures ---------------------------------------------------------------------------


def _stack(tmp: Path, model_dir: Path, engine_args: list[str] | None = None):
    servicer = Servicer(tmp, model_dir=model_dir, engine_args=engine_args).start()
    try:
        router = Router(tmp, servicer.port, model_dir).start()
    except BaseException:
        servicer.stop()
        raise
    return servicer, router


@pytest.fixture(scope="module")
def stack(tmp_path_factory, test_model_dir):
    servicer, router = _stack(tmp_path_factory.mktemp("router-e2e"), test_model_dir)
    try:
        status, models = get(router.url, "/v1/models")
        assert status == 200, models
        model = models["data"][0]["id"]
        yield SimpleNamespace(
            servicer=servicer,
            router=router,
            url=router.url,
            model=model,
            tokenizer=Tokenizer.from_file(str(test_model_dir / "tokenizer.json")),
        )
    finally:
        router.stop()  # SIGKILL: nothing left to drain
        servicer.stop()


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory, test_model_dir):
    servicer, router = _stack(tmp_path_factory.mktemp("router-e2e-slow"), test_model_dir, ["--step-us", "20000"])
    try:
        yield SimpleNamespace(servicer=servicer, router=router, url=router.url, model=test_model_dir.name)
    finally:
        router.stop()
        servicer.stop()


# -- helpers ----------------------------------------------------------------------------


def chat_body(stack, **extra) -> dict:
    return {"model": stack.model, "messages": [{"role": "user", "content": "hello"}], **extra}


def completion_body(stack, prompt: str = PROMPT, **extra) -> dict:
    return {"model": stack.model, "prompt": prompt, **extra}


def ok(reply: tuple[int, object]) -> dict:
    status, body = reply
    assert status == 200, body
    return body


def streamed(reply: tuple[int, list]) -> tuple[list[dict], list]:
    """The JSON chunks of a 200 stream that ended with ``[DONE]``."""
    status, events = reply
    assert status == 200, events
    assert events and events[-1] == DONE, f"stream did not end with [DONE]: {events[-3:]}"
    chunks = events[:-1]
    assert all(isinstance(c, dict) and "error" not in c for c in chunks), chunks
    return chunks, events


def journal(servicer: Servicer) -> list[tuple[int, str, str, object]]:
    """Every record the servicer has flushed so far: (seq, stream, kind, payload)."""
    with open_reader(servicer.journal) as reader:
        return [(rec.seq, rec.stream, rec.kind, rec.payload) for rec in reader.records()]


def servicer_greedy_text(stack, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """Generate straight on the servicer (no router), decoded as the router decodes."""
    request = generate_request(
        f"direct-{len(prompt_ids)}-{max_tokens}", prompt_ids, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    replies = list(stack.servicer.stub.Generate(request, timeout=30))
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    assert len(completes) == 1, replies
    ids = list(completes[0].output_ids)
    return stack.tokenizer.decode(ids, skip_special_tokens=True), ids


# -- the model -------------------------------------------------------------------------


def test_models_lists_the_served_model_name(stack, test_model_dir):
    assert stack.model == test_model_dir.name
    status, workers = get(stack.url, "/workers")
    assert status == 200
    (worker,) = workers["workers"]
    assert worker["runtime_type"] == "vllm"
    assert worker["connection_mode"] == "grpc"
    assert worker["is_healthy"] is True


# -- chat --------------------------------------------------------------------------------


def test_chat_non_streaming(stack):
    body = ok(post(stack.url, CHAT, chat_body(stack, max_tokens=8, ignore_eos=True, temperature=0)))
    assert body["object"] == "chat.completion"
    assert body["model"] == stack.model
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == HELLO_TEMPLATE_TOKENS
    assert body["usage"]["total_tokens"] == 8 + HELLO_TEMPLATE_TOKENS


def test_chat_streaming_equals_non_streaming(stack):
    request = chat_body(stack, max_tokens=8, ignore_eos=True, temperature=0)
    whole = ok(post(stack.url, CHAT, request))["choices"][0]["message"]["content"]
    chunks, _ = streamed(stream(stack.url, CHAT, request))
    assert len({c["id"] for c in chunks}) == 1, "every chunk of one stream carries one id"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    text = "".join(d.get("content") or "" for d in deltas)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1]), finishes
    assert sum(1 for d in deltas if d.get("content")) >= 1
    assert text == whole


# -- completions -------------------------------------------------------------------------


def test_completions_streaming_equals_non_streaming_equals_servicer(stack):
    request = completion_body(stack, max_tokens=16, ignore_eos=True, temperature=0)
    body = ok(post(stack.url, COMPLETIONS, request))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16

    chunks, _ = streamed(stream(stack.url, COMPLETIONS, request))
    streamed_text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert streamed_text == choice["text"]

    # The router tokenizes the prompt itself (no special tokens for this model);
    # the servicer, asked directly with those ids, must produce the same text.
    prompt_ids = stack.tokenizer.encode(PROMPT).ids
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    direct_text, direct_ids = servicer_greedy_text(stack, prompt_ids, 16)
    assert len(direct_ids) == 16
    assert direct_text == choice["text"]


def test_ignore_eos_reaches_the_engine(stack):
    """A prompt whose greedy output hits EOS early: stop without ignore_eos, length with it."""
    for k in range(200):
        prompt = f"item {k}:"
        ids = stack.tokenizer.encode(prompt).ids
        replies = list(stack.servicer.stub.Generate(
            generate_request(f"eos-probe-{k}", ids, temperature=0.0, max_tokens=8), timeout=30))
        complete = replies[-1].complete
        if complete.finish_reason == "stop" and len(complete.output_ids) < 8:
            break
    else:
        pytest.fail("no prompt in 200 hit EOS within 8 greedy tokens")
    stopped = ok(post(stack.url, COMPLETIONS, completion_body(stack, prompt, max_tokens=8, temperature=0)))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 8
    ignored = ok(post(stack.url, COMPLETIONS, completion_body(stack, prompt, max_tokens=8, temperature=0, ignore_eos=True)))
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 8
    assert ignored["choices"][0]["text"].startswith(stopped["choices"][0]["text"])


def test_n_2_gives_two_choices(stack):
    body = ok(post(stack.url, COMPLETIONS, completion_body(stack, max_tokens=8, n=2)))
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert all(c["finish_reason"] in ("length", "stop") for c in body["choices"])

    chunks, _ = streamed(stream(stack.url, COMPLETIONS, completion_body(stack, max_tokens=8, n=2)))
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks if c["choices"][0]["finish_reason"] is not None}
    assert sorted(finished) == [0, 1]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_stop_string_cuts_the_text(stack, streaming):
    request = completion_body(stack, max_tokens=16, ignore_eos=True, temperature=0)
    full = ok(post(stack.url, COMPLETIONS, request))["choices"][0]["text"]
    # A 4-character piece from the middle, first seen there, with no U+FFFD in it.
    for start in range(len(full) // 3, len(full) - 4):
        stop = full[start:start + 4]
        if "\ufffd" not in stop and stop.strip() and full.find(stop) == start:
            break
    else:
        pytest.fail(f"no usable stop string in {full!r}")
    request["stop"] = [stop]
    if streaming:
        chunks, _ = streamed(stream(stack.url, COMPLETIONS, request))
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        (choice,) = ok(post(stack.url, COMPLETIONS, request))["choices"]
        text, finish = choice["text"], choice["finish_reason"]
        assert choice.get("matched_stop", stop) == stop
    assert finish == "stop"
    assert text == full[:start], (stop, full)


# -- a client that hangs up --------------------------------------------------------------


def servicer_tokens_after(servicer: Servicer, aborted_id: str) -> str:
    """Run a short request straight on the servicer; return its id once it is journaled."""
    probe = f"after-{aborted_id[-12:]}"
    replies = list(servicer.stub.Generate(generate_request(probe, [5, 6, 7], temperature=0.0, max_tokens=3,
                                                           ignore_eos=True), timeout=30))
    assert replies[-1].complete.finish_reason == "length"
    wait_until(lambda: any(kind == "client.sent" and st == f"req/{probe}" for _, st, kind, _ in journal(servicer)),
               10, "the probe request in the journal")
    return probe


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

    # The servicer lets go of the call...
    wait_until(lambda: servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).active_requests == 0,
               10, "active_requests == 0 after the client hung up")

    # ...and its journal says why: one request, aborted, never finished.
    def aborted():
        records = journal(servicer)
        streams = {st for _, st, kind, _ in records if kind == "client.generate" and st.startswith(f"req/{router_id}")}
        if len(streams) != 1:
            return None
        (st,) = streams
        mine = [r for r in records if r[1] == st]
        if not any(kind == "client.sent" for _, _, kind, _ in mine):
            return None
        return st, mine

    st, mine = wait_until(aborted, 10, "the journal records the aborted request")
    request_id = st.removeprefix("req/")
    aborts = [p for _, _, kind, p in mine if kind == "client.abort"]
    assert len(aborts) == 1 and aborts[0]["request_ids"] == [request_id], aborts
    assert aborts[0]["reason"] in ("abort_rpc", "client_gone"), aborts
    dests = [p["dest"] for _, _, kind, p in mine if kind == "transition"]
    assert dests[-1] == "aborted", dests
    assert "finished" not in dests, dests
    (sent,) = [p for _, _, kind, p in mine if kind == "client.sent"]
    assert sent["finish_reason"] == "abort"
    assert sent["tokens_sent"] < 200

    # The engine dropped it: a request admitted after the abort (its ADD follows
    # the ABORT on the same socket) runs in steps that no longer carry it.
    abort_seq = max(seq for seq, _, kind, _ in mine if kind == "client.abort")
    after = servicer_tokens_after(servicer, request_id)
    records = journal(servicer)
    codec = VllmCodec()
    probe_seq = next(seq for seq, st_, kind, _ in records if kind == "client.generate" and st_ == f"req/{after}")
    carried = set()
    for seq, _, kind, payload in records:
        if kind == "engine.frame" and seq > probe_seq:
            batch = codec.decode_output([payload])
            carried.update(out.request_id for out in getattr(batch, "outputs", ()))
    assert after in carried
    assert request_id not in carried, "the engine kept generating for the aborted request"
    assert probe_seq > abort_seq


# -- start-up: detection probes ---------------------------------------------------------


def test_router_detected_vllm_and_the_probes_did_no_harm(stack):
    router_log = stack.router.log()
    assert f"Detected backend: vllm for {stack.router.worker_url}" in router_log, router_log[-3000:]
    # KV events are on by default: the router keeps its subscription (tests/kv/test_kv_router.py).
    assert "KV event stream connected" in router_log
    assert "disabling KV event subscription" not in router_log
    # The probes of SGLang/TokenSpeed/TRT-LLM/MLX services got UNIMPLEMENTED and
    # nothing else: the servicer logged no error and is still healthy.
    servicer_log = stack.servicer.log()
    for bad in ("Traceback", "ERROR", "CRITICAL", "Exception"):
        assert bad not in servicer_log, servicer_log
    assert stack.servicer.process.poll() is None
    health = stack.servicer.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert health.healthy
    errors = [p for _, _, kind, p in journal(stack.servicer) if kind == "error" and p.get("whose") != "client"]
    assert errors == []

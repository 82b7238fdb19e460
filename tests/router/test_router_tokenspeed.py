"""End to end on TokenSpeed's contract: HTTP client → the real SMG router 1.13.0 → ``enginelink serve
--engine sim --wire tokenspeed`` → the sim engine speaking TokenSpeed 0.1.1's headless wire.

The router detects the worker's backend by probing every engine service
(``reference/router-harness.md`` §3); only ``TokenSpeedScheduler`` answers here,
so everything below runs through TokenSpeed's contract: chat, completions,
streaming, ``n = 2`` (child ids ``<id>-n<i>``, journaled), and a client that hangs
up (the router cancels; every child gets an ABORT, which TokenSpeed answers with
an abort entry the journal keeps). All on 127.0.0.1, started and stopped here.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from enginelink.wire.engine import FinishReason
from enginelink.wire.tokenspeed import TokenSpeedCodec
from tests.harness import Router, Servicer, wait_until
from tests.router.openai_http import DONE, SSEStream, get
from tests.router.test_router_e2e import (
    CHAT, COMPLETIONS, HELLO_TEMPLATE_TOKENS, PROMPT, chat_body, completion_body, journal, ok, streamed,
)
from tests.router.openai_http import post, stream

pytestmark = pytest.mark.router

SERVICE = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"


def _stack(tmp: Path, model_dir: Path, engine_args: list[str] | None = None):
    servicer = Servicer(tmp, model_dir=model_dir, extra=["--engine", "sim", "--wire", "tokenspeed"],
                        engine_args=engine_args, health_service=SERVICE, env={"ENGINELINK_WARMUP": "fast"}).start()
    try:
        router = Router(tmp, servicer.port, model_dir).start()
    except BaseException:
        servicer.stop()
        raise
    return servicer, router


@pytest.fixture(scope="module")
def stack(tmp_path_factory, test_model_dir):
    # 5 ms a step: fast enough for the plain calls, slow enough that a 400-token stream is still running
    # when its client hangs up.
    servicer, router = _stack(tmp_path_factory.mktemp("router-ts"), test_model_dir, ["--step-us", "5000"])
    try:
        yield SimpleNamespace(servicer=servicer, router=router, url=router.url, model=test_model_dir.name,
                              tokenizer=Tokenizer.from_file(str(test_model_dir / "tokenizer.json")))
    finally:
        router.stop()
        servicer.stop()


def test_router_detects_tokenspeed(stack):
    wait_until(lambda: f"Detected backend: tokenspeed for {stack.router.worker_url}" in stack.router.log(), 10,
               "the router's detection line")
    status, workers = get(stack.url, "/workers")
    assert status == 200
    (worker,) = workers["workers"]
    assert worker["runtime_type"] == "tokenspeed"
    assert worker["is_healthy"] is True
    # SubscribeKvEvents serves TokenSpeed's contract through the same relay.
    wait_until(lambda: "KV event stream connected" in stack.router.log(), 10, "the router's KV event stream")
    # The other services' probes got UNIMPLEMENTED and nothing else went wrong.
    for bad in ("Traceback", "ERROR", "CRITICAL"):
        assert bad not in stack.servicer.log(), stack.servicer.log()[-3000:]


def test_chat_whole_and_streamed_agree(stack):
    request = chat_body(stack, max_tokens=8, ignore_eos=True, temperature=0)
    body = ok(post(stack.url, CHAT, request))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    assert body["usage"] == {**body["usage"], "completion_tokens": 8, "prompt_tokens": HELLO_TEMPLATE_TOKENS}
    chunks, _ = streamed(stream(stack.url, CHAT, request))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_completions_whole_and_streamed_agree_with_usage(stack):
    request = completion_body(stack, max_tokens=12, ignore_eos=True, temperature=0)
    body = ok(post(stack.url, COMPLETIONS, request))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(stack.tokenizer.encode(PROMPT).ids)
    chunks, _ = streamed(stream(stack.url, COMPLETIONS, {**request, "stream_options": {"include_usage": True}}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 12  # the running counts add up to the real total


def _engine_requests(servicer, router_id: str) -> list[dict]:
    return [p for _, st, kind, p in journal(servicer) if kind == "engine.request" and st.startswith(f"req/{router_id}")]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_n_2_runs_as_two_child_ids(stack, streaming):
    request = completion_body(stack, max_tokens=6, ignore_eos=True, n=2, temperature=0.7)
    if streaming:
        chunks, _ = streamed(stream(stack.url, COMPLETIONS, request))
        finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                    for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
        assert finished == {0: "length", 1: "length"}
        router_id = chunks[0]["id"]
    else:
        body = ok(post(stack.url, COMPLETIONS, request))
        assert sorted((c["index"], c["finish_reason"]) for c in body["choices"]) == [(0, "length"), (1, "length")]
        assert body["usage"]["completion_tokens"] == 12
        router_id = body["id"]
    sent = wait_until(lambda: _engine_requests(stack.servicer, router_id), 10, "the call's engine requests")
    (one,) = sent
    request_id = one["request_ids"][0].removesuffix("-n0")
    assert one["request_ids"] == [f"{request_id}-n0", f"{request_id}-n1"]


def _aborted_by_engine(servicer, engine_ids: set[str]) -> set[str]:
    codec, seen = TokenSpeedCodec(), set()
    for _, _, kind, payload in journal(servicer):
        if kind == "engine.frame":
            batch = codec.decode_output([payload])
            seen.update(o.request_id for o in getattr(batch, "outputs", ())
                        if o.request_id in engine_ids and o.finish_reason == FinishReason.ABORT)
    return seen


def test_client_disconnect_aborts_every_child(stack):
    s = SSEStream(stack.url, COMPLETIONS, completion_body(stack, max_tokens=400, ignore_eos=True, n=2,
                                                          temperature=0.7, stream=True))
    assert s.status == 200
    router_id = s.headers["x-request-id"]
    got = []
    for payload in s.data():
        assert payload != DONE, "the stream ended before the client hung up"
        got.append(payload)
        if len(got) == 2:
            break
    s.hang_up()
    (one,) = wait_until(lambda: _engine_requests(stack.servicer, router_id), 10, "the call's engine requests")
    children = set(one["request_ids"])
    assert len(children) == 2 and all("-n" in child for child in children)
    # Every child was told to stop: TokenSpeed answers each ABORT with an abort entry.
    wait_until(lambda: _aborted_by_engine(stack.servicer, children) == children, 15,
               "the engine's abort entries for both children")
    request_id = one["request_ids"][0].removesuffix("-n0")
    aborts = [p for _, st, kind, p in journal(stack.servicer) if kind == "client.abort" and st == f"req/{request_id}"]
    assert len(aborts) == 1 and aborts[0]["reason"] in ("client_gone", "abort_rpc"), aborts


# -- cache_aware routing by KV events across two TokenSpeed workers ----------------------------


def test_cache_aware_routing_follows_two_tokenspeed_workers_kv_events(tmp_path, test_model_dir):
    """Each prefix is generated directly on one worker (the router never sees it); requests sharing it then
    land on that worker, which only its KV events (TokenSpeed's publisher, relayed on TokenSpeed's contract's
    SubscribeKvEvents) can tell the router."""
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc

    from tests.kv.kv_client import prompt
    from tests.kv.test_kv_router import PREFIX, PRIMED, prompt_lengths, router_metric

    workers = [Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "tokenspeed"],
                        health_service=SERVICE, env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.2"})
               for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.start()
        router = Router(tmp_path, workers[0].port, test_model_dir, extra=["--policy", "cache_aware"])
        router.argv.insert(router.argv.index(router.worker_url) + 1, f"grpc://127.0.0.1:{workers[1].port}")
        router.start()
        stubs = [pb_grpc.TokenSpeedSchedulerStub(w.channel) for w in workers]
        prefixes = [prompt(300 + i, PREFIX) for i in range(PRIMED)]
        for i, p in enumerate(prefixes):
            list(stubs[i % 2].Generate(pb.GenerateRequest(
                request_id=f"prime-{i}", tokenized=pb.TokenizedInput(input_ids=p),
                sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=1)), timeout=30))
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
        assert "Detected backend: tokenspeed" in router.log()
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()

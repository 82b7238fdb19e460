"""The real SMG router 1.13.0 in front of enginelink in front of a real MLX engine.

HTTP client -> ``smg launch`` -> ``enginelink serve --engine mlx`` -> mlx-lm on
CPU. enginelink serves the ``MlxEngine`` contract, so the router detects an MLX
worker ("gRPC client (mlx)") and takes its MLX paths: chunk logprobs per token,
a streamed complete with no tokens, MLX's refusals of what the contract lacks.
Greedy requests make comparisons exact: streamed == whole == the servicer's own
tokens decoded == mlx-lm's own tokens decoded.
"""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import mlx_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.journal.store import open_reader
from tests.harness import Router, wait_until
from tests.mlx.conftest import mlx_request as generate_request
from tests.router.openai_http import DONE, SSEStream, post, stream

pytestmark = [pytest.mark.mlx, pytest.mark.router]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "def foo(x):"
TOKENS = 12


@pytest.fixture(scope="module")
def router(mlx_stack, test_model_dir, tmp_path_factory):
    servicer, _ = mlx_stack
    running = Router(tmp_path_factory.mktemp("mlx-router"), servicer.port, test_model_dir).start(timeout_s=60)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def tokenizer(test_model_dir):
    return Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))


def ok(reply):
    status, body = reply
    assert status == 200, body
    return body


def events_of(reply) -> list[dict]:
    status, events = reply
    assert status == 200, events
    assert events and events[-1] == DONE, events[-3:]
    return events[:-1]


def test_completions_streaming_and_not_equal_mlx_lm(router, mlx_stack, test_model_dir, tokenizer):
    servicer, offline = mlx_stack
    body = {"model": test_model_dir.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    whole = ok(post(router.url, COMPLETIONS, body))
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == TOKENS
    chunks = events_of(stream(router.url, COMPLETIONS, body))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]

    prompt_ids = tokenizer.encode(PROMPT).ids
    replies = list(servicer.stub.Generate(generate_request("router-direct", prompt_ids, temperature=0.0,
                                                           max_tokens=TOKENS, ignore_eos=True), timeout=60))
    direct_ids = list(replies[-1].complete.output_ids)  # unary: the complete has every token
    theirs = offline.run([{"id": "r", "prompt_token_ids": prompt_ids, "max_tokens": TOKENS}])["r"]
    assert direct_ids[: len(theirs["token_ids"])] == theirs["token_ids"]  # mlx-lm stops at EOS; ignore_eos here
    assert tokenizer.decode(direct_ids) == choice["text"]


def test_chat_streaming_and_not(router, test_model_dir):
    body = {"model": test_model_dir.name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    whole = ok(post(router.url, CHAT, body))
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    assert whole["usage"]["completion_tokens"] == TOKENS
    chunks = events_of(stream(router.url, CHAT, body))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]


def test_chat_logprobs_streaming_and_not(router, test_model_dir):
    body = {"model": test_model_dir.name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    whole = ok(post(router.url, CHAT, body))["choices"][0]["logprobs"]["content"]
    streamed = [entry for event in events_of(stream(router.url, CHAT, body)) for c in event["choices"]
                for entry in ((c.get("logprobs") or {}).get("content") or [])]
    assert len(whole) == len(streamed) == TOKENS
    for a, b in zip(whole, streamed):
        assert a["token"] == b["token"]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-6)
        tops = [t["logprob"] for t in a["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert a["logprob"] <= 0 and a["logprob"] == pytest.approx(tops[0], abs=1e-6)  # greedy: the top one


def test_client_disconnect_frees_the_engine(router, mlx_stack, test_model_dir):
    servicer, _ = mlx_stack
    s = SSEStream(router.url, COMPLETIONS, {"model": test_model_dir.name, "prompt": PROMPT, "max_tokens": 2000,
                                            "ignore_eos": True, "temperature": 0})
    assert s.status == 200
    router_id = s.headers["x-request-id"]
    got = 0
    for payload in s.data():
        assert payload != DONE, "the long stream ended before the client hung up"
        got += 1
        if got == 2:
            break
    s.hang_up()
    wait_until(lambda: servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).active_requests == 0,
               30, "active_requests == 0 after the client hung up")
    wait_until(lambda: servicer.engine_running() == 0, 30, "the engine's stats show no request running")

    def aborted():
        records = open_reader(servicer.journal).records(kinds=["client.abort", "client.sent"])
        mine = [r for r in records if r.stream.startswith(f"req/{router_id}")]
        return mine if any(r.kind == "client.sent" for r in mine) else None

    # The router's request id is the call's; it ends aborted (the router's Abort or its hang-up), short.
    mine = wait_until(aborted, 10, "the journal records the aborted request")
    (abort,) = [r.payload for r in mine if r.kind == "client.abort"]
    assert abort["reason"] in ("abort_rpc", "client_gone")
    (sent,) = [r.payload for r in mine if r.kind == "client.sent"]
    assert sent["finish_reason"] == "abort" and sent["tokens_sent"] < 2000


def test_the_router_sees_an_mlx_worker(router):
    # Detected by its HealthCheck fan-out: only MlxEngine answers (VllmEngine is UNIMPLEMENTED here).
    wait_until(lambda: "gRPC client (mlx)" in router.log() or None, 10, "the router's MLX detection in its log")
    assert "Detected backend: vllm" not in router.log()


@pytest.mark.parametrize("extra, words", [
    ({"stop": ["\n"]}, "string stop sequences"),
    ({"n": 2}, "n > 1"),
], ids=["stop strings", "n=2"])
def test_what_the_mlx_contract_lacks_is_refused_by_the_router(router, test_model_dir, extra, words):
    status, body = post(router.url, COMPLETIONS, {"model": test_model_dir.name, "prompt": PROMPT, "max_tokens": 4,
                                                  **extra})
    assert status == 400 and words in str(body), body

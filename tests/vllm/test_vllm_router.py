"""The real SMG router in front of enginelink in front of a real vLLM engine.

HTTP client → ``smg launch`` → ``enginelink serve --engine vllm`` → vLLM 0.32
on CPU. The servicer is the session's (``vllm_stack``); the router is this
module's. Greedy requests make every comparison exact: streamed == whole ==
the servicer's own tokens decoded == vLLM offline's tokens decoded.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.harness import Router, generate_request
from tests.router.openai_http import DONE, get, post, stream

pytestmark = [pytest.mark.vllm, pytest.mark.router]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "def foo(x):"
TOKENS = 16


@pytest.fixture(scope="module")
def router(vllm_stack, test_model_dir, tmp_path_factory):
    servicer, _ = vllm_stack
    running = Router(tmp_path_factory.mktemp("vllm-router"), servicer.port, test_model_dir).start(timeout_s=60)
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


def chunks_of(reply) -> list[dict]:
    status, events = reply
    assert status == 200, events
    assert events and events[-1] == DONE, events[-3:]
    return events[:-1]


def test_router_sees_the_vllm_worker(router, test_model_dir):
    status, models = get(router.url, "/v1/models")
    assert status == 200
    assert models["data"][0]["id"] == test_model_dir.name
    status, workers = get(router.url, "/workers")
    assert status == 200
    (worker,) = workers["workers"]
    assert worker["runtime_type"] == "vllm" and worker["is_healthy"] is True


def test_completions_streaming_and_not_equal_the_engine(router, vllm_stack, test_model_dir, tokenizer):
    servicer, offline = vllm_stack
    body = {"model": test_model_dir.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    whole = ok(post(router.url, COMPLETIONS, body))
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == TOKENS
    chunks = chunks_of(stream(router.url, COMPLETIONS, body))
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    prompt_ids = tokenizer.encode(PROMPT).ids
    replies = list(servicer.stub.Generate(generate_request("router-direct", prompt_ids, temperature=0.0,
                                                           max_tokens=TOKENS, ignore_eos=True), timeout=30))
    direct_ids = list(replies[-1].complete.output_ids)
    theirs = offline.run([{"id": "r", "prompt_token_ids": prompt_ids,
                           "sampling": {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}}])["r"][0]
    assert direct_ids == theirs["token_ids"]
    assert tokenizer.decode(direct_ids) == choice["text"]


def test_chat_streaming_and_not(router, test_model_dir):
    body = {"model": test_model_dir.name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    whole = ok(post(router.url, CHAT, body))
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"]
    assert whole["usage"]["completion_tokens"] == TOKENS
    chunks = chunks_of(stream(router.url, CHAT, body))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_2_and_stop_string_through_the_router(router, test_model_dir):
    base = {"model": test_model_dir.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    full = ok(post(router.url, COMPLETIONS, base))["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = ok(post(router.url, COMPLETIONS, {**base, "stop": [stop]}))["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert full.startswith(cut["text"]) and stop not in cut["text"]
    two = ok(post(router.url, COMPLETIONS, {**base, "n": 2, "temperature": 1.0, "seed": 7}))
    assert sorted(c["index"] for c in two["choices"]) == [0, 1]

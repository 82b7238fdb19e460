"""Logprobs through the real SMG router: an OpenAI chat client asking ``logprobs: true, top_logprobs: 3``.

HTTP client → ``smg launch`` → ``enginelink serve`` → the sim engine, which
sends logprobs on vLLM's wire encoding (``machines/sim_logprobs.py``). What the
client gets must be the servicer's own numbers: the same request sent
straight to the servicer (the chat template's tokens) gives the values the
router returned, streamed and not. The real engine's run of the same is in
``tests/vllm/test_vllm_logprobs.py``.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.harness import Router, Servicer, generate_request
from tests.router.openai_http import DONE, post, stream

pytestmark = pytest.mark.router

CHAT = "/v1/chat/completions"
TOKENS = 6
# The test model's ChatML template around one user message, as the router renders it.
HELLO = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, test_model_dir):
    tmp = tmp_path_factory.mktemp("router-logprobs")
    servicer = Servicer(tmp, model_dir=test_model_dir).start()
    try:
        router = Router(tmp, servicer.port, test_model_dir).start()
        try:
            yield servicer, router
        finally:
            router.stop()
    finally:
        servicer.stop()


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}


def direct_logprobs(servicer, prompt_ids: list[int]) -> list[tuple[int, float, list[float]]]:
    """(token, logprob, top-3 values) per position, asked of the servicer itself."""
    (reply,) = servicer.stub.Generate(generate_request("direct-lp", prompt_ids, temperature=0.0, max_tokens=TOKENS,
                                                       ignore_eos=True, logprobs=3), timeout=30)
    lp = reply.complete.output_logprobs
    return [(t, v, list(top.values)) for t, v, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs)]


def check_content(content: list[dict], expected, tokenizer) -> None:
    assert len(content) == len(expected) == TOKENS
    for entry, (token, value, top_values) in zip(content, expected):
        assert entry["token"] == tokenizer.decode([token], skip_special_tokens=False)
        assert entry["logprob"] == pytest.approx(value, abs=1e-5)
        tops = entry["top_logprobs"]
        assert [t["logprob"] for t in tops] == pytest.approx(top_values, abs=1e-5)
        # Greedy: the chosen token is the most likely one, listed first.
        assert tops[0]["token"] == entry["token"] and len(tops) == 3


def test_chat_logprobs_streaming_and_not(stack, test_model_dir):
    servicer, router = stack
    tokenizer = Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))
    expected = direct_logprobs(servicer, tokenizer.encode(HELLO).ids)

    status, whole = post(router.url, CHAT, chat_body(test_model_dir.name))
    assert status == 200, whole
    (choice,) = whole["choices"]
    assert whole["usage"]["completion_tokens"] == TOKENS
    check_content(choice["logprobs"]["content"], expected, tokenizer)

    status, events = stream(router.url, CHAT, chat_body(test_model_dir.name))
    assert status == 200 and events[-1] == DONE, events[-3:]
    content = [entry for event in events[:-1] for c in event["choices"]
               for entry in ((c.get("logprobs") or {}).get("content") or [])]
    check_content(content, expected, tokenizer)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == \
        choice["message"]["content"]

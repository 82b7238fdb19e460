"""Logprobs through enginelink against a real vLLM 0.32 engine, compared with vLLM offline.

The session's servicer and offline ``LLM`` both run with ``--max-logprobs -1``
(conftest), so every count up to the whole vocabulary is allowed. vLLM
offline gives, per position, a dict ``{sampled, top1..topk}`` (the sampled
token first, duplicates collapsed); enginelink gives the token's logprob and
the true top-k in order (machines/logprobs.py, runtime/contracts/vllm/edge.py). The comparison: the same
token ids, the token's logprob equal within 1e-5, the top-k's ids (with the
token) exactly the dict's keys, and each top value equal to the dict's.
Then the real SMG router in front: chat ``logprobs: true, top_logprobs: 3``.
"""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from tests.harness import Router, generate_request
from tests.router.openai_http import DONE, post, stream

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 4096
TOL = 1e-5
PROMPT_TEXT = "def foo(x):"
HELLO = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(test_model_dir):
    return Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT_TEXT).ids


def _mine(replies: list[pb.GenerateResponse], stream: bool) -> dict[int, dict]:
    """{index: {"token_ids", "positions", "prompt"}} from one call's messages."""
    choices: dict[int, dict] = {}
    for reply in replies:
        kind = reply.WhichOneof("response")
        body = getattr(reply, kind)
        choice = choices.setdefault(body.index, {"token_ids": [], "positions": [], "prompt": None})
        if kind == "chunk" or not stream:
            choice["token_ids"] += list(body.token_ids if kind == "chunk" else body.output_ids)
            lp = body.output_logprobs
            tops = list(lp.top_logprobs) or [None] * len(lp.token_ids)
            choice["positions"] += [(t, v, [] if top is None else list(zip(top.token_ids, top.values)))
                                    for t, v, top in zip(lp.token_ids, lp.token_logprobs, tops, strict=True)]
        if body.HasField("input_logprobs"):
            assert choice["prompt"] is None, "input logprobs sent twice for one choice"
            choice["prompt"] = body.input_logprobs
    return choices


def _same_position(token: int, value: float, top: list[tuple[int, float]], theirs: list, k: int) -> None:
    entries = {t: lp for t, lp, _ in theirs}
    assert theirs[0][0] == token  # vLLM's dict starts with the sampled (or prompt) token
    assert value == pytest.approx(entries[token], abs=TOL)
    assert len(top) == (VOCAB if k == -1 else k)
    assert {t for t, _ in top} | {token} == set(entries)
    for t, v in top:
        assert v == pytest.approx(entries[t], abs=TOL)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def _compare(mine: dict, theirs: dict, k: int | None, prompt_k: int | None, prompt_ids: list[int]) -> None:
    assert mine["token_ids"] == theirs["token_ids"]
    if k is not None:
        assert [p[0] for p in mine["positions"]] == mine["token_ids"]
        assert len(theirs["logprobs"]) == len(mine["positions"])
        for (token, value, top), entry in zip(mine["positions"], theirs["logprobs"]):
            _same_position(token, value, top, entry, k)
    if prompt_k is not None:
        prompt = mine["prompt"]
        assert list(prompt.token_ids) == prompt_ids
        assert theirs["prompt_logprobs"][0] is None and not prompt.token_logprobs[0].HasField("value")
        tops = list(prompt.top_logprobs)
        for i in range(1, len(prompt_ids)):
            top = list(zip(tops[i].token_ids, tops[i].values)) if prompt_k else []
            _same_position(prompt_ids[i], prompt.token_logprobs[i].value, top, theirs["prompt_logprobs"][i], prompt_k)


CASES = [
    # (name, sampling, n): greedy and seeded, k = 3, 0 and the whole vocabulary, prompt logprobs.
    ("greedy-k3", {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 3}, 1),
    ("greedy-k0", {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "logprobs": 0, "prompt_logprobs": 0}, 1),
    ("seeded-n2", {"temperature": 1.0, "seed": 99, "max_tokens": 8, "ignore_eos": True, "logprobs": 3}, 2),
    ("all-vocab", {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True, "logprobs": -1, "prompt_logprobs": -1}, 1),
]


@pytest.mark.parametrize("name, sampling, n", CASES, ids=[c[0] for c in CASES])
def test_logprobs_equal_vllm_offline(vllm_stack, prompt_ids, name, sampling, n):
    servicer, offline = vllm_stack
    theirs = offline.run([{"id": name, "prompt_token_ids": prompt_ids, "sampling": {**sampling, "n": n}}])[name]
    streams = (False, True) if name != "all-vocab" else (False,)
    for stream in streams:
        request = generate_request(f"lp-{name}-{stream}", prompt_ids, stream=stream, n=n, **sampling)
        mine = _mine(list(servicer.stub.Generate(request, timeout=120)), stream)
        assert sorted(mine) == list(range(n))
        for index in range(n):
            _compare(mine[index], theirs[index], sampling.get("logprobs"), sampling.get("prompt_logprobs"),
                     prompt_ids)
    if n == 2:
        assert theirs[0]["token_ids"] != theirs[1]["token_ids"]


def test_counts_past_the_vocabulary_are_refused(vllm_stack, prompt_ids):
    servicer, _ = vllm_stack
    for sampling, message in (({"logprobs": VOCAB + 1}, "greater than max allowed: 4096"),
                              ({"prompt_logprobs": -3}, "must be non-negative or -1")):
        with pytest.raises(grpc.RpcError) as refused:
            list(servicer.stub.Generate(generate_request("lp-refused", prompt_ids, max_tokens=2, **sampling),
                                        timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()


# -- the real router in front ----------------------------------------------------------------


@pytest.fixture(scope="module")
def router(vllm_stack, test_model_dir, tmp_path_factory):
    servicer, _ = vllm_stack
    running = Router(tmp_path_factory.mktemp("vllm-router-lp"), servicer.port, test_model_dir).start(timeout_s=60)
    try:
        yield running
    finally:
        running.stop()


def test_chat_logprobs_through_the_router(router, vllm_stack, test_model_dir, tokenizer):
    servicer, _ = vllm_stack
    tokens = 6
    (reply,) = servicer.stub.Generate(generate_request("lp-direct", tokenizer.encode(HELLO).ids, temperature=0.0,
                                                       max_tokens=tokens, ignore_eos=True, logprobs=3), timeout=60)
    lp = reply.complete.output_logprobs
    expected = [(t, v, list(top.values)) for t, v, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs)]
    body = {"model": test_model_dir.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}

    def check(content: list[dict]) -> None:
        assert len(content) == tokens
        for entry, (token, value, top_values) in zip(content, expected):
            assert entry["token"] == tokenizer.decode([token], skip_special_tokens=False)
            assert entry["logprob"] == pytest.approx(value, abs=TOL)
            assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top_values, abs=TOL)

    status, whole = post(router.url, "/v1/chat/completions", body)
    assert status == 200, whole
    check(whole["choices"][0]["logprobs"]["content"])
    status, events = stream(router.url, "/v1/chat/completions", body)
    assert status == 200 and events[-1] == DONE, events[-3:]
    check([entry for event in events[:-1] for c in event["choices"]
           for entry in ((c.get("logprobs") or {}).get("content") or [])])

"""Embed through enginelink against a real vLLM 0.32 engine, compared with vLLM's own ``LLM.embed``.

The engine is the tiny test model run as an embedding model by vLLM's
pooling runner (``--runner pooling --convert embed``: last-token pooling,
normalised), one engine for the module. The reference is vLLM's offline
``LLM`` on the same model and arguments, one prompt at a time; every
element of every vector must be within 1e-5 of it.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.vllm.conftest import ENGINE_ARGS, MAX_MODEL_LEN, START_TIMEOUT_S, OfflineVllm, vllm_servicer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

POOLING_ARGS = ["--runner", "pooling", "--convert", "embed"]
HIDDEN_SIZE = 256  # the test model's: the embedding length
TOLERANCE = 1e-5
PROMPTS = {
    "one": [5],
    "short": [17, 301, 2048, 9, 77],
    "medium": [3 + (i * 7919) % 4093 for i in range(37)],
    "long": [3 + (i * 104729) % 4093 for i in range(300)],
    "full": [3 + (i * 31) % 4093 for i in range(MAX_MODEL_LEN)],  # a pooling prompt may fill the context
}


@pytest.fixture(scope="module")
def pooling_stack(tmp_path_factory, test_model_dir, vllm_python):
    """(servicer over a pooling vLLM engine, vLLM's offline LLM as a pooling model)."""
    tmp = tmp_path_factory.mktemp("vllm-embed")
    offline = OfflineVllm(vllm_python, test_model_dir, tmp / "offline-embed.log",
                          llm_kwargs={"runner": "pooling", "convert": "embed"})
    servicer = vllm_servicer(tmp, test_model_dir, ENGINE_ARGS + POOLING_ARGS, env={"ENGINELINK_DRAIN_SECS": "0.5"})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer, offline
    finally:
        servicer.stop()
        offline.close()


@pytest.fixture(scope="module")
def reference(pooling_stack) -> dict[str, list[float]]:
    _, offline = pooling_stack
    answers = offline.run([{"id": name, "prompt_token_ids": ids, "embed": True} for name, ids in PROMPTS.items()])
    return {name: outputs[0]["embedding"] for name, outputs in answers.items()}


def embed(servicer, request_id: str, ids: list[int]) -> pb.EmbedResponse:
    return servicer.stub.Embed(pb.EmbedRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids)),
                               timeout=60)


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == HIDDEN_SIZE, what
    worst = max(abs(g - w) for g, w in zip(got, want))
    assert worst <= TOLERANCE, f"{what}: largest difference {worst}"


def test_embeddings_equal_vllm_offline(pooling_stack, reference):
    servicer, _ = pooling_stack
    for name, ids in PROMPTS.items():
        reply = embed(servicer, f"embed-{name}", ids)
        assert reply.embedding_dim == HIDDEN_SIZE
        assert reply.prompt_tokens == len(ids)
        assert_close(list(reply.embedding), reference[name], name)


def test_concurrent_embeds_equal_vllm_offline(pooling_stack, reference):
    """Batched by the engine (several prompts per step), each still gets its own vector."""
    servicer, _ = pooling_stack
    replies: dict[str, pb.EmbedResponse] = {}
    names = [name for name in PROMPTS if name != "full"] * 2

    def one(index: int, name: str) -> None:
        replies[f"{name}-{index}"] = embed(servicer, f"conc-{index}-{name}", PROMPTS[name])

    threads = [threading.Thread(target=one, args=(i, name)) for i, name in enumerate(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(replies) == len(names)
    for key, reply in replies.items():
        assert_close(list(reply.embedding), reference[key.rsplit("-", 1)[0]], key)


def test_the_worker_says_it_is_not_a_generation_model(pooling_stack):
    servicer, _ = pooling_stack
    info = servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.is_generation is False
    assert info.max_context_length == MAX_MODEL_LEN


def test_generate_on_the_pooling_engine_is_unimplemented(pooling_stack):
    servicer, _ = pooling_stack
    request = pb.GenerateRequest(request_id="gen-on-pooling", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                                 sampling_params=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as caught:
        list(servicer.stub.Generate(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "pooling" in caught.value.details()


def test_too_long_is_refused_and_the_engine_keeps_serving(pooling_stack, reference):
    servicer, _ = pooling_stack
    with pytest.raises(grpc.RpcError) as caught:
        embed(servicer, "too-long", [5] * (MAX_MODEL_LEN + 1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the context is {MAX_MODEL_LEN}" in caught.value.details()
    assert_close(list(embed(servicer, "after-refusal", PROMPTS["short"]).embedding), reference["short"], "after")
    assert "warm-up skipped: the engine runs a pooling model" in servicer.log()

"""End to end: ``POST /v1/embeddings`` → the real SMG router → ``enginelink serve`` → the sim engine as a pooling model.

The router tokenizes the input and calls Embed; the sim's vector is
``sim_embedding`` of those ids, so the client must get exactly it (as
float32). On a generation worker the same request fails without reaching
the engine, and chat on the pooling worker is refused the same way.
"""

from __future__ import annotations

import array

import pytest
from tokenizers import Tokenizer

from enginelink.machines.sim_core import sim_embedding
from tests.harness import Router, Servicer
from tests.router.openai_http import get, post

pytestmark = pytest.mark.router

DIM = 256  # the test model's hidden_size


@pytest.fixture(scope="module")
def pooling_stack(tmp_path_factory, test_model_dir):
    tmp = tmp_path_factory.mktemp("router-embed")
    servicer = Servicer(tmp, model_dir=test_model_dir, engine_args=["--runner", "pooling"]).start()
    try:
        router = Router(tmp, servicer.port, test_model_dir).start()
        try:
            status, models = get(router.url, "/v1/models")
            assert status == 200, models
            yield servicer, router, models["data"][0]["id"]
        finally:
            router.stop()
    finally:
        servicer.stop()


def test_embeddings_through_the_router_are_the_engines_vectors(pooling_stack, test_model_dir):
    servicer, router, model = pooling_stack
    tokenizer = Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))
    for text in ("def foo(x):", "hello world"):
        status, body = post(router.url, "/v1/embeddings", {"model": model, "input": text})
        assert status == 200, body
        (item,) = body["data"]
        ids = tokenizer.encode(text).ids
        # The router prints each float32 in its shortest form: equal as float32, bit for bit.
        assert array.array("f", item["embedding"]) == array.array("f", sim_embedding(ids, DIM))
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_chat_on_the_pooling_worker_is_refused(pooling_stack):
    servicer, router, model = pooling_stack
    status, body = post(router.url, "/v1/chat/completions",
                        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 501, body
    assert "pooling" in str(body)


def test_embeddings_on_a_generation_worker_are_a_501_naming_the_runner(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir).start()
    try:
        router = Router(tmp_path, servicer.port, test_model_dir).start()
        try:
            model = get(router.url, "/v1/models")[1]["data"][0]["id"]
            status, body = post(router.url, "/v1/embeddings", {"model": model, "input": "hello world"})
            assert status == 501, body
            assert "generation model" in str(body) and "--runner pooling" in str(body)
        finally:
            router.stop()
    finally:
        servicer.stop()

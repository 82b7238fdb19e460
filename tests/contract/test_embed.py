"""Embed as a client sees it, over the sim engine run as a pooling model (``--runner pooling``).

The sim's pooled vector is ``sim_embedding`` of the prompt, sent as float32
the way vLLM sends tensors (an aux frame: 256 floats are over vLLM's 256-byte
inline threshold), so a client must get exactly ``array("f", sim_embedding(...))``.
A generation engine refuses Embed and a pooling engine refuses Generate, both
UNIMPLEMENTED with a message naming the runner; bad input is INVALID_ARGUMENT
and never reaches the engine; an Embed call is journaled like a Generate,
without its vector.
"""

from __future__ import annotations

import array
import json
import threading

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.machines.sim_core import sim_embedding
from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    engine_request_ids,
    journal_rows,
    new_id,
    prompt,
    wait_idle,
    wait_journal,
)
from enginelink.journal.records import request_stream
from tests.harness import Servicer, engine_pid, frozen, generate_request, shared, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

DIM = 256  # the test model's hidden_size: the sim's default embedding length
MAX_MODEL_LEN = 512
# The sim sends a step's outputs and then waits out its cost: a full-context prompt's step
# costs about two seconds (4 ms per prompt token), so a call sent right after it waits that
# long in flight (``hold_next_step``), long enough to abort it or collide with it.
POOLING_ARGS = ["--runner", "pooling", "--max-model-len", str(MAX_MODEL_LEN), "--step-us", "5000",
                "--prefill-us-per-token", "10000"]


def in_flight(stub) -> int:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).active_requests


def hold_next_step(stub) -> None:
    """Make the engine's next step wait about five seconds (long enough on a loaded machine): one full-context Embed, answered at once."""
    wait_idle(stub)
    stub.Embed(embed_request(new_id("hold"), prompt(99, MAX_MODEL_LEN)), timeout=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def pooling(tmp_path_factory, test_model_dir):
    with shared(Servicer(tmp_path_factory.mktemp("pooling"), model_dir=test_model_dir, engine_args=POOLING_ARGS)) as running:
        yield running


def embed_request(request_id: str, input_ids: list[int]) -> pb.EmbedRequest:
    return pb.EmbedRequest(request_id=request_id, tokenized=pb.TokenizedInput(original_text="x", input_ids=input_ids))


def embed_error(stub, request: pb.EmbedRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(request, timeout=CALL_TIMEOUT_S)
    return caught.value


def float32(values) -> list[float]:
    return array.array("f", values).tolist()


def test_embed_returns_the_engines_pooled_vector(pooling):
    for seed, length in ((1, 8), (2, 1), (3, 100)):
        ids = prompt(seed, length)
        reply = pooling.stub.Embed(embed_request(new_id("emb"), ids), timeout=CALL_TIMEOUT_S)
        assert reply.embedding_dim == DIM == len(reply.embedding)
        assert reply.prompt_tokens == length
        assert list(reply.embedding) == float32(sim_embedding(ids, DIM))
        assert abs(sum(v * v for v in reply.embedding) - 1.0) < 1e-5  # normalised, as vLLM's embed default


def test_embeddings_differ_by_prompt_and_repeat_for_the_same_prompt(pooling):
    first = pooling.stub.Embed(embed_request(new_id("emb"), prompt(5)), timeout=CALL_TIMEOUT_S).embedding
    again = pooling.stub.Embed(embed_request(new_id("emb"), prompt(5)), timeout=CALL_TIMEOUT_S).embedding
    other = pooling.stub.Embed(embed_request(new_id("emb"), prompt(6)), timeout=CALL_TIMEOUT_S).embedding
    assert list(first) == list(again) != list(other)


def test_a_prompt_may_fill_the_whole_context(pooling):
    ids = prompt(7, MAX_MODEL_LEN)
    reply = pooling.stub.Embed(embed_request(new_id("full"), ids), timeout=CALL_TIMEOUT_S)
    assert reply.prompt_tokens == MAX_MODEL_LEN
    assert list(reply.embedding) == float32(sim_embedding(ids, DIM))


def test_concurrent_embeds_each_get_their_own_vector(pooling):
    ids = {new_id("conc"): prompt(seed, 4 + seed) for seed in range(12)}
    replies: dict[str, pb.EmbedResponse] = {}

    def one(request_id: str) -> None:
        replies[request_id] = pooling.stub.Embed(embed_request(request_id, ids[request_id]), timeout=CALL_TIMEOUT_S)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert sorted(replies) == sorted(ids)
    for request_id, reply in replies.items():
        assert list(reply.embedding) == float32(sim_embedding(ids[request_id], DIM)), request_id


def test_model_info_says_which_runner(pooling, servicer):
    info = pooling.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.is_generation is False
    assert servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S).is_generation is True


def test_generate_on_a_pooling_engine_is_unimplemented(pooling):
    request_id = new_id("gen")
    with pytest.raises(grpc.RpcError) as caught:
        list(pooling.stub.Generate(generate_request(request_id, prompt(1), max_tokens=4), timeout=CALL_TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "pooling" in caught.value.details() and "Generate" in caught.value.details()
    assert request_id not in engine_request_ids(pooling.journal)


def test_embed_on_a_generation_engine_is_unimplemented(servicer):
    request_id = new_id("emb")
    error = embed_error(servicer.stub, embed_request(request_id, prompt(1)))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "generation model" in error.details() and "--runner pooling" in error.details()
    assert request_id not in engine_request_ids(servicer.journal)


@pytest.mark.parametrize(
    "request_, field, words",
    [
        (pb.EmbedRequest(request_id="no-input"), "tokenized", "required"),
        (embed_request("empty", []), "tokenized.input_ids", "must not be empty"),
        (embed_request("oov", [5, 4096, 7]), "tokenized.input_ids", "token id 4096 at position 1 is outside"),
        (embed_request("oov-max", [2**32 - 1]), "tokenized.input_ids", "outside the vocabulary"),
        (embed_request("too-long", [5] * (MAX_MODEL_LEN + 1)), "tokenized.input_ids", f"the context is {MAX_MODEL_LEN}"),
        (embed_request("", [5, 6]), "request_id", ""),
        (embed_request("x" * 300, [5, 6]), "request_id", ""),
    ],
    ids=["no-tokenized", "empty", "out-of-vocab", "uint32-max", "too-long", "empty-id", "long-id"],
)
def test_bad_input_is_refused_before_the_engine(pooling, request_, field, words):
    request_id = request_.request_id + "-" + new_id("bad") if request_.request_id and len(request_.request_id) < 100 else request_.request_id
    request_.request_id = request_id
    error = embed_error(pooling.stub, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field + ":") and words in error.details()
    wait_journal(pooling.journal, lambda rows: any(r.kind == "error" and r.payload.get("code") == "INVALID_ARGUMENT"
                                                   for r in rows), "the refusal journaled")
    assert not request_id or request_id not in engine_request_ids(pooling.journal)


def test_a_duplicate_id_in_flight_is_already_exists(pooling):
    request_id = new_id("dup")
    ids = prompt(9)
    results: list = []

    def first() -> None:
        results.append(pooling.stub.Embed(embed_request(request_id, ids), timeout=CALL_TIMEOUT_S))

    hold_next_step(pooling.stub)
    thread = threading.Thread(target=first)
    thread.start()
    try:
        wait_until(lambda: in_flight(pooling.stub) == 1, 5.0, "the first call in flight", interval_s=0.005)
        error = embed_error(pooling.stub, embed_request(request_id, prompt(10)))
    finally:
        thread.join(CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert len(results) == 1 and list(results[0].embedding) == float32(sim_embedding(ids, DIM))


def test_abort_ends_an_embed_with_cancelled(pooling):
    request_id = new_id("abort")
    ids = prompt(11)
    errors: list = []

    def call() -> None:
        try:
            pooling.stub.Embed(embed_request(request_id, ids), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            errors.append(error)

    wait_idle(pooling.stub)
    thread = threading.Thread(target=call)
    # The engine stopped while the call is in flight, so it cannot answer before the abort however
    # loaded the machine is (a step held for ~5 s once did not last long enough in a full CI run).
    with frozen(engine_pid(pooling.journal)):
        thread.start()
        wait_until(lambda: in_flight(pooling.stub) == 1, 5.0, "the embed in flight", interval_s=0.005)
        pooling.stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=CALL_TIMEOUT_S)
        thread.join(CALL_TIMEOUT_S)
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.CANCELLED
    assert "aborted" in errors[0].details()
    wait_idle(pooling.stub)
    # The engine keeps serving.
    assert pooling.stub.Embed(embed_request(new_id("after"), prompt(12)), timeout=CALL_TIMEOUT_S).embedding_dim == DIM


def test_an_embed_is_journaled_like_a_generate_without_its_vector(pooling):
    request_id = new_id("journal")
    ids = prompt(13, 16)
    reply = pooling.stub.Embed(embed_request(request_id, ids), timeout=CALL_TIMEOUT_S)
    stream = request_stream(request_id)

    def ended(rows) -> bool:
        return any(r.stream == stream and r.kind == "client.sent" for r in rows)

    wait_journal(pooling.journal, ended, "the embed's end journaled")
    rows = [r for r in journal_rows(pooling.journal) if r.stream == stream]
    kinds = [r.kind for r in rows]
    assert kinds[0] == "client.generate" and rows[0].payload["task"] == "embed"
    assert rows[0].payload["prompt_tokens"] == 16
    states = [r.payload["dest"] for r in rows if r.kind == "transition"]
    assert states == ["running", "finished"]
    assert "engine.request" in kinds and kinds[-1] == "client.sent"
    assert rows[-1].payload["finish_reason"] == "stop"
    # Neither the vector's bytes nor its values are anywhere in the journal.
    vector = array.array("f", reply.embedding).tobytes()
    for row in journal_rows(pooling.journal):
        blob = row.payload if isinstance(row.payload, bytes) else json.dumps(row.payload, default=str).encode()
        assert vector[:64] not in blob, row.kind
        assert repr(reply.embedding[0]) not in blob.decode("latin-1"), row.kind

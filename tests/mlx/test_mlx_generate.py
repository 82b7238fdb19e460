"""Generate over the ``MlxEngine`` contract against a real mlx-lm engine, compared with mlx-lm on its own.

The reference is mlx-lm's own ``generate_step`` (what ``mlx_lm.generate``
runs) on the same model, in a subprocess of the MLX venv (``offline_mlx.py``).
Greedy output must be token-for-token equal, logprobs within 1e-4. Sampled
output is checked for what a per-request random key promises: the same seed
gives the same tokens whatever else is batched beside it.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import mlx_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.journal.records import KIND_CLIENT_ABORT, KIND_CLIENT_SENT
from enginelink.journal.store import open_reader
from tests.harness import wait_until
from tests.mlx.conftest import mlx_request as generate_request

pytestmark = pytest.mark.mlx

TEXTS = {"def": "def foo(x):", "import": "import os\n", "class": "class Foo:\n    def", "hello": "hello world"}
GREEDY_TOKENS = 24
CONTEXT = 2048  # the test model's max_position_embeddings
VOCAB = 4096
ATTEMPTS = 3


@pytest.fixture(scope="module")
def tokenizer(test_model_dir):
    return Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {name: tokenizer.encode(text).ids for name, text in TEXTS.items()}


@pytest.fixture(scope="module")
def greedy(mlx_stack, prompts):
    """mlx-lm's own greedy outputs for every prompt."""
    _, offline = mlx_stack
    return offline.run([{"id": name, "prompt_token_ids": ids, "max_tokens": GREEDY_TOKENS}
                        for name, ids in prompts.items()])  # fmt: skip


def generate(servicer, request_id: str, prompt_ids: list[int], *, stream: bool, **sampling) -> dict:
    """{"token_ids", "finish_reason", "matched", "logprobs"} of one Generate, read as the router reads MLX.

    Checks the contract's shapes on the way (reference/mlx.md §3.4): streamed, one chunk per token
    with running counts, then a complete with no tokens and the total; unary, one complete.
    """
    replies = list(servicer.stub.Generate(generate_request(request_id, prompt_ids, stream=stream, **sampling),
                                          timeout=120))
    *chunks, last = replies
    assert last.WhichOneof("response") == "complete" and all(r.WhichOneof("response") == "chunk" for r in chunks)
    c = last.complete
    choice: dict = {"token_ids": [], "logprobs": []}
    if stream:
        for count, reply in enumerate(chunks, 1):
            assert len(reply.chunk.token_ids) == 1 and reply.chunk.completion_tokens == count
            assert reply.chunk.prompt_tokens == len(prompt_ids)
            choice["token_ids"] += list(reply.chunk.token_ids)
            choice["logprobs"] += _rows(reply.chunk.output_logprobs)
        assert list(c.output_ids) == [] and not c.output_logprobs.token_ids
    else:
        assert chunks == []
        choice["token_ids"] = list(c.output_ids)
        choice["logprobs"] = _rows(c.output_logprobs)
    assert c.completion_tokens == len(choice["token_ids"]) and c.prompt_tokens == len(prompt_ids)
    choice["finish_reason"] = c.finish_reason
    choice["matched"] = c.matched_stop_token_id if c.HasField("matched_stop_token_id") else None
    return choice


def _rows(lp) -> list:
    return [(token, value, dict(zip(top.token_ids, top.values)))
            for token, value, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs)]


def running_requests(servicer) -> int:
    return servicer.engine_running()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_greedy_output_equals_mlx_lm(mlx_stack, prompts, greedy, stream):
    servicer, _ = mlx_stack
    for name, ids in prompts.items():
        mine = generate(servicer, f"greedy-{name}-{stream}", ids, stream=stream, temperature=0.0,
                        max_tokens=GREEDY_TOKENS)
        assert mine["token_ids"] == greedy[name]["token_ids"], name
        assert mine["finish_reason"] == greedy[name]["finish_reason"], name
    # The comparison means something only if the output depends on the prompt and moves.
    outputs = [tuple(greedy[name]["token_ids"]) for name in prompts]
    assert len(set(outputs)) == len(outputs)
    assert all(len(set(out)) > 4 for out in outputs)


def test_concurrent_greedy_streams_each_equal_mlx_lm(mlx_stack, prompts, greedy):
    servicer, _ = mlx_stack
    results: dict[str, dict] = {}

    def one(name: str) -> None:
        results[name] = generate(servicer, f"conc-{name}", prompts[name], stream=True, temperature=0.0,
                                 max_tokens=GREEDY_TOKENS)

    threads = [threading.Thread(target=one, args=(name,)) for name in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name in prompts:
        assert results[name]["token_ids"] == greedy[name]["token_ids"], name


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_logprobs_equal_mlx_lm_within_1e_4(mlx_stack, prompts, stream):
    servicer, offline = mlx_stack
    k = 5
    theirs = offline.run([{"id": "lp", "prompt_token_ids": prompts["class"], "max_tokens": 12, "logprobs": k}])["lp"]
    mine = generate(servicer, f"lp-{stream}", prompts["class"], stream=stream, temperature=0.0, max_tokens=12,
                    logprobs=k)
    assert mine["token_ids"] == theirs["token_ids"]
    assert len(mine["logprobs"]) == len(theirs["token_ids"])
    for position, ((token, value, top), (their_value, their_top)) in enumerate(zip(mine["logprobs"],
                                                                                   theirs["logprobs"])):
        assert token == theirs["token_ids"][position]
        assert abs(value - their_value) <= 1e-4, position
        assert len(top) == k
        mine_sorted = sorted(top.values(), reverse=True)
        theirs_sorted = sorted(their_top.values(), reverse=True)
        assert all(abs(a - b) <= 1e-4 for a, b in zip(mine_sorted, theirs_sorted)), position
        # bf16 logprobs tie often: ids strictly above the k-th value must be the same ids, same values.
        boundary = theirs_sorted[-1]
        for token_id, lp in top.items():
            if lp > boundary + 1e-4:
                assert abs(their_top[str(token_id)] - lp) <= 1e-4, (position, token_id)


def test_seeded_sampling_is_repeatable_through_the_servicer(mlx_stack, prompts):
    servicer, _ = mlx_stack
    sampling = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
    # Alone, after the greedy tests: mlx-lm 0.31.3 once sampled this with a stale greedy sampler.
    alone = generate(servicer, "seed-alone", prompts["def"], stream=False, seed=7, **sampling)["token_ids"]
    again = generate(servicer, "seed-again", prompts["def"], stream=False, seed=7, **sampling)["token_ids"]
    other_seed = generate(servicer, "seed-other", prompts["def"], stream=False, seed=8, **sampling)["token_ids"]
    assert alone == again
    assert alone != other_seed  # the seed decides the draw


def test_seeded_draws_in_the_core_do_not_depend_on_the_batch(mlx_python, test_model_dir):
    # In the core, where the batch is under control (through the servicer, when a call joins the
    # running batch is timing).
    done = subprocess.run([mlx_python, str(Path(__file__).with_name("core_seeds.py")), str(test_model_dir)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    alone, together = report["alone"], report["together"]
    assert len(alone) == 24
    assert together["a"] == together["b"] == together["c"] == alone  # each copy draws from its own key
    assert together["x"] != alone and together["u"] != alone  # another seed, no seed: other draws
    assert report["after_greedy"] == alone
    assert report["joined_during_prefill"] == alone  # the cache stays bf16 (tools/mlx_core.py, extend)


def test_a_burst_spread_over_the_wire_joins_the_batch_together(mlx_python, test_model_dir):
    # Four requests 1 ms apart with the engine stepping between them: held until the burst stops
    # (5 ms without a request), they get their first token in the same engine step; admitted one by
    # one (--coalesce-max-ms 0, mlx-lm's own way) each ran a step apart. The tokens are the same.
    done = subprocess.run([mlx_python, str(Path(__file__).with_name("core_burst.py")), str(test_model_dir)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    burst, each = report["burst"], report["each_at_once"]
    assert len(set(burst["first_step"].values())) == 1
    assert sorted(each["first_step"].values()) == [each["first_step"][f"r{i}"] for i in range(4)]
    assert len(set(each["first_step"].values())) == 4
    assert burst["tokens"] == each["tokens"] and all(len(t) == 6 for t in burst["tokens"].values())
    # A held request aborted: gone from the engine at once; the other four still wait, none running.
    assert burst["held_stats"] == [0, 4]
    assert burst["wait_before_s"] == pytest.approx(0.005)
    # Joining a prompt part-way through its prefill made mlx-lm 0.31.3's cache float32 for good (its
    # extend pads with a float32 empty array): the caches keep the model's dtype, whichever way they joined.
    assert burst["cache_dtypes"] == each["cache_dtypes"] == [burst["model_dtype"]] == ["mlx.core.bfloat16"]


def test_stop_token_ids_end_the_output_with_the_stop_token(mlx_stack, prompts, greedy):
    servicer, _ = mlx_stack
    ids = greedy["def"]["token_ids"]
    stop_id = ids[5]
    cut = ids.index(stop_id) + 1  # its first appearance
    for stream in (False, True):
        mine = generate(servicer, f"stop-id-{stream}", prompts["def"], stream=stream, temperature=0.0,
                        max_tokens=GREEDY_TOKENS, stop_token_ids=[stop_id])
        assert mine["token_ids"] == ids[:cut]
        assert mine["finish_reason"] == "stop" and mine["matched"] == stop_id


def test_the_context_limit_is_enforced(mlx_stack):
    servicer, _ = mlx_stack
    prompt = [5 + (i % 1000) for i in range(CONTEXT - 6)]
    mine = generate(servicer, "to-the-edge", prompt, stream=False, temperature=0.0, ignore_eos=True)
    assert mine["finish_reason"] == "length"
    assert len(mine["token_ids"]) == 6  # exactly the rest of the context, no token past it


@pytest.mark.parametrize("case, sampling, field", [
    ("empty prompt", {"input_ids": []}, "input_ids"),
    ("id past the vocabulary", {"input_ids": [1, VOCAB]}, "input_ids"),
    ("huge id", {"input_ids": [999999]}, "input_ids"),
    ("prompt fills the context", {"input_ids": [7] * CONTEXT}, "context"),
    ("max_tokens past the context", {"input_ids": [7] * 10, "max_tokens": CONTEXT}, "max_tokens"),
    ("logprobs above the vocabulary", {"input_ids": [7] * 10, "logprobs": VOCAB + 1}, "logprobs"),
    ("stop id past the vocabulary", {"input_ids": [7] * 10, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
])
def test_refused_before_the_engine(mlx_stack, case, sampling, field):
    servicer, _ = mlx_stack
    sampling = dict(sampling)
    ids = sampling.pop("input_ids")
    with pytest.raises(grpc.RpcError) as refused:
        list(servicer.stub.Generate(generate_request(f"bad-{case}", ids, temperature=0.0, **sampling), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert field in refused.value.details(), refused.value.details()
    # The engine never saw it and still serves (the reference segfaulted or spun here).
    again = generate(servicer, f"after-{case}", [7, 8, 9], stream=False, temperature=0.0, max_tokens=2)
    assert again["finish_reason"] == "length"


def _long_stream(servicer, request_id: str, prompt_ids: list[int]):
    request = generate_request(request_id, prompt_ids, stream=True, temperature=0.0, ignore_eos=True,
                               max_tokens=CONTEXT - len(prompt_ids))
    return servicer.stub.Generate(request, timeout=120)


def test_a_duplicate_id_in_flight_is_refused(mlx_stack, prompts):
    servicer, _ = mlx_stack
    call = _long_stream(servicer, "twice", prompts["def"])
    assert next(call).WhichOneof("response") == "chunk"
    with pytest.raises(grpc.RpcError) as refused:
        list(servicer.stub.Generate(generate_request("twice", prompts["def"], max_tokens=2), timeout=30))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "twice" in refused.value.details()
    servicer.stub.Abort(pb.AbortRequest(request_ids=["twice"]), timeout=30)
    list(call)


def _engine_idle(servicer) -> None:
    wait_until(lambda: running_requests(servicer) == 0, 30, "the engine's stats show no request running",
               interval_s=0.02)


def test_abort_mid_stream_ends_with_an_abort_complete_and_frees_the_engine(mlx_stack, prompts):
    servicer, _ = mlx_stack
    for attempt in range(ATTEMPTS):
        request_id = f"to-abort-{attempt}"
        call = _long_stream(servicer, request_id, prompts["import"])
        first = next(call)
        assert first.WhichOneof("response") == "chunk"
        servicer.stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=30)
        rest = list(call)
        completes = [r.complete for r in rest if r.WhichOneof("response") == "complete"]
        assert len(completes) == 1, rest[-3:]
        if completes[0].finish_reason == "length":
            continue  # it finished before the abort landed: try again
        assert completes[0].finish_reason == "abort"
        _engine_idle(servicer)
        return
    pytest.fail(f"every one of {ATTEMPTS} requests finished before its abort landed")


def _aborted_in_engine(servicer, request_id: str, reason: str) -> bool:
    def flushed():
        records = open_reader(servicer.journal).records(kinds=[KIND_CLIENT_ABORT, KIND_CLIENT_SENT])
        return [r for r in records if r.stream == f"req/{request_id}"] or None

    records = wait_until(flushed, 10, f"{request_id}'s end in the journal")
    return any(r.kind == KIND_CLIENT_ABORT and r.payload["reason"] == reason for r in records)


def test_client_disconnect_frees_the_engine(mlx_stack, prompts):
    servicer, _ = mlx_stack
    for attempt in range(ATTEMPTS):
        request_id = f"to-drop-{attempt}"
        call = _long_stream(servicer, request_id, prompts["hello"])
        assert next(call).WhichOneof("response") == "chunk"
        call.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        _engine_idle(servicer)
        if _aborted_in_engine(servicer, request_id, "client_gone"):
            break
    else:
        pytest.fail(f"every one of {ATTEMPTS} requests finished before the client hung up")
    again = generate(servicer, "after-drop", prompts["hello"], stream=False, temperature=0.0, max_tokens=4)
    assert again["finish_reason"] == "length"

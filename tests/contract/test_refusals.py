"""Bad input is refused before the engine sees it, and never disturbs other requests.

Each bad request must end with INVALID_ARGUMENT (ALREADY_EXISTS for an id in
flight) and a message naming the field; the journal must show the refusal and
no ADD sent to the engine for it; requests running across the refusals must
finish exactly as they would have alone.
"""

from __future__ import annotations

import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    Outcome,
    call,
    engine_request_ids,
    journal_rows,
    new_id,
    outcome_or_error,
    prompt,
    refusal,
    wait_idle,
    wait_journal,
)
from tests.harness import generate_request

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

CONTEXT = 2048


def _sampling(rid: str, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return generate_request(rid, [5, 6, 7], **sampling)


def _no_input(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, sampling_params=pb.SamplingParams(max_tokens=4))


def _text(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, text="hello", sampling_params=pb.SamplingParams(max_tokens=4))


def _empty_choice(rid: str) -> pb.GenerateRequest:
    request = _sampling(rid)
    request.sampling_params.choice.SetInParent()
    return request


def _with(rid: str, **fields) -> pb.GenerateRequest:
    """A valid request with top-level fields set (PD params, a DP rank pin)."""
    request = _sampling(rid)
    for name, value in fields.items():
        if name == "legacy_kv":
            request.kv_transfer_params.CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


@dataclass(frozen=True)
class Bad:
    name: str
    build: Callable[[str], pb.GenerateRequest]
    field: str  # a regex the message must match: it names the field


BAD = [
    Bad("empty-request-id", lambda rid: _sampling(""), r"request_id"),
    Bad("no-input", _no_input, r"input"),
    Bad("text-input", _text, r"\btext\b"),
    Bad("empty-prompt", lambda rid: generate_request(rid, [], max_tokens=4), r"input_ids"),
    Bad("token-id-outside-vocab", lambda rid: generate_request(rid, [5, 4096], max_tokens=4), r"input_ids"),
    Bad("prompt-fills-context", lambda rid: generate_request(rid, prompt(1, CONTEXT)), r"input_ids"),
    Bad("max-tokens-cannot-fit",
        lambda rid: generate_request(rid, prompt(2, CONTEXT - 8), max_tokens=9), r"max_tokens"),
    Bad("max-tokens-zero", lambda rid: _sampling(rid, max_tokens=0), r"max_tokens"),
    Bad("temperature-nan", lambda rid: _sampling(rid, temperature=math.nan), r"temperature"),
    Bad("temperature-negative", lambda rid: _sampling(rid, temperature=-0.5), r"temperature"),
    Bad("top-p-above-1", lambda rid: _sampling(rid, top_p=1.5), r"top_p"),
    Bad("top-p-negative", lambda rid: _sampling(rid, top_p=-0.1), r"top_p"),
    Bad("top-k-negative", lambda rid: _sampling(rid, top_k=2**32 - 1), r"top_k"),
    Bad("n-1000", lambda rid: _sampling(rid, n=1000), r"\bn\b"),
    Bad("empty-stop-string", lambda rid: _sampling(rid, stop=["ok", ""]), r"\bstop\b"),
    Bad("stop-token-outside-vocab", lambda rid: _sampling(rid, stop_token_ids=[5000]), r"stop_token_ids"),
    Bad("malformed-json-schema", lambda rid: _sampling(rid, json_schema="{not json"), r"json_schema"),
    Bad("empty-regex", lambda rid: _sampling(rid, regex=""), r"regex"),
    Bad("choice-without-choices", _empty_choice, r"choice"),
    Bad("kv-transfer-params-not-an-object", lambda rid: _with(rid, kv_transfer_params_json="[1, 2]"),
        r"kv_transfer_params_json"),
    Bad("kv-transfer-params-not-json", lambda rid: _with(rid, kv_transfer_params_json="{not json"),
        r"kv_transfer_params_json"),
    Bad("legacy-kv-transfer-params-without-host",
        lambda rid: _with(rid, legacy_kv=pb.KvTransferParams(remote_port=7000)), r"kv_transfer_params"),
    Bad("dp-rank-out-of-range", lambda rid: _with(rid, data_parallel_rank=1),
        r"data_parallel_rank 1 is out of range \[0, 1\)"),
    Bad("logprobs-negative", lambda rid: _sampling(rid, logprobs=-2), r"\blogprobs"),
    Bad("prompt-logprobs-huge", lambda rid: _sampling(rid, prompt_logprobs=2**31 - 1), r"prompt_logprobs"),
    Bad("json-schema-not-an-object", lambda rid: _sampling(rid, json_schema="[1, 2]"), r"json_schema"),
    Bad("json-object-false", lambda rid: _sampling(rid, json_object=False), r"json_object"),
    Bad("blank-grammar", lambda rid: _sampling(rid, grammar=" \n\t"), r"grammar"),
    Bad("blank-structural-tag", lambda rid: _sampling(rid, structural_tag="  "), r"structural_tag"),
    Bad("regex-with-nul", lambda rid: _sampling(rid, regex="a\x00b"), r"regex"),
    Bad("logit-bias-outside-vocab", lambda rid: _sampling(rid, logit_bias={4096: 1.0}), r"logit_bias.*4096"),
    Bad("logit-bias-negative-id", lambda rid: _sampling(rid, logit_bias={-1: 1.0}), r"logit_bias"),
    Bad("logit-bias-above-100", lambda rid: _sampling(rid, logit_bias={5: 150.0}), r"logit_bias"),
    Bad("logit-bias-nan", lambda rid: _sampling(rid, logit_bias={5: math.nan}), r"logit_bias"),
    Bad("truncate-below-minus-1", lambda rid: _sampling(rid, truncate_prompt_tokens=-2), r"truncate_prompt_tokens"),
    Bad("truncate-beyond-context",
        lambda rid: _sampling(rid, truncate_prompt_tokens=CONTEXT + 1), r"truncate_prompt_tokens.*cannot be greater"),
]


@dataclass
class Run:
    refused: dict[str, tuple[str, grpc.RpcError | Outcome]]  # case name -> (request id, what came back)
    bystander_id: str
    streamed: Outcome
    full: Outcome
    chunks_after_refusals: int


# 2 s on the slow engine: the ~20 refusals take a few tens of ms, so they fall inside it.
BYSTANDER_TOKENS = 100


@pytest.fixture(scope="module")
def refusal_run(slow_servicer) -> Run:
    """Send every bad request while two valid ones (streaming and not) are running."""
    stub = slow_servicer.stub
    bystander_id = new_id("bystander")
    ids = prompt(42, 20)
    started = threading.Event()
    chunk_times: list[float] = []

    def streaming() -> Outcome:
        request = generate_request(bystander_id, ids, stream=True, temperature=0.0,
                                   max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
        messages = []
        for message in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            messages.append(message)
            chunk_times.append(time.monotonic())
            started.set()
        return Outcome(messages)

    def full() -> Outcome:
        return call(stub, generate_request(new_id("bystander-full"), ids, temperature=0.0,
                                           max_tokens=BYSTANDER_TOKENS, ignore_eos=True))

    with ThreadPoolExecutor(2) as pool:
        streamed_f = pool.submit(streaming)
        full_f = pool.submit(full)
        assert started.wait(CALL_TIMEOUT_S), "the bystander never streamed"
        refused = {}
        for bad in BAD:
            rid = new_id(bad.name)
            refused[bad.name] = (rid, outcome_or_error(stub, bad.build(rid)))
        refusals_done = time.monotonic()
        streamed, full_outcome = streamed_f.result(CALL_TIMEOUT_S), full_f.result(CALL_TIMEOUT_S)
    return Run(refused, bystander_id, streamed, full_outcome, sum(t > refusals_done for t in chunk_times))


def _request_id_of(name: str, rid: str) -> str:
    return "" if name == "empty-request-id" else rid


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(refusal_run, bad):
    _, error = refusal_run.refused[bad.name]
    assert isinstance(error, grpc.RpcError), f"served instead of refused: {error.messages}"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert re.search(bad.field, error.details()), f"{error.details()!r} does not name {bad.field!r}"


def test_refused_requests_never_reach_the_engine(refusal_run, slow_servicer):
    refused_ids = {_request_id_of(name, rid) for name, (rid, _) in refusal_run.refused.items()}
    answered_with_error = {_request_id_of(name, rid) for name, (rid, result) in refusal_run.refused.items()
                           if isinstance(result, grpc.RpcError)}

    def all_journaled(rows) -> bool:
        errors = {row.payload.get("id") for row in rows if row.kind == "error"}
        sent = {row.payload["request_id"] for row in rows if row.kind == "client.sent"}
        return answered_with_error <= errors and refusal_run.bystander_id in sent

    wait_journal(slow_servicer.journal, all_journaled, "refusals and the bystander journaled")
    errors = [row.payload for row in journal_rows(slow_servicer.journal, ("error",))]
    for rid in answered_with_error:
        mine = [e for e in errors if e.get("id") == rid]
        assert len(mine) == 1 and mine[0]["code"] == "INVALID_ARGUMENT" and mine[0]["whose"] == "client", mine
    engine_ids = engine_request_ids(slow_servicer.journal)
    assert refusal_run.bystander_id in engine_ids, "the journal shows what the engine was sent"
    for rid in refused_ids:
        leaked = [e for e in engine_ids if e == rid or e.startswith(f"{rid}#")]
        assert not leaked, f"refused request {rid!r} reached the engine as {leaked}"
    generates = {row.payload["request_id"] for row in journal_rows(slow_servicer.journal, ("client.generate",))}
    assert not (generates & refused_ids), "a refused request was admitted"


def test_requests_running_across_refusals_are_unaffected(refusal_run, slow_servicer):
    assert refusal_run.chunks_after_refusals > 0, "the bystander did not run across the refusals"
    streamed, full = refusal_run.streamed, refusal_run.full
    assert streamed.complete(0).finish_reason == "length"
    assert full.complete(0).finish_reason == "length"
    assert len(streamed.streamed(0)) == BYSTANDER_TOKENS
    assert streamed.streamed(0) == list(full.complete(0).output_ids)
    wait_idle(slow_servicer.stub)


def _stream_until_first_chunk(stub, request):
    stream = stub.Generate(request, timeout=CALL_TIMEOUT_S)
    first = next(stream)
    return stream, [first]


def test_duplicate_in_flight_id_is_already_exists(slow_servicer):
    stub = slow_servicer.stub
    rid = new_id("dup")
    ids = prompt(43, 10)
    stream, messages = _stream_until_first_chunk(
        stub, generate_request(rid, ids, stream=True, temperature=0.0, max_tokens=60, ignore_eos=True))
    for duplicate in (generate_request(rid, [5, 6], max_tokens=2),
                      generate_request(rid, [5, 6], stream=True, max_tokens=2)):
        error = refusal(stub, duplicate)
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error.details()
        assert rid in error.details()
    messages += list(stream)
    original = Outcome(messages)
    assert original.complete(0).finish_reason == "length"
    assert len(original.streamed(0)) == 60
    wait_journal(slow_servicer.journal,
                 lambda rows: sum(r.kind == "error" and r.payload.get("id") == rid for r in rows) == 2,
                 "the duplicate refusals journaled")
    errors = [r.payload for r in journal_rows(slow_servicer.journal, ("error",)) if r.payload.get("id") == rid]
    assert [e["code"] for e in errors] == ["ALREADY_EXISTS", "ALREADY_EXISTS"]
    assert engine_request_ids(slow_servicer.journal).count(rid) == 1, "the duplicates reached the engine"
    # Once it has ended the id is free again.
    again = call(stub, generate_request(rid, ids, temperature=0.0, max_tokens=3, ignore_eos=True))
    assert list(again.complete(0).output_ids) == original.streamed(0)[:3]


def test_id_colliding_with_an_n2_choice_is_refused(slow_servicer):
    stub = slow_servicer.stub
    rid = new_id("col")
    stream, messages = _stream_until_first_chunk(
        stub, generate_request(rid, prompt(44), stream=True, n=2, temperature=1.0, max_tokens=40, ignore_eos=True))
    error = refusal(stub, generate_request(f"{rid}#1", [5, 6], max_tokens=2))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error.details()
    original = Outcome(messages + list(stream))
    for index in (0, 1):
        assert original.complete(index).finish_reason == "length"
        assert len(original.streamed(index)) == 40
    rows = journal_rows(slow_servicer.journal, ("engine.request",))
    assert not [r for r in rows if r.stream == f"req/{rid}#1"], "the colliding request reached the engine"

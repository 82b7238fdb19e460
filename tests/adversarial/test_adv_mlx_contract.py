"""Attacks on the MLX contract's edge: nothing the engine cannot serve gets past it, nothing it sends lies.

The reference MLX servicer spun forever on an empty prompt and segfaulted on
an out-of-vocabulary id (reference/mlx.md §3.1). The properties, each
attacked more than one way:

1. Whatever a client puts in an ``mlx_engine_pb2.GenerateRequest``, the edge
   either refuses it as the client's error (ClientError, INVALID_ARGUMENT,
   naming a field) or builds an engine request the engine can serve: a
   non-empty prompt inside the vocabulary, room in the context for every
   token it may generate, logprobs within the engine's cap. Attacked with
   random requests (hypothesis), with raw bytes decoded as a request, and
   with the boundary values one by one.
2. What the client reads adds up: the chunks of a streamed call carry one
   token each and running counts that end at the complete's total, however
   the core split the tokens into chunks (a writer that fell behind).
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings, strategies as st
from smg_grpc_proto.generated import mlx_engine_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.mlx.edge import encode, validate_generate
from enginelink.runtime.requests.validate import EngineLimits

CONTEXT, VOCAB, CAP = 32, 50, 20
LIMITS = EngineLimits(max_model_len=CONTEXT, vocab_size=VOCAB, eos_token_ids=(2,), max_logprobs=CAP)
FIELDS = {"request_id", "text", "tokenized", "tokenized.input_ids", "sampling_params.max_tokens",
          "sampling_params.logprobs", "sampling_params.stop_token_ids", "sampling_params.logit_bias",
          "sampling_params.temperature", "sampling_params.top_p", "sampling_params.top_k", "sampling_params.min_p",
          "sampling_params.frequency_penalty", "sampling_params.presence_penalty",
          "sampling_params.repetition_penalty"}  # fmt: skip

ids = st.lists(st.one_of(st.integers(0, VOCAB + 2), st.integers(0, 2**32 - 1)), max_size=CONTEXT + 3)
floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32))


def _assert_servable_or_refused(request: pb.GenerateRequest) -> None:
    try:
        call = validate_generate(request, LIMITS, 0.0)
    except ClientError as error:
        assert error.field in FIELDS, error.field
        return
    (spec,) = call.specs
    prompt, s = spec.prompt_token_ids, spec.sampling
    assert prompt and all(0 <= t < VOCAB for t in prompt)
    assert 1 <= s.max_tokens <= CONTEXT - len(prompt)
    assert s.logprobs is None or 1 <= s.logprobs <= CAP
    assert all(0 <= t < VOCAB for t in s.stop_token_ids)
    assert all(0 <= t < VOCAB for t in (s.logit_bias or {}))
    assert s.temperature >= 0 and 0 < s.top_p <= 1 and 0 <= s.min_p <= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=ids, max_tokens=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       logprobs=st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), stops=ids,
       bias=st.dictionaries(st.integers(-(2**31), 2**31 - 1), st.floats(width=32), max_size=3),
       temperature=floats, top_p=floats, min_p=floats)  # fmt: skip
def test_random_requests_are_refused_or_servable(prompt, max_tokens, logprobs, stops, bias, temperature, top_p, min_p):
    sampling = pb.SamplingParams(stop_token_ids=stops, logit_bias=bias)
    for name, value in (("max_tokens", max_tokens), ("logprobs", logprobs), ("temperature", temperature),
                        ("top_p", top_p), ("min_p", min_p)):
        if value is not None:
            setattr(sampling, name, value)
    _assert_servable_or_refused(pb.GenerateRequest(request_id="a", tokenized=pb.TokenizedInput(input_ids=prompt),
                                                   sampling_params=sampling))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_raw_bytes_decoded_as_a_request_are_refused_or_servable(data):
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError:
        return  # grpclib answers an undecodable message itself
    _assert_servable_or_refused(request)


@pytest.mark.parametrize("prompt, sampling, servable", [
    ([VOCAB - 1] * (CONTEXT - 1), {}, True),  # the longest prompt: one token of room
    ([VOCAB - 1] * CONTEXT, {}, False),
    ([1], {"max_tokens": CONTEXT - 1}, True),
    ([1], {"max_tokens": CONTEXT}, False),
    ([1], {"logprobs": CAP}, True),
    ([1], {"logprobs": CAP + 1}, False),
    ([VOCAB], {}, False),
    ([2**32 - 1], {}, False),
    ([], {}, False),
], ids=["prompt one short", "prompt at the context", "max_tokens to the edge", "max_tokens past it",
        "logprobs at the cap", "logprobs past it", "id at the vocabulary", "largest uint32 id", "empty"])  # fmt: skip
def test_the_boundaries_one_by_one(prompt, sampling, servable):
    request = pb.GenerateRequest(request_id="b", tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(**sampling))
    if servable:
        validate_generate(request, LIMITS, 0.0)
    else:
        with pytest.raises(ClientError):
            validate_generate(request, LIMITS, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_streamed_counts_add_up_however_the_tokens_were_chunked(sizes):
    messages, sent, token = [], 0, 10
    for size in sizes:
        sent += size
        messages.append(Chunk(0, list(range(token, token + size)), 4, 0, completion_tokens=sent))
        token += size
    messages.append(Complete(0, [], "length", 4, 0, stream=True, completion_tokens=sent))
    replies = encode(messages)
    chunks = [r.chunk for r in replies[:-1]]
    assert all(len(c.token_ids) == 1 for c in chunks)
    assert [c.completion_tokens for c in chunks] == list(range(1, sent + 1))
    assert [c.token_ids[0] for c in chunks] == list(range(10, 10 + sent))
    complete = replies[-1].complete
    assert complete.completion_tokens == sent and list(complete.output_ids) == []

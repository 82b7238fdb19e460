"""The MLX contract's edge without an engine: what it refuses, what it asks the engine, what the client gets.

``runtime/contracts/mlx/edge.py`` turns an ``mlx_engine_pb2.GenerateRequest``
into the core's call and the core's messages into MLX's responses. The real
engine behind it is tests/mlx's; these pin the shapes the router reads
(reference/mlx.md §3.4) and the refusals the reference servicer lacked.
"""

from __future__ import annotations

import array

import pytest
from grpclib.const import Status
from smg_grpc_proto.generated import mlx_engine_pb2 as pb

from enginelink.machines.logprobs import LogprobRun
from enginelink.machines.request_api import Chunk, Complete
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.mlx.edge import MLX_EDGE, encode, validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.runtime.contracts.mlx.service import MlxEngineService

LIMITS = EngineLimits(max_model_len=64, vocab_size=100, eos_token_ids=(2,), max_logprobs=20)


def request(ids=(5, 6, 7), *, stream=False, request_id="r", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=list(ids)),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream)


def refused(req: pb.GenerateRequest) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate_generate(req, LIMITS, 0.0)
    assert error.value.status is Status.INVALID_ARGUMENT
    return error.value


@pytest.mark.parametrize("req, field, words", [
    (request([]), "tokenized.input_ids", "must not be empty"),
    (request([5, 100]), "tokenized.input_ids", "token id 100 at position 1 is outside the vocabulary"),
    (request([999999]), "tokenized.input_ids", "outside the vocabulary"),
    (request([5] * 64), "tokenized.input_ids", "leaves no room for output"),
    (request([5] * 10, max_tokens=55), "sampling_params.max_tokens", "so at most 54"),
    (request(max_tokens=0), "sampling_params.max_tokens", "at least 1"),
    (request(logprobs=21), "sampling_params.logprobs", "greater than max allowed: 20"),
    (request(stop_token_ids=[100]), "sampling_params.stop_token_ids", "outside the vocabulary"),
    (request(logit_bias={-1: 1.0}), "sampling_params.logit_bias", "outside the vocabulary"),
    (request(temperature=-1.0), "sampling_params.temperature", ">= 0"),
    (request(temperature=float("nan")), "sampling_params.temperature", "finite"),
    (request(top_p=1.5), "sampling_params.top_p", "(0, 1]"),
    (pb.GenerateRequest(request_id="r", text="hello"), "text", "send tokenized.input_ids"),
    (pb.GenerateRequest(request_id="r"), "tokenized", "an input is required"),
    (request(request_id=""), "request_id", ""),
], ids=["empty prompt", "id at the vocabulary", "huge id", "prompt fills the context", "max_tokens past the context",
        "max_tokens 0", "logprobs above the cap", "stop id outside", "bias key outside", "negative temperature",
        "nan temperature", "top_p above 1", "text input", "no input", "empty id"])  # fmt: skip
def test_refusals_name_the_field_before_the_engine(req, field, words):
    error = refused(req)
    assert error.field == field
    assert words in str(error)


def test_logprobs_cap_is_the_vocabulary_when_the_engine_serves_all():
    limits = EngineLimits(max_model_len=64, vocab_size=100, eos_token_ids=(2,), max_logprobs=-1)
    assert validate_generate(request(logprobs=100), limits, 0.0).specs[0].sampling.logprobs == 100
    with pytest.raises(ClientError, match="greater than max allowed: 100"):
        validate_generate(request(logprobs=101), limits, 0.0)


def test_defaults_follow_the_reference_servicer():
    call = validate_generate(request([5, 6, 7]), LIMITS, 1.5)
    (spec,) = call.specs
    s = spec.sampling
    assert (call.request_id, call.engine_ids, call.stream, call.prompt_token_ids) == ("r", ["r"], False, [5, 6, 7])
    assert s.max_tokens == call.max_tokens == 61  # the rest of the context
    assert s.temperature == 1.0 and s.top_p == 1.0 and s.repetition_penalty == 1.0  # unset / 0: off
    assert s.logprobs is None and s.seed is None and s.eos_token_ids == (2,) and not s.ignore_eos
    assert call.stop_strings == ()  # MLX has no stop strings: the router refuses them
    assert spec.arrival_time == 1.5


def test_fields_reach_the_engine_request():
    call = validate_generate(request(temperature=0.0, max_tokens=9, stop_token_ids=[11, 12], ignore_eos=True,
                                     logprobs=3, seed=-7, logit_bias={4: 2.5}, top_k=5, min_p=0.1),
                             LIMITS, 0.0)  # fmt: skip
    s = call.specs[0].sampling
    assert (s.temperature, s.max_tokens, s.stop_token_ids, s.ignore_eos) == (0.0, 9, (11, 12), True)
    assert (s.logprobs, s.seed, s.logit_bias, s.top_k) == (3, -7, {4: 2.5}, 5)
    assert s.min_p == pytest.approx(0.1)


@pytest.mark.parametrize("value", [0, -1, -5])
def test_logprobs_zero_or_below_means_none_as_mlx_says(value):
    # vLLM's 0 is "the sampled token's"; MLX's reference returns nothing for <= 0.
    assert validate_generate(request(logprobs=value), LIMITS, 0.0).specs[0].sampling.logprobs is None


def _position(token: int, value: float, top: list[tuple[int, float]]) -> LogprobRun:
    """One position as the core keeps it: a run of one row (its own token, then its top entries)."""
    return LogprobRun(1, 1 + len(top), len(top), array.array("i", [token] + [t for t, _ in top]),
                      array.array("f", [value] + [v for _, v in top]))


def test_a_chunk_of_several_tokens_goes_out_as_one_message_per_token_with_running_counts():
    positions = [_position(t, -0.5 * i, [(t, -0.5 * i), (9, -3.0)]) for i, t in enumerate([40, 41, 42])]
    # The writer fell behind: the core hands three tokens at once; two were sent before.
    replies = encode([Chunk(0, [40, 41, 42], 6, 0, positions, 2, None, completion_tokens=5)])
    assert [r.WhichOneof("response") for r in replies] == ["chunk"] * 3
    chunks = [r.chunk for r in replies]
    assert [list(c.token_ids) for c in chunks] == [[40], [41], [42]]
    assert [c.completion_tokens for c in chunks] == [3, 4, 5]
    assert all(c.prompt_tokens == 6 for c in chunks)
    for c, token, value in zip(chunks, [40, 41, 42], [0.0, -0.5, -1.0]):
        lp = c.output_logprobs
        assert list(lp.token_ids) == [token] and list(lp.token_logprobs) == [value]
        (top,) = lp.top_logprobs
        assert list(top.token_ids) == [token, 9] and list(top.values) == [value, -3.0]


def test_without_logprobs_a_chunk_has_none():
    (reply,) = encode([Chunk(0, [40], 6, 0, completion_tokens=1)])
    assert not reply.chunk.HasField("output_logprobs")


def test_a_streamed_complete_carries_no_tokens_and_no_logprobs_but_the_total():
    positions = [_position(7, -0.25, [(7, -0.25)])]
    (reply,) = encode([Complete(0, [7], "stop", 6, 0, matched_token_id=7, logprobs=positions, logprobs_top=1,
                                stream=True, completion_tokens=12)])  # fmt: skip
    c = reply.complete
    assert list(c.output_ids) == [] and not c.HasField("output_logprobs")
    assert (c.finish_reason, c.completion_tokens, c.prompt_tokens, c.matched_stop_token_id) == ("stop", 12, 6, 7)


def test_a_unary_complete_carries_every_token_and_position_and_keeps_the_matched_stop_token():
    positions = [_position(t, -1.0, [(t, -1.0), (3, -2.0)]) for t in (40, 41, 2)]
    (reply,) = encode([Complete(0, [40, 41, 2], "stop", 6, 0, matched_token_id=2, logprobs=positions, logprobs_top=2,
                                completion_tokens=3)])  # fmt: skip
    c = reply.complete
    assert list(c.output_ids) == [40, 41, 2] and c.completion_tokens == 3 and c.matched_stop_token_id == 2
    assert list(c.output_logprobs.token_ids) == [40, 41, 2] and len(c.output_logprobs.top_logprobs) == 3


def test_length_and_abort_completes_have_no_matched_stop():
    for reason in ("length", "abort"):
        (reply,) = encode([Complete(0, [1, 2], reason, 6, 0, completion_tokens=2)])
        assert reply.complete.finish_reason == reason and not reply.complete.HasField("matched_stop_token_id")


def test_the_service_offers_the_six_rpcs_with_the_mlx_edge():
    # (serve --engine mlx choosing it is tests/mlx's: the process answers health for this service only.)
    service = MlxEngineService
    assert service.edge is MLX_EDGE
    paths = set(service.__mapping__(service.__new__(service)))
    assert paths == {f"/mlx.grpc.engine.MlxEngine/{name}" for name in
                     ("Generate", "HealthCheck", "Abort", "GetModelInfo", "GetServerInfo", "GetTokenizer")}

"""The ``mlx.grpc.engine.MlxEngine`` contract's edge: its GenerateRequest in, its GenerateResponses out.

The same seam as vLLM's (``runtime/requests/contract.py``, ``ContractEdge``);
the request core, the hub and the MLX engine process (which speaks vLLM's
headless wire, ``tools/mlx_engine.py``) do not know which contract a call
came in by. What differs is only here (reference/mlx.md §2-3):

- the request has no stop strings, constraints, ``n``, ``min_tokens``,
  prompt logprobs, truncation, DP pin, media or PD fields, and only
  ``tokenized`` input (``text`` is refused, as the reference does);
- ``logprobs`` unset or <= 0 means none (vLLM's 0 means "the sampled
  token's"); k > 0 is the sampled token's and the top k, per position;
- the responses keep the reference servicer's observable shapes, which the
  router 1.13.0 reads: **one chunk per token** (a writer that fell behind
  gets one core chunk of several tokens: it goes out as several messages),
  cumulative ``completion_tokens`` in each chunk, that token's logprobs in
  its chunk; a streamed ``complete`` with empty ``output_ids`` and no
  logprobs (the router accumulates the chunks), a non-streamed one with
  every token and every position's logprobs; ``matched_stop_token_id`` for
  a stop id or EOS, whose token stays in the output.

Where enginelink does better than the reference (each refusal a
``ClientError`` naming the field, INVALID_ARGUMENT, before the engine): an
empty prompt (the reference spun forever), ids outside the vocabulary (the
reference segfaulted), a prompt that fills the context, ``max_tokens`` past
the context (the reference ran past it), ``logprobs`` above what the engine
serves. A duplicate id in flight is the hub's ALREADY_EXISTS; an aborted call
ends with ``complete{finish_reason: "abort"}`` (the core's), not a bare OK.
"""

from __future__ import annotations

from smg_grpc_proto.generated import mlx_engine_pb2 as pb

from enginelink.machines.logprobs import Position, positions_of
from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.chunk_bytes import stream_chunk
from enginelink.runtime.requests.inputs import check_request_id
from enginelink.runtime.contracts.shared.pb_fields import (
    check_logit_bias, check_max_tokens, logprobs_cap, no_release_params, prompt_ids, raw_request_id, stop_token_ids,
    tokenized_ids, vllm_sampling_numbers,
)
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec

NAME = "mlx"
SERVICE = "mlx.grpc.engine.MlxEngine"
SERVER_TYPE = "mlx-grpc"  # GetServerInfo.server_type, as the reference servicer answers


# -- the request: GenerateRequest → GenerateCall ------------------------------------------


def validate_generate(request: pb.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
    """Check an ``mlx_engine_pb2.GenerateRequest``; raise ClientError or return the call.

    Checked in this order, so a request with several faults is refused for the first.
    """
    check_request_id("request_id", request.request_id, limits.inputs)
    sp = request.sampling_params
    prompt = _prompt(request, limits)
    max_tokens = check_max_tokens(sp, "max_tokens", prompt, limits)  # unset: the rest of the context, as the reference
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **vllm_sampling_numbers(sp),  # vLLM's fields, ranges and defaults (temperature unset: 1.0)
        stop_token_ids=stop_token_ids(sp, limits),
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        logprobs=_logprobs(sp, limits),
        logit_bias=check_logit_bias(sp, limits),
        # A per-request key in the engine (tools/mlx_core.py), not mlx's process-global seed.
        seed=sp.seed if sp.HasField("seed") else None,
    )
    spec = GenerateSpec(request_id=request.request_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now)
    return GenerateCall(
        request_id=request.request_id,
        stream=request.stream,
        prompt_token_ids=prompt,
        specs=[spec],
        max_tokens=max_tokens,
        engine_ids=[request.request_id],
    )


def _prompt(request: pb.GenerateRequest, limits: EngineLimits) -> list[int]:
    return prompt_ids(tokenized_ids(request), limits)


def _logprobs(sp: pb.SamplingParams, limits: EngineLimits) -> int | None:
    """Unset or <= 0: none (MLX's meaning, the reference's); k: the top k, at most what the engine serves."""
    if not sp.HasField("logprobs") or sp.logprobs <= 0:
        return None
    cap = logprobs_cap(limits)
    if sp.logprobs > cap:
        raise ClientError("sampling_params.logprobs", f"requested {sp.logprobs} logprobs, which is greater than "
                          f"max allowed: {cap}")  # fmt: skip
    return sp.logprobs


# -- the responses: Chunk / Complete → GenerateResponse -----------------------------------


def encode(messages: list[Message]) -> list[pb.GenerateResponse]:
    """The core's messages as MLX ``GenerateResponse``s, in order; a chunk of n tokens becomes n messages."""
    out: list[pb.GenerateResponse] = []
    for m in messages:
        if type(m) is Chunk:
            out.extend(encode_chunk(m))
        else:
            out.append(encode_complete(m))
    return out


def encode_chunk(m: Chunk) -> list[pb.GenerateResponse]:
    count = len(m.token_ids)
    first = m.completion_tokens - count  # the running count before this chunk
    replies = []
    # MLX's engine sends small top-k (its --max-logprobs): per-position tuples are cheap here.
    positions = positions_of(m.logprobs) if m.logprobs else None
    for i, token in enumerate(m.token_ids):
        message = pb.GenerateResponse()
        chunk = message.chunk
        chunk.token_ids.append(token)
        chunk.prompt_tokens = m.prompt_tokens
        chunk.completion_tokens = first + i + 1
        chunk.cached_tokens = m.cached_tokens
        chunk.index = m.index
        if positions:
            _fill(chunk.output_logprobs, positions[i : i + 1], m.logprobs_top)
        replies.append(message)
    return replies


def encode_complete(m: Complete) -> pb.GenerateResponse:
    complete = pb.GenerateComplete(
        # Streamed, the chunks carried every token: the router accumulates them (the reference's shape).
        output_ids=[] if m.stream else m.output_ids,
        finish_reason=m.finish_reason,
        prompt_tokens=m.prompt_tokens,
        completion_tokens=m.completion_tokens,
        cached_tokens=m.cached_tokens,
        index=m.index,
    )
    if m.logprobs and not m.stream:
        _fill(complete.output_logprobs, positions_of(m.logprobs), m.logprobs_top)
    if m.matched_token_id is not None:
        complete.matched_stop_token_id = m.matched_token_id
    return pb.GenerateResponse(complete=complete)


def _fill(message: pb.OutputLogProbs, positions: list[Position], top: int) -> None:
    """``OutputLogProbs`` in place: each position's own logprob and id, and one ``TopLogProbs`` (top k, descending)."""
    message.token_logprobs.extend([p[0] for p in positions])
    message.token_ids.extend([p[1] for p in positions])
    add = message.top_logprobs.add
    for _, _, values, ids in positions:
        entry = add()
        if top and values is not None:
            entry.values.extend(values)
            entry.token_ids.extend(ids)


def chunk_body(call, choice, tokens: list[int]) -> bytes | None:
    """``encode_chunk``'s message as bytes (``chunk_bytes.py``) when it is one message (one token):
    ``GenerateResponse.chunk`` = 1, the running ``completion_tokens``, ``index`` = 6. A chunk of
    several tokens is several messages here: None, so it takes ``encode``."""
    if len(tokens) != 1:
        return None
    return stream_chunk(b"", b"\x0a", tokens, call.prompt_tokens, choice.tokens_sent + 1, choice.cached_tokens,
                        b"\x30", choice.index)


class MlxEdge:
    """The MLX contract's edge (``contract.ContractEdge``)."""

    name = NAME
    id_field = "request_id"
    validate = staticmethod(validate_generate)
    encode = staticmethod(encode)
    chunk_body = staticmethod(chunk_body)
    raw_request_id = staticmethod(raw_request_id)
    release_params = staticmethod(no_release_params)  # MLX has no prefill/decode disaggregation


MLX_EDGE = MlxEdge()


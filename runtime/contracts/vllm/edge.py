"""The ``vllm.grpc.engine.VllmEngine`` contract's edge: its GenerateRequest in, its GenerateResponses out.

The request core (``machines/request_core.py``) is contract-neutral; each
gRPC contract has one small edge module like this one, chosen when the
service is built (``runtime/contracts/vllm/service.py``, ``server.py``). An edge provides
(``runtime/requests/contract.py``, ``ContractEdge``):

- ``id_field`` / ``raw_request_id``: the request's id, checked before
  anything else (a bad id is the client's error even while the engine starts);
- ``validate``: the contract's request → ``GenerateCall``, or a
  ``ClientError`` naming the field (below, one function per field group);
- ``encode``: the core's ``Chunk`` / ``Complete`` → the contract's messages;
- ``chunk_body``: a one-choice chunk (tokens and counts only) straight to
  the bytes of its serialized message, for the fast path (``chunk_bytes.py``), or None;
- ``release_params``: the PD params of a refused request whose prefill side
  holds KV for it (``kv_transfer.py``), or None.
"""

from __future__ import annotations

import msgspec
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message, choice_engine_id
from enginelink.runtime.contracts.vllm import kv_transfer
from enginelink.runtime.requests.chunk_bytes import stream_chunk
from enginelink.runtime.requests.constraints import Constraint, constraint_of
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import InputLimits, check_request_id, stop_strings as _stop_strings
from enginelink.runtime.contracts.shared.media import media_settings
from enginelink.runtime.requests.bridge import in_trio
from enginelink.runtime.requests.media_bounds import check_router_features, media_bounds
from enginelink.runtime.contracts.vllm.media_identity import identity_bytes
from enginelink.runtime.contracts.shared.media_refit import with_processed_media
from enginelink.runtime.contracts.shared.mm_tensors import mm_features_of
from enginelink.runtime.contracts.shared.pb_fields import (
    LogprobBudget, check_logit_bias, check_max_tokens, check_n, fill_chunk, fill_matched, logprobs_cap, prompt_ids,
    raw_request_id, stop_token_ids as _stop_token_ids, tokenized_ids, vllm_sampling_numbers, with_logprobs,
)
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec

NAME = "vllm"


# -- the request: GenerateRequest → GenerateCall ------------------------------------------


def validate_generate(request: pb.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
    """Check a ``vllm_engine_pb2.GenerateRequest``; raise ClientError or return the call.

    The field groups are checked in this order, so a request with several
    faults is refused for the first of them.
    """
    inputs = limits.inputs
    check_request_id("request_id", request.request_id, inputs)
    sp = request.sampling_params
    prompt = _prompt(request, limits)
    max_tokens = check_max_tokens(sp, "max_tokens", prompt, limits)
    numbers = _sampling_numbers(sp, max_tokens)
    n = check_n(sp)
    stop_token_ids = _stop_token_ids(sp, limits)
    stop_strings = _stop_strings(sp.stop, inputs)
    logprobs = _logprobs(sp, "logprobs", "sample", limits)
    prompt_logprobs = _logprobs(sp, "prompt_logprobs", "prompt", limits)
    logit_bias = check_logit_bias(sp, limits)
    constraint = constraint_of(sp, inputs, limits.grammar_backend, limits.engine_release)
    # PD: the JSON field or the legacy message, checked as the reference does (runtime/contracts/vllm/kv_transfer.py).
    kv_transfer_params = kv_transfer.params_from_request(request, inputs)
    dp_rank = _dp_rank(request, limits)

    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **numbers,
        stop_token_ids=stop_token_ids,
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        structured_outputs=constraint.params if constraint else None,
        grammar_backend=constraint.backend if constraint else None,
        grammar_backend_auto=constraint.backend_was_auto if constraint else False,
    )
    seed = sp.seed if sp.HasField("seed") else None
    engine_ids = [choice_engine_id(request.request_id, index, n) for index in range(n)]
    specs = [
        GenerateSpec(
            request_id=engine_id,
            prompt_token_ids=prompt,
            # Seeds as vLLM's parallel sampling: seed + index per choice.
            sampling=sampling if seed is None else _with_seed(sampling, seed + index),
            arrival_time=now,
            data_parallel_rank=dp_rank,
            kv_transfer_params=kv_transfer_params,
            # The gateway shaped the constraint to start at the first generated token.
            reasoning_ended=True if constraint and sp.grammar_from_first_token else None,
        )
        for index, engine_id in enumerate(engine_ids)
    ]
    return _call(request, sp, prompt, specs, engine_ids, stop_strings, max_tokens, constraint)


def _call(request, sp, prompt, specs, engine_ids, stop_strings, max_tokens, constraint: Constraint | None):
    return GenerateCall(
        request_id=request.request_id,
        stream=request.stream,
        prompt_token_ids=prompt,
        specs=specs,
        stop_strings=stop_strings,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens,
        max_tokens=max_tokens,
        engine_ids=engine_ids,
        constraint=constraint.field if constraint else None,
        grammar_backend=constraint.backend if constraint else None,
    )


def _with_seed(sampling: SamplingSpec, seed: int) -> SamplingSpec:
    return msgspec.structs.replace(sampling, seed=seed)


def _prompt(request, limits: EngineLimits) -> list[int]:
    """The prompt's token ids: tokenized input only, truncated as asked, with room to generate, in the vocabulary.

    Judged by their number before they are copied (``pb_fields.prompt_ids``); a prompt to truncate is cut
    first, so only the part kept is ever copied, however long the rest (the 64 MiB message bound's).
    """
    ids = tokenized_ids(request)
    if request.HasField("media_refs") and (request.HasField("mm_inputs") or len(request.extra_mm_inputs)):
        raise ClientError("media_refs", "cannot be combined with preprocessed mm_inputs; send one or the other")
    sp = request.sampling_params
    if sp.HasField("truncate_prompt_tokens") and sp.truncate_prompt_tokens != 0:
        if request.HasField("mm_inputs") or len(request.extra_mm_inputs):
            # Truncating would cut placeholder ranges the router computed against the whole prompt.
            raise ClientError("sampling_params.truncate_prompt_tokens", "cannot be combined with mm_inputs")
        keep = sp.truncate_prompt_tokens
        if keep == -1:
            keep = limits.max_model_len - 1
        if keep < -1:
            raise ClientError("sampling_params.truncate_prompt_tokens", f"must be -1 or positive, got {keep}")
        if keep > limits.max_model_len:
            # vLLM's TokenizeParams refuses it in these words (renderers/params.py).
            raise ClientError(
                "sampling_params.truncate_prompt_tokens",
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {limits.max_model_len}. "
                "Please request a smaller truncation size.",
            )
        # The last N, as vLLM's OpenAI server truncates (left side): the end of a
        # prompt is what the answer continues.
        ids = ids[-keep:]
    return prompt_ids(ids, limits)


def _sampling_numbers(sp, max_tokens: int) -> dict:
    """Temperature, nucleus, top-k, min-p, penalties (``pb_fields``) and min_tokens, defaulted as the reference does."""
    numbers = vllm_sampling_numbers(sp)
    if sp.min_tokens > max_tokens:
        raise ClientError("sampling_params.min_tokens", f"{sp.min_tokens} exceeds max_tokens {max_tokens}")
    numbers["min_tokens"] = sp.min_tokens
    return numbers


def _logprobs(sp, name: str, what: str, limits: EngineLimits) -> int | None:
    """A logprobs count as vLLM's front end checks it (``SamplingParams._validate_logprobs``).

    The EngineCore does not check: a count it cannot serve (above the
    vocabulary) would fail inside the engine's top-k. So: unset → None;
    -1 (the whole vocabulary) or k >= 0, within the engine's ``--max-logprobs``
    (-1 there: the vocabulary), in vLLM's words.
    """
    if not sp.HasField(name):
        return None
    value = getattr(sp, name)
    if value < -1:
        raise ClientError(f"sampling_params.{name}", f"must be non-negative or -1, got {value}")
    asked = limits.vocab_size if value == -1 else value
    cap = logprobs_cap(limits)
    if asked > cap:
        raise ClientError(
            f"sampling_params.{name}",
            f"Requested {what} logprobs of {asked}, which is greater than max allowed: {cap}",
        )
    return value


def _dp_rank(request, limits: EngineLimits) -> int | None:
    if not request.HasField("data_parallel_rank"):
        return None
    dp_rank = request.data_parallel_rank
    if not 0 <= dp_rank < limits.data_parallel_size:
        # vLLM's words (input_processor.py), N = the ranks this servicer fronts.
        raise ClientError("data_parallel_rank", "out of range", words=(
            f"data_parallel_rank {dp_rank} is out of range [0, {limits.data_parallel_size})."))
    return dp_rank


def release_params(request: pb.GenerateRequest, limits: InputLimits) -> dict | None:
    """The PD params of a refused request whose prefill side holds KV for it (``kv_transfer.py``)."""
    return kv_transfer.params_for_release(request, limits)


# -- the responses: Chunk / Complete → GenerateResponse -----------------------------------


def encode(messages: list[Message]) -> list:
    """The core's messages as ``GenerateResponse``s, in order; one whose logprobs are over the
    step's budget is a ``SlicedResponse`` its writer serializes (``logprob_bytes.py``)."""
    budget = LogprobBudget()
    return [encode_chunk(m, budget) if type(m) is Chunk else encode_complete(m, budget) for m in messages]


def encode_chunk(m: Chunk, budget: LogprobBudget | None = None):
    # Filled in place: building the chunk apart and passing it to the response's
    # constructor copies it (~2x the cost, upb).
    message = pb.GenerateResponse()
    fill_chunk(message.chunk, m, len(m.token_ids))
    if m.logprobs or m.prompt_logprobs is not None:
        return with_logprobs(message, "chunk", m, pb.InputTokenLogProb, budget)
    return message


def encode_complete(m: Complete, budget: LogprobBudget | None = None):
    complete = pb.GenerateComplete(
        output_ids=m.output_ids,
        finish_reason=m.finish_reason,
        prompt_tokens=m.prompt_tokens,
        completion_tokens=len(m.output_ids),
        cached_tokens=m.cached_tokens,
        index=m.index,
    )
    fill_matched(complete, m)
    if m.kv_transfer_params is not None:
        kv_transfer.fill_complete(complete, m.kv_transfer_params)
    if m.media_identity is not None:  # a PD prefill side's processed media (media_identity.py)
        complete.media_identity.ParseFromString(m.media_identity)
    message = pb.GenerateResponse(complete=complete)
    if m.logprobs or m.prompt_logprobs is not None:
        return with_logprobs(message, "complete", m, pb.InputTokenLogProb, budget)
    return message


# -- a stream chunk's bytes ----------------------------------------------------------


def stream_chunk_body(tokens: list[int], prompt_tokens: int, cached_tokens: int, index: int) -> bytes:
    """``GenerateResponse(chunk=GenerateStreamChunk(...))`` serialized, without protobuf objects
    (``chunk_bytes.stream_chunk``; ``tests/test_hub_direct.py`` compares it with upb's bytes).

    Layout: vllm_engine.proto, ``GenerateResponse.chunk`` = 1; ``GenerateStreamChunk``:
    token_ids = 1, prompt_tokens = 2, completion_tokens = 3 (this chunk's count, not a running
    total), cached_tokens = 4, index = 7 (logprobs, 5 and 6, are not written here: a call that
    asked for them takes the protobuf path, ``Call.plain_one``).
    """
    return stream_chunk(b"", b"\x0a", tokens, prompt_tokens, len(tokens), cached_tokens, b"\x38", index)


def chunk_body(call, choice, tokens: list[int]) -> bytes:
    """The edge's ``chunk_body`` (``contract.ContractEdge``): ``stream_chunk_body`` of the core's counts."""
    return stream_chunk(b"", b"\x0a", tokens, call.prompt_tokens, len(tokens), choice.cached_tokens, b"\x38",
                        choice.index)


async def prepare_media(app, request: pb.GenerateRequest, spec: GenerateCall) -> GenerateCall:
    """The request's media before admission: refs fetched (``media.py``), router tensors made engine
    features (``mm_tensors.py``, in a worker thread), both held to the engine's bounds (``media_bounds.py``);
    the call unchanged when it has none."""
    if request.HasField("media_refs"):
        if app.media is None:
            raise ClientError("media_refs", "media_refs sent but --mm-processor (SMG_VLLM_MM_PROCESSOR) is off "
                              "on this worker")  # fmt: skip
        bounds = media_bounds(app.ready, app.media.settings.items_max)
        processed = await app.media.prepare(request.media_refs, spec.prompt_token_ids, bounds)
        spec = with_processed_media(spec, request.sampling_params, processed.prompt, processed.features, app.limits)
        if spec.specs[0].kv_transfer_params is not None:  # a PD prefill side: the decode side is told what it was
            spec.media_identity = identity_bytes(processed.prompt, processed.identity)
        return spec
    if not (request.HasField("mm_inputs") or len(request.extra_mm_inputs)):
        return spec
    has_kv = spec.specs[0].kv_transfer_params is not None
    mm_features = await in_trio(mm_features_of, request, spec.prompt_token_ids, has_kv)
    items_max = app.media.settings.items_max if app.media is not None else media_settings().items_max
    check_router_features(media_bounds(app.ready, items_max), mm_features, "mm_inputs")
    spec.specs = [msgspec.structs.replace(s, mm_features=mm_features) for s in spec.specs]
    return spec


class VllmEdge:
    """The vLLM contract's edge, as the executor and the Generate loop use it (``contract.ContractEdge``)."""

    name = NAME
    id_field = "request_id"
    validate = staticmethod(validate_generate)
    encode = staticmethod(encode)
    chunk_body = staticmethod(chunk_body)
    release_params = staticmethod(release_params)
    raw_request_id = staticmethod(raw_request_id)
    prepare_media = staticmethod(prepare_media)


VLLM_EDGE = VllmEdge()

"""The ``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` contract's edge: its GenerateRequest in, its responses out.

The second real contract on the request core's seam (``runtime/requests/contract.py``;
vLLM's is ``contracts/vllm/edge.py``). TokenSpeed's semantics, from the reference
servicer (``reference/tokenspeed.md`` §2-3), and where they differ from vLLM's:

- every sampling scalar is ``optional``: only what is set is taken, anything
  unset is the engine's default (an explicit ``temperature=0`` is kept);
- ``n > 1`` becomes child engine requests ``<id>-n<i>`` (vLLM: ``<id>#<i>``),
  each with the request's seed as it is; the Abort RPC on ``<id>`` ends them all;
- what TokenSpeed 0.1.1's headless wire would only answer with a pre-abort
  (top-k logprobs, prompt logprobs, ranged sampling values it refuses) is
  refused here, INVALID_ARGUMENT, in the engine's words
  (``wire.tokenspeed.preabort_reason``); ``token_ids_logprob`` and multimodal
  input, which the wire cannot carry, likewise;
- the matched stop token is trimmed unless ``no_stop_trim`` (the codec does
  it: ``wire.tokenspeed.TokenSpeedCodec``);
- responses carry ``request_id``; chunk counts are running totals (the
  core's ``Chunk.completion_tokens``) and logprobs per-chunk deltas. The
  stateless ``encode`` has no id: ``CallStamp`` (one per call, in the gRPC
  handler) sets it as the messages go out; the hub's hand-encoded chunks
  (``chunk_body``) take it from ``StampedCall.id_field``, its bytes made
  once at validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.chunk_bytes import stream_chunk, string_field
from enginelink.runtime.requests.constraints import check_json_nesting, parse_json
from enginelink.runtime.contracts.shared.call_stamp import CallStamp, StampedCall  # noqa: F401 (CallStamp: its service, tests)
from enginelink.runtime.requests.inputs import InputLimits, check_request_id, stop_strings, utf8_len
from enginelink.runtime.contracts.shared.pb_fields import (
    check_dp_rank, check_logit_bias, check_max_tokens, check_n, check_prompt_room, check_token_ids, fill_chunk,
    fill_matched, fill_output_logprobs, finite, no_release_params, raw_request_id,
)
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from enginelink.wire.tokenspeed import preabort_reason

NAME = "tokenspeed"


def child_id(request_id: str, index: int, n: int) -> str:
    """The engine id of choice ``index``: the id itself when n = 1, else ``<id>-n<index>`` (the reference's)."""
    return request_id if n == 1 else f"{request_id}-n{index}"


# -- the request: GenerateRequest → GenerateCall ------------------------------------------


def validate_generate(request: pb.GenerateRequest, limits: EngineLimits, now: float, *,
                      output_logprobs: bool = True) -> GenerateCall:
    """Check a ``tokenspeed_scheduler_pb2.GenerateRequest``; raise ClientError or return the call.

    ``output_logprobs``: the engine was started with ``--enable-output-logprobs`` (the sim
    always serves them); without it TokenSpeed pre-aborts any request for logprobs.
    """
    inputs = limits.inputs
    check_request_id("request_id", request.request_id, inputs)
    sp = request.sampling_params
    prompt = _prompt(request, limits)
    max_tokens = check_max_tokens(sp, "max_new_tokens", prompt, limits)
    n = check_n(sp)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **_numbers(sp),
        stop_token_ids=tuple(check_token_ids("sampling_params.stop_token_ids", sp.stop_token_ids, limits.vocab_size)),
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        seed=sp.sampling_seed if sp.HasField("sampling_seed") else None,
        logprobs=_logprobs(request),
        prompt_logprobs=0 if request.HasField("logprob_start_len") and request.logprob_start_len >= 0 else None,
        logit_bias=check_logit_bias(sp, limits, key_chars=32),
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        structured_outputs=_constraint(sp, inputs),
        no_stop_trim=sp.no_stop_trim,
    )
    if request.top_logprobs_num:  # before the pre-abort check: its own field and the engine's words
        raise ClientError("top_logprobs_num", "top_logprobs_num > 0 (output top-k logprobs) is not supported yet")
    if request.token_ids_logprob:
        raise ClientError("token_ids_logprob", "logprobs of chosen token ids are not carried on TokenSpeed's wire")
    engine_ids = [child_id(request.request_id, index, n) for index in range(n)]
    dp_rank = check_dp_rank(request, limits)
    specs = [GenerateSpec(request_id=engine_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                          data_parallel_rank=dp_rank) for engine_id in engine_ids]
    refused = preabort_reason(specs[0], output_logprobs_enabled=output_logprobs)  # each child is sent with n = 1
    if refused is not None:
        raise ClientError(refused[0], refused[1], words=refused[1])
    return StampedCall(
        request_id=request.request_id,
        stream=request.stream,
        prompt_token_ids=prompt,
        specs=specs,
        stop_strings=stop_strings(sp.stop, inputs),
        skip_special_tokens=sp.skip_special_tokens,
        max_tokens=max_tokens,
        engine_ids=engine_ids,
        id_field=string_field(b"\x0a", request.request_id),
    )


def _prompt(request, limits: EngineLimits) -> list[int]:
    """Tokenized input only (the reference requires it), in the vocabulary, with room to generate."""
    if request.HasField("mm_inputs") or request.HasField("encode_bootstrap_info"):
        raise ClientError("mm_inputs", "multimodal input is not supported by this worker (text-only)")
    if request.HasField("kv_bootstrap_info"):
        raise ClientError("kv_bootstrap_info", "PD disaggregation is not supported by this worker "
                                               "(enginelink's TokenSpeed front end serves whole requests)")
    if not request.HasField("tokenized"):
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    prompt = check_token_ids("tokenized.input_ids", request.tokenized.input_ids, limits.vocab_size)
    return check_prompt_room(prompt, limits)


# Unset → the engine's default (TokenSpeed's SamplingParams defaults).
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
             "repetition_penalty": 1.0}


def _numbers(sp) -> dict:
    """The optional sampling numbers, set ones only, finite; their ranges are the engine's (``preabort_reason``)."""
    numbers = {}
    for name, default in _DEFAULTS.items():
        numbers[name] = finite(f"sampling_params.{name}", getattr(sp, name) if sp.HasField(name) else default)
    # TokenSpeed's top_k: -1 (or unset, or 0) is off; SamplingSpec's off is 0.
    top_k = sp.top_k if sp.HasField("top_k") else -1
    if top_k < -1:
        raise ClientError("sampling_params.top_k", f"must be -1 (off) or a positive count, got {top_k}")
    numbers["top_k"] = max(top_k, 0)
    numbers["min_tokens"] = sp.min_new_tokens
    return numbers


def _logprobs(request) -> int | None:
    """``return_logprob``: the sampled tokens' logprobs (0 alternatives; top-k is refused)."""
    return 0 if request.return_logprob else None


# The constraint oneof's fields → the codec's keys (vLLM's StructuredOutputsParams names).
_CONSTRAINT_KEYS = {"regex": "regex", "json_schema": "json", "ebnf_grammar": "grammar",
                    "structural_tag": "structural_tag"}


def _constraint(sp, inputs: InputLimits) -> dict | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    name, value, cap = f"sampling_params.{kind}", getattr(sp, kind), inputs.constraint_bytes
    if not value.strip():
        raise ClientError(name, "must not be empty")
    if kind == "json_schema":
        schema = parse_json(name, value, cap, "ENGINELINK_MAX_CONSTRAINT_BYTES", inputs)
        if not isinstance(schema, dict):
            raise ClientError(name, f"must be a JSON Schema object, got a JSON {type(schema).__name__}")
        return {"json": value}
    size = utf8_len(value, cap)
    if size > cap:
        raise ClientError(name, f"is {size} bytes; at most {cap} (ENGINELINK_MAX_CONSTRAINT_BYTES)")
    if kind == "structural_tag":
        check_json_nesting("structural_tag", value, inputs)
    return {_CONSTRAINT_KEYS[kind]: value}


# -- the responses: Chunk / Complete → GenerateResponse -----------------------------------


def encode(messages: list[Message]) -> list[pb.GenerateResponse]:
    """The core's messages as ``GenerateResponse``s, in order; ``CallStamp`` adds the id."""
    return [_chunk(m) if type(m) is Chunk else _complete(m) for m in messages]


def _chunk(m: Chunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    chunk = message.chunk
    fill_chunk(chunk, m, m.completion_tokens)  # TokenSpeed's running total
    if m.logprobs:
        fill_output_logprobs(chunk.output_logprobs, m.logprobs, 0)  # top-k is refused: ids and values only
    return message


def _complete(m: Complete) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    complete = message.complete
    complete.output_ids.extend(m.output_ids)
    complete.finish_reason = m.finish_reason
    complete.prompt_tokens = m.prompt_tokens
    complete.completion_tokens = m.completion_tokens  # streamed: the choice's total, not the last delta's
    complete.cached_tokens = m.cached_tokens
    complete.index = m.index
    if m.logprobs:
        fill_output_logprobs(complete.output_logprobs, m.logprobs, 0)
    fill_matched(complete, m)
    return message


def chunk_body(call, choice, tokens: list[int]) -> bytes:
    """``_chunk``'s message, stamped, as bytes (``chunk_bytes.py``), for the hub's fast path:
    ``request_id`` = 1 (made at validation), ``GenerateResponse.chunk`` = 2, the running
    ``completion_tokens``, ``index`` = 6."""
    return stream_chunk(call.spec.id_field, b"\x12", tokens, call.prompt_tokens, choice.tokens_sent + len(tokens),
                        choice.cached_tokens, b"\x30", choice.index)


class TokenSpeedEdge:
    """The TokenSpeed contract's edge (``contract.ContractEdge``); ``output_logprobs`` as ``validate_generate``'s."""

    name = NAME
    id_field = "request_id"
    encode = staticmethod(encode)

    def __init__(self, output_logprobs: bool = True) -> None:
        self.output_logprobs = output_logprobs

    def validate(self, request: pb.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
        return validate_generate(request, limits, now, output_logprobs=self.output_logprobs)

    chunk_body = staticmethod(chunk_body)
    release_params = staticmethod(no_release_params)  # no PD on this contract (``kv_bootstrap_info`` is refused)
    raw_request_id = staticmethod(raw_request_id)


TOKENSPEED_EDGE = TokenSpeedEdge()

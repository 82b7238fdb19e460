"""The ``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` contract's edge: its GenerateRequest in, its responses out.

The second real contract on the request core's seam (``runtime/requests/contract.py``;
vLLM's is ``contract_vllm.py``). TokenSpeed's semantics, from the reference
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
- responses carry ``request_id``; chunk counts are running totals and logprobs
  per-chunk deltas. Both need the call's history, which the stateless
  ``encode`` does not have: ``CallStamp`` (one per call, in the gRPC handler)
  fills them in as the messages go out.
"""

from __future__ import annotations

import math

from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.constraints import check_json_nesting, parse_json
from enginelink.runtime.requests.inputs import InputLimits, check_request_id, stop_strings, utf8_len
from enginelink.runtime.requests.validate import N_MAX, EngineLimits
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
    max_tokens = _max_tokens(sp, prompt, limits)
    n = sp.n or 1
    if n > N_MAX:
        raise ClientError("sampling_params.n", f"must be at most {N_MAX}, got {n}")
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **_numbers(sp),
        stop_token_ids=tuple(_token_ids("sampling_params.stop_token_ids", sp.stop_token_ids, limits.vocab_size)),
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        seed=sp.sampling_seed if sp.HasField("sampling_seed") else None,
        logprobs=_logprobs(request),
        prompt_logprobs=0 if request.HasField("logprob_start_len") and request.logprob_start_len >= 0 else None,
        logit_bias=_logit_bias(sp, limits),
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
    dp_rank = _dp_rank(request, limits)
    specs = [GenerateSpec(request_id=engine_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                          data_parallel_rank=dp_rank) for engine_id in engine_ids]
    refused = preabort_reason(specs[0], output_logprobs_enabled=output_logprobs)  # each child is sent with n = 1
    if refused is not None:
        raise ClientError(refused[0], refused[1], words=refused[1])
    return GenerateCall(
        request_id=request.request_id,
        stream=request.stream,
        prompt_token_ids=prompt,
        specs=specs,
        stop_strings=stop_strings(sp.stop, inputs),
        skip_special_tokens=sp.skip_special_tokens,
        max_tokens=max_tokens,
        engine_ids=engine_ids,
    )


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    for position, token in enumerate(ids):
        if token >= vocab_size:
            raise ClientError(name, f"token id {token} at position {position} is outside the vocabulary "
                                    f"(size {vocab_size})")
    return ids


def _prompt(request, limits: EngineLimits) -> list[int]:
    """Tokenized input only (the reference requires it), in the vocabulary, with room to generate."""
    if request.HasField("mm_inputs") or request.HasField("encode_bootstrap_info"):
        raise ClientError("mm_inputs", "multimodal input is not supported by this worker (text-only)")
    if request.HasField("kv_bootstrap_info"):
        raise ClientError("kv_bootstrap_info", "PD disaggregation is not supported by this worker "
                                               "(enginelink's TokenSpeed front end serves whole requests)")
    if not request.HasField("tokenized"):
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    prompt = _token_ids("tokenized.input_ids", request.tokenized.input_ids, limits.vocab_size)
    if not prompt:
        raise ClientError("tokenized.input_ids", "must not be empty")
    if len(prompt) >= limits.max_model_len:
        raise ClientError("tokenized.input_ids", f"prompt has {len(prompt)} tokens; the context is "
                                                 f"{limits.max_model_len}, which leaves no room for output")
    return prompt


def _max_tokens(sp, prompt: list[int], limits: EngineLimits) -> int:
    room = limits.max_model_len - len(prompt)
    if not sp.HasField("max_new_tokens"):
        return room
    if sp.max_new_tokens < 1:
        raise ClientError("sampling_params.max_new_tokens", "must be at least 1")
    if sp.max_new_tokens > room:
        raise ClientError("sampling_params.max_new_tokens",
                          f"{sp.max_new_tokens} does not fit: the prompt has {len(prompt)} tokens and the context "
                          f"is {limits.max_model_len}, so at most {room}")
    return sp.max_new_tokens


# Unset → the engine's default (TokenSpeed's SamplingParams defaults).
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
             "repetition_penalty": 1.0}


def _numbers(sp) -> dict:
    """The optional sampling numbers, set ones only, finite; their ranges are the engine's (``preabort_reason``)."""
    numbers = {}
    for name, default in _DEFAULTS.items():
        value = getattr(sp, name) if sp.HasField(name) else default
        if not math.isfinite(value):
            raise ClientError(f"sampling_params.{name}", f"must be a finite number, got {value}")
        numbers[name] = value
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


def _logit_bias(sp, limits: EngineLimits) -> dict[int, float] | None:
    if not sp.logit_bias:
        return None
    bias = {}
    for key, value in sp.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ClientError("sampling_params.logit_bias", f"key {key[:32]!r} is not a token id") from None
        if not 0 <= token < limits.vocab_size:
            raise ClientError("sampling_params.logit_bias",
                              f"token id {token} is outside the vocabulary (size {limits.vocab_size})")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise ClientError("sampling_params.logit_bias", f"bias for {token} must be in [-100, 100]")
        bias[token] = value
    return bias


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


def _dp_rank(request, limits: EngineLimits) -> int | None:
    if not request.HasField("data_parallel_rank"):
        return None
    rank = request.data_parallel_rank
    if not 0 <= rank < limits.data_parallel_size:
        raise ClientError("data_parallel_rank", f"{rank} is out of range [0, {limits.data_parallel_size})")
    return rank


def release_params(request, limits: InputLimits) -> dict | None:
    """No PD on this contract (``kv_bootstrap_info`` is refused): nothing to release."""
    return None


# -- the responses: Chunk / Complete → GenerateResponse -----------------------------------


def encode(messages: list[Message]) -> list[pb.GenerateResponse]:
    """The core's messages as ``GenerateResponse``s, in order; ``CallStamp`` adds the id and running counts."""
    return [_chunk(m) if type(m) is Chunk else _complete(m) for m in messages]


def _chunk(m: Chunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    chunk = message.chunk
    chunk.token_ids.extend(m.token_ids)
    chunk.prompt_tokens = m.prompt_tokens
    chunk.completion_tokens = len(m.token_ids)  # the delta; CallStamp makes it the running total
    chunk.cached_tokens = m.cached_tokens
    chunk.index = m.index
    if m.logprobs:
        _fill_output(chunk.output_logprobs, m.logprobs)
    return message


def _complete(m: Complete) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    complete = message.complete
    complete.output_ids.extend(m.output_ids)
    complete.finish_reason = m.finish_reason
    complete.prompt_tokens = m.prompt_tokens
    complete.completion_tokens = len(m.output_ids)
    complete.cached_tokens = m.cached_tokens
    complete.index = m.index
    if m.logprobs:
        _fill_output(complete.output_logprobs, m.logprobs)
    if m.matched_stop_str is not None:
        complete.matched_stop_str = m.matched_stop_str
    elif m.matched_token_id is not None:
        complete.matched_token_id = m.matched_token_id
    return message


def _fill_output(message, positions) -> None:
    message.token_logprobs.extend([p[0] for p in positions])
    message.token_ids.extend([p[1] for p in positions])


class CallStamp:
    """One streamed call's response history: fills in what the stateless ``encode`` cannot.

    Each message is stamped once, in the order it goes out (the fan-out's
    direct writes and the writer's sends share one stamp; a message stamped
    and left for the writer is not stamped again): ``request_id``, and the
    running completion count of its choice in chunks and in a streamed
    complete (TokenSpeed's counts are cumulative; the router takes the
    complete's as the usage). Bounded: one count per choice.
    """

    __slots__ = ("request_id", "stream", "totals")

    def __init__(self, request_id: str, stream: bool) -> None:
        self.request_id = request_id
        self.stream = stream
        self.totals: dict[int, int] = {}

    def stamp(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        if message.request_id:
            return message
        message.request_id = self.request_id
        if message.HasField("chunk"):
            chunk = message.chunk
            total = self.totals.get(chunk.index, 0) + len(chunk.token_ids)
            self.totals[chunk.index] = total
            chunk.completion_tokens = total
        elif self.stream:
            complete = message.complete
            complete.completion_tokens = self.totals.get(complete.index, 0)
        return message


def raw_request_id(request: pb.GenerateRequest) -> str:
    return request.request_id


class TokenSpeedEdge:
    """The TokenSpeed contract's edge (``contract.ContractEdge``); ``output_logprobs`` as ``validate_generate``'s."""

    name = NAME
    id_field = "request_id"
    encode = staticmethod(encode)

    def __init__(self, output_logprobs: bool = True) -> None:
        self.output_logprobs = output_logprobs

    def validate(self, request: pb.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
        return validate_generate(request, limits, now, output_logprobs=self.output_logprobs)

    chunk_body = None  # responses need CallStamp: the protobuf path only
    release_params = staticmethod(release_params)
    raw_request_id = staticmethod(raw_request_id)


TOKENSPEED_EDGE = TokenSpeedEdge()

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
- PD (``pd_bootstrap.py``): ``kv_bootstrap_info`` goes to the engine on a
  prefill/decode leg (``--disaggregation-mode``), required there and refused
  on a whole engine; under attention data parallelism a prefill leg runs the
  request on its room's residue rank (where TokenSpeed's decode receiver
  looks for the KV), a pin yielding to it;
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
from enginelink.runtime.requests.chunk_bytes import stream_chunk, string_field
from enginelink.runtime.requests.constraints import check_json_nesting, parse_json
from enginelink.runtime.contracts.shared.call_stamp import CallStamp, StampedCall  # noqa: F401 (CallStamp: its service, tests)
from enginelink.runtime.requests.inputs import InputLimits, check_request_id, stop_strings, utf8_len
from enginelink.runtime.contracts.shared.pb_fields import (
    LogprobBudget, check_dp_rank, check_logit_bias, check_max_tokens, check_n, fill_chunk, fill_matched, finite,
    no_release_params, prompt_ids, raw_request_id, stop_token_ids as _stop_token_ids, with_logprobs,
)
from enginelink.runtime.requests.pd_bootstrap import bootstrap_params, leg_rank
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
        stop_token_ids=_stop_token_ids(sp, limits),
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
    info = request.kv_bootstrap_info
    bootstrap = bootstrap_params(limits.pd_leg, "kv_bootstrap_info", request.HasField("kv_bootstrap_info"),
                                 info.bootstrap_host, info.bootstrap_port, info.bootstrap_room)
    if bootstrap is not None and n > 1:
        raise ClientError("sampling_params.n", f"{n} choices on a {limits.pd_leg.mode} leg: one bootstrap room "
                                               "carries one request's KV (n = 1)")
    dp_rank = leg_rank(limits.pd_leg, bootstrap, dp_rank, limits.data_parallel_size, request.request_id)
    specs = [GenerateSpec(request_id=engine_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                          data_parallel_rank=dp_rank, kv_transfer_params=bootstrap) for engine_id in engine_ids]
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
    if not request.HasField("tokenized"):
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    return prompt_ids(request.tokenized.input_ids, limits)  # judged by their number before they are copied


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


def encode(messages: list[Message]) -> list:
    """The core's messages as ``GenerateResponse``s, in order; ``CallStamp`` adds the id. One over the
    step's logprob budget is a ``SlicedResponse`` its writer serializes (``logprob_bytes.py``)."""
    budget = LogprobBudget()
    return [_chunk(m, budget) if type(m) is Chunk else _complete(m, budget) for m in messages]


def _chunk(m: Chunk, budget: LogprobBudget | None = None):
    message = pb.GenerateResponse()
    fill_chunk(message.chunk, m, m.completion_tokens)  # TokenSpeed's running total
    if m.logprobs:
        # Top-k is refused: ids and values only; prompt logprobs are not carried.
        return with_logprobs(message, "chunk", m, None, budget, top=0)
    return message


def _complete(m: Complete, budget: LogprobBudget | None = None):
    message = pb.GenerateResponse()
    complete = message.complete
    complete.output_ids.extend(m.output_ids)
    complete.finish_reason = m.finish_reason
    complete.prompt_tokens = m.prompt_tokens
    complete.completion_tokens = m.completion_tokens  # streamed: the choice's total, not the last delta's
    complete.cached_tokens = m.cached_tokens
    complete.index = m.index
    fill_matched(complete, m)
    if m.logprobs:
        return with_logprobs(message, "complete", m, None, budget, top=0)
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
    # TokenSpeed's wire has no add-and-abort: a decode leg refused here leaves the prefill side's KV to
    # the engine's own bootstrap timeout.
    release_params = staticmethod(no_release_params)
    raw_request_id = staticmethod(raw_request_id)


TOKENSPEED_EDGE = TokenSpeedEdge()

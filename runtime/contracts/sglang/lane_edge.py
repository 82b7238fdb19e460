"""The router's direct ZMQ lane for SGLang as a contract edge: its ADD in, the lane's output rows out.

``enginelink headless`` (``runtime/contracts/sglang/router_front.py``) takes requests
from the router's ZMQ lane (``wire/sglang_router.py``) instead of gRPC; the
request core and the hub do not change. This edge gives the Generate loop
(``runtime/requests/generate.py``) what it needs:

- ``validate``: the lane's ``TokenizedGenerateReqInput`` → the neutral call,
  with SGLang's semantics (the same numbers as the SglangScheduler contract,
  ``edge.py``: temperature 0 greedy, top_k -1 off, an unset
  ``max_new_tokens`` the rest of the context); what the lane refuses, by the
  reference's rules (``zmq_msgpack.MsgpackRecvSocket``): ``n != 1`` (the
  router fans out n > 1 itself), empty ``input_ids``; what enginelink does
  not carry here: prompt logprobs, logprobs of chosen ids, and what the
  lane decodes but does not forward to the scheduler (``mm_inputs``,
  ``input_embeds``, ``token_type_ids``: served as text, they would answer
  a different question). Refusals are
  ``ClientError`` naming the field; the front answers them with a terminal
  abort (status 400), as the reference's plugin does, never by dropping;
- ``encode``: the core's messages unchanged; the front turns them into the
  lane's rows (``rows``), one step's rows per output message.
"""

from __future__ import annotations

from array import array

import msgspec

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message
from enginelink.runtime.errors import ClientError, ServicerError
from enginelink.runtime.contracts.sglang.edge import SGLANG_GRAMMAR_BACKEND, _sampling_numbers
from enginelink.runtime.requests.inputs import stop_strings, utf8_len
from enginelink.runtime.contracts.shared.pb_fields import (
    check_logit_bias, check_max_tokens, check_prompt_room, check_token_ids, logprobs_cap, no_release_params,
)
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import sglang_router as lane
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from enginelink.wire.sglang_structs import EXT_ARRAY, unpack_array

NAME = "sglang-zmq"
# The lane's constraint fields → the codec's keys (vLLM's StructuredOutputsParams names).
_CONSTRAINTS = (("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar"), ("structural_tag", "structural_tag"))
# Fields the lane decodes but does not carry to the scheduler: a request with one is refused by its name.
_NOT_FORWARDED = ("mm_inputs", "input_embeds", "token_type_ids")
# gRPC status → the HTTP status a lane abort carries (the reference's table, read backwards).
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "ALREADY_EXISTS": 400, "NOT_FOUND": 404, "DEADLINE_EXCEEDED": 504,
               "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "FAILED_PRECONDITION": 400}


class _Fields:
    """The lane's sampling struct as the contracts' checks read a proto message (``HasField``: not None)."""

    __slots__ = ("_struct",)

    def __init__(self, struct) -> None:
        self._struct = struct

    def __getattr__(self, name: str):
        return getattr(self._struct, name)

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf method the checks call
        return getattr(self._struct, name) is not None


def _input_ids(value) -> list[int]:
    if isinstance(value, msgspec.msgpack.Ext) and value.code == EXT_ARRAY:
        return unpack_array(value.data).tolist()
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, list) and all(type(i) is int and i >= 0 for i in value):
        return value
    raise ClientError("input_ids", "must be a list of token ids (or SGLang's array)")


def validate_generate(request: lane.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
    rid = request.rid or ""
    raw = request.sampling_params
    if raw.n not in (0, 1):
        raise ClientError("sampling_params.n", f"n={raw.n} is not served on this wire; SMG fans out n > 1 itself")
    for field in _NOT_FORWARDED:
        if getattr(request, field):
            raise ClientError(field, "is not forwarded to the scheduler on this wire by enginelink headless (it "
                              "would be served as text alone); send it through the gRPC lane (--connection-mode grpc)")
    ids = _input_ids(request.input_ids)
    if not ids:
        raise ClientError("input_ids", "input_ids are required on this wire")
    prompt = check_prompt_room(check_token_ids("input_ids", ids, limits.vocab_size), limits)
    sp = _Fields(raw)
    max_tokens = check_max_tokens(sp, "max_new_tokens", prompt, limits)
    numbers = _sampling_numbers(sp, max_tokens)
    stops = [raw.stop] if isinstance(raw.stop, str) else list(raw.stop or ())
    if not all(isinstance(stop, str) for stop in stops):
        raise ClientError("sampling_params.stop", "must be strings")
    if request.token_ids_logprob:
        raise ClientError("token_ids_logprob", "logprobs of chosen token ids are not served on this wire")
    if request.logprob_start_len not in (-1, None):
        raise ClientError("logprob_start_len", "prompt logprobs are not served on this wire; send -1")
    logprobs = None
    if request.return_logprob:
        cap = logprobs_cap(limits)
        if not 0 <= request.top_logprobs_num <= cap:
            raise ClientError("top_logprobs_num", f"must be in [0, {cap}], got {request.top_logprobs_num}")
        logprobs = request.top_logprobs_num
    constraint = _constraint(raw, limits)
    sampling = SamplingSpec(
        max_tokens=max_tokens, **numbers,
        stop_token_ids=tuple(check_token_ids("sampling_params.stop_token_ids", raw.stop_token_ids or (),
                                             limits.vocab_size)),
        eos_token_ids=limits.eos_token_ids, ignore_eos=raw.ignore_eos, logprobs=logprobs,
        logit_bias=check_logit_bias(sp, limits, key_chars=40), skip_special_tokens=raw.skip_special_tokens,
        spaces_between_special_tokens=raw.spaces_between_special_tokens,
        structured_outputs=constraint[1] if constraint else None,
        grammar_backend=SGLANG_GRAMMAR_BACKEND if constraint else None, no_stop_trim=raw.no_stop_trim,
        seed=raw.sampling_seed,
    )
    spec = GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=sampling, arrival_time=now)
    return GenerateCall(
        request_id=rid, stream=request.stream, prompt_token_ids=prompt, specs=[spec],
        stop_strings=stop_strings(stops, limits.inputs), include_stop_str_in_output=raw.no_stop_trim,
        skip_special_tokens=raw.skip_special_tokens, max_tokens=max_tokens, engine_ids=[rid],
        constraint=constraint[0] if constraint else None,
        grammar_backend=SGLANG_GRAMMAR_BACKEND if constraint else None,
    )


def _constraint(raw: lane.SamplingParams, limits: EngineLimits) -> tuple[str, dict] | None:
    given = [(field, key, getattr(raw, field)) for field, key in _CONSTRAINTS if getattr(raw, field) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ClientError("sampling_params", f"one constraint at a time, got {', '.join(g[0] for g in given)}")
    field, key, value = given[0]
    name, cap = f"sampling_params.{field}", limits.inputs.constraint_bytes
    if not isinstance(value, str) or not value.strip():
        raise ClientError(name, "must not be blank")
    if utf8_len(value, cap) > cap:
        raise ClientError(name, f"is over {cap} bytes (ENGINELINK_MAX_CONSTRAINT_BYTES)")
    return name, {key: value}


def rows(request_id: str, messages: list[Message]) -> list[lane.Row]:
    """The core's messages of one call as the lane's rows (one per message: a chunk's tokens; a complete's
    finish, with its tokens unless the call streamed, where the chunks carried them)."""
    out = []
    for m in messages:
        positions = m.logprobs or ()
        logprobs = dict(logprob_values=[p[0] for p in positions], logprob_ids=[p[1] for p in positions],
                        top_values=[list(p[2]) for p in positions] if m.logprobs_top else [],
                        top_ids=[list(p[3]) for p in positions] if m.logprobs_top else [])
        if type(m) is Chunk:
            out.append(lane.Row(request_id, list(m.token_ids), prompt_tokens=m.prompt_tokens,
                                completion_tokens=m.completion_tokens, cached_tokens=m.cached_tokens, **logprobs))
            continue
        assert type(m) is Complete
        matched = m.matched_token_id if m.matched_token_id is not None else m.matched_stop_str
        out.append(lane.Row(request_id, [] if m.stream else list(m.output_ids), finish=m.finish_reason,
                            matched=matched, prompt_tokens=m.prompt_tokens, completion_tokens=m.completion_tokens,
                            cached_tokens=m.cached_tokens, **(logprobs if not m.stream else {})))
    return out


def abort_row(request_id: str, error: ServicerError) -> lane.Row:
    """A call that ended on a status: its terminal ``abort`` with the message and the HTTP status."""
    return lane.Row(request_id, [], finish="abort", message=str(error),
                    status=HTTP_STATUS.get(error.status.name, 500))


class LaneEdge:
    """The lane's edge (``contract.ContractEdge``): the core's messages go out as they are (``rows``)."""

    name = NAME
    id_field = "rid"
    validate = staticmethod(validate_generate)
    chunk_body = None

    @staticmethod
    def encode(messages: list[Message]) -> list[Message]:
        return messages

    @staticmethod
    def raw_request_id(request: lane.GenerateRequest) -> str:
        return request.rid or ""

    release_params = staticmethod(no_release_params)


LANE_EDGE = LaneEdge()

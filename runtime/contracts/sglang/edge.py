"""The ``sglang.grpc.scheduler.SglangScheduler`` contract's edge: its GenerateRequest in, its responses out.

The same four members as the vLLM edge (``runtime/requests/contract.py``),
with SGLang's semantics (``reference/sglang-contract.md`` §2, §3):

- proto3 zeros are not SGLang's defaults: ``temperature`` 0 is greedy (the
  router sends 1.0 when the client omits it), ``top_p`` 0 → 1, ``top_k`` 0
  or -1 → off, ``repetition_penalty`` 0 → 1; ``max_new_tokens`` unset → the
  rest of the context (SGLang's own default);
- the servicer matches stop strings itself (the core's ``stops.py``; the
  scheduler gets none), ``no_stop_trim`` keeps the matched stop in the text,
  stop ids, ``min_new_tokens``, ``ignore_eos``, ``logit_bias`` (string keys)
  and the four constraint kinds go to the engine;
- ``n > 1``: n engine requests of one sample each, as SGLang's front end runs
  them (its shared-prefill ``<id>-prefix`` request is an optimisation the
  engine's prefix cache gives anyway: the n requests share their prompt's
  blocks), each choice's messages tagged with its ``index``;
- logprobs: ``return_logprob`` + ``top_logprobs_num``; prompt logprobs when
  ``logprob_start_len >= 0`` (only from the first prompt token);
  each chunk carries its own positions (deltas), counts are cumulative;
- every response repeats the call's ``request_id``, as the reference's do
  (the handler stamps them: ``call_stamp.py``);
- refused before the engine, naming the field: no ``tokenized``, hidden
  states, multimodal input, input embeddings, LoRA, a custom logit processor,
  ``token_ids_logprob``, PD bootstrap params (this worker is not a PD leg).
"""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message, choice_engine_id
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.call_stamp import StampedCall
from enginelink.runtime.contracts.shared.chunk_bytes import stream_chunk, string_field
from enginelink.runtime.requests.constraints import Constraint, constraint_of
from enginelink.runtime.requests.inputs import stop_strings as _stop_strings, utf8_len
from enginelink.runtime.contracts.shared.pb_fields import (
    check_dp_rank, check_logit_bias, check_max_tokens, check_min_p, check_n, check_penalties, check_prompt_room,
    check_token_ids, check_top_p, fill_chunk, fill_matched, fill_output_logprobs, fill_prompt_logprobs, finite,
    logprobs_cap, no_release_params, raw_request_id,
)
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec

NAME = "sglang"
SERVICE = "sglang.grpc.scheduler.SglangScheduler"
# SGLang's grammar backend when the engine does not name one (the reference's GetServerInfo default).
SGLANG_GRAMMAR_BACKEND = "xgrammar"


def validate_generate(request: pb.GenerateRequest, limits: EngineLimits, now: float) -> GenerateCall:
    """Check an SGLang ``GenerateRequest``; raise ClientError naming the field, or return the call."""
    _unsupported(request)
    sp = request.sampling_params
    prompt = _prompt(request, limits)
    max_tokens = check_max_tokens(sp, "max_new_tokens", prompt, limits)
    numbers = _sampling_numbers(sp, max_tokens)
    n = check_n(sp)
    stop_token_ids = tuple(check_token_ids("sampling_params.stop_token_ids", sp.stop_token_ids, limits.vocab_size))
    stop_strings = _stop_strings(sp.stop, limits.inputs)
    logprobs, prompt_logprobs = _logprobs(request, limits)
    constraint = _constraint(sp, limits)
    dp_rank = check_dp_rank(request, limits)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **numbers,
        stop_token_ids=stop_token_ids,
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=check_logit_bias(sp, limits, key_chars=40),
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        structured_outputs=constraint.params if constraint else None,
        grammar_backend=constraint.backend if constraint else None,
        no_stop_trim=sp.no_stop_trim,
        stream_interval=sp.stream_interval if sp.HasField("stream_interval") else None,
    )
    engine_ids = [choice_engine_id(request.request_id, index, n) for index in range(n)]
    specs = [GenerateSpec(request_id=engine_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                          data_parallel_rank=dp_rank) for engine_id in engine_ids]
    return StampedCall(
        request_id=request.request_id,
        stream=request.stream,
        prompt_token_ids=prompt,
        specs=specs,
        stop_strings=stop_strings,
        include_stop_str_in_output=sp.no_stop_trim,
        skip_special_tokens=sp.skip_special_tokens,
        max_tokens=max_tokens,
        engine_ids=engine_ids,
        constraint=constraint.field if constraint else None,
        grammar_backend=constraint.backend if constraint else None,
        id_field=string_field(b"\x0a", request.request_id),
    )


def _unsupported(request: pb.GenerateRequest) -> None:
    """What this worker cannot do, refused by name before anything reaches the engine."""
    if request.return_hidden_states:
        raise ClientError("return_hidden_states", "hidden states are not served by this worker")
    if request.HasField("mm_inputs"):
        raise ClientError("mm_inputs", "multimodal input is not supported by this worker (text-only)")
    if len(request.input_embeds):
        raise ClientError("input_embeds", "input embeddings are not supported; send tokenized.input_ids")
    if request.lora_id:
        raise ClientError("lora_id", "LoRA adapters are not served by this worker")
    if request.custom_logit_processor:
        raise ClientError("custom_logit_processor", "custom logit processors are not accepted by this worker")
    if len(request.token_ids_logprob):
        raise ClientError("token_ids_logprob", "logprobs of chosen token ids are not served by this worker")
    if request.HasField("disaggregated_params"):
        raise ClientError("disaggregated_params", "this worker is not a prefill/decode leg (no bootstrap server)")
    if request.sampling_params.HasField("custom_params") and request.sampling_params.custom_params.fields:
        raise ClientError("sampling_params.custom_params", "custom params are not accepted by this worker")


def _prompt(request: pb.GenerateRequest, limits: EngineLimits) -> list[int]:
    if not request.HasField("tokenized"):
        raise ClientError("tokenized", "an input is required (tokenized.input_ids; the router tokenizes)")
    prompt = check_token_ids("tokenized.input_ids", request.tokenized.input_ids, limits.vocab_size)
    return check_prompt_room(prompt, limits)


def _sampling_numbers(sp, max_tokens: int) -> dict:
    """SGLang's defaults for proto3 zeros, and its ranges (``SamplingParams.verify``)."""
    temperature = finite("sampling_params.temperature", sp.temperature)
    if temperature < 0:
        raise ClientError("sampling_params.temperature", f"must be >= 0, got {temperature}")
    top_p = check_top_p(sp)
    top_k = sp.top_k
    if top_k < -1:
        raise ClientError("sampling_params.top_k", f"must be -1 or 0 (off) or a positive count, got {top_k}")
    min_p = check_min_p(sp)
    check_penalties(sp)
    repetition_penalty = finite("sampling_params.repetition_penalty", sp.repetition_penalty) or 1.0
    if not 0 < repetition_penalty <= 2:
        raise ClientError("sampling_params.repetition_penalty", f"must be in (0, 2], got {repetition_penalty}")
    if sp.min_new_tokens > max_tokens:
        raise ClientError("sampling_params.min_new_tokens", f"{sp.min_new_tokens} exceeds max_new_tokens {max_tokens}")
    return {
        "temperature": temperature, "top_p": top_p, "top_k": 0 if top_k in (0, -1) else top_k, "min_p": min_p,
        "frequency_penalty": sp.frequency_penalty, "presence_penalty": sp.presence_penalty,
        "repetition_penalty": repetition_penalty, "min_tokens": sp.min_new_tokens,
    }  # fmt: skip


def _logprobs(request: pb.GenerateRequest, limits: EngineLimits) -> tuple[int | None, int | None]:
    """(sample, prompt) logprob counts: None unless ``return_logprob``; prompt ones from ``logprob_start_len``."""
    if not request.return_logprob:
        return None, None
    top = request.top_logprobs_num
    cap = logprobs_cap(limits)
    if not 0 <= top <= cap:
        raise ClientError("top_logprobs_num", f"must be in [0, {cap}], got {top}")
    start = request.logprob_start_len
    if start < -1:
        raise ClientError("logprob_start_len", f"must be -1 (no prompt logprobs) or >= 0, got {start}")
    if start > 0:
        raise ClientError("logprob_start_len", "prompt logprobs are served from the first prompt token only (0)")
    return top, (top if start == 0 else None)


def _constraint(sp, limits: EngineLimits) -> Constraint | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    backend = limits.grammar_backend if limits.grammar_backend not in ("", "auto") else SGLANG_GRAMMAR_BACKEND
    if kind != "ebnf_grammar":  # regex, json_schema, structural_tag: the shared checks
        return constraint_of(sp, limits.inputs, backend)
    name, value, cap = "sampling_params.ebnf_grammar", sp.ebnf_grammar, limits.inputs.constraint_bytes
    if not value.strip():
        raise ClientError(name, "must not be blank")
    size = utf8_len(value, cap)
    if size > cap:
        raise ClientError(name, f"is {size} bytes; at most {cap} (ENGINELINK_MAX_CONSTRAINT_BYTES)")
    return Constraint("ebnf_grammar", {"grammar": value}, backend, False)


# -- the responses ----------------------------------------------------------------------


def encode(messages: list[Message]) -> list[pb.GenerateResponse]:
    return [encode_chunk(m) if type(m) is Chunk else encode_complete(m) for m in messages]


def encode_chunk(m: Chunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse()
    chunk = message.chunk
    fill_chunk(chunk, m, m.completion_tokens)  # SGLang's running total
    if m.logprobs:
        fill_output_logprobs(chunk.output_logprobs, m.logprobs, m.logprobs_top)
    if m.prompt_logprobs is not None:
        fill_prompt_logprobs(chunk.input_logprobs, m.prompt_logprobs, pb.InputTokenLogProb)
    return message


def encode_complete(m: Complete) -> pb.GenerateResponse:
    complete = pb.GenerateComplete(
        output_ids=m.output_ids,
        finish_reason=m.finish_reason,
        prompt_tokens=m.prompt_tokens,
        completion_tokens=m.completion_tokens,
        cached_tokens=m.cached_tokens,
        index=m.index,
    )
    if m.prompt_logprobs is not None:
        fill_prompt_logprobs(complete.input_logprobs, m.prompt_logprobs, pb.InputTokenLogProb)
    if m.logprobs:
        fill_output_logprobs(complete.output_logprobs, m.logprobs, m.logprobs_top)
    fill_matched(complete, m)
    return pb.GenerateResponse(complete=complete)


def chunk_body(call, choice, tokens: list[int]) -> bytes:
    """``encode_chunk``'s message, stamped, as bytes (``chunk_bytes.py``), for the hub's fast path:
    ``request_id`` = 1 (made at validation), ``GenerateResponse.chunk`` = 2, the running
    ``completion_tokens``, ``index`` = 8."""
    return stream_chunk(call.spec.id_field, b"\x12", tokens, call.prompt_tokens, choice.tokens_sent + len(tokens),
                        choice.cached_tokens, b"\x40", choice.index)


class SglangEdge:
    """The SGLang contract's edge (``contract.ContractEdge``)."""

    name = NAME
    id_field = "request_id"
    validate = staticmethod(validate_generate)
    encode = staticmethod(encode)
    chunk_body = staticmethod(chunk_body)
    release_params = staticmethod(no_release_params)  # PD bootstrap params are refused (``_unsupported``)
    raw_request_id = staticmethod(raw_request_id)


SGLANG_EDGE = SglangEdge()

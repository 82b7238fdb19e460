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
  ``logprob_start_len >= 0``, from that prompt position on (the scheduler's
  own slice: the start position carries no value, then one per token to the
  prompt's end); a start past the prompt is refused (the scheduler aborts
  it), a start at its end asks for none; each chunk carries its own
  positions (deltas), counts are cumulative;
- every response repeats the call's ``request_id``, as the reference's do
  (the handler stamps them: ``call_stamp.py``);
- forwarded to the scheduler's own fields: ``lora_id`` (the scheduler
  serves the adapters its ``--lora-paths`` loaded, and aborts an unknown
  one itself), ``custom_logit_processor`` (only under SGLang's own
  ``--enable-custom-logit-processor``, as its front end requires; refused
  otherwise), ``require_reasoning``; the finish's ``reasoning_tokens``;
- router-preprocessed images (``mm_inputs``) in the scheduler's own
  ``MultimodalProcessorOutput`` (``mm_inputs.py``), on a model that takes
  them;
- refused before the engine, naming the field: no ``tokenized``, hidden
  states, input embeddings, ``token_ids_logprob``, and what ``mm_inputs.py``
  refuses;
- PD (``pd_bootstrap.py``): ``disaggregated_params`` (bootstrap host, port,
  room) go to the engine on a prefill/decode leg (``--disaggregation-mode``)
  and are required there, refused on a whole engine; a prefill leg under data
  parallelism runs the request on its room's residue rank.
"""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, Message, choice_engine_id
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.call_stamp import StampedCall
from enginelink.runtime.requests.chunk_bytes import stream_chunk, string_field
from enginelink.runtime.requests.constraints import Constraint, constraint_of
from enginelink.runtime.requests.inputs import stop_strings as _stop_strings, utf8_len
from enginelink.runtime.contracts.sglang.mm_inputs import mm_inputs_of
from enginelink.runtime.contracts.shared.pb_fields import (
    LogprobBudget, check_dp_rank, check_logit_bias, check_max_tokens, check_min_p, check_n, check_penalties,
    check_top_p, fill_chunk, fill_matched, finite, logprobs_cap, no_release_params, prompt_ids, raw_request_id,
    stop_token_ids as _stop_token_ids, with_logprobs,
)
from enginelink.runtime.requests.pd_bootstrap import bootstrap_params, leg_rank
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
    stop_token_ids = _stop_token_ids(sp, limits)
    stop_strings = _stop_strings(sp.stop, limits.inputs)
    logprobs, prompt_logprobs, prompt_start = _logprobs(request, limits, len(prompt))
    constraint = _constraint(sp, limits)
    dp_rank = check_dp_rank(request, limits)
    bootstrap = _bootstrap(request, limits, n)
    dp_rank = leg_rank(limits.pd_leg, bootstrap, dp_rank, limits.data_parallel_size, request.request_id)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        **numbers,
        stop_token_ids=stop_token_ids,
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prompt_logprobs_start=prompt_start,
        logit_bias=check_logit_bias(sp, limits, key_chars=40),
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        structured_outputs=constraint.params if constraint else None,
        grammar_backend=constraint.backend if constraint else None,
        no_stop_trim=sp.no_stop_trim,
        stream_interval=sp.stream_interval if sp.HasField("stream_interval") else None,
    )
    mm_inputs = mm_inputs_of(request, len(prompt), supports_vision=limits.supports_vision,
                             item_limits=limits.mm_item_limits, vocab_size=limits.vocab_size)
    engine_ids = [choice_engine_id(request.request_id, index, n) for index in range(n)]
    specs = [GenerateSpec(request_id=engine_id, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                          data_parallel_rank=dp_rank, lora_id=request.lora_id or None,
                          custom_logit_processor=_logit_processor(request, limits),
                          require_reasoning=request.require_reasoning, mm_inputs=mm_inputs,
                          kv_transfer_params=bootstrap)
             for engine_id in engine_ids]
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
    if len(request.input_embeds):
        raise ClientError("input_embeds", "input embeddings are not supported; send tokenized.input_ids")
    if len(request.token_ids_logprob):
        raise ClientError("token_ids_logprob", "logprobs of chosen token ids are not served by this worker")
    if request.sampling_params.HasField("custom_params") and request.sampling_params.custom_params.fields:
        raise ClientError("sampling_params.custom_params", "custom params are not accepted by this worker")


# A serialized processor is the client's code: bounded like a constraint's text.
LOGIT_PROCESSOR_BYTES_MAX = 65536
LORA_ID_CHARS_MAX = 256


def _logit_processor(request: pb.GenerateRequest, limits: EngineLimits) -> str | None:
    """The serialized custom logit processor, forwarded only where the scheduler runs them
    (SGLang's own ``--enable-custom-logit-processor``; its front end refuses it otherwise)."""
    if len(request.lora_id) > LORA_ID_CHARS_MAX:
        raise ClientError("lora_id", f"is {len(request.lora_id)} characters; at most {LORA_ID_CHARS_MAX}")
    processor = request.custom_logit_processor
    if not processor:
        return None
    if not limits.custom_logit_processors:
        raise ClientError("custom_logit_processor", "this worker's scheduler was not started with "
                          "--enable-custom-logit-processor (SGLang's flag), so it runs none")
    size = utf8_len(processor, LOGIT_PROCESSOR_BYTES_MAX)
    if size > LOGIT_PROCESSOR_BYTES_MAX:
        raise ClientError("custom_logit_processor", f"is {size} bytes; at most {LOGIT_PROCESSOR_BYTES_MAX}")
    return processor


def _bootstrap(request: pb.GenerateRequest, limits: EngineLimits, n: int) -> dict | None:
    """PD: ``disaggregated_params`` on a prefill/decode leg, required there and refused elsewhere
    (``pd_bootstrap.py``); one room is one request, so a leg serves n = 1."""
    params = request.disaggregated_params
    bootstrap = bootstrap_params(limits.pd_leg, "disaggregated_params", request.HasField("disaggregated_params"),
                                 params.bootstrap_host, params.bootstrap_port, params.bootstrap_room)
    if bootstrap is not None and n > 1:
        raise ClientError("sampling_params.n", f"{n} choices on a {limits.pd_leg.mode} leg: one bootstrap room "
                                               "carries one request's KV (n = 1)")
    return bootstrap


def _prompt(request: pb.GenerateRequest, limits: EngineLimits) -> list[int]:
    if not request.HasField("tokenized"):
        raise ClientError("tokenized", "an input is required (tokenized.input_ids; the router tokenizes)")
    return prompt_ids(request.tokenized.input_ids, limits)  # judged by their number before they are copied


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


def _logprobs(request: pb.GenerateRequest, limits: EngineLimits, prompt_len: int) -> tuple[int | None, int | None, int]:
    """(sample, prompt) logprob counts, and the prompt position the prompt's start from: None unless
    ``return_logprob``; prompt ones from ``logprob_start_len`` (SGLang's scheduler takes any start up to
    the prompt's length, and aborts one past it: refused here, before it)."""
    if not request.return_logprob:
        return None, None, 0
    top = request.top_logprobs_num
    cap = logprobs_cap(limits)
    if not 0 <= top <= cap:
        raise ClientError("top_logprobs_num", f"must be in [0, {cap}], got {top}")
    start = request.logprob_start_len
    if start < -1:
        raise ClientError("logprob_start_len", f"must be -1 (no prompt logprobs) or >= 0, got {start}")
    if start > prompt_len:
        raise ClientError("logprob_start_len", f"{start} is past the prompt's {prompt_len} tokens")
    if start == -1 or start == prompt_len:  # at the prompt's end: no prompt position left to return
        return top, None, 0
    return top, top, start


def _constraint(sp, limits: EngineLimits) -> Constraint | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    backend = limits.grammar_backend if limits.grammar_backend not in ("", "auto") else SGLANG_GRAMMAR_BACKEND
    # What the scheduler would abort, refused ahead of it (its grammar manager: none builds no grammar,
    # outlines compiles neither EBNF nor structural tags).
    if backend == "none":
        raise ClientError(f"sampling_params.{kind}", "this worker's scheduler runs no grammar backend "
                          "(grammar_backend none: --skip-tokenizer-init or --grammar-backend none)")
    if backend == "outlines" and kind in ("ebnf_grammar", "structural_tag"):
        raise ClientError(f"sampling_params.{kind}", "the scheduler's outlines grammar backend cannot compile it")
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


def encode(messages: list[Message]) -> list:
    """In order; a response over the step's logprob budget is a ``SlicedResponse`` (``logprob_bytes.py``)."""
    budget = LogprobBudget()
    return [encode_chunk(m, budget) if type(m) is Chunk else encode_complete(m, budget) for m in messages]


def encode_chunk(m: Chunk, budget: LogprobBudget | None = None):
    message = pb.GenerateResponse()
    fill_chunk(message.chunk, m, m.completion_tokens)  # SGLang's running total
    if m.logprobs or m.prompt_logprobs is not None:
        return with_logprobs(message, "chunk", m, pb.InputTokenLogProb, budget)
    return message


def encode_complete(m: Complete, budget: LogprobBudget | None = None):
    complete = pb.GenerateComplete(
        output_ids=m.output_ids,
        finish_reason=m.finish_reason,
        prompt_tokens=m.prompt_tokens,
        completion_tokens=m.completion_tokens,
        cached_tokens=m.cached_tokens,
        index=m.index,
        reasoning_tokens=m.reasoning_tokens,
    )
    fill_matched(complete, m)
    message = pb.GenerateResponse(complete=complete)
    if m.logprobs or m.prompt_logprobs is not None:
        return with_logprobs(message, "complete", m, pb.InputTokenLogProb, budget)
    return message


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
    # SGLang's scheduler has no add-and-abort (vLLM's ``abort_immediately``): a decode leg refused here
    # leaves the prefill side's KV to its own bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    release_params = staticmethod(no_release_params)
    raw_request_id = staticmethod(raw_request_id)


SGLANG_EDGE = SglangEdge()

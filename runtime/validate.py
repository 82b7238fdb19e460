"""Validate a Generate call and turn it into engine requests, or refuse it.

Rules:
- every refusal is a ``ClientError`` naming the field and what is wrong with
  it (INVALID_ARGUMENT); nothing refused ever reaches the engine;
- defaults follow the smg contract's mapping (reference servicer): unset
  temperature → 1.0, top_p 0 → 1.0, repetition_penalty 0 → 1.0, n 0 → 1,
  unset max_tokens → the rest of the context;
- ``n > 1`` becomes n independent engine requests (``<id>#<index>``; a seed
  becomes ``seed + index`` per choice, as vLLM's parallel sampling does);
- every client string is bounded (``runtime/inputs.py``, ``ENGINELINK_MAX_*``)
  before anything else looks at it: a request id lands in every journal
  record and snapshot of its call, stop strings cost work per token, JSON
  is parsed here. Ids may not take the servicer's reserved prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from enginelink.runtime import kv_transfer
from enginelink.runtime.constraints import DEFAULT_BACKEND, constraint_of
from enginelink.runtime.errors import ClientError
from enginelink.runtime.inputs import (
    InputLimits,
    check_request_id,
    input_limits,
    parse_json,
    stop_strings as _stop_strings,
)
from enginelink.wire.engine import GenerateSpec, SamplingSpec

# The most parallel samples one call may ask for; each is a full engine request.
N_MAX = 64
# vLLM's default --max-logprobs (the engine's own value comes with its facts).
LOGPROBS_MAX = 20
@dataclass(frozen=True)
class EngineLimits:
    """What validation needs to know about the engine behind the link."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    data_parallel_size: int = 1
    # The engine's --max-logprobs; -1: the whole vocabulary.
    max_logprobs: int = LOGPROBS_MAX
    # The engine's structured-output backend (its --structured-outputs-config), "auto" by default.
    grammar_backend: str = DEFAULT_BACKEND
    inputs: InputLimits = field(default_factory=input_limits)


@dataclass
class GenerateCall:
    """One validated Generate: the call, its choices' engine requests, and the
    servicer-side duties (stop strings) the engine does not do."""

    request_id: str
    stream: bool
    prompt_token_ids: list[int]
    specs: list[GenerateSpec]
    stop_strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    max_tokens: int = 0
    engine_ids: list[str] = field(default_factory=list)
    # The constraint's field (``sampling_params.regex``, …) and backend, when the call has one:
    # an engine error on such a call is reported as the constraint's failure (hub).
    constraint: str | None = None
    grammar_backend: str | None = None

    @property
    def n(self) -> int:
        return len(self.specs)


def choice_engine_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ClientError(name, f"must be a finite number, got {value}")
    return value


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    for position, token in enumerate(ids):
        if token >= vocab_size:
            raise ClientError(
                name, f"token id {token} at position {position} is outside the vocabulary (size {vocab_size})"
            )
    return ids


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
    cap = limits.vocab_size if limits.max_logprobs == -1 else min(limits.max_logprobs, limits.vocab_size)
    if asked > cap:
        raise ClientError(
            f"sampling_params.{name}",
            f"Requested {what} logprobs of {asked}, which is greater than max allowed: {cap}",
        )
    return value


def validate_generate(request, limits: EngineLimits, now: float) -> GenerateCall:
    """Check a ``vllm_engine_pb2.GenerateRequest``; raise ClientError or return the call."""
    inputs = limits.inputs
    request_id = request.request_id
    check_request_id("request_id", request_id, inputs)

    kind = request.WhichOneof("input")
    if kind == "text":
        raise ClientError("text", "text input is not supported; send tokenized.input_ids (the router tokenizes)")
    if kind != "tokenized":
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    prompt = _token_ids("tokenized.input_ids", request.tokenized.input_ids, limits.vocab_size)
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs) or request.HasField("media_refs"):
        raise ClientError("mm_inputs", "multimodal input is not supported by this worker (text-only)")

    sp = request.sampling_params
    if sp.HasField("truncate_prompt_tokens") and sp.truncate_prompt_tokens != 0:
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
        prompt = prompt[-keep:]
    if not prompt:
        raise ClientError("tokenized.input_ids", "must not be empty")
    if len(prompt) >= limits.max_model_len:
        raise ClientError(
            "tokenized.input_ids",
            f"prompt has {len(prompt)} tokens; the context is {limits.max_model_len}, "
            "which leaves no room for output",
        )
    room = limits.max_model_len - len(prompt)

    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
        if max_tokens < 1:
            raise ClientError("sampling_params.max_tokens", "must be at least 1")
        if max_tokens > room:
            raise ClientError(
                "sampling_params.max_tokens",
                f"{max_tokens} does not fit: the prompt has {len(prompt)} tokens and the context is "
                f"{limits.max_model_len}, so at most {room}",
            )
    else:
        max_tokens = room

    temperature = _finite("sampling_params.temperature", sp.temperature) if sp.HasField("temperature") else 1.0
    if temperature < 0:
        raise ClientError("sampling_params.temperature", f"must be >= 0, got {temperature}")
    top_p = _finite("sampling_params.top_p", sp.top_p) or 1.0
    if not 0 < top_p <= 1:
        raise ClientError("sampling_params.top_p", f"must be in (0, 1], got {top_p}")
    top_k = sp.top_k
    if top_k >= 2**31:
        raise ClientError("sampling_params.top_k", f"must be 0 (off) or a positive count, got {top_k - 2**32}")
    min_p = _finite("sampling_params.min_p", sp.min_p)
    if not 0 <= min_p <= 1:
        raise ClientError("sampling_params.min_p", f"must be in [0, 1], got {min_p}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _finite(f"sampling_params.{name}", getattr(sp, name))
        if not -2 <= value <= 2:
            raise ClientError(f"sampling_params.{name}", f"must be in [-2, 2], got {value}")
    repetition_penalty = _finite("sampling_params.repetition_penalty", sp.repetition_penalty) or 1.0
    if repetition_penalty < 0:
        raise ClientError("sampling_params.repetition_penalty", f"must be > 0, got {repetition_penalty}")
    if sp.min_tokens > max_tokens:
        raise ClientError("sampling_params.min_tokens", f"{sp.min_tokens} exceeds max_tokens {max_tokens}")

    n = sp.n or 1
    if n > N_MAX:
        raise ClientError("sampling_params.n", f"must be at most {N_MAX}, got {n}")
    stop_token_ids = tuple(_token_ids("sampling_params.stop_token_ids", sp.stop_token_ids, limits.vocab_size))
    stop_strings = _stop_strings(sp.stop, inputs)

    logprobs = _logprobs(sp, "logprobs", "sample", limits)
    prompt_logprobs = _logprobs(sp, "prompt_logprobs", "prompt", limits)
    logit_bias = None
    if sp.logit_bias:
        logit_bias = {}
        for token, bias in sp.logit_bias.items():
            if not 0 <= token < limits.vocab_size:
                # vLLM's front end (_validate_logit_bias) refuses it; its engine would index out of range.
                raise ClientError("sampling_params.logit_bias",
                                  f"token id {token} is outside the vocabulary (size {limits.vocab_size})")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ClientError("sampling_params.logit_bias", f"bias for {token} must be in [-100, 100]")
            logit_bias[token] = bias
    constraint = constraint_of(sp, inputs, limits.grammar_backend)

    # PD: the JSON field or the legacy message, checked as the reference does (runtime/kv_transfer.py).
    kv_transfer_params = kv_transfer.params_from_request(request, inputs)
    dp_rank = None
    if request.HasField("data_parallel_rank"):
        dp_rank = request.data_parallel_rank
        if not 0 <= dp_rank < limits.data_parallel_size:
            # vLLM's words (input_processor.py), N = the ranks this servicer fronts.
            raise ClientError("data_parallel_rank", "out of range", words=(
                f"data_parallel_rank {dp_rank} is out of range [0, {limits.data_parallel_size})."))

    seed = sp.seed if sp.HasField("seed") else None
    specs = []
    engine_ids = []
    for index in range(n):
        engine_id = choice_engine_id(request_id, index, n)
        engine_ids.append(engine_id)
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=sp.min_tokens,
            stop_token_ids=stop_token_ids,
            eos_token_ids=limits.eos_token_ids,
            ignore_eos=sp.ignore_eos,
            seed=None if seed is None else seed + index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            structured_outputs=constraint.params if constraint else None,
            grammar_backend=constraint.backend if constraint else None,
            grammar_backend_auto=constraint.backend_was_auto if constraint else False,
        )
        specs.append(
            GenerateSpec(
                request_id=engine_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                arrival_time=now,
                data_parallel_rank=dp_rank,
                kv_transfer_params=kv_transfer_params,
                # The gateway shaped the constraint to start at the first generated token.
                reasoning_ended=True if constraint and sp.grammar_from_first_token else None,
            )
        )
    return GenerateCall(
        request_id=request_id,
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

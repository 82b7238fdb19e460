"""Validate a Generate call and turn it into engine requests, or refuse it.

Rules:
- every refusal is a ``ClientError`` naming the field and what is wrong with
  it (INVALID_ARGUMENT); nothing refused ever reaches the engine;
- defaults follow the smg contract's mapping (reference servicer): unset
  temperature → 1.0, top_p 0 → 1.0, repetition_penalty 0 → 1.0, n 0 → 1,
  unset max_tokens → the rest of the context;
- ``n > 1`` becomes n independent engine requests (``<id>#<index>``; a seed
  becomes ``seed + index`` per choice, as vLLM's parallel sampling does);
- every client string is bounded (``InputLimits``, ``ENGINELINK_MAX_*``)
  before anything else looks at it: a request id lands in every journal
  record and snapshot of its call, stop strings cost work per token, JSON
  is parsed here. Ids may not take the servicer's reserved prefixes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from enginelink.machines.link import WARMUP_REQUEST_PREFIX
from enginelink.runtime.errors import ClientError
from enginelink.wire.engine import GenerateSpec, SamplingSpec

# The most parallel samples one call may ask for; each is a full engine request.
N_MAX = 64
# vLLM's default --max-logprobs.
LOGPROBS_MAX = 20
# Request-id prefixes the servicer gives its own requests; a client's id may not
# start with one (a client id taking the warm-up's prefix would be admitted
# during warm-up, hidden from the metrics, and collide with the warm-up's ids).
RESERVED_ID_PREFIXES = (WARMUP_REQUEST_PREFIX,)


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one client may send (``ENGINELINK_MAX_*``; docs/limits.md, "Request input").

    Stop strings: OpenAI allows 4, TGI 4 by default, vLLM any number; 64
    strings of at most 1 KiB and 4 KiB together cover chat templates' stop
    sets many times over, and bound the per-call automaton (runtime/stops.py)
    to ~0.5 MB and ~10 ms to build. Ids: the router sends ~40-byte uuids.
    """

    request_id_bytes: int = 256  # ENGINELINK_MAX_REQUEST_ID_BYTES
    stop_strings: int = 64  # ENGINELINK_MAX_STOP_STRINGS
    stop_string_bytes: int = 1024  # ENGINELINK_MAX_STOP_STRING_BYTES, each
    stop_bytes_total: int = 4096  # ENGINELINK_MAX_STOP_BYTES_TOTAL, all of one call's
    constraint_bytes: int = 65536  # ENGINELINK_MAX_CONSTRAINT_BYTES: json_schema, regex, grammar, structural_tag, choices
    kv_transfer_params_bytes: int = 16384  # ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES
    json_depth: int = 64  # ENGINELINK_MAX_JSON_DEPTH: nesting of json_schema and kv_transfer_params_json


# The environment variable of each InputLimits field.
INPUT_LIMIT_ENV = {
    "request_id_bytes": "ENGINELINK_MAX_REQUEST_ID_BYTES",
    "stop_strings": "ENGINELINK_MAX_STOP_STRINGS",
    "stop_string_bytes": "ENGINELINK_MAX_STOP_STRING_BYTES",
    "stop_bytes_total": "ENGINELINK_MAX_STOP_BYTES_TOTAL",
    "constraint_bytes": "ENGINELINK_MAX_CONSTRAINT_BYTES",
    "kv_transfer_params_bytes": "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES",
    "json_depth": "ENGINELINK_MAX_JSON_DEPTH",
}


class InputKnobError(ValueError):
    """An ``ENGINELINK_MAX_*`` setting that is not a positive whole number (serve exits 2)."""


def input_limits_from(environ: Mapping[str, str]) -> InputLimits:
    values = {}
    for spec in fields(InputLimits):
        name = INPUT_LIMIT_ENV[spec.name]
        text = environ.get(name, "").strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            raise InputKnobError(f"{name}={text!r}: expected a whole number") from None
        if value < 1:
            raise InputKnobError(f"{name}={text!r}: must be at least 1")
        values[spec.name] = value
    return InputLimits(**values)


@functools.cache
def input_limits() -> InputLimits:
    """The process's limits, read from the environment once (``serve`` checks them at start-up)."""
    return input_limits_from(os.environ)


@dataclass(frozen=True)
class EngineLimits:
    """What validation needs to know about the engine behind the link."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    data_parallel_size: int = 1
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


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _utf8_len(text: str, cap: int) -> int:
    """``len(text.encode())``, without encoding a text that is over ``cap`` by its length alone."""
    return len(text) if len(text) > cap else len(text.encode("utf-8", "surrogatepass"))


def check_request_id(name: str, request_id: str, limits: InputLimits) -> None:
    """Refuse an id the servicer will not take from a client (empty, too long, reserved, control characters)."""
    if not request_id:
        raise ClientError(name, "must not be empty")
    size = _utf8_len(request_id, limits.request_id_bytes)
    if size > limits.request_id_bytes:
        raise ClientError(
            name, f"is {size} bytes; at most {limits.request_id_bytes} (ENGINELINK_MAX_REQUEST_ID_BYTES)"
        )
    for prefix in RESERVED_ID_PREFIXES:
        if request_id.startswith(prefix):
            raise ClientError(name, f"must not start with {prefix!r}: reserved for the servicer's own requests")
    control = _CONTROL_CHARACTERS.search(request_id)
    if control is not None:
        raise ClientError(name, f"must not hold control characters (U+{ord(control.group()):04X})")


def _stop_strings(stops, limits: InputLimits) -> tuple[str, ...]:
    name = "sampling_params.stop"
    if len(stops) > limits.stop_strings:
        raise ClientError(name, f"{len(stops)} stop strings; at most {limits.stop_strings} (ENGINELINK_MAX_STOP_STRINGS)")
    total = 0
    for position, stop in enumerate(stops):
        if not stop:
            raise ClientError(name, "stop strings must not be empty")
        size = _utf8_len(stop, limits.stop_string_bytes)
        if size > limits.stop_string_bytes:
            raise ClientError(
                name, f"stop string {position} is {size} bytes; at most {limits.stop_string_bytes} "
                "(ENGINELINK_MAX_STOP_STRING_BYTES)",
            )
        total += size
    if total > limits.stop_bytes_total:
        raise ClientError(
            name, f"stop strings total {total} bytes; at most {limits.stop_bytes_total} (ENGINELINK_MAX_STOP_BYTES_TOTAL)"
        )
    return tuple(stops)


def _json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in node if isinstance(child, (dict, list)))
    return deepest


def _json(name: str, text: str, bytes_max: int, knob: str, limits: InputLimits):
    """Parse client JSON, bounded in size (checked first) and nesting depth."""
    size = _utf8_len(text, bytes_max)
    if size > bytes_max:
        raise ClientError(name, f"is {size} bytes; at most {bytes_max} ({knob})")
    try:
        value = json.loads(text)
    except RecursionError:
        # The C parser nests on the stack: far deeper than the limit, refused all the same.
        raise ClientError(name, f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)") from None
    except ValueError as error:
        raise ClientError(name, f"is not valid JSON: {error}") from None
    if _json_depth(value) > limits.json_depth:
        raise ClientError(name, f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)")
    return value


def _json_nesting(name: str, text: str, limits: InputLimits) -> None:
    """Refuse JSON nested past the limit; text that is not JSON is left for the engine to judge."""
    try:
        too_deep = _json_depth(json.loads(text)) > limits.json_depth
    except RecursionError:
        too_deep = True
    except ValueError:
        return
    if too_deep:
        raise ClientError(
            f"sampling_params.{name}", f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)"
        )


def validate_abort_ids(request_ids, limits: InputLimits) -> list[str]:
    """The ids of an Abort call; refuses what no client call can be in flight under (a warm-up's, say).

    An empty id stays what the contract makes any unknown id: a no-op.
    """
    ids = list(request_ids)
    for request_id in ids:
        if request_id:
            check_request_id("request_ids", request_id, limits)
    return ids


def _structured_outputs(sp, limits: InputLimits) -> dict | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    name = f"sampling_params.{kind}"
    cap = limits.constraint_bytes
    if kind == "json_object":
        return {"json_object": True} if sp.json_object else None
    if kind == "choice":
        choices = list(sp.choice.choices)
        if not choices:
            raise ClientError(name, "needs at least one choice")
        size = sum(_utf8_len(c, cap) for c in choices)
        if size > cap:
            raise ClientError(name, f"choices total {size} bytes; at most {cap} (ENGINELINK_MAX_CONSTRAINT_BYTES)")
        return {"choice": choices}
    value = getattr(sp, kind)
    if not value:
        raise ClientError(name, "must not be empty")
    if kind == "json_schema":
        return {"json": _json(name, value, cap, "ENGINELINK_MAX_CONSTRAINT_BYTES", limits)}
    size = _utf8_len(value, cap)
    if size > cap:
        raise ClientError(name, f"is {size} bytes; at most {cap} (ENGINELINK_MAX_CONSTRAINT_BYTES)")
    if kind == "structural_tag":
        _json_nesting("structural_tag", value, limits)
    if kind in ("regex", "grammar", "structural_tag"):
        return {kind: value}
    raise ClientError("sampling_params.constraint", f"unknown constraint kind {kind!r}")


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

    for name in ("logprobs", "prompt_logprobs"):
        if sp.HasField(name):
            raise ClientError(f"sampling_params.{name}", "logprobs are not supported by enginelink yet")
    logit_bias = None
    if sp.logit_bias:
        logit_bias = {}
        for token, bias in sp.logit_bias.items():
            if not 0 <= token < limits.vocab_size:
                raise ClientError("sampling_params.logit_bias", f"token id {token} is outside the vocabulary")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ClientError("sampling_params.logit_bias", f"bias for {token} must be in [-100, 100]")
            logit_bias[token] = bias
    structured = _structured_outputs(sp, inputs)

    kv_transfer_params = None
    if request.HasField("kv_transfer_params_json"):
        kv_transfer_params = _json(
            "kv_transfer_params_json", request.kv_transfer_params_json, inputs.kv_transfer_params_bytes,
            "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES", inputs,
        )
        if not isinstance(kv_transfer_params, dict):
            raise ClientError("kv_transfer_params_json", "must be a JSON object")
    dp_rank = None
    if request.HasField("data_parallel_rank"):
        dp_rank = request.data_parallel_rank
        if not 0 <= dp_rank < limits.data_parallel_size:
            raise ClientError(
                "data_parallel_rank", f"{dp_rank} is not a rank of this engine (0..{limits.data_parallel_size - 1})"
            )

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
            logit_bias=logit_bias,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            structured_outputs=structured,
        )
        specs.append(
            GenerateSpec(
                request_id=engine_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                arrival_time=now,
                data_parallel_rank=dp_rank,
                kv_transfer_params=kv_transfer_params,
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
    )

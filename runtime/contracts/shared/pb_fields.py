"""The field checks and response fills the four contracts' edges share (vLLM, MLX, SGLang, TokenSpeed).

Each edge (a wing's ``edge.py``) keeps what is its own: which fields it has,
their defaults, the order it checks them in and its error words where they
differ. What is the same in every contract, to the letter, lives here once, so
a fix to a vocabulary check or a logprob fill reaches all four. The proto
classes differ per contract; every function takes the message (or the class
it needs) as an argument and touches only fields all four protos share.
"""

from __future__ import annotations

import math

from enginelink.runtime.errors import ClientError
# check_token_ids: in inputs.py, since Embed (runtime/requests/embed.py) checks its ids with it too.
from enginelink.runtime.requests.inputs import check_count, check_token_ids  # noqa: F401
# The logprob fills live with their sliced form (issue 38); the edges import them from here.
from enginelink.runtime.requests.logprob_bytes import (  # noqa: F401
    LogprobBudget, fill_output_logprobs, fill_prompt_logprobs, with_logprobs,
)
from enginelink.runtime.requests.validate import N_MAX, EngineLimits

# -- the request ---------------------------------------------------------------------------


def finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ClientError(name, f"must be a finite number, got {value}")
    return value


def stop_token_ids(sp, limits: EngineLimits) -> tuple[int, ...]:
    """``stop_token_ids``: counted before they are copied (each choice's engine request gets them all), in the
    vocabulary."""
    name = "sampling_params.stop_token_ids"
    check_count(name, sp.stop_token_ids, limits.inputs.stop_token_ids, "ENGINELINK_MAX_STOP_TOKEN_IDS", "stop token ids")
    return tuple(check_token_ids(name, sp.stop_token_ids, limits.vocab_size))


def tokenized_ids(request):
    """The ``input`` oneof's token ids, as the request holds them (vLLM's and MLX's requests): ``text`` is
    refused, as the references do. Not copied: the caller judges their number first (``prompt_ids``)."""
    kind = request.WhichOneof("input")
    if kind == "text":
        raise ClientError("text", "text input is not supported; send tokenized.input_ids (the router tokenizes)")
    if kind != "tokenized":
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    return request.tokenized.input_ids


def prompt_ids(ids, limits: EngineLimits) -> list[int]:
    """A prompt's ids: not empty, room left in the context, judged by their number before anything copies
    them (issue 38: a 32M-token prompt was copied into a Python list, +1.5 GB, before it was refused);
    then in the vocabulary."""
    return check_token_ids("tokenized.input_ids", check_prompt_room(ids, limits), limits.vocab_size)


def check_prompt_room(prompt, limits: EngineLimits):
    """A prompt that is not empty and leaves at least one token of the context to generate (by its length:
    a list, or the request's repeated field before it is copied)."""
    if not len(prompt):
        raise ClientError("tokenized.input_ids", "must not be empty")
    if len(prompt) >= limits.max_model_len:
        raise ClientError(
            "tokenized.input_ids",
            f"prompt has {len(prompt)} tokens; the context is {limits.max_model_len}, "
            "which leaves no room for output",
        )
    return prompt


def check_max_tokens(sp, field: str, prompt: list[int], limits: EngineLimits) -> int:
    """The output bound (``max_tokens`` or ``max_new_tokens``, as ``field``), or the rest of the context when unset."""
    room = limits.max_model_len - len(prompt)
    if not sp.HasField(field):
        return room
    value = getattr(sp, field)
    if value < 1:
        raise ClientError(f"sampling_params.{field}", "must be at least 1")
    if value > room:
        raise ClientError(
            f"sampling_params.{field}",
            f"{value} does not fit: the prompt has {len(prompt)} tokens and the context is "
            f"{limits.max_model_len}, so at most {room}",
        )
    return value


def check_n(sp) -> int:
    """``n`` (0, proto3's unset, is 1), at most ``N_MAX`` choices."""
    n = sp.n or 1
    if n > N_MAX:
        raise ClientError("sampling_params.n", f"must be at most {N_MAX}, got {n}")
    return n


def check_top_p(sp) -> float:
    top_p = finite("sampling_params.top_p", sp.top_p) or 1.0  # proto3's 0 is unset: 1
    if not 0 < top_p <= 1:
        raise ClientError("sampling_params.top_p", f"must be in (0, 1], got {top_p}")
    return top_p


def check_min_p(sp) -> float:
    min_p = finite("sampling_params.min_p", sp.min_p)
    if not 0 <= min_p <= 1:
        raise ClientError("sampling_params.min_p", f"must be in [0, 1], got {min_p}")
    return min_p


def check_penalties(sp) -> None:
    """``frequency_penalty`` and ``presence_penalty`` in [-2, 2]."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = finite(f"sampling_params.{name}", getattr(sp, name))
        if not -2 <= value <= 2:
            raise ClientError(f"sampling_params.{name}", f"must be in [-2, 2], got {value}")


def vllm_sampling_numbers(sp) -> dict:
    """vLLM's sampling numbers (MLX's are the same fields): temperature unset → 1.0, nucleus,
    top-k (uint32: a negative one arrives wrapped), min-p, penalties; 0 = off."""
    temperature = finite("sampling_params.temperature", sp.temperature) if sp.HasField("temperature") else 1.0
    if temperature < 0:
        raise ClientError("sampling_params.temperature", f"must be >= 0, got {temperature}")
    top_p = check_top_p(sp)
    top_k = sp.top_k
    if top_k >= 2**31:
        raise ClientError("sampling_params.top_k", f"must be 0 (off) or a positive count, got {top_k - 2**32}")
    min_p = check_min_p(sp)
    check_penalties(sp)
    repetition_penalty = finite("sampling_params.repetition_penalty", sp.repetition_penalty) or 1.0
    if repetition_penalty < 0:
        raise ClientError("sampling_params.repetition_penalty", f"must be > 0, got {repetition_penalty}")
    return {
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "frequency_penalty": sp.frequency_penalty, "presence_penalty": sp.presence_penalty,
        "repetition_penalty": repetition_penalty,
    }  # fmt: skip


def logprobs_cap(limits: EngineLimits) -> int:
    """The most logprobs per position the engine serves (its ``--max-logprobs``; -1 there: the vocabulary)."""
    return limits.vocab_size if limits.max_logprobs == -1 else min(limits.max_logprobs, limits.vocab_size)


def check_logit_bias(sp, limits: EngineLimits, *, key_chars: int | None = None) -> dict[int, float] | None:
    """``logit_bias`` as {token: bias}: ids in the vocabulary, biases in [-100, 100].

    ``key_chars``: the contract's keys are strings (SGLang's, TokenSpeed's), and
    this much of one that is not a token id is quoted back; None: integer keys (vLLM's).
    """
    if not sp.logit_bias:
        return None
    # Counted before it is walked: each choice's engine request gets all of it.
    check_count("sampling_params.logit_bias", sp.logit_bias, limits.inputs.logit_bias_entries,
                "ENGINELINK_MAX_LOGIT_BIAS_ENTRIES", "entries")
    bias: dict[int, float] = {}
    for key, value in sp.logit_bias.items():
        if key_chars is None:
            token = key
        else:
            try:
                token = int(key)
            except ValueError:
                raise ClientError("sampling_params.logit_bias", f"key {key[:key_chars]!r} is not a token id") from None
        if not 0 <= token < limits.vocab_size:
            # vLLM's front end (_validate_logit_bias) refuses it; its engine would index out of range.
            raise ClientError("sampling_params.logit_bias",
                              f"token id {token} is outside the vocabulary (size {limits.vocab_size})")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise ClientError("sampling_params.logit_bias", f"bias for {token} must be in [-100, 100]")
        bias[token] = value
    return bias


def check_dp_rank(request, limits: EngineLimits) -> int | None:
    """The DP rank a request pins, within the ranks this servicer fronts (SGLang's and TokenSpeed's words)."""
    if not request.HasField("data_parallel_rank"):
        return None
    rank = request.data_parallel_rank
    if not 0 <= rank < limits.data_parallel_size:
        raise ClientError("data_parallel_rank", f"{rank} is out of range [0, {limits.data_parallel_size})")
    return rank


def raw_request_id(request) -> str:
    return request.request_id


def no_release_params(request, limits) -> None:
    """A contract without PD legs: a refused call holds no KV on a prefill side."""
    return None


# -- the responses -------------------------------------------------------------------------


def fill_chunk(chunk, m, completion_tokens: int) -> None:
    """A ``GenerateStreamChunk`` in place (filled, not built apart: the constructor would copy it, ~2x, upb)."""
    chunk.token_ids.extend(m.token_ids)
    chunk.prompt_tokens = m.prompt_tokens
    chunk.completion_tokens = completion_tokens
    chunk.cached_tokens = m.cached_tokens
    chunk.index = m.index


def fill_matched(complete, m) -> None:
    """The complete's matched stop: the string when one matched, else the token id (the oneof's two sides)."""
    if m.matched_stop_str is not None:
        complete.matched_stop_str = m.matched_stop_str
    elif m.matched_token_id is not None:
        complete.matched_token_id = m.matched_token_id

"""A second gRPC contract, as small as one can be: its own request and response shapes, and its edge.

It exists to show the seam (``runtime/requests/contract.py``): the request core and
the hub serve it unchanged, and ``test_second_contract.py`` runs the
simulation's seeds through it. Nothing here is vLLM's: the request is a
msgspec Struct with its own field names, the responses are two Structs with
their own finish codes, and the validator is its own (it checks fewer
fields than vLLM's, because the toy has fewer).

``toy_request`` / ``as_checked`` are the toy's *client*: what a simulated
client sends for a plan, and how it reads what came back, as the checks
read every client's messages.
"""

from __future__ import annotations

import math

import msgspec
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.machines.request_api import Chunk, Complete, GenerateCall, choice_engine_id
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import check_request_id, stop_strings
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from tests.sim.scenario import ClientPlan

# -- the toy contract's messages ----------------------------------------------------


class ToyAsk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tokens: list[int]
    stream: bool = False
    max_new: int | None = None
    min_new: int = 0
    samples: int = 1
    heat: float | None = None
    seed: int | None = None
    keep_going: bool = False  # ignore EOS
    stop_words: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()


class ToyPiece(msgspec.Struct, frozen=True):
    sample: int
    tokens: list[int]
    prompt_len: int


# The toy's own finish codes.
TOY_CODES = {"stop": "S", "length": "L", "abort": "A", "error": "E"}
CODE_NAMES = {code: name for name, code in TOY_CODES.items()}


class ToyEnd(msgspec.Struct, frozen=True):
    sample: int
    code: str
    tokens: list[int]
    prompt_len: int
    stop_word: str | None = None
    stop_token: int | None = None


# -- the edge -----------------------------------------------------------------------


SAMPLES_MAX = 64


def validate(ask: ToyAsk, limits: EngineLimits, now: float) -> GenerateCall:
    check_request_id(ToyEdge.id_field, ask.id, limits.inputs)
    if not ask.tokens:
        raise ClientError("tokens", "must not be empty")
    for token in ask.tokens:
        if not 0 <= token < limits.vocab_size:
            raise ClientError("tokens", f"{token} is outside the vocabulary")
    room = limits.max_model_len - len(ask.tokens)
    if room < 1:
        raise ClientError("tokens", "leave no room in the context")
    max_new = room if ask.max_new is None else ask.max_new
    if not 1 <= max_new <= room:
        raise ClientError("max_new", f"must be in [1, {room}]")
    if ask.min_new > max_new:
        raise ClientError("min_new", "exceeds max_new")
    if not 1 <= ask.samples <= SAMPLES_MAX:
        raise ClientError("samples", f"must be in [1, {SAMPLES_MAX}]")
    heat = 1.0 if ask.heat is None else ask.heat
    if not (math.isfinite(heat) and heat >= 0):
        raise ClientError("heat", "must be a finite number >= 0")
    stops = stop_strings(ask.stop_words, limits.inputs)
    engine_ids = [choice_engine_id(ask.id, i, ask.samples) for i in range(ask.samples)]
    specs = [
        GenerateSpec(
            request_id=engine_id,
            prompt_token_ids=list(ask.tokens),
            sampling=SamplingSpec(
                max_tokens=max_new, min_tokens=ask.min_new, temperature=heat, ignore_eos=ask.keep_going,
                seed=None if ask.seed is None else ask.seed + i, stop_token_ids=ask.stop_tokens,
                eos_token_ids=limits.eos_token_ids,
            ),
            arrival_time=now,
        )
        for i, engine_id in enumerate(engine_ids)
    ]
    return GenerateCall(ask.id, ask.stream, list(ask.tokens), specs, stop_strings=stops, max_tokens=max_new,
                        engine_ids=engine_ids)


def encode(messages) -> list:
    out = []
    for m in messages:
        if type(m) is Chunk:
            out.append(ToyPiece(m.index, list(m.token_ids), m.prompt_tokens))
        else:
            assert type(m) is Complete
            out.append(ToyEnd(m.index, TOY_CODES[m.finish_reason], list(m.output_ids), m.prompt_tokens,
                              m.matched_stop_str, m.matched_token_id))
    return out


class ToyEdge:
    name = "toy"
    id_field = "id"
    raw_request_id = staticmethod(lambda ask: ask.id)
    validate = staticmethod(validate)
    encode = staticmethod(encode)
    chunk_body = None  # no hand-encoded bytes: every message goes through ``encode``

    @staticmethod
    def release_params(request, limits) -> None:
        return None  # no PD in the toy contract


TOY_EDGE = ToyEdge()


# -- the toy's client -----------------------------------------------------------------


def toy_request(plan: ClientPlan) -> ToyAsk:
    """What a toy client sends for a plan; a plan meant to be refused sends something the toy refuses."""
    ask = ToyAsk(
        id=plan.request_id, tokens=list(plan.prompt), stream=plan.stream, max_new=plan.max_tokens,
        min_new=plan.min_tokens, samples=plan.n, heat=plan.temperature, seed=plan.seed,
        keep_going=plan.ignore_eos, stop_words=tuple(plan.stop), stop_tokens=tuple(plan.stop_token_ids),
    )
    return ask if plan.bad is None else _spoil(ask, plan.bad)


def _spoil(ask: ToyAsk, bad: str) -> ToyAsk:
    replace = msgspec.structs.replace
    match bad:
        case "empty_id":
            return replace(ask, id="")
        case "no_input" | "text_input" | "empty_prompt":
            return replace(ask, tokens=[])
        case "token_outside_vocab":
            return replace(ask, tokens=[*ask.tokens, 1 << 20])
        case "prompt_fills_context":
            return replace(ask, tokens=[*ask.tokens, *[3] * 4096])
        case "max_tokens_too_big":
            return replace(ask, max_new=1 << 20)
        case "temperature_nan":
            return replace(ask, heat=float("nan"))
        case "temperature_negative":
            return replace(ask, heat=-0.5)
        case "n_above_64":
            return replace(ask, samples=65)
        case "empty_stop_string":
            return replace(ask, stop_words=("",))
        case "min_tokens_above_max":
            return replace(ask, max_new=2, min_new=3)
        case _:
            # vLLM-only faults (logprobs, logit bias, constraints, PD, DP pins): the toy has no such
            # fields, so its client's bad request is one the toy refuses for its own reason.
            return replace(ask, max_new=0)


def as_checked(message) -> pb.GenerateResponse:
    """A toy message as the checks read every client's (they speak vLLM's response)."""
    if isinstance(message, ToyPiece):
        return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
            token_ids=message.tokens, prompt_tokens=message.prompt_len, completion_tokens=len(message.tokens),
            index=message.sample))  # fmt: skip
    assert isinstance(message, ToyEnd), f"the toy contract does not send {type(message).__name__}"
    complete = pb.GenerateComplete(output_ids=message.tokens, finish_reason=CODE_NAMES[message.code],
                                   prompt_tokens=message.prompt_len, index=message.sample)
    if message.stop_word is not None:
        complete.matched_stop_str = message.stop_word
    elif message.stop_token is not None:
        complete.matched_token_id = message.stop_token
    return pb.GenerateResponse(complete=complete)

"""The engine-neutral side of every engine wire.

The gRPC layer and the machines speak only these types. Each engine's codec
(``wire/vllm.py`` first; SGLang and TokenSpeed next) turns them into its own
frames and its frames back into them, so a new engine plugs in without
touching ``machines/`` or ``runtime/grpc_*``.

Rules:
- sans-io: nothing here opens a socket, reads a clock or touches a file;
- one decode per engine frame: a codec returns one ``OutputBatch`` for one
  frame, and the per-request entries are the codec's own decoded structs (they
  only need the four attributes of ``EngineOutput``), never copies;
- finish reasons use vLLM's numbering (the first engine); other codecs map
  theirs onto it.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence

import msgspec


class FinishReason(enum.IntEnum):
    """Why an engine ended a request (vLLM 0.32 codes, used for every engine)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    @property
    def contract_name(self) -> str:
        """The string the smg contract puts in ``GenerateComplete.finish_reason``."""
        return _CONTRACT_NAMES[self]


_CONTRACT_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    # vLLM's repetition detector stops a request; the router knows only
    # stop/length/abort/error, and "stop" is what a client should see.
    FinishReason.REPETITION: "stop",
}


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Validated, defaulted sampling for one engine request (one choice).

    Built by the gRPC layer from the contract's SamplingParams after
    validation; every field here is already legal for the engine.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # The model's EOS ids; the engine stops on them unless ignore_eos.
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output: at most one of these, as vLLM's StructuredOutputsParams keys.
    structured_outputs: dict | None = None


class GenerateSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One engine request: what the engine must generate for one choice."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    arrival_time: float = 0.0
    data_parallel_rank: int | None = None
    cache_salt: str | None = None
    # Opaque PD connector params, passed verbatim (JSON object) when present.
    kv_transfer_params: dict | None = None
    trace_headers: dict[str, str] | None = None
    # Added and aborted at once by the engine, never run: how a servicer tells
    # the engine's KV connector about a PD request it refused, so the prefill
    # side's blocks are freed now rather than when the connector's lease ends.
    abort_immediately: bool = False


class EngineOutput(Protocol):
    """What the runtime reads from one per-request output entry."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None  # FinishReason value, None while running
    stop_reason: int | str | None  # matched stop token id (or string), if any
    kv_transfer_params: dict | None  # PD: the connector's params for the other leg (a finished request's)


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Engine load, as a rank reports it with its steps."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_counter: int = 0


class UtilityReply(msgspec.Struct, frozen=True):
    call_id: int
    failure: str | None
    result: object = None


class OutputBatch(msgspec.Struct, frozen=True):
    """Everything one engine output frame said."""

    engine_index: int
    outputs: Sequence[EngineOutput]
    stats: SchedulerStats | None = None
    utility: UtilityReply | None = None
    finished_requests: Sequence[str] | None = None
    timestamp: float = 0.0


class EngineDead(msgspec.Struct, frozen=True):
    """The engine said it died (vLLM's ``ENGINE_CORE_DEAD``)."""

    reason: str = "ENGINE_CORE_DEAD"


class WireError(Exception):
    """A frame from the engine that the codec cannot read: the engine's fault."""


class EngineCodec(Protocol):
    """Sans-io codec of one engine wire, front-end side."""

    name: str

    def encode_add(self, spec: GenerateSpec) -> list[bytes]: ...

    def encode_abort(self, request_ids: Sequence[str]) -> list[bytes]: ...

    def encode_utility(self, call_id: int, method: str, args: Sequence[object]) -> list[bytes]: ...

    def decode_output(self, frames: Sequence[bytes]) -> OutputBatch | EngineDead:
        """Raise WireError on a frame it cannot read."""
        ...

    def cached_tokens(self, output: EngineOutput) -> int | None:
        """Prompt tokens served from the prefix cache, if this output says (first output only)."""
        ...

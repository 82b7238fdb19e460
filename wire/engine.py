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
from typing import Any, Protocol, Sequence

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
    # The first prompt position whose logprob is returned (its own has none: it starts the slice):
    # SGLang's ``logprob_start_len``; vLLM's prompt logprobs always start at 0.
    prompt_logprobs_start: int = 0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output: at most one of these, as vLLM's StructuredOutputsParams keys.
    structured_outputs: dict | None = None
    # The grammar backend the front end resolved for it (runtime/requests/constraints.py), and
    # whether it was resolved from "auto"; each codec carries them as its engine needs.
    grammar_backend: str | None = None
    grammar_backend_auto: bool = False
    # SGLang / TokenSpeed only (vLLM's front end has no such knobs): keep a matched
    # stop token in the output, the engine's streaming interval, opaque custom params.
    no_stop_trim: bool = False
    stream_interval: int | None = None
    custom_params: dict | None = None


class PoolingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A pooling request (Embed): the engine runs the prompt once and returns one pooled tensor.

    ``task`` is the pooling task (``"embed"``); ``normalize`` is vLLM's
    ``use_activation`` for embed (L2-normalise the pooled vector), on by
    default as vLLM's front end sets it.
    """

    task: str = "embed"
    normalize: bool = True


class GenerateSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One engine request: what the engine must generate for one choice.

    With ``pooling`` set it is a pooling request instead (Embed): nothing is
    generated, ``sampling`` is unused (``max_tokens=1``, as vLLM's own
    ``Request`` has for pooling), and the codec sends pooling params in place
    of sampling params.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    arrival_time: float = 0.0
    data_parallel_rank: int | None = None
    cache_salt: str | None = None
    # Opaque PD connector params, passed verbatim (JSON object) when present.
    kv_transfer_params: dict | None = None
    trace_headers: dict[str, str] | None = None
    pooling: PoolingSpec | None = None
    # True: a constraint starts at the first generated token, whatever reasoning parser runs.
    reasoning_ended: bool | None = None
    # Added and aborted at once by the engine, never run: how a servicer tells
    # the engine's KV connector about a PD request it refused, so the prefill
    # side's blocks are freed now rather than when the connector's lease ends.
    abort_immediately: bool = False
    # Router-preprocessed media as vLLM's ``mm_features`` entries (``wire/vllm_mm.py``), codec-ready.
    mm_features: list | None = None
    # SGLang: the router's preprocessed image as the scheduler's ``MultimodalProcessorOutput``
    # (``wire/sglang_structs.py``), codec-ready.
    mm_inputs: object | None = None
    # SGLang only: the adapter id the router names (``lora_id``), a serialized custom logit processor
    # (the scheduler runs it under --enable-custom-logit-processor), and whether the prompt asks the
    # model to think (``require_reasoning``: the scheduler then defers a grammar past the thought).
    lora_id: str | None = None
    custom_logit_processor: str | None = None
    require_reasoning: bool = False


class EngineOutput(Protocol):
    """What the runtime reads from one per-request output entry."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None  # FinishReason value, None while running
    stop_reason: int | str | None  # matched stop token id (or string), if any
    kv_transfer_params: dict | None  # PD: the connector's params for the other leg (a finished request's)


class LogprobRows(msgspec.Struct, frozen=True, kw_only=True):
    """Logprobs of consecutive positions, as the engine computed them (vLLM's layout).

    ``rows`` positions of ``cols`` columns each, flat in row order: column 0
    is the position's own token (the sampled token, or the prompt token) and
    its logprob; columns 1.. are the top-(cols - 1) tokens, descending. The
    sequences are typically zero-copy views of the frame's bytes.
    """

    rows: int
    cols: int
    token_ids: Sequence[int]
    logprobs: Sequence[float]


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
    # The message's frames, for what the outputs point into (vLLM's large
    # arrays travel as further frames; see ``EngineCodec.logprobs``).
    frames: Sequence[bytes] = ()


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

    def logprobs(self, output: EngineOutput, frames: Sequence[bytes]) -> tuple[LogprobRows | None, LogprobRows | None]:
        """(this step's output logprobs, the prompt's logprobs) an output carries, each None if absent.

        Decoded only when asked (calls that requested logprobs), never on
        the decode of every frame. Raise WireError on arrays it cannot read.
        """
        ...


class HandshakeStep(enum.StrEnum):
    """What an engine rank says on the handshake socket: first HELLO, last READY."""

    HELLO = "HELLO"
    READY = "READY"


class HandshakeWire(Protocol):
    """Sans-io codec of one engine wire's start-up handshake, front-end side.

    vLLM's headless handshake (HELLO → init addresses → ready response and
    READY, in either order), which SMG's SGLang adapter and TokenSpeed's
    headless scheduler reuse with a few fields of their own. The handshake
    machine (``machines/handshake.py``) decides; this object only reads and
    writes one wire's messages, as typed structs. Every ``decode_*`` raises
    ``WireError`` on a message it cannot read.
    """

    engine: str  # how messages name the engine ("vLLM")

    def identity(self, rank: int) -> bytes:
        """The socket identity a DP rank speaks from."""
        ...

    def decode_status(self, payload: bytes) -> tuple[HandshakeStep, Any]:
        """A handshake-socket message: which step it is, and the typed message."""
        ...

    def encode_init(self, inputs: Sequence[str], outputs: Sequence[str]) -> bytes:
        """The init message: where the rank sends its inputs' answers and its outputs."""
        ...

    def decode_ready(self, payload: bytes) -> Any:
        """The ready response (the rank's first message on the input socket), typed."""
        ...

    def facts(self, ready: Any) -> dict:
        """The ready response as the runtime reads it (vLLM's key names)."""
        ...

    def version(self, ready: Any) -> str:
        """The release the ready response says the engine runs ("" when it does not say)."""
        ...

    def foreign(self, version: str) -> str | None:
        """The other engine a version names (SGLang's adapter says ``sglang-…``), or None if it is this wire's."""
        ...

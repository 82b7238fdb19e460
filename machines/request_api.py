"""The request core's vocabulary: the call it is given, and what it gives back.

- ``GenerateCall``: one validated call, contract-neutral (a contract's edge
  builds it from its own request message: ``runtime/contracts/vllm/edge.py``);
- ``Chunk`` / ``Complete``: what a call's writer takes, contract-neutral
  (the edge encodes them as its contract's response messages);
- ``Refusal`` / ``Failure``: why a call was not admitted, or ended badly,
  with whose fault it is; ``runtime/errors.py`` maps them to a status;
- ``Actions``: what one event asks of the shell, in order (journal records,
  engine requests to add, engine ids to abort per rank, calls to wake).

Rules: plain data; one ``Actions`` per event (an engine frame, an abort, a
take), never one per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from enginelink.wire.engine import GenerateSpec

if TYPE_CHECKING:
    from enginelink.machines.logprobs import Position, PromptLogprobs


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
    # an engine error on such a call is reported as the constraint's failure (request core).
    constraint: str | None = None
    grammar_backend: str | None = None
    # A PD prefill side's processed media, serialized (runtime/contracts/vllm/media_identity.py): every complete carries it.
    media_identity: bytes | None = None

    @property
    def n(self) -> int:
        return len(self.specs)


def choice_engine_id(request_id: str, index: int, n: int) -> str:
    """n > 1 becomes n engine requests ``<id>#<index>``; ``<id>`` itself when n = 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


class Chunk(NamedTuple):
    """New tokens of one choice of a streaming call."""

    index: int
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[Position] | None = None  # the call asked for them: this chunk's positions
    logprobs_top: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # on the choice's first chunk only
    # The choice's tokens sent so far, this chunk's included: a contract whose chunks carry running
    # counts (MLX's and SGLang's ``completion_tokens``) reads it; vLLM's carry the delta's length.
    completion_tokens: int = 0


class Complete(NamedTuple):
    """A choice's end; streamed, it repeats the last chunk's tokens (as the reference)."""

    index: int
    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    matched_stop_str: str | None = None
    matched_token_id: int | None = None
    kv_transfer_params: dict | None = None
    logprobs: list[Position] | None = None
    logprobs_top: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    # The call streamed: a contract whose streamed complete carries no tokens (MLX's) needs to know.
    stream: bool = False
    # The choice's tokens in all (streamed: every chunk's; else ``len(output_ids)``).
    completion_tokens: int = 0
    # Of them, the model's thinking (a wire that counts them: SGLang's ``reasoning_tokens``), else 0.
    reasoning_tokens: int = 0
    # The call's media identity (``GenerateCall.media_identity``), opaque here.
    media_identity: bytes | None = None


Message = Chunk | Complete


class Refusal(NamedTuple):
    """A call not admitted. ``kind``: ``duplicate`` (the client's: ALREADY_EXISTS) or
    ``unavailable`` (retry elsewhere: UNAVAILABLE), ``reason`` for metrics."""

    kind: str
    message: str
    reason: str = ""


class Failure(NamedTuple):
    """Why a call ended badly. ``kind``: ``engine`` (UNAVAILABLE: the engine's fault, retryable),
    ``constraint`` (FAILED_PRECONDITION: the engine refused the call's constraint, ``constraint``) or
    ``status`` (the engine ended it with a status of its own, ``code``: a gRPC status name; SGLang's
    aborts carry an HTTP status, ``wire/sglang.py`` ``abort_outcome``)."""

    kind: str
    message: str
    constraint: str | None = None
    code: str | None = None


class Actions:
    """What one event asks of the shell. ``records``: (time, stream, kind, payload) to journal;
    ``aborts``: (rank, engine ids) ABORT frames; ``touched``: calls with new messages (written at
    once where they can be, else woken), each once; ``wake``: calls whose writer must wake."""

    __slots__ = ("records", "aborts", "touched", "wake")

    def __init__(self) -> None:
        self.records: list[tuple[float, str, str, dict]] = []
        self.aborts: list[tuple[int, list[str]]] = []
        self.touched: list = []
        self.wake: list = []

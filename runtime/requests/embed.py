"""The Embed RPC: one pooling request from validation to its ``EmbedResponse``.

An Embed call is a one-choice call of the request hub, so it shares
everything a Generate call has that is not about tokens: the request machine
(admitted → running → finished | aborted | failed) and its journal records,
the in-flight cap, duplicate ids, the Abort RPC, a dead engine failing it,
draining. What differs is small and lives here:

- the engine request carries pooling params (``PoolingSpec``, task ``embed``)
  instead of sampling params (``wire/vllm.py``);
- its result is the pooled tensor on its last output, kept by the hub on the
  choice (``Choice.pooled``, a ``wire.vllm_arrays.Tensor``) and read here once;
- the answer is one ``Embedding`` (the vector and the prompt's length),
  never a stream; each contract's wing takes its ``EmbedRequest`` into an
  ``EmbedInput`` and the answer into its ``EmbedResponse`` (vLLM's and
  SGLang's).

Which requests an engine runs comes from its runner (``runner_type`` in the
engine facts: ``--runner pooling`` or what vLLM resolved for the model, and
the sim engine's ``--runner``): a generation engine answers Embed with
UNIMPLEMENTED, a pooling engine answers Generate the same (``check_generation``),
each naming the runner, before anything reaches the engine (``NotThisEngine``).

Validation (``validate_embed``) follows Generate's for the prompt: ids bounded,
tokenized input required, every id in the vocabulary, not empty, and the
prompt no longer than the context (a pooling model generates nothing, so the
whole context is the prompt's). Refusals are INVALID_ARGUMENT. The embedding
vector is never journaled (records carry counts; snapshots fold the journal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio

from enginelink.machines.request_api import GenerateCall
from enginelink.runtime.errors import (
    CallAborted,
    ClientError,
    EngineRequestFailed,
    NotThisEngine,
    ServicerError,
)
from enginelink.runtime.requests.inputs import check_request_id, check_token_ids, input_limits
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.runtime.requests.writers import counted
from enginelink.wire.engine import GenerateSpec, PoolingSpec, SamplingSpec, WireError

RUNNER_GENERATE = "generate"
RUNNER_POOLING = "pooling"


def runner_type(ready: dict) -> str:
    """The engine's runner from its facts; an engine that does not say is a generation engine."""
    return RUNNER_POOLING if ready.get("runner_type") == RUNNER_POOLING else RUNNER_GENERATE


def check_generation(ready: dict) -> None:
    """Refuse a Generate on a pooling engine (called by runtime/requests/generate.py before validation)."""
    if runner_type(ready) == RUNNER_POOLING:
        raise NotThisEngine(
            "Generate: this worker's engine runs a pooling (embedding) model (vLLM --runner pooling) and "
            "generates nothing; send generation requests to a worker started with a generation model"
        )


@dataclass(frozen=True, slots=True)
class EmbedInput:
    """An Embed request, contract-neutral: its id, and its token ids (None: it has no tokenized input).

    The ids as the request holds them (a protobuf repeated field): counted before they are copied."""

    request_id: str
    input_ids: Sequence[int] | None


@dataclass(frozen=True, slots=True)
class Embedding:
    """An Embed call's answer: the pooled vector and how many prompt tokens it pooled."""

    embedding: list[float]
    prompt_tokens: int

    @property
    def embedding_dim(self) -> int:
        return len(self.embedding)


@dataclass
class EmbedCall(GenerateCall):
    """A validated Embed: a one-choice, non-streaming hub call whose engine request pools."""

    task: str = "embed"


def validate_embed(request: EmbedInput, limits: EngineLimits, now: float) -> EmbedCall:
    """Check an Embed request; raise ClientError or return the call."""
    request_id = request.request_id
    check_request_id("request_id", request_id, limits.inputs)
    if request.input_ids is None:
        raise ClientError("tokenized", "an input is required (tokenized.input_ids)")
    ids = request.input_ids
    if not ids:
        raise ClientError("tokenized.input_ids", "must not be empty")
    if len(ids) > limits.max_model_len:  # by their number, before they are copied (issue 38)
        raise ClientError(
            "tokenized.input_ids",
            f"input has {len(ids)} tokens; the context is {limits.max_model_len}",
        )  # a pooling model generates nothing: the whole context is the prompt's, as vLLM allows
    prompt = check_token_ids("tokenized.input_ids", ids, limits.vocab_size)  # uint32 on the wire: never negative
    spec = GenerateSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        # Unused by a pooling request (the codec sends no sampling params); 1 as vLLM's own Request has.
        sampling=SamplingSpec(max_tokens=1),
        arrival_time=now,
        pooling=PoolingSpec(task="embed"),
    )
    return EmbedCall(
        request_id=request_id,
        stream=False,
        prompt_token_ids=prompt,
        specs=[spec],
        max_tokens=0,
        engine_ids=[request_id],
    )


@counted  # a drain's flush waits for it (runtime/requests/writers.py)
async def embed(app, request: EmbedInput, *, wake) -> Embedding:
    """Serve one Embed request through ``app.hub``; its answer, or a ``ServicerError``.

    ``wake``: what the hub sets when the call has news (an ``asyncio.Event``
    in a grpclib handler). A caller that goes away mid-call (cancellation)
    leaves an open call behind: it is aborted as ``client_gone``, as Generate's are.
    """
    hub = app.hub
    now = trio.current_time()
    try:
        # The id first, whatever the link's state (as Generate).
        check_request_id("request_id", request.request_id, input_limits())
        limits = app.limits  # UNAVAILABLE while the engine starts: its runner is not known yet
        if runner_type(app.ready) != RUNNER_POOLING:
            raise NotThisEngine(
                "Embed: this worker's engine runs a generation model; embeddings need an engine started "
                "as a pooling model (vLLM: --runner pooling, e.g. with --convert embed)"
            )
        call = hub.admit(validate_embed(request, limits, app.wall_time(now)), now, wake=wake)
    except ServicerError as error:
        app.refused(request.request_id, error, now)
        raise
    choice = call.choices[0]
    try:
        while not (call.error is not None or choice.finished):
            await wake.wait()
            wake.clear()
        if call.error is not None:
            raise call.error
        # Journals the choice's end (client.sent) and frees the id; the GenerateResponse it builds is not sent.
        hub.take(call, trio.current_time())
    finally:
        if call.machine.open:
            hub.abort([request.request_id], "client_gone", trio.current_time())
        hub.release(call)
    return _response(request.request_id, choice, call.prompt_tokens)


def _response(request_id: str, choice, prompt_tokens: int) -> Embedding:
    if choice.finish_reason == "abort":
        raise CallAborted(f"Embed request {request_id!r} was aborted before the engine answered")
    if choice.pooled is None:
        raise EngineRequestFailed(
            f"Embed request {request_id!r} did not produce a result (the engine ended it: {choice.finish_reason})"
        )
    if isinstance(choice.pooled, list):  # SGLang's BatchEmbeddingOutput: the vector itself (wire/sglang.py)
        return Embedding(choice.pooled, prompt_tokens)
    try:
        embedding = choice.pooled.floats()
    except WireError as error:
        raise EngineRequestFailed(f"Embed request {request_id!r}: the engine's pooled output is unreadable: {error}")
    return Embedding(embedding, prompt_tokens)

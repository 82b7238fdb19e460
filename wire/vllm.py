"""The vLLM headless EngineCore wire, as a sans-io msgspec codec.

The structs here are vLLM 0.32.0's (the canonical ones); every release from
0.28.0 to 0.34.0 is spoken through them, what a release does differently
(request fields, prompt ids as an array, utility arguments) coming from its
layout file (``wire/vllm_release.py``, ``wire/vllm_layout.py``). Both ends
of the wire live here, so the servicer and the sim engine can never
disagree about it: the front-end side (``VllmCodec``, the ``EngineCodec`` the
runtime uses), the handshake messages, and the engine side (``decode_input``,
``encode_outputs``) that the sim engine speaks. Facts come from
``reference/vllm-engine-wire.md``; section numbers below point there.

Rules:
- sans-io: no sockets, no clocks, no files. Frames in, frames out. The engine
  identity frame of the input ROUTER belongs to the socket layer, not here.
- one msgspec decode per output frame, with module-level typed decoders; the
  per-request ``EngineCoreOutput`` structs go to the runtime as they are (they
  satisfy ``EngineOutput``), never copied.
- positional structs keep vLLM's declaration order and only ever grow at the
  end; every field past the required prefix has vLLM's default, so shorter
  arrays (older senders, hand-written doubles) decode with defaults filled.
- msgspec ignores ``omit_defaults`` on ``array_like`` structs (msgspec #720):
  vLLM itself therefore sends full-length arrays (22 request elements,
  9 outputs elements, 18 per-output elements). We declare the same config as
  vLLM so our engine side writes exactly what vLLM writes.
- maps (sampling params, handshake, stats) are matched by key; unknown keys
  are ignored so a newer engine's extra keys never break decoding.
- anything the engine sends that we cannot read is ``WireError`` (the
  engine's fault), never a msgspec exception leaking out.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Sequence

import msgspec

from enginelink.wire import vllm_arrays
from enginelink.wire.engine import (
    EngineDead,
    GenerateSpec,
    HandshakeStep,
    LogprobRows,
    PoolingSpec,
    OutputBatch,
    SamplingSpec,
    SchedulerStats,
    UtilityReply,
    WireError,
)
from enginelink.wire.vllm_arrays import decode_tensor

VLLM_VERSION: Final = "0.32.0"

# Request type bytes (first frame after the identity), §4.
REQ_ADD: Final = b"\x00"
REQ_ABORT: Final = b"\x01"
REQ_START_DP_WAVE: Final = b"\x02"
REQ_UTILITY: Final = b"\x03"
REQ_EXECUTOR_FAILED: Final = b"\x04"
REQ_WAKEUP: Final = b"\x05"

ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"

# SamplingParams.output_kind values (RequestOutputKind).
OUTPUT_KIND_CUMULATIVE: Final = 0
OUTPUT_KIND_DELTA: Final = 1
OUTPUT_KIND_FINAL_ONLY: Final = 2

# EngineCoreEvent.type values.
EVENT_QUEUED: Final = 1
EVENT_SCHEDULED: Final = 2
EVENT_PREEMPTED: Final = 3


# --------------------------------------------------------------------------
# Requests (front end -> engine)
# --------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM's ``SamplingParams`` map: the keys we send or read, vLLM's defaults.

    Declared in vLLM's field order with vLLM's default values, so
    ``omit_defaults`` puts exactly the non-default keys on the wire, in the
    order vLLM's own front end writes them (§4.2).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # the engine ignores stop strings
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: int = OUTPUT_KIND_CUMULATIVE
    eos_token_id: int | None = msgspec.field(default=None, name="_eos_token_id")
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list, name="_all_stop_token_ids")
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    extra_args: dict[str, Any] | None = None


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """vLLM's ``PoolingParams``: unlike SamplingParams a positional array (§4.1, pooling_params).

    Fields in vLLM 0.32's order. The values are what vLLM's front end sends
    after ``PoolingParams.verify`` for an embed request on a model without
    pooler defaults (checked against ``LLM.embed`` on the test model run with
    ``--runner pooling --convert embed``): ``task="embed"``,
    ``use_activation=True`` (normalise), ``skip_reading_prefix_cache=False``,
    ``output_kind`` FINAL_ONLY. The engine core does not verify them again.
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: int = OUTPUT_KIND_FINAL_ONLY


def pooling_params_for(pooling: PoolingSpec) -> PoolingParams:
    return PoolingParams(use_activation=pooling.normalize, task=pooling.task, skip_reading_prefix_cache=False)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """ADD payload: a positional array, fields 0-8 required (§4.1)."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any = None
    prompt_is_token_ids: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None


def sampling_params_for(sampling: SamplingSpec, kv_transfer_params: dict | None = None) -> SamplingParams:
    """The map vLLM's own front end would send for this sampling (§4.2, §4.3).

    Mirrors ``SamplingParams.update_from_generation_config``: the first EOS id
    becomes ``_eos_token_id`` unless ``ignore_eos``; further EOS ids join
    ``stop_token_ids`` unless ``ignore_eos``; ``_all_stop_token_ids`` always
    holds every EOS id and stop id, because the engine's min_tokens mask reads
    it even when EOS is ignored.
    """
    eos = sampling.eos_token_ids
    stops = list(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stops += [t for t in eos[1:] if t not in stops]
    values = {
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "stop_token_ids": stops or None,
        "ignore_eos": sampling.ignore_eos,
        "max_tokens": sampling.max_tokens,
        "min_tokens": sampling.min_tokens,
        "logprobs": sampling.logprobs,
        "prompt_logprobs": sampling.prompt_logprobs,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
        "output_kind": OUTPUT_KIND_DELTA,
        "eos_token_id": eos[0] if eos and not sampling.ignore_eos else None,
        "all_stop_token_ids": sorted(set(eos) | set(sampling.stop_token_ids)),
        "structured_outputs": _structured_outputs(sampling),
        "logit_bias": sampling.logit_bias,
        # vLLM carries PD connector params in extra_args.
        "extra_args": {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    }
    # msgspec's omit_defaults tests identity for scalars (0.0 is not the
    # default's 0.0 object), so pass only the values that differ; the rest
    # take the default object itself and stay off the wire.
    return SamplingParams(**{k: v for k, v in values.items() if v != _SAMPLING_DEFAULTS[k]})


def _structured_outputs(sampling: SamplingSpec) -> dict | None:
    """vLLM's ``StructuredOutputsParams`` map with the private ``_backend`` its engine reads.

    vLLM's engine builds its grammar backend from ``_backend``, which only its
    front end sets (msgspec carries a dataclass's underscore fields as plain
    keys); without it every constrained request ends FINISHED_ERROR
    ("Unsupported structured output backend: None"). runtime/requests/constraints.py
    resolves the value as vLLM's front end does.
    """
    if sampling.structured_outputs is None:
        return None
    params = dict(sampling.structured_outputs)
    if sampling.grammar_backend is not None:
        params["_backend"] = sampling.grammar_backend
        if sampling.grammar_backend_auto:
            params["_backend_was_auto"] = True
    return params


_SAMPLING_DEFAULTS: Final = {
    f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
    for f in msgspec.structs.fields(SamplingParams)
}


def request_for(spec: GenerateSpec, client_index: int = 0) -> EngineCoreRequest:
    # A pooling request (Embed) carries pooling params and no sampling params, as vLLM's front end sends it.
    pooling = spec.pooling
    return EngineCoreRequest(
        spec.request_id,
        spec.prompt_token_ids,
        spec.mm_features,
        sampling_params_for(spec.sampling, spec.kv_transfer_params) if pooling is None else None,
        None if pooling is None else pooling_params_for(pooling),
        spec.arrival_time,
        None,
        spec.cache_salt,
        spec.data_parallel_rank,
        client_index=client_index,
        trace_headers=spec.trace_headers,
        reasoning_ended=spec.reasoning_ended,
        abort_immediately=spec.abort_immediately,
    )


# --------------------------------------------------------------------------
# Outputs (engine -> front end)
# --------------------------------------------------------------------------


class PrefillStats(msgspec.Struct, gc=False):
    """``EngineCoreOutput.prefill_stats``: a dataclass in vLLM, so a map.

    Set on the first output of a newly scheduled prefill while stats logging
    is on; ``num_cached_tokens`` = local prefix-cache hits + external KV.
    """

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0


class EngineCoreEvent(msgspec.Struct, gc=False):
    type: int
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's delta in one engine step (§5.2); an ``EngineOutput``."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: Any = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None


class PrefixCacheStats(msgspec.Struct, gc=False):
    """Per-step delta of prefix-cache lookups (tokens), a map."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class WireSchedulerStats(msgspec.Struct, gc=False):
    """The keys of vLLM's ``SchedulerStats`` map whose types we know.

    vLLM 0.32 also sends ``num_kv_fetch_reqs_by_stage``, ``iteration_details``
    and ``ec_connector_stats``; decoding ignores them, and the sim engine
    leaves them out (vLLM fills defaults for missing keys).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    # Typed loosely where a None from another version must not fail the frame.
    prefix_cache_stats: PrefixCacheStats | None = msgspec.field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: Any = None
    kv_cache_eviction_events: list[Any] | None = msgspec.field(default_factory=list)
    spec_decoding_stats: Any = None
    kv_connector_stats: Any = None
    waiting_lora_adapters: dict[str, int] | None = msgspec.field(default_factory=dict)
    running_lora_adapters: dict[str, int] | None = msgspec.field(default_factory=dict)
    cudagraph_stats: Any = None
    perf_stats: Any = None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """``[call_id, failure_message, [type_info, result]]`` (§8)."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One output frame (§5.1). ``engine_index`` and ``outputs`` are required."""

    engine_index: int
    outputs: list[EngineCoreOutput]
    scheduler_stats: WireSchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: Any = None


_OUTPUTS_DECODER: Final = msgspec.msgpack.Decoder(EngineCoreOutputs)
_ENCODER: Final = msgspec.msgpack.Encoder()


def cached_tokens(output: EngineCoreOutput) -> int | None:
    """Prompt tokens the engine did not compute (prefix cache + external KV).

    None when this output carries no prefill stats (every output but the
    first of a request, or an engine with stats logging off).
    """
    stats = output.prefill_stats
    return None if stats is None else stats.num_cached_tokens


def _stats(wire: WireSchedulerStats) -> SchedulerStats:
    pcs = wire.prefix_cache_stats
    return SchedulerStats(
        num_running_reqs=wire.num_running_reqs,
        num_waiting_reqs=wire.num_waiting_reqs,
        kv_cache_usage=wire.kv_cache_usage,
        prefix_cache_queries=0 if pcs is None else pcs.queries,
        prefix_cache_hits=0 if pcs is None else pcs.hits,
        step_counter=wire.step_counter,
    )


def _utility(wire: UtilityOutput) -> UtilityReply:
    result = wire.result
    # vLLM wraps results as UtilityResult -> [type_info, value]; type_info is
    # None unless insecure serialization is on.
    if isinstance(result, list) and len(result) == 2:
        result = result[1]
    return UtilityReply(wire.call_id, wire.failure_message, result)


def decode_outputs(frames: Sequence[bytes]) -> EngineCoreOutputs | EngineDead:
    """The raw decode of one output message (used by the codec and tests)."""
    if not frames:
        raise WireError("empty output message")
    first = frames[0]
    if first == ENGINE_CORE_DEAD:
        return EngineDead()
    try:
        return _OUTPUTS_DECODER.decode(first)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise WireError(f"undecodable vLLM EngineCoreOutputs: {exc}") from None


class VllmCodec:
    """``EngineCodec`` for vLLM headless engines (front-end side).

    ``release`` is what one release does differently (``wire/vllm_release.py``,
    from its layout): the request's fields and their order, prompt ids as an
    array, utility arguments. None: the canonical structs as declared here
    (vLLM 0.32.0), which is also what journal replay decodes with.
    """

    name: str = "vllm"

    def __init__(self, client_index: int = 0, release: Any = None) -> None:
        self.client_index = client_index
        # A ReleaseWire (not imported here: vllm_release builds on this module).
        self.release = release

    # Prefix-cache hits of a request, read from its first output's prefill stats.
    cached_tokens = staticmethod(cached_tokens)

    @staticmethod
    def logprobs(output: EngineCoreOutput, frames: Sequence[bytes]) -> tuple[LogprobRows | None, LogprobRows | None]:
        """``new_logprobs`` and ``new_prompt_logprobs_tensors``, read from their arrays (``wire/vllm_arrays.py``)."""
        sample = output.new_logprobs
        prompt = output.new_prompt_logprobs_tensors
        return (
            None if sample is None else vllm_arrays.logprob_rows(sample, frames),
            None if prompt is None else vllm_arrays.logprob_rows(prompt, frames),
        )

    def encode_add(self, spec: GenerateSpec) -> list[bytes]:
        request = request_for(spec, self.client_index)
        if self.release is not None:
            return [REQ_ADD, _ENCODER.encode(self.release.request(request))]
        return [REQ_ADD, _ENCODER.encode(request)]

    def encode_abort(self, request_ids: Sequence[str]) -> list[bytes]:
        return [REQ_ABORT, _ENCODER.encode(list(request_ids))]

    def encode_utility(self, call_id: int, method: str, args: Sequence[object]) -> list[bytes]:
        """ValueError when the release cannot take ``args`` (``ReleaseWire.utility_args``)."""
        if self.release is not None:
            args = self.release.utility_args(method, args)
        return [REQ_UTILITY, _ENCODER.encode([self.client_index, call_id, method, list(args)])]

    def decode_output(self, frames: Sequence[bytes]) -> OutputBatch | EngineDead:
        raw = decode_outputs(frames)
        if isinstance(raw, EngineDead):
            return raw
        for out in raw.outputs:
            if out.pooling_output is not None:
                # A pooling request's result (Embed): its bytes may be in a later frame of this message.
                out.pooling_output = decode_tensor(out.pooling_output, frames)
        return OutputBatch(
            raw.engine_index,
            raw.outputs,
            None if raw.scheduler_stats is None else _stats(raw.scheduler_stats),
            None if raw.utility_output is None else _utility(raw.utility_output),
            raw.finished_requests,
            raw.timestamp,
            frames,
        )


# --------------------------------------------------------------------------
# Handshake (§3): all msgpack maps
# --------------------------------------------------------------------------


class HandshakeStatus(msgspec.Struct, kw_only=True):
    """HELLO (step 1) or READY (step 6), engine -> handshake ROUTER."""

    status: Literal["HELLO", "READY"]
    local: bool = False
    headless: bool = True
    # Sent only when DP > 1; UNSET keeps the key off the wire otherwise.
    parallel_config_hash: str | msgspec.UnsetType = msgspec.UNSET


class HandshakeAddresses(msgspec.Struct, kw_only=True):
    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class HandshakeInit(msgspec.Struct, kw_only=True):
    """``EngineHandshakeMetadata`` (step 2), front end -> engine."""

    addresses: HandshakeAddresses
    # Filled only for MoE data parallelism.
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)


class ReadyResponse(msgspec.Struct, kw_only=True):
    """``EngineCoreReadyResponse`` (step 4): the first message on the input socket.

    All 25 keys of 0.32.0 in vLLM's order. Defaults mark "not said" so a
    partial response from another version still decodes; the launch check
    looks at ``vllm_version``.
    """

    max_model_len: int = 0
    num_gpu_blocks: int = 0
    block_size: int = 16
    dp_stats_address: str | None = None
    dtype: str = "bfloat16"
    vllm_version: str = ""
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int = 0
    kv_cache_max_concurrency: float = 0.0
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: Any = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None


_STATUS_DECODER: Final = msgspec.msgpack.Decoder(HandshakeStatus)
_INIT_DECODER: Final = msgspec.msgpack.Decoder(HandshakeInit)
_READY_DECODER: Final = msgspec.msgpack.Decoder(ReadyResponse)


def _decode(decoder: msgspec.msgpack.Decoder, payload: bytes, what: str) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable vLLM {what}: {exc}") from None


# Front-end side of the handshake.
def decode_handshake_status(payload: bytes) -> HandshakeStatus:
    return _decode(_STATUS_DECODER, payload, "handshake status")


def encode_handshake_init(init: HandshakeInit) -> bytes:
    return _ENCODER.encode(init)


def decode_ready_response(payload: bytes) -> ReadyResponse:
    return _decode(_READY_DECODER, payload, "ready response")


# Engine side of the handshake.
def encode_handshake_status(status: HandshakeStatus) -> bytes:
    return _ENCODER.encode(status)


def decode_handshake_init(payload: bytes) -> HandshakeInit:
    return _decode(_INIT_DECODER, payload, "handshake init")


def encode_ready_response(response: ReadyResponse) -> bytes:
    return _ENCODER.encode(response)


class VllmHandshake:
    """vLLM 0.32's handshake as the handshake machine reads it (``wire.engine.HandshakeWire``).

    A rank's identity is its rank, 2 bytes little-endian (vLLM's engine
    index). Another engine's adapter that reuses this handshake says so in
    ``vllm_version`` (``sglang-<version>``, ``tokenspeed-<version>``): a
    version that starts with a name and a dash is another engine's.
    """

    engine: Final = "vLLM"

    @staticmethod
    def identity(rank: int) -> bytes:
        return rank.to_bytes(2, "little")

    @staticmethod
    def decode_status(payload: bytes) -> tuple[HandshakeStep, HandshakeStatus]:
        status = decode_handshake_status(payload)
        return HandshakeStep(status.status), status

    @staticmethod
    def encode_init(inputs: Sequence[str], outputs: Sequence[str]) -> bytes:
        return encode_handshake_init(HandshakeInit(addresses=HandshakeAddresses(inputs=list(inputs), outputs=list(outputs))))

    @staticmethod
    def decode_ready(payload: bytes) -> ReadyResponse:
        return decode_ready_response(payload)

    @staticmethod
    def facts(ready: ReadyResponse) -> dict:
        return msgspec.to_builtins(ready)

    @staticmethod
    def version(ready: ReadyResponse) -> str:
        # The release without a local build label ("0.32.0+cu129" is 0.32.0): what the launch check verified.
        return ready.vllm_version.split("+", 1)[0]

    @staticmethod
    def foreign(version: str) -> str | None:
        name, dash, _ = version.partition("-")
        return name if dash and name.isalpha() else None


# --------------------------------------------------------------------------
# Engine side: input frames in, output frames out (the sim engine, tests)
# --------------------------------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True):
    request: EngineCoreRequest


class AbortRequest(msgspec.Struct, frozen=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True):
    client_index: int
    call_id: int
    method: str
    args: list[Any]


EngineInput = AddRequest | AbortRequest | UtilityCall

_REQUEST_DECODER: Final = msgspec.msgpack.Decoder(EngineCoreRequest)
_ABORT_DECODER: Final = msgspec.msgpack.Decoder(list[str])
_UTILITY_DECODER: Final = msgspec.msgpack.Decoder(tuple[int, int, str, list[Any]])


def decode_input(request_type: bytes, payload: bytes) -> EngineInput:
    """One input message as the engine's DEALER sees it: [type byte, payload].

    Raises WireError for types a single-rank engine does not take from a
    front end (START_DP_WAVE, EXECUTOR_FAILED, WAKEUP) and for bad payloads.
    """
    if request_type == REQ_ADD:
        try:
            return AddRequest(_REQUEST_DECODER.decode(payload))
        except msgspec.DecodeError:
            return AddRequest(_decode(_REQUEST_DECODER, _prompt_ids_as_list(payload), "EngineCoreRequest"))
    if request_type == REQ_ABORT:
        return AbortRequest(_decode(_ABORT_DECODER, payload, "abort list"))
    if request_type == REQ_UTILITY:
        return UtilityCall(*_decode(_UTILITY_DECODER, payload, "utility call"))
    raise WireError(f"unsupported vLLM request type {bytes(request_type)!r}")


def _prompt_ids_as_list(payload: bytes) -> bytes:
    """A request whose prompt ids are an int32 array (vLLM 0.34.0's front end) as one with a list:
    the sim engine reads every release's request with the canonical struct."""
    try:
        fields = msgspec.msgpack.decode(payload)
        ids = fields[1]
        if isinstance(fields, list) and isinstance(ids, list) and len(ids) == 3 and isinstance(ids[0], str):
            view, _ = vllm_arrays.read_array(ids, [payload])
            fields[1] = view.tolist()
            return _ENCODER.encode(fields)
    except (msgspec.DecodeError, IndexError, WireError):
        pass
    return payload


def encode_outputs(outputs: EngineCoreOutputs, writer: vllm_arrays.ArrayWriter | None = None) -> list[bytes]:
    """The output message for one EngineCoreOutputs: one frame, plus the large
    arrays ``writer`` put out of line (vLLM's aux frames), if any."""
    body = _ENCODER.encode(outputs)
    return [body] if writer is None else writer.message(body)


def encode_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


def utility_success(call_id: int, result: object) -> UtilityOutput:
    return UtilityOutput(call_id, None, [None, result])


def utility_failure(call_id: int, method: str, error: str) -> UtilityOutput:
    # vLLM's EngineCoreProc._invoke_utility_method wording.
    return UtilityOutput(call_id, f"Call to {method} method failed: {error}")

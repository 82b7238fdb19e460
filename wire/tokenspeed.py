"""The TokenSpeed 0.1.1 headless wire (``--zmq-msgpack``), as a sans-io codec.

TokenSpeed's headless mode speaks SMG's vLLM-style handshake and a msgpack
data plane of its own tagged structs (``tokenspeed/runtime/engine/zmq_wire.py``,
``zmq_msgpack.py``, ``io_struct.py``; ``reference/tokenspeed.md`` §5). Both
ends live here: the front-end side (``TokenSpeedCodec``) and the engine side
(``decode_input``, ``encode_outputs``, handshake) for the sim personality and
the round-trip tests.

What is the same as vLLM's wire, and is shared with ``wire/vllm.py`` (never
copied): the request type bytes (ADD ``0x00``, ABORT ``0x01``), the ABORT
payload (a msgpack list of ids), the INIT message (``addresses.inputs/outputs``)
and the raw ``ENGINE_CORE_DEAD`` frame an exiting engine pushes.

What differs, and is explicit here:
- the data-plane structs are tagged arrays with tag field ``_tag`` (SGLang's
  is ``type``, vLLM's are untagged); ADD is ``[0x00, TokenizedGenerateReqInput,
  *aux]`` with ``input_ids`` a plain int list;
- HELLO/READY (``WireReadyMessage``) are maps that carry every key, None
  included (vLLM's decoder would refuse ``parallel_config_hash: None``);
- the ready response has TokenSpeed's keys (``prefix_granularity``,
  ``multimodal_encoder_dtype``; no ``block_size``/LoRA keys);
- outputs are ``BatchTokenIDOutSlim`` columns ending in a load tail
  (``engine_index, num_running, num_waiting, kv_active_pages, kv_total_pages``);
  finish reasons are bare strings, with no matched token and no status code;
- no utility or control calls: TokenSpeed 0.1.1 drops control replies on
  this wire (``MsgpackSendSocket``), so FlushCache/profiling have no path;
- the engine normalises sampling itself (``resolve_seed`` + ``normalize``),
  so requests carry the parameters as a caller gives them;
- what the engine would only pre-abort (n != 1, top-k or prompt logprobs,
  ``verify`` failures) is named by ``preabort_reason``, for the contract to
  refuse before the engine.

Rules: sans-io; one decode per frame; whatever we cannot read is ``WireError``.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Final, Literal, Sequence

import msgspec

from enginelink.wire import vllm
from enginelink.wire.engine import (
    EngineDead,
    FinishReason,
    GenerateSpec,
    HandshakeStep,
    LogprobRows,
    OutputBatch,
    SchedulerStats,
    WireError,
)
from enginelink.wire.struct_layout import layout_of, read_struct

TOKENSPEED_VERSION: Final = "0.1.1"
TAG_FIELD: Final = "_tag"
# Shared with vLLM's wire, byte for byte.
REQ_ADD: Final = vllm.REQ_ADD
REQ_ABORT: Final = vllm.REQ_ABORT
ENGINE_CORE_DEAD: Final = vllm.ENGINE_CORE_DEAD
HandshakeAddresses = vllm.HandshakeAddresses
HandshakeInit = vllm.HandshakeInit
encode_handshake_init = vllm.encode_handshake_init
decode_handshake_init = vllm.decode_handshake_init
AbortRequest = vllm.AbortRequest

TOP_K_FUSED_MAX: Final = 128  # sampling_params._TOP_K_FUSED_MAX: verify() refuses top_k at or above it
_FINISH: Final = {"": None, "stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


# --------------------------------------------------------------------------
# Structs (tokenspeed 0.1.1 declaration order and defaults)
# --------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, array_like=True, kw_only=True):
    """``tokenspeed.runtime.sampling.sampling_params.SamplingParams`` (30 fields, no tag)."""

    max_new_tokens: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    thinking_budget: int | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop_strs: Any = None
    stop_str_max_len: int = 0
    is_normalized: bool = False


class TokenizedGenerateReqInput(msgspec.Struct, tag="TokenizedGenerateReqInput", tag_field=TAG_FIELD,
                                array_like=True, kw_only=True):
    """ADD payload (24 fields; only ``sampling_params`` is required)."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    input_text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    input_embeds: Any = None
    session_params: Any = None
    custom_logit_processor: str | None = None
    return_hidden_states: bool = False
    created_time: float = 0.0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    input_multi_ids: Any = None
    input_extra_infos: Any = None
    input_ids_unpadded: list[int] | None = None
    multimodal_inputs: Any = None
    validation_error: str | None = None
    data_parallel_rank: int | None = None


class BatchTokenIDOutSlim(msgspec.Struct, tag="BatchTokenIDOutSlim", tag_field=TAG_FIELD, array_like=True,
                          kw_only=True, gc=False):
    """One output step, column-oriented, with the producing rank's load tail (14 fields)."""

    rids: list[str] | None = None
    output_ids: list[list[int]]
    finished_reasons: list[str]  # "" while running, else "stop" / "length" / "abort"
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[float]]
    output_token_logprobs_idx: list[list[int]]
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_active_pages: int = 0
    kv_total_pages: int = 0


class WireReadyMessage(msgspec.Struct):
    """HELLO / READY, engine -> handshake ROUTER: a map with every key (None included)."""

    status: str | None = None
    local: bool | None = None
    headless: bool | None = None
    parallel_config_hash: str | None = None


class WireEngineCoreReadyResponse(msgspec.Struct):
    """The engine's post-init facts, the first message on the input socket (a map)."""

    max_model_len: int = 0
    num_gpu_blocks: int = 0
    prefix_granularity: int = 0
    dp_stats_address: str | None = None
    dtype: str = "bfloat16"
    multimodal_encoder_dtype: str | None = None
    vllm_version: str = ""  # "tokenspeed-<release>"
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    instance_id: str = ""
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_REQUEST: Final = msgspec.msgpack.Decoder(TokenizedGenerateReqInput)
_OUTPUT: Final = msgspec.msgpack.Decoder(BatchTokenIDOutSlim)
_LOGPROB_COLUMNS: Final = ("output_token_logprobs_val", "output_token_logprobs_idx")


# A step as the front end reads it: its two logprob columns (two lists per request, empty unless the
# request asked for logprobs) left Raw, decoded when a request of the step reads them (``_StepLogprobs``).
BatchTokenIDOutSlimRead = read_struct(
    BatchTokenIDOutSlim, lambda field: msgspec.Raw if field.name in _LOGPROB_COLUMNS else field.type)
_OUTPUT_READ: Final = msgspec.msgpack.Decoder(BatchTokenIDOutSlimRead)
_LOGPROB_VALUES: Final = msgspec.msgpack.Decoder(list[list[float]])
_LOGPROB_IDS: Final = msgspec.msgpack.Decoder(list[list[int]])
_STATUS: Final = msgspec.msgpack.Decoder(WireReadyMessage)
_READY: Final = msgspec.msgpack.Decoder(WireEngineCoreReadyResponse)
_ABORT: Final = msgspec.msgpack.Decoder(list[str])


def _decode(decoder: msgspec.msgpack.Decoder, payload: bytes, what: str) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable TokenSpeed {what}: {exc}") from None


# --------------------------------------------------------------------------
# Requests (front end -> engine)
# --------------------------------------------------------------------------


def sampling_params_for(spec: GenerateSpec) -> SamplingParams:
    """The parameters as a caller gives them; the engine's ``__post_init__``/``normalize`` do the rest."""
    sp = spec.sampling
    constraint = sp.structured_outputs or {}
    json_schema = constraint.get("json")
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = msgspec.json.encode(json_schema).decode()
    return SamplingParams(
        max_new_tokens=sp.max_tokens,
        stop_token_ids=sorted(set(sp.stop_token_ids)) or None,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=-1 if sp.top_k in (0, -1) else sp.top_k,
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        min_new_tokens=sp.min_tokens,
        json_schema=json_schema,
        regex=constraint.get("regex"),
        ebnf=constraint.get("grammar"),
        structural_tag=constraint.get("structural_tag"),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        custom_params=sp.custom_params,
        stream_interval=sp.stream_interval,
        logit_bias={str(k): float(v) for k, v in sp.logit_bias.items()} if sp.logit_bias else None,
        seed=sp.seed,
        logprobs=0 if sp.logprobs is not None else None,
    )


def request_for(spec: GenerateSpec) -> TokenizedGenerateReqInput:
    kv = spec.kv_transfer_params or {}
    return TokenizedGenerateReqInput(
        rid=spec.request_id,
        input_ids=list(spec.prompt_token_ids),
        sampling_params=sampling_params_for(spec),
        return_logprob=spec.sampling.logprobs is not None,
        stream=True,  # every step's delta: the servicer does its own (non-)streaming
        created_time=spec.arrival_time,
        bootstrap_host=kv.get("bootstrap_host"),
        bootstrap_port=kv.get("bootstrap_port"),
        bootstrap_room=kv.get("bootstrap_room"),
        data_parallel_rank=spec.data_parallel_rank,
    )


def preabort_reason(spec: GenerateSpec, *, n: int = 1, output_logprobs_enabled: bool = True) -> tuple[str, str] | None:
    """(contract field, message) for a request TokenSpeed would only answer with an abort, else None.

    Mirrors ``zmq_wire._finalize_generate_request`` (n), ``MsgpackRecvSocket.
    _validation_error`` (logprobs) and ``SamplingParams.verify`` (ranges), in
    their words, so the contract can refuse with ``INVALID_ARGUMENT`` before
    the engine is involved. ``n`` is the request's choice count as the engine
    would see it on the wire (the servicer fans ``n > 1`` out as child ids,
    each sent with ``n = 1``). The vocabulary checks (logit bias keys, token
    ids) are the contract's own validation.
    """
    sp = spec.sampling
    if n != 1:
        return "sampling_params.n", f"n={n} is not supported on the msgpack wire; the frontend must fan out n > 1 itself"
    if sp.logprobs is not None:
        if not output_logprobs_enabled:
            return "return_logprob", ("logprobs were requested but the server was started without "
                                      "--enable-output-logprobs")
        if sp.logprobs != 0:
            return "top_logprobs_num", "top_logprobs_num > 0 (output top-k logprobs) is not supported yet"
    if sp.prompt_logprobs is not None:
        return "logprob_start_len", ("logprob_start_len >= 0 (prompt logprobs) is not carried on the msgpack "
                                     "output wire; use logprob_start_len=-1")
    checks = (
        (sp.temperature < 0.0, "sampling_params.temperature", f"temperature must be non-negative, got {sp.temperature}."),
        (not 0.0 < sp.top_p <= 1.0, "sampling_params.top_p", f"top_p must be in (0, 1], got {sp.top_p}."),
        (not 0.0 <= sp.min_p <= 1.0, "sampling_params.min_p", f"min_p must be in [0, 1], got {sp.min_p}."),
        (sp.top_k < -1 or sp.top_k >= TOP_K_FUSED_MAX, "sampling_params.top_k",
         f"top_k must be < {TOP_K_FUSED_MAX} (fused kernel limit) or -1 (disable), got {sp.top_k}."),
        (not -2.0 <= sp.frequency_penalty <= 2.0, "sampling_params.frequency_penalty",
         f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}."),
        (not -2.0 <= sp.presence_penalty <= 2.0, "sampling_params.presence_penalty",
         f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}."),
        (not 0.0 <= sp.repetition_penalty <= 2.0, "sampling_params.repetition_penalty",
         f"repetition_penalty must be in (0, 2], got {sp.repetition_penalty}."),
        (sp.min_tokens > sp.max_tokens, "sampling_params.min_new_tokens",
         f"min_new_tokens must be in (0, max_new_tokens({sp.max_tokens})], got {sp.min_tokens}."),
    )
    for failed, field, message in checks:
        if failed:
            return field, message
    return None


# --------------------------------------------------------------------------
# Outputs (engine -> front end)
# --------------------------------------------------------------------------


class TokenSpeedOutput(msgspec.Struct, gc=False):
    """One request's entry of a ``BatchTokenIDOutSlim``: an ``EngineOutput``.

    TokenSpeed 0.1.1 names no matched stop token on this wire: a ``stop``
    finish means its last token matched (EOS or a stop id; enginelink sends
    no stop strings to it), so ``decode_output`` names that token as
    ``stop_reason`` and trims it (``TokenSpeedCodec``). Counts are running totals.
    A Struct, built positionally by ``map`` over the step's columns: one per
    request per step, so its construction is C, not an ``__init__``
    (docs/benchmarks-history.md, "Per-token cost of the SGLang and TokenSpeed contracts").
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None
    stop_reason: int | None = None
    kv_transfer_params: None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _batch: _StepLogprobs | None = None  # the step's logprob columns, read when this request's are
    _index: int = 0

    def __repr__(self) -> str:
        return f"TokenSpeedOutput({self.request_id!r}, {self.new_token_ids!r}, finish={self.finish_reason})"


class _StepLogprobs:
    """One step's logprob columns, decoded once, the first time a request of the step reads them."""

    __slots__ = ("_raw", "_n", "_columns")

    def __init__(self, values: msgspec.Raw, ids: msgspec.Raw, n: int) -> None:
        self._raw, self._n = (values, ids), n
        self._columns: tuple[list[list[float]], list[list[int]]] | None = None

    def columns(self) -> tuple[list[list[float]], list[list[int]]]:
        if self._columns is None:
            try:
                values, ids = _LOGPROB_VALUES.decode(self._raw[0]), _LOGPROB_IDS.decode(self._raw[1])
            except msgspec.DecodeError as exc:
                raise WireError(f"undecodable TokenSpeed logprob column: {exc}") from None
            for name, column in zip(_LOGPROB_COLUMNS, (values, ids)):
                if len(column) != self._n:
                    raise WireError(f"TokenSpeed BatchTokenIDOutSlim has {self._n} rids but {len(column)} {name}")
            self._columns = values, ids
        return self._columns


def load_stats(batch: BatchTokenIDOutSlim) -> SchedulerStats:
    usage = batch.kv_active_pages / batch.kv_total_pages if batch.kv_total_pages > 0 else 0.0
    return SchedulerStats(num_running_reqs=batch.num_running, num_waiting_reqs=batch.num_waiting,
                          kv_cache_usage=min(max(usage, 0.0), 1.0))


def _decode_step(frames: Sequence[bytes], decoder: msgspec.msgpack.Decoder) -> Any:
    """One output message's step (``decoder``'s struct), or EngineDead; aux frames carry nothing we read."""
    if not frames:
        raise WireError("empty TokenSpeed output message")
    if frames[0] == ENGINE_CORE_DEAD:
        return EngineDead()
    return _decode(decoder, frames[0], "BatchTokenIDOutSlim")


def decode_batch(frames: Sequence[bytes]) -> BatchTokenIDOutSlim | EngineDead:
    """The raw decode of one output message (aux frames, if any, carry nothing we read)."""
    batch = _decode_step(frames, _OUTPUT)
    if isinstance(batch, EngineDead):
        return batch
    rids = batch.rids or []
    for name in ("output_ids", "finished_reasons", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "output_token_logprobs_val", "output_token_logprobs_idx"):
        if len(getattr(batch, name)) != len(rids):
            raise WireError(f"TokenSpeed BatchTokenIDOutSlim has {len(rids)} rids but {len(getattr(batch, name))} {name}")
    return batch


class TokenSpeedCodec:
    """``EngineCodec`` for TokenSpeed 0.1.1 headless engines (front-end side).

    Stop trimming: TokenSpeed's outputs keep the stop token that ended a
    request, and the reference servicer drops it from ``output_ids`` (and
    its logprob) unless the request set ``no_stop_trim``. The output columns
    do not say which requests set it, so this codec remembers the ids of
    those that did, from their ADD until their finish or ABORT: a set
    bounded by the requests open on the link, empty in the common case.
    (A fresh codec, as journal replay uses, trims them all.)
    """

    name: str = "tokenspeed"
    # No utility calls on this wire (encode_utility refuses): the link sends no idle liveness probes.
    control_calls: bool = False

    def __init__(self) -> None:
        self._keep_stop: set[str] = set()

    def encode_add(self, spec: GenerateSpec) -> list[bytes]:
        if spec.sampling.no_stop_trim:
            self._keep_stop.add(spec.request_id)
        return [REQ_ADD, _ENCODER.encode(request_for(spec))]

    def encode_abort(self, request_ids: Sequence[str]) -> list[bytes]:
        self._keep_stop.difference_update(request_ids)
        return [REQ_ABORT, _ENCODER.encode(list(request_ids))]

    def encode_utility(self, call_id: int, method: str, args: Sequence[object]) -> list[bytes]:
        raise ValueError(f"TokenSpeed {TOKENSPEED_VERSION}'s wire has no control calls ({method!r})")

    def decode_output(self, frames: Sequence[bytes]) -> OutputBatch | EngineDead:
        """One step's outputs; its logprob columns stay undecoded until a request reads them (``logprobs``)."""
        batch = _decode_step(frames, _OUTPUT_READ)
        if isinstance(batch, EngineDead):
            return batch
        rids = batch.rids or []
        n = len(rids)
        columns = (batch.output_ids, batch.finished_reasons, batch.prompt_tokens, batch.completion_tokens,
                   batch.cached_tokens)
        if any(len(column) != n for column in columns):
            raise WireError(f"TokenSpeed BatchTokenIDOutSlim columns disagree with its {n} rids: "
                            f"{[len(column) for column in columns]}")
        reasons = batch.finished_reasons
        try:
            finishes = list(map(_FINISH.__getitem__, reasons))
        except KeyError:
            i = next(i for i, reason in enumerate(reasons) if reason not in _FINISH)
            raise WireError(f"TokenSpeed finish reason {reasons[i]!r} for {rids[i]!r} "
                            f"is none of {sorted(_FINISH)}") from None
        logprobs = _StepLogprobs(batch.output_token_logprobs_val, batch.output_token_logprobs_idx, n)
        # One output per request, made in C (``map`` over the columns): the per-request cost of this wire.
        outputs = list(map(TokenSpeedOutput, rids, batch.output_ids, finishes, repeat(None), repeat(None),
                           batch.prompt_tokens, batch.completion_tokens, batch.cached_tokens, repeat(logprobs),
                           range(n)))  # fmt: skip
        for i in [i for i, finish in enumerate(finishes) if finish is not None]:
            out = outputs[i]
            rid, tokens = out.request_id, out.new_token_ids
            keep = rid in self._keep_stop
            self._keep_stop.discard(rid)
            if out.finish_reason is FinishReason.STOP and tokens:
                out.stop_reason = tokens[-1]
                if not keep:
                    out.new_token_ids = tokens[:-1]
        return OutputBatch(batch.engine_index, outputs, load_stats(batch), frames=frames)

    @staticmethod
    def cached_tokens(output: TokenSpeedOutput) -> int | None:
        return output.cached_tokens

    @staticmethod
    def logprobs(output: TokenSpeedOutput, frames: Sequence[bytes]) -> tuple[LogprobRows | None, LogprobRows | None]:
        """The sampled tokens' logprobs of this step (TokenSpeed carries no top-k and no prompt logprobs)."""
        step, i = output._batch, output._index
        if step is None:
            return None, None
        all_values, all_ids = step.columns()
        values, ids = all_values[i], all_ids[i]
        if not values:
            return None, None
        if len(values) != len(ids):
            raise WireError(f"TokenSpeed logprob values and ids disagree for {output.request_id!r}")
        kept = len(output.new_token_ids)
        if kept < len(values):  # a trimmed stop token's logprob goes with it
            values, ids = values[:kept], ids[:kept]
        return LogprobRows(rows=len(values), cols=1, token_ids=ids, logprobs=values), None


# --------------------------------------------------------------------------
# Handshake: TokenSpeed's own status and ready maps; INIT is vLLM's
# --------------------------------------------------------------------------


def encode_handshake_status(status: Literal["HELLO", "READY"], *, local: bool = True, headless: bool = True) -> bytes:
    return _ENCODER.encode(WireReadyMessage(status=status, local=local, headless=headless))


def decode_handshake_status(payload: bytes) -> WireReadyMessage:
    message = _decode(_STATUS, payload, "handshake status")
    if message.status not in ("HELLO", "READY"):
        raise WireError(f"TokenSpeed handshake status {message.status!r} is neither HELLO nor READY")
    return message


def encode_ready_response(response: WireEngineCoreReadyResponse) -> bytes:
    return _ENCODER.encode(response)


def decode_ready_response(payload: bytes) -> WireEngineCoreReadyResponse:
    return _decode(_READY, payload, "ready response")


ENGINE_VERSION_PREFIX: Final = "tokenspeed-"  # the ready response's vllm_version: "tokenspeed-0.1.1"


def ready_version(release: str = TOKENSPEED_VERSION) -> str:
    """What a TokenSpeed release says in its ready response (what a launch check expects)."""
    return f"{ENGINE_VERSION_PREFIX}{release}"


class TokenSpeedHandshake:
    """TokenSpeed 0.1.1's handshake as the handshake machine reads it (``wire.engine.HandshakeWire``).

    vLLM's shape (HELLO → INIT → READY and the ready response, in either
    order; TokenSpeed sends READY first) with TokenSpeed's maps: HELLO/READY
    carry every key (``parallel_config_hash: None``), the ready response has
    ``prefix_granularity`` where vLLM has ``block_size``. A rank's identity is
    ``struct.pack("<H", engine_index + dp_rank)``: the rank, 2 bytes
    little-endian. ``facts`` gives the runtime vLLM's key names
    (``block_size`` = ``prefix_granularity``). ``version`` is the whole
    ``vllm_version`` (``tokenspeed-0.1.1``): a launch check compares it with
    ``ready_version()``; any other engine's version is ``foreign``.
    """

    engine: Final = "TokenSpeed"

    @staticmethod
    def identity(rank: int) -> bytes:
        return rank.to_bytes(2, "little")

    @staticmethod
    def decode_status(payload: bytes) -> tuple[HandshakeStep, WireReadyMessage]:
        status = decode_handshake_status(payload)
        return HandshakeStep(status.status), status

    @staticmethod
    def encode_init(inputs: Sequence[str], outputs: Sequence[str]) -> bytes:
        return encode_handshake_init(HandshakeInit(addresses=HandshakeAddresses(inputs=list(inputs),
                                                                                outputs=list(outputs))))

    @staticmethod
    def decode_ready(payload: bytes) -> WireEngineCoreReadyResponse:
        return decode_ready_response(payload)

    @staticmethod
    def facts(ready: WireEngineCoreReadyResponse) -> dict:
        facts = msgspec.to_builtins(ready)
        facts["block_size"] = ready.prefix_granularity
        return facts

    @staticmethod
    def version(ready: WireEngineCoreReadyResponse) -> str:
        return ready.vllm_version

    @staticmethod
    def foreign(version: str) -> str | None:
        if version.startswith(ENGINE_VERSION_PREFIX):
            return None
        name, dash, _ = version.partition("-")
        return name if dash and name.isalpha() else "vLLM"  # a bare release number is vLLM's own


# --------------------------------------------------------------------------
# Engine side: input frames in, output frames out
# --------------------------------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True):
    request: TokenizedGenerateReqInput
    aux: tuple[bytes, ...] = ()  # out-of-band tensor frames (multimodal; never sent by enginelink)


def decode_input(frames: Sequence[bytes]) -> AddRequest | AbortRequest:
    """``[type byte, payload, *aux]`` as the engine's input DEALER sees it."""
    if len(frames) < 2:
        raise WireError(f"a TokenSpeed request needs a type frame and a payload, got {len(frames)} frames")
    kind = bytes(frames[0])
    if kind == REQ_ADD:
        return AddRequest(_decode(_REQUEST, frames[1], "TokenizedGenerateReqInput"), tuple(frames[2:]))
    if kind == REQ_ABORT:
        return AbortRequest(_decode(_ABORT, frames[1], "abort list"))
    raise WireError(f"unsupported TokenSpeed request type {kind!r}")


def encode_outputs(batch: BatchTokenIDOutSlim) -> list[bytes]:
    return [_ENCODER.encode(batch)]


def encode_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


# --------------------------------------------------------------------------
# Layout declaration, for the launch-time check against an installed TokenSpeed
# --------------------------------------------------------------------------

STRUCTS: Final = {
    "SamplingParams": SamplingParams,
    "TokenizedGenerateReqInput": TokenizedGenerateReqInput,
    "BatchTokenIDOutSlim": BatchTokenIDOutSlim,
    "WireReadyMessage": WireReadyMessage,
    "WireHandshakeAddresses": HandshakeAddresses,
    "WireHandshakeInitMessage": HandshakeInit,
    "WireEngineCoreReadyResponse": WireEngineCoreReadyResponse,
}
LAYOUT: Final = {"engine": "tokenspeed", "version": TOKENSPEED_VERSION,
                 "structs": {name: layout_of(cls) for name, cls in STRUCTS.items()}}

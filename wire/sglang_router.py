"""The SMG router's direct ZMQ lane for SGLang, engine side, as a sans-io codec.

``smg serve --backend sglang --connection-mode zmq`` (the reference's
``python -m smg_grpc_servicer.sglang.headless``): the router BINDS a TCP
handshake ROUTER and two ipc data sockets; the engine DIALS
(``reference/sglang-wire.md`` §6; observed with router 1.13.0, ``smg launch
--worker-urls ipc://… --backend sglang``):

1. HELLO on a DEALER whose identity is the engine index (2 bytes, LE): a map
   ``{status, local, headless, parallel_config_hash}``;
2. INIT back: ``{addresses: {inputs, outputs, …}, parallel_config}``
   (vLLM's, ``wire/vllm.py`` decodes it);
3. READY on the handshake socket, then the ready response (vLLM's key names,
   ``vllm_version`` ``sglang-<release>``, plus ``positional_layouts``) as the
   first message of a DEALER (the same identity) to ``inputs[0]``; a PUSH to
   ``outputs[0]`` carries every output from then on;
4. requests ``[type, payload, *aux]``: ``0x00`` ADD, SGLang's tagged
   ``TokenizedGenerateReqInput`` (the router 1.13.0 sends the prefix through
   ``stream``, token ids as a plain int list, its ``SamplingParams`` one
   field short of 0.5.23's: ``watermark``, which 0.5.23 added, is not in it);
   ``0x01`` ABORT, a list of ids; ``0x02`` CONTROL ``[call_id, method, args]``;
5. outputs: ``BatchTokenIDSlimOutput`` (the token columns, each finish as
   ``""``/``stop``/``length``/``abort`` with message and matched stop, the
   counts, the sampled logprobs, then the load tail: ``engine_index,
   num_running, num_waiting, kv_used_tokens, kv_total_tokens``, then the
   optional columns), ``ControlReplySlim``, and the raw frame
   ``ENGINE_CORE_DEAD`` when the engine goes.

Only the fields a request's meaning needs are read: the sampling struct up
to ``custom_params`` (its later fields are SGLang's own normalisation
results, and the router's are shifted by one against 0.5.23's anyway);
anything after ``stream`` is ignored (msgspec skips an array's extra
elements). Whatever cannot be read is ``WireError``.
"""

from __future__ import annotations

import struct
from typing import Any, Final, Sequence

import msgspec

from enginelink.wire.engine import WireError

ADD: Final = b"\x00"
ABORT: Final = b"\x01"
CONTROL: Final = b"\x02"
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"
ENGINE_INDEX_MAX: Final = 0xFFFF


def identity(engine_index: int) -> bytes:
    if not 0 <= engine_index <= ENGINE_INDEX_MAX:
        raise ValueError(f"engine index {engine_index} does not fit the lane's 2-byte identity (0..{ENGINE_INDEX_MAX})")
    return struct.pack("<H", engine_index)


class HandshakeStatus(msgspec.Struct):
    """HELLO / READY (a map, every key sent)."""

    status: str | None = None
    local: bool | None = None
    headless: bool | None = None
    parallel_config_hash: str | None = None


class ReadyResponse(msgspec.Struct):
    """The registration message on the input DEALER (a map: key names, not order, are the contract)."""

    max_model_len: int = 0
    num_gpu_blocks: int = 0
    block_size: int = 0
    dp_stats_address: str | None = None
    dtype: str = "bfloat16"
    multimodal_encoder_dtype: str | None = None
    vllm_version: str = ""
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
    # Each positional struct's field order, by class name; empty: nothing declared (the router then
    # checks nothing). Never None: the key goes out on every response.
    positional_layouts: dict[str, list[str]] = {}


class SamplingParams(msgspec.Struct, array_like=True):
    """The lane's sampling params, up to ``custom_params`` (SGLang's order; later fields ignored)."""

    max_new_tokens: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    stop_regex: Any = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: Any = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, tag="TokenizedGenerateReqInput", tag_field="type", array_like=True):
    """An ADD's payload: SGLang's ``TokenizedGenerateReqInput`` through ``stream`` (the rest ignored)."""

    rid: str | None = None
    http_worker_ipc: Any = None
    input_text: Any = None
    input_ids: Any = None  # a plain int list (the router's), or SGLang's array Ext 1
    input_embeds: Any = None
    mm_inputs: Any = None
    token_type_ids: Any = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Any = None
    stream: bool = False


class AbortRequest(msgspec.Struct, frozen=True):
    request_ids: list[str]


class ControlRequest(msgspec.Struct, frozen=True):
    call_id: int
    method: str
    args: list


class BatchTokenIDSlimOutput(msgspec.Struct, tag=True, array_like=True):
    """One output step for the router (the reference's column order; new fields only ever appended)."""

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[str]  # "" while running, else "stop" | "length" | "abort"
    finished_messages: list[str | None]
    finished_matched: list[int | str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[float]]
    output_token_logprobs_idx: list[list[int]]
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    finished_status: list[int | None] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    reasoning_tokens: list[int] | None = None


class ControlReplySlim(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    success: bool
    message: str | None = None
    engine_index: int = 0


class Row(msgspec.Struct):
    """One request's entry of an output step (the lane's columns, built by the shell)."""

    rid: str
    output_ids: list[int]
    finish: str = ""
    message: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprob_values: list[float] = []
    logprob_ids: list[int] = []
    status: int | None = None
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []


class Load(msgspec.Struct, frozen=True):
    """The load tail every output carries."""

    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0


_ENCODER: Final = msgspec.msgpack.Encoder()
_STATUS: Final = msgspec.msgpack.Decoder(HandshakeStatus)
_ADD: Final = msgspec.msgpack.Decoder(GenerateRequest)
_ABORT: Final = msgspec.msgpack.Decoder(list[str])
_CONTROL: Final = msgspec.msgpack.Decoder(tuple[int, str, list])
_READY: Final = msgspec.msgpack.Decoder(ReadyResponse)


def encode_status(status: str) -> bytes:
    return _ENCODER.encode(HandshakeStatus(status=status, local=True, headless=True))


def decode_status(payload: bytes) -> HandshakeStatus:
    try:
        return _STATUS.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable handshake status: {exc}") from None


def encode_ready_response(response: ReadyResponse) -> bytes:
    return _ENCODER.encode(response)


def decode_ready_response(payload: bytes) -> ReadyResponse:
    try:
        return _READY.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable ready response: {exc}") from None


def decode_request(frames: Sequence[bytes]) -> GenerateRequest | AbortRequest | ControlRequest:
    """One message from the router's input ROUTER (``[type, payload, *aux]``; aux frames are ignored)."""
    if len(frames) < 2:
        raise WireError(f"a lane request needs a type and a payload, got {len(frames)} frame(s)")
    kind, payload = bytes(frames[0]), frames[1]
    try:
        if kind == ADD:
            return _ADD.decode(payload)
        if kind == ABORT:
            return AbortRequest(_ABORT.decode(payload))
        if kind == CONTROL:
            return ControlRequest(*_CONTROL.decode(payload))
    except (msgspec.DecodeError, TypeError) as exc:
        raise WireError(f"undecodable lane request (type {kind!r}): {exc}") from None
    raise WireError(f"unknown lane request type {kind!r}")


def request_id_of(frames: Sequence[bytes]) -> str | None:
    """An ADD's id read loosely (element 1), for one whose typed decode failed; None if unreadable."""
    if len(frames) < 2 or bytes(frames[0]) != ADD:
        return None
    try:
        payload = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return None
    return payload[1] if isinstance(payload, list) and len(payload) > 1 and isinstance(payload[1], str) else None


def encode_request(request: GenerateRequest) -> list[bytes]:
    """An ADD as the router sends it (the tests' router side)."""
    return [ADD, _ENCODER.encode(request)]


def encode_rows(rows: Sequence[Row], load: Load) -> bytes:
    """One output step: the rows as the lane's columns, with the load tail."""
    return _ENCODER.encode(BatchTokenIDSlimOutput(
        rids=[r.rid for r in rows], output_ids=[r.output_ids for r in rows],
        finished_reasons=[r.finish for r in rows], finished_messages=[r.message for r in rows],
        finished_matched=[r.matched for r in rows], prompt_tokens=[r.prompt_tokens for r in rows],
        completion_tokens=[r.completion_tokens for r in rows], cached_tokens=[r.cached_tokens for r in rows],
        output_token_logprobs_val=[r.logprob_values for r in rows],
        output_token_logprobs_idx=[r.logprob_ids for r in rows],
        engine_index=load.engine_index, num_running=load.num_running, num_waiting=load.num_waiting,
        kv_used_tokens=load.kv_used_tokens, kv_total_tokens=load.kv_total_tokens,
        finished_status=[r.status for r in rows], output_top_logprobs_val=[r.top_values for r in rows],
        output_top_logprobs_idx=[r.top_ids for r in rows]))


def encode_control_reply(call_id: int, success: bool, message: str | None, engine_index: int) -> bytes:
    return _ENCODER.encode(ControlReplySlim(call_id=call_id, success=success, message=message,
                                            engine_index=engine_index))


_OUTPUT: Final = msgspec.msgpack.Decoder(BatchTokenIDSlimOutput | ControlReplySlim)


def decode_output(payload: bytes) -> BatchTokenIDSlimOutput | ControlReplySlim:
    """An output as the router reads it (the tests' router side)."""
    try:
        return _OUTPUT.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable lane output: {exc}") from None

"""SGLang 0.5.23's IPC structs, as its scheduler encodes them in msgpack mode.

SGLang's TokenizerManager and scheduler exchange ``msgspec`` structs declared
in ``sglang/srt/managers/io_struct.py``: ``tag=True`` (tag field ``type``, the
class name), ``array_like=True``, keyword-only. On the wire each message is one
msgpack array ``["ClassName", field, field, ...]`` holding *every* field in
declaration order (msgspec ignores ``omit_defaults`` on array-like structs).
``SamplingParams`` is array-like without a tag. ``array.array`` values (token
ids) travel as msgpack extension 1 (``utils/msgpack_utils.py``): a uint32
big-endian length of ``msgpack(typecode)``, that, then the raw native-endian
bytes. Facts: ``reference/sglang-contract.md`` §5.2-5.3; checked against the
installed release by ``tests/wire/test_sglang_codec.py``.

Rules:
- the declarations below copy SGLang's field order, required prefix and
  defaults exactly, so our encoder writes the bytes SGLang's own encoder
  writes and decodes what it writes; fields enginelink never reads are typed
  ``Any`` (decoded as plain msgpack values, never rejected);
- a struct only ever changes with a release: ``LAYOUT`` (below) is what the
  release check compares with the installed ``sglang``;
- sans-io: no sockets, clocks or files.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Final, Union

import msgspec

from enginelink.wire.struct_layout import read_struct

SGLANG_VERSION: Final = "0.5.23"

EXT_ARRAY: Final = 1  # array.array (token ids)
EXT_TORCH_TENSOR: Final = 2  # a torch tensor (router-preprocessed pixels); 3-5 (numpy, shm, CUDA IPC): never sent
_META_LEN: Final = struct.Struct(">I")
# SGLang's Req concatenates arrays of typecode "q"; the reference servicer sends that too.
TOKEN_TYPECODE: Final = "q"
TOP_K_ALL: Final = 1 << 30  # SGLang's "whole vocabulary" (sampling_params.TOP_K_ALL)


def pack_array(values: Any, typecode: str = TOKEN_TYPECODE) -> msgspec.msgpack.Ext:
    """Ext 1 for an ``array.array`` of ``values`` (SGLang's ``_pack_buffer_ext``)."""
    arr = values if isinstance(values, array) else array(typecode, values)
    if sys.byteorder != "little":  # SGLang writes native bytes; every host it runs on is little-endian
        arr = array(arr.typecode, arr)
        arr.byteswap()
    meta = msgspec.msgpack.encode(arr.typecode)
    return msgspec.msgpack.Ext(EXT_ARRAY, _META_LEN.pack(len(meta)) + meta + arr.tobytes())


def pack_tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> msgspec.msgpack.Ext:
    """Ext 2 for a CPU torch tensor of ``dtype`` (torch's name: ``float32``, ``bfloat16``, ...) and ``shape``
    whose C-contiguous little-endian bytes are ``data`` (SGLang's ``enc_hook``: the metadata
    ``(shape, dtype, device)`` behind its uint32 big-endian length, then the raw bytes). No torch here:
    the router's ``TensorData`` bytes are those bytes already."""
    meta = msgspec.msgpack.encode((tuple(shape), dtype, "cpu"))
    return msgspec.msgpack.Ext(EXT_TORCH_TENSOR, _META_LEN.pack(len(meta)) + meta + data)


def unpack_tensor(data: memoryview | bytes) -> tuple[tuple[int, ...], str, bytes]:
    """(shape, dtype, bytes) of an Ext 2 payload; ``ValueError`` when it is malformed."""
    if len(data) < _META_LEN.size:
        raise ValueError("tensor extension is missing its metadata length")
    (size,) = _META_LEN.unpack_from(data)
    start = _META_LEN.size + size
    meta = msgspec.msgpack.decode(data[_META_LEN.size:start]) if start <= len(data) else None
    if not (isinstance(meta, list) and len(meta) == 3 and isinstance(meta[0], list) and isinstance(meta[1], str)):
        raise ValueError(f"tensor extension has metadata {meta!r}")
    return tuple(meta[0]), meta[1], bytes(data[start:])


def unpack_array(data: memoryview | bytes) -> array:
    """The ``array.array`` an Ext 1 payload holds; ``ValueError`` when it is malformed."""
    if data[:_TOKEN_META_SIZE] == _TOKEN_META and not (len(data) - _TOKEN_META_SIZE) % _TOKEN_ITEMSIZE:
        # Token ids as every sender writes them (typecode "q", native little-endian): once per
        # request per step, so without the typecode's decode and the checks below.
        out = array(TOKEN_TYPECODE)
        out.frombytes(data[_TOKEN_META_SIZE:])
        if sys.byteorder != "little":
            out.byteswap()
        return out
    if len(data) < _META_LEN.size:
        raise ValueError("array extension is missing its typecode length")
    (size,) = _META_LEN.unpack_from(data)
    start = _META_LEN.size + size
    if start > len(data):
        raise ValueError("array extension's typecode length runs past its end")
    typecode = msgspec.msgpack.decode(data[_META_LEN.size:start])
    if not isinstance(typecode, str) or len(typecode) != 1:
        raise ValueError(f"array extension has typecode {typecode!r}")
    out = array(typecode)  # a bad typecode raises ValueError
    raw = data[start:]
    if len(raw) % out.itemsize:
        raise ValueError(f"array extension of {typecode!r} has {len(raw)} bytes")
    out.frombytes(raw)
    if sys.byteorder != "little":
        out.byteswap()
    return out


_TOKEN_META: Final = (_META_LEN.pack(len(msgspec.msgpack.encode(TOKEN_TYPECODE)))
                      + msgspec.msgpack.encode(TOKEN_TYPECODE))
_TOKEN_META_SIZE: Final = len(_TOKEN_META)
_TOKEN_ITEMSIZE: Final = array(TOKEN_TYPECODE).itemsize
# One request's one new token as an Ext 1 payload: the typecode header, then one little-endian int64.
_ONE_TOKEN: Final = struct.Struct(f"<{_TOKEN_META_SIZE}sq")


def ext_hook(code: int, data: memoryview) -> Any:
    """Decode hook: Ext 1 becomes an ``array.array``; any other extension stays opaque."""
    if code == EXT_ARRAY:
        return unpack_array(data)
    return msgspec.msgpack.Ext(code, bytes(data))


def enc_hook(obj: Any) -> Any:
    if isinstance(obj, array):
        return pack_array(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the SGLang wire")


class SamplingParams(msgspec.Struct, array_like=True, kw_only=True):
    """``sglang.srt.sampling.sampling_params.SamplingParams`` (33 fields, no tag)."""

    max_new_tokens: int | None = 128
    stop: Any = None
    stop_token_ids: list[int] | None = None  # a set in SGLang: an array on the wire, sorted by us
    stop_regex: Any = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
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
    watermark: Any = None
    stop_strs: Any = None
    stop_regex_strs: Any = None
    stop_str_max_len: int = 0
    stop_regex_max_len: int = 0
    is_normalized: bool = False
    ebnf_full_assistant: bool = False


MODALITY_IMAGE: Final = 1  # sglang.srt.multimodal.modality.Modality.IMAGE (an auto() Enum: its value on the wire)
FORMAT_NORMAL: Final = 1  # MultimodalInputFormat.NORMAL


class MultimodalDataItem(msgspec.Struct, array_like=True, kw_only=True):
    """``sglang.srt.managers.schedule_batch.MultimodalDataItem``: one image (video, audio) of a request (11 fields).

    ``feature`` is the processor's tensor (pixel values, Ext 2), ``offsets`` its placeholder token
    ranges in the prompt as ``[start, end]`` inclusive; the scheduler computes ``hash`` and the pad
    values itself (``MultimodalInputs.from_processor_output``) when they are None.
    """

    modality: int
    hash: int | None = None
    pad_value: int | None = None
    offsets: list[tuple[int, int]] | None = None
    format: int = FORMAT_NORMAL
    feature: Any = None
    precomputed_embeddings: Any = None
    keep_device_embedding: bool = False
    model_specific_data: dict[str, Any] = msgspec.field(default_factory=dict)
    identity: bytes | None = None
    pad_values: Any = None


class MultimodalProcessorOutput(msgspec.Struct, array_like=True, kw_only=True):
    """``schedule_batch.MultimodalProcessorOutput``: a request's ``mm_inputs`` as a processor leaves them (18 fields)."""

    mm_items: list[MultimodalDataItem]
    input_ids: Any = None
    padded_input_ids: Any = None
    im_token_id: int | None = None
    im_start_id: int | None = None
    im_end_id: int | None = None
    slice_start_id: int | None = None
    slice_end_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None
    audio_start_id: int | None = None
    audio_end_id: int | None = None
    mrope_positions: Any = None
    mrope_position_delta: Any = None
    vision_position_ids: Any = None
    media_nums_per_sample: Any = None
    visible_frame_counts: Any = None
    token_type_ids: Any = None


class TokenizedGenerateReqInput(msgspec.Struct, tag="TokenizedGenerateReqInput", array_like=True, kw_only=True):
    """A generate request, front end -> scheduler (49 fields; ``input_text`` .. ``stream`` required)."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    input_text: Any
    input_ids: Any  # array.array, Ext 1 on the wire
    input_embeds: Any
    mm_inputs: MultimodalProcessorOutput | None
    token_type_ids: Any
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    stream: bool
    return_sampling_mask: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    session_id: str | None = None
    session_params: Any = None
    lora_id: str | None = None
    custom_logit_processor: str | None = None
    positional_embed_overrides: Any = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    bootstrap_pair_key: str | None = None
    decode_tp_size: int | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    routing_key: str | None = None
    require_reasoning: bool = False
    priority: int | None = None
    extra_key: str | None = None
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    encoder_urls: list[str] | None = None
    multi_item_delimiter_indices: list[int] | None = None
    token_indices_to_pool: list[int] | None = None
    time_stats: Any = None
    cache_salt: str | None = None
    kv_hints: Any = None
    pp_prefetch_ticketed: bool = False
    sampling_logprobs_mode: str = "selected"
    lora_name: str | None = None


class TokenizedEmbeddingReqInput(msgspec.Struct, tag="TokenizedEmbeddingReqInput", array_like=True, kw_only=True):
    """An embedding request (18 fields; ``input_text`` .. ``sampling_params`` required)."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    input_text: Any
    input_ids: Any
    mm_inputs: Any
    token_type_ids: Any
    sampling_params: SamplingParams
    lora_id: str | None = None
    positional_embed_overrides: Any = None
    routed_dp_rank: int | None = None
    priority: int | None = None
    dimensions: int | None = None
    return_pooled_hidden_states: bool = False
    multi_item_delimiter_indices: list[int] | None = None
    token_indices_to_pool: list[int] | None = None
    decision_layout: list[int] | None = None
    time_stats: Any = None
    lora_name: str | None = None


class AbortReq(msgspec.Struct, tag="AbortReq", array_like=True, kw_only=True):
    """Both ways: the front end's cancel, and the scheduler's report of a request it ended itself."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None


class FlushCacheReqInput(msgspec.Struct, tag="FlushCacheReqInput", array_like=True, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None
    timeout_s: float | None = None


class FlushCacheReqOutput(msgspec.Struct, tag="FlushCacheReqOutput", array_like=True, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None
    success: bool
    message: str = ""


PROFILE_START: Final = 1  # ProfileReqType.START_PROFILE (an Enum: its value on the wire)
PROFILE_STOP: Final = 2


class ProfileReq(msgspec.Struct, tag="ProfileReq", array_like=True, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None
    req_type: int = PROFILE_START
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None
    detailed_annotations: bool = False


class ProfileReqOutput(msgspec.Struct, tag="ProfileReqOutput", array_like=True, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None
    success: bool
    message: str


class HealthCheckOutput(msgspec.Struct, tag="HealthCheckOutput", array_like=True, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None


class BatchTokenIDOutput(msgspec.Struct, tag="BatchTokenIDOutput", array_like=True, kw_only=True, gc=False):
    """One scheduler output step, column-oriented: entry i of every list is request ``rids[i]``'s (53 fields)."""

    rids: list[str] | None = None
    http_worker_ipcs: Any = None
    finished_reasons: list[dict[str, Any] | None]
    decoded_texts: Any
    decode_ids: Any
    read_offsets: Any
    output_ids: list[Any] | None  # arrays (Ext 1): each request's new tokens since its last send
    skip_special_tokens: Any
    spaces_between_special_tokens: Any
    no_stop_trim: Any
    prompt_tokens: list[int]
    reasoning_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: Any
    input_token_logprobs_idx: Any
    output_token_logprobs_val: Any
    output_token_logprobs_idx: Any
    input_top_logprobs_val: Any
    input_top_logprobs_idx: Any
    output_top_logprobs_val: Any
    output_top_logprobs_idx: Any
    input_token_ids_logprobs_val: Any
    input_token_ids_logprobs_idx: Any
    output_token_ids_logprobs_val: Any
    output_token_ids_logprobs_idx: Any
    output_token_entropy_val: Any
    output_token_sampling_mask: Any
    output_hidden_states: Any
    routed_experts: Any
    indexer_topk: Any
    placeholder_tokens_idx: Any
    placeholder_tokens_val: Any
    retraction_counts: Any = None
    beam_search_output: Any = None
    weight_versions: Any = None
    token_steps: Any = None
    customized_info: Any = None
    cached_tokens_details: Any = None
    dp_ranks: list[int | None] | None = None
    time_stats: Any = None
    image_tokens: Any = None
    audio_tokens: Any = None
    video_tokens: Any = None
    spec_verify_ct: list[int] | None = None
    spec_num_correct_drafts: list[int] | None = None
    spec_num_block_accept_tokens: Any = None
    spec_num_cap_tokens: Any = None
    spec_correct_drafts_histogram: Any = None
    spec_cap_lens_histogram: Any = None
    input_top_logprobs_val_flat: Any = None
    input_top_logprobs_idx_flat: Any = None
    input_top_logprobs_flat_null_prefix: Any = None


class BatchEmbeddingOutput(msgspec.Struct, tag="BatchEmbeddingOutput", array_like=True, kw_only=True, gc=False):
    """Finished embedding requests (12 fields)."""

    rids: list[str] | None = None
    http_worker_ipcs: Any = None
    finished_reasons: list[dict[str, Any] | None]
    embeddings: list[Any]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    placeholder_tokens_idx: Any
    placeholder_tokens_val: Any
    retraction_counts: Any = None
    cached_tokens_details: Any = None
    time_stats: Any = None
    pooled_hidden_states: Any = None


# What the scheduler pushes to the front end, and what the front end sends to the scheduler.
FromScheduler = Union[BatchTokenIDOutput, BatchEmbeddingOutput, AbortReq, FlushCacheReqOutput,
                      ProfileReqOutput, HealthCheckOutput]
ToScheduler = Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput, AbortReq, FlushCacheReqInput, ProfileReq]

ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=enc_hook)
FROM_SCHEDULER: Final = msgspec.msgpack.Decoder(FromScheduler, ext_hook=ext_hook)


# -- the front end's hot decode ------------------------------------------------------------
#
# A ``BatchTokenIDOutput`` carries 53 columns per step, most of them per request
# (decode ids as an Ext 1 array, texts, offsets, flags, twelve logprob columns),
# and the front end reads nine. Decoded in full, every request of every step
# built some twenty Python objects and one more array through ``ext_hook`` for
# columns nobody reads: the SGLang wire's largest cost per streamed token
# (docs/benchmarks-history.md, "Per-token cost of the SGLang and TokenSpeed contracts").
# ``BatchTokenIDOutputRead`` is the same wire layout (built from the declaration
# above, so it cannot drift from it) with every column the front end does not
# read as ``msgspec.Raw``: still checked to be well-formed msgpack, never built.
# Token arrays stay ``Ext`` values, read in one pass (``token_lists``).
# The logprob columns are Raw too; ``wire/sglang.py`` decodes one only when a
# request of that step asked for logprobs. The full structs stay what the
# release check and the round-trip tests compare.

READ_COLUMNS: Final = {
    "rids": list[str] | None, "finished_reasons": list[Union[dict[str, Any], None]], "output_ids": list[Any] | None,
    "prompt_tokens": list[int], "reasoning_tokens": list[int], "completion_tokens": list[int],
    "cached_tokens": list[int], "spec_verify_ct": list[int] | None, "spec_num_correct_drafts": list[int] | None,
}


BatchTokenIDOutputRead = read_struct(BatchTokenIDOutput, lambda field: READ_COLUMNS.get(field.name, msgspec.Raw))


def token_lists(column: list) -> list[list[int]]:
    """The read decoder's ``output_ids`` (Ext 1 values left as ``Ext``, no hook) as lists of ints.

    The common step (every request one new token, an array of typecode "q",
    little-endian) is one ``iter_unpack`` over the joined payloads, its
    typecode headers compared as one set; anything else entry by entry, as
    ``ext_hook`` would (a malformed array raises ValueError).
    """
    try:
        joined = b"".join([e.data for e in column])
    except AttributeError:  # an entry that is not an extension (None, a plain list)
        joined = None
    if joined is not None and len(joined) == len(column) * _ONE_TOKEN.size and sys.byteorder == "little":
        records = list(_ONE_TOKEN.iter_unpack(joined))
        if {meta for meta, _ in records} <= {_TOKEN_META} and {e.code for e in column} <= {EXT_ARRAY}:
            return [[token] for _, token in records]
    Ext = msgspec.msgpack.Ext
    out = []
    for e in column:
        if type(e) is Ext and e.code == EXT_ARRAY:
            out.append(unpack_array(e.data).tolist())
        else:
            out.append(e.tolist() if isinstance(e, array) else list(e or ()))
    return out


FROM_SCHEDULER_READ: Final = msgspec.msgpack.Decoder(
    Union[BatchTokenIDOutputRead, BatchEmbeddingOutput, AbortReq, FlushCacheReqOutput, ProfileReqOutput,
          HealthCheckOutput])  # no ext_hook: output_ids' arrays stay Ext, read by ``token_lists`` in one pass
RAW_COLUMN: Final = msgspec.msgpack.Decoder(ext_hook=ext_hook)  # a Raw column, decoded when it is read
TO_SCHEDULER: Final = msgspec.msgpack.Decoder(ToScheduler, ext_hook=ext_hook)

# The structs the release check compares, by SGLang's class name.
STRUCTS: Final = {
    cls.__struct_config__.tag if cls is not SamplingParams else "SamplingParams": cls
    for cls in (SamplingParams, TokenizedGenerateReqInput, TokenizedEmbeddingReqInput, AbortReq,
                FlushCacheReqInput, FlushCacheReqOutput, ProfileReq, ProfileReqOutput, HealthCheckOutput,
                BatchTokenIDOutput, BatchEmbeddingOutput)
}
STRUCTS.update({"MultimodalDataItem": MultimodalDataItem, "MultimodalProcessorOutput": MultimodalProcessorOutput})
STRUCTS_BY_TYPE: Final = {cls: name for name, cls in STRUCTS.items()}

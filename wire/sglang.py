"""The SGLang 0.5.23 scheduler wire (msgpack mode), as a sans-io codec.

enginelink stands where SGLang's TokenizerManager stands: it PUSHes requests
to the scheduler's input and PULLs its outputs, one msgpack frame per message,
in SGLang's own encoding (``SGLANG_USE_PICKLE_IPC=0``, ``--skip-tokenizer-init``;
``reference/sglang-contract.md`` §5). Both ends live here, so the servicer and
the sim scheduler can never disagree: the front-end side (``SglangCodec``, the
``EngineCodec`` the runtime uses) and the engine side (``decode_input``,
``encode_outputs``) the sim personality and the round-trip tests use. The
structs themselves are in ``wire/sglang_structs.py``.

Rules:
- sans-io: frames in, frames out; no sockets, clocks or files;
- the scheduler does not normalise sampling parameters in this mode (it skips
  ``normalize`` when ``is_normalized`` is set, and cannot run it without a
  tokenizer), so ``sampling_params_for`` sends them normalised as SGLang's own
  ``SamplingParams.normalize`` leaves them: greedy as ``temperature 1.0,
  top_k 1``, "off" top-k as ``TOP_K_ALL``, stop strings resolved (the
  servicer matches them itself, so none go to the engine);
- one decode per output frame; SGLang's outputs are columns, so each request
  of a batch becomes one ``SglangOutput`` view (an ``EngineOutput``) whose
  logprobs are read from the batch's columns only when asked;
- an abort keeps SGLang's status code, message and error type
  (``AbortInfo``); ``abort_outcome`` is the table that turns it into the gRPC
  status the reference servicer answers with;
- whatever the scheduler sends that we cannot read is ``WireError``.
"""

from __future__ import annotations

import json
from array import array
from itertools import repeat
from typing import Any, Final, Iterable, Sequence

import msgspec

from enginelink.wire import sglang_structs as s
from enginelink.wire.struct_layout import layout_of
from enginelink.wire.engine import (
    EngineDead,
    FinishReason,
    GenerateSpec,
    LogprobRows,
    OutputBatch,
    SamplingSpec,
    UtilityReply,
    WireError,
)

SGLANG_VERSION: Final = s.SGLANG_VERSION
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"  # SMG's headless adapter; stock SGLang dies silently
_SAMPLING_EPS: Final = 1e-6
# Control calls ride in rid and http_worker_ipc; SGLang's replies echo http_worker_ipc (output_sender.py).
CONTROL_PREFIX: Final = "enginelink-control-"
CONTROL_METHODS: Final = ("flush_cache", "start_profile", "stop_profile")


# --------------------------------------------------------------------------
# Aborts: SGLang's status codes and the gRPC codes the reference answers with
# --------------------------------------------------------------------------

# smg_grpc_servicer/engine_status.py grpc_code_for_http_status; anything else (500 too) is INTERNAL.
GRPC_CODE_FOR_HTTP_STATUS: Final = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# Stamped in the scheduler's ranks on the abort of a request whose grammar rejected a sampled token
# (enginelink's tools/sglang_grammar_attribution.py, the reference's plugin alike, under
# SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS). Stock SGLang leaves that abort 500 "InternalServerError"; a
# grammar that does not compile is its 400 (the client's grammar): neither is read from its wording.
GRAMMAR_ERR_TYPE: Final = "GrammarRejectedToken"
CONSTRAINT_TRAILER: Final = ("smg-constraint-failed", "engine")


class AbortInfo(msgspec.Struct, frozen=True, gc=False):
    """What SGLang said about a request it aborted."""

    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None
    # True: the scheduler reported it with an ``AbortReq`` (queue full, bad input, ...),
    # not in an output batch's finish reasons.
    reported: bool = False

    @property
    def constraint_failed(self) -> bool:
        """The engine's own attribution (the ranks' stamp), never the message's wording."""
        return self.err_type == GRAMMAR_ERR_TYPE


class AbortOutcome(msgspec.Struct, frozen=True):
    """How a call ends after an engine abort: a gRPC status (name) and message, or a plain abort (None)."""

    code: str | None
    message: str
    trailer: tuple[str, str] | None = None


def grpc_code_for_http_status(status: int | None) -> str:
    return GRPC_CODE_FOR_HTTP_STATUS.get(status, "INTERNAL") if status is not None else "INTERNAL"


def abort_outcome(info: AbortInfo) -> AbortOutcome:
    """The reference servicer's order (§3): grammar, then a status code, then a reported abort, else plain."""
    message = info.message or "Abort before prefill"
    if info.constraint_failed:
        return AbortOutcome("FAILED_PRECONDITION", "the engine could not continue the request under its "
                            f"constraint: the scheduler aborted the request: {message}", CONSTRAINT_TRAILER)
    if info.status_code is not None:
        return AbortOutcome(grpc_code_for_http_status(info.status_code), message)
    if info.reported:
        return AbortOutcome("INTERNAL", message)
    return AbortOutcome(None, message)


# --------------------------------------------------------------------------
# Requests (front end -> scheduler)
# --------------------------------------------------------------------------


def sampling_params_for(sampling: SamplingSpec, *, max_new_tokens: int | None = None) -> s.SamplingParams:
    """SGLang's ``SamplingParams`` after ``__post_init__`` and ``normalize`` (no stop strings)."""
    temperature, top_k = sampling.temperature, sampling.top_k
    if 0 <= temperature < _SAMPLING_EPS:  # greedy, as SGLang normalises it
        temperature, top_k = 1.0, 1
    elif top_k in (0, -1):  # our "off" (vLLM's 0) and SGLang's -1
        top_k = s.TOP_K_ALL
    constraint = _constraint(sampling.structured_outputs)
    return s.SamplingParams(
        max_new_tokens=sampling.max_tokens if max_new_tokens is None else max_new_tokens,
        stop_token_ids=sorted(set(sampling.stop_token_ids)) or None,
        temperature=temperature,
        top_p=sampling.top_p,
        top_k=top_k,
        min_p=sampling.min_p,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repetition_penalty=sampling.repetition_penalty,
        min_new_tokens=sampling.min_tokens,
        ignore_eos=sampling.ignore_eos,
        skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        no_stop_trim=sampling.no_stop_trim,
        stream_interval=sampling.stream_interval,
        logit_bias={str(k): float(v) for k, v in sampling.logit_bias.items()} if sampling.logit_bias else None,
        sampling_seed=sampling.seed,
        custom_params=sampling.custom_params,
        stop_strs=[],
        stop_regex_strs=[],
        is_normalized=True,
        **constraint,
    )


def _constraint(params: dict | None) -> dict[str, str]:
    """vLLM-style structured-output keys (``SamplingSpec.structured_outputs``) as SGLang's four fields."""
    if not params:
        return {}
    if "json" in params:
        schema = params["json"]
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))}
    if params.get("json_object"):
        return {"json_schema": '{"type":"object"}'}  # what the router sends an SGLang worker for json_object
    for key, field in (("regex", "regex"), ("grammar", "ebnf"), ("structural_tag", "structural_tag")):
        if key in params:
            return {field: params[key]}
    raise ValueError(f"SGLang cannot express the constraint {sorted(params)} (convert a choice to a grammar first)")


def _bootstrap(kv: dict | None) -> dict[str, Any]:
    """PD: SGLang's bootstrap fields, from the connector params the contract carried."""
    if not kv:
        return {}
    return {k: kv[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if kv.get(k) is not None}


def request_for(spec: GenerateSpec) -> s.TokenizedGenerateReqInput | s.TokenizedEmbeddingReqInput:
    """The struct SGLang's own front end would send for ``spec`` (an embedding request when pooling)."""
    ids = s.pack_array(spec.prompt_token_ids)
    if spec.pooling is not None:
        return s.TokenizedEmbeddingReqInput(
            rid=spec.request_id, input_text=None, input_ids=ids, mm_inputs=None, token_type_ids=None,
            sampling_params=sampling_params_for(spec.sampling, max_new_tokens=0),
            routed_dp_rank=spec.data_parallel_rank,
        )
    sampling = spec.sampling
    return s.TokenizedGenerateReqInput(
        rid=spec.request_id,
        input_text=None,
        input_ids=ids,
        input_embeds=None,
        mm_inputs=spec.mm_inputs,
        token_type_ids=None,
        sampling_params=sampling_params_for(sampling),
        return_logprob=sampling.logprobs is not None or sampling.prompt_logprobs is not None,
        # -1: no prompt logprobs; N: from prompt position N (its own value is None, the scheduler's slice).
        logprob_start_len=-1 if sampling.prompt_logprobs is None else sampling.prompt_logprobs_start,
        top_logprobs_num=max(sampling.logprobs or 0, sampling.prompt_logprobs or 0),
        token_ids_logprob=None,
        stream=True,  # every step's delta: the servicer does its own (non-)streaming
        routed_dp_rank=spec.data_parallel_rank,
        cache_salt=spec.cache_salt,
        lora_id=spec.lora_id,
        custom_logit_processor=spec.custom_logit_processor,
        require_reasoning=spec.require_reasoning,
        **_bootstrap(spec.kv_transfer_params),
    )


# The engine-neutral utility names the runtime calls (vLLM's), as SGLang's control calls.
UTILITY_ALIASES: Final = {"reset_prefix_cache": "flush_cache"}


def control_request(call_id: int, method: str, args: Sequence[object]) -> s.FlushCacheReqInput | s.ProfileReq:
    """A control call: ``flush_cache [timeout_s]``, ``start_profile [{ProfileReq fields}]``, ``stop_profile``;
    vLLM's ``reset_prefix_cache [...]`` (the warm-up's flush) is a flush, and its ``profile [start, ...]``
    a start or a stop; a flush refused while requests run is a failure reply (the caller retries)."""
    tag = f"{CONTROL_PREFIX}{call_id}"
    if method in UTILITY_ALIASES:
        method, args = UTILITY_ALIASES[method], ()
    elif method == "profile":
        method, args = ("start_profile" if args and args[0] else "stop_profile"), ()
    if method == "flush_cache":
        timeout = args[0] if args else None
        return s.FlushCacheReqInput(rid=tag, http_worker_ipc=tag, timeout_s=None if timeout is None else float(timeout))
    if method in ("start_profile", "stop_profile"):
        fields = dict(args[0]) if args and args[0] else {}
        kind = s.PROFILE_START if method == "start_profile" else s.PROFILE_STOP
        return s.ProfileReq(rid=tag, http_worker_ipc=tag, req_type=kind, **fields)
    raise ValueError(f"no SGLang control call {method!r}; known: {', '.join(CONTROL_METHODS)}")


# --------------------------------------------------------------------------
# Outputs (scheduler -> front end)
# --------------------------------------------------------------------------


class SglangOutput(msgspec.Struct, gc=False):
    """One request's entry of an SGLang output message: an ``EngineOutput``.

    ``completion_tokens`` and ``cached_tokens`` are SGLang's running totals;
    ``new_token_ids`` is the delta since the request's last output. A Struct,
    built positionally by ``map`` over a step's columns (``_token_outputs``):
    one per request per step, so its construction is C, not an ``__init__``.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    abort: AbortInfo | None = None
    pooling_output: list[float] | None = None
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    _batch: _Columns | None = None  # the step's columns, for logprobs (``SglangCodec.logprobs``)
    _index: int = 0

    @property
    def engine_outcome(self) -> AbortOutcome | None:
        """How the call ends when the scheduler aborted this request: its gRPC status, or None."""
        return abort_outcome(self.abort) if self.abort is not None else None

    def __repr__(self) -> str:
        return (f"SglangOutput({self.request_id!r}, {self.new_token_ids!r}, finish={self.finish_reason}, "
                f"stop={self.stop_reason!r}, abort={self.abort!r})")


def _finish(reason: dict | None) -> tuple[int | None, int | str | None, AbortInfo | None]:
    if reason is None:
        return None, None, None
    kind = reason.get("type")
    if kind == "stop":
        return FinishReason.STOP, reason.get("matched"), None
    if kind == "length":
        return FinishReason.LENGTH, None, None
    if kind == "abort":
        return FinishReason.ABORT, None, AbortInfo(reason.get("message"), reason.get("status_code"),
                                                   reason.get("err_type"))
    raise WireError(f"SGLang finish reason of unknown type {kind!r}: {reason!r}")


def _column(batch: msgspec.Struct, name: str, index: int, default: Any = 0) -> Any:
    column = getattr(batch, name)
    return default if column is None or index >= len(column) or column[index] is None else column[index]


def _counts(column: list[int] | None, n: int) -> Iterable[int]:
    """A per-request count column, n long, absent entries 0 (as ``_column``); as sent when it is whole,
    zeros without a Python loop when absent or empty (SGLang's scheduler sends its spec counts as empty
    lists when it runs no speculative decoding, ``output_streamer.py``)."""
    if not column:
        return repeat(0, n)
    if len(column) == n and None not in column:
        return column
    return [_column_at(column, i, 0) for i in range(n)]


def _column_at(column: list | None, index: int, default: Any) -> Any:
    return default if column is None or index >= len(column) or column[index] is None else column[index]


class _Columns:
    """One step's batch as its outputs keep it: the logprob columns it left Raw are decoded the first
    time a request of the step reads them, once for all of its requests (``sglang_structs.FROM_SCHEDULER_READ``)."""

    __slots__ = ("batch", "_decoded")

    def __init__(self, batch: msgspec.Struct) -> None:
        self.batch = batch
        self._decoded: dict[str, Any] = {}

    @property
    def rids(self) -> list[str]:
        return self.batch.rids or []

    def column(self, name: str) -> Any:
        if name in self._decoded:
            return self._decoded[name]
        value = getattr(self.batch, name)
        if isinstance(value, msgspec.Raw):
            try:
                value = s.RAW_COLUMN.decode(value)
            except (msgspec.DecodeError, ValueError) as exc:
                raise WireError(f"undecodable SGLang column {name}: {exc}") from None
        self._decoded[name] = value
        return value

    def at(self, name: str, index: int) -> Any:
        return _column_at(self.column(name), index, None)


def _token_outputs(batch: s.BatchTokenIDOutputRead) -> list[SglangOutput]:
    """The step's outputs, one per request, made in C (``map`` over its columns, read once per step)."""
    rids = batch.rids or []
    n = len(rids)
    ids = batch.output_ids
    if ids is not None and len(ids) != n:
        raise WireError(f"SGLang BatchTokenIDOutput has {n} rids but {len(ids)} output_ids")
    reasons = batch.finished_reasons
    if len(reasons) != n:
        raise WireError(f"SGLang BatchTokenIDOutput has {n} rids but {len(reasons)} finished_reasons")
    try:
        tokens = [[] for _ in rids] if ids is None else s.token_lists(ids)
    except (ValueError, TypeError) as exc:  # a malformed Ext 1, or ids that are not a list of ints
        raise WireError(f"undecodable SGLang scheduler message: output_ids: {exc}") from None
    if any(reason is not None for reason in reasons):
        finishes, stops, aborts = zip(*[(None, None, None) if r is None else _finish(r) for r in reasons])
    else:  # the common step: nobody finished
        finishes = stops = aborts = repeat(None)
    return list(map(
        SglangOutput, rids, tokens, finishes, stops, repeat(None), _counts(batch.prompt_tokens, n),
        _counts(batch.completion_tokens, n), _counts(batch.cached_tokens, n), _counts(batch.reasoning_tokens, n),
        aborts, repeat(None), _counts(batch.spec_num_correct_drafts, n), _counts(batch.spec_verify_ct, n),
        repeat(_Columns(batch)), range(n)))


def _embedding_outputs(batch: s.BatchEmbeddingOutput) -> list[SglangOutput]:
    rids = batch.rids or []
    if len(batch.embeddings) != len(rids):
        raise WireError(f"SGLang BatchEmbeddingOutput has {len(rids)} rids but {len(batch.embeddings)} embeddings")
    outputs = []
    for i, rid in enumerate(rids):
        finish, _, abort = _finish(_column(batch, "finished_reasons", i, None))
        vector = batch.embeddings[i]
        if not isinstance(vector, list) or not all(isinstance(v, (int, float)) for v in vector):
            raise WireError(f"SGLang embedding of {rid!r} is not a flat list of numbers")
        outputs.append(SglangOutput(rid, [], FinishReason.STOP if finish is None else finish, abort=abort,
                                    prompt_tokens=_column(batch, "prompt_tokens", i),
                                    cached_tokens=_column(batch, "cached_tokens", i),
                                    pooling_output=[float(v) for v in vector]))
    return outputs


def _control_reply(reply: s.FlushCacheReqOutput | s.ProfileReqOutput) -> UtilityReply:
    marker = reply.http_worker_ipc or reply.rid or ""
    if not marker.startswith(CONTROL_PREFIX) or not marker[len(CONTROL_PREFIX):].isdigit():
        raise WireError(f"SGLang {type(reply).__name__} answers no control call of ours ({marker!r})")
    call_id = int(marker[len(CONTROL_PREFIX):])
    result = {"success": reply.success, "message": reply.message}
    return UtilityReply(call_id, None if reply.success else (reply.message or "failed"), result)


def decode_message(frames: Sequence[bytes], decoder: msgspec.msgpack.Decoder = s.FROM_SCHEDULER
                   ) -> s.FromScheduler | EngineDead:
    """The raw decode of one message from the scheduler (one frame); every column unless ``decoder`` says."""
    if len(frames) != 1:
        raise WireError(f"an SGLang message is one frame, got {len(frames)}")
    frame = frames[0]
    if frame == ENGINE_CORE_DEAD:
        return EngineDead()
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: a malformed Ext 1
        raise WireError(f"undecodable SGLang scheduler message: {exc}") from None


class SglangCodec:
    """``EngineCodec`` for SGLang 0.5.23 schedulers in msgpack mode (front-end side).

    Every message is one frame on a PUSH/PULL pair (no identity frame, no
    type byte). SGLang aborts one request per ``AbortReq``: ``encode_aborts``
    gives one message per id, ``encode_abort`` the message of exactly one id.
    """

    name: str = "sglang"
    # Under data parallelism every request names its rank (``routed_dp_rank``): one input address
    # reaches all ranks through SGLang's DP controller, which places a request by it.
    rank_in_request: bool = True

    def encode_add(self, spec: GenerateSpec) -> list[bytes]:
        return [s.ENCODER.encode(request_for(spec))]

    def encode_abort(self, request_ids: Sequence[str]) -> list[bytes]:
        if len(request_ids) != 1:
            raise ValueError(f"an SGLang AbortReq names one request, got {len(request_ids)}: use encode_aborts")
        return [s.ENCODER.encode(s.AbortReq(rid=request_ids[0]))]

    def encode_aborts(self, request_ids: Sequence[str]) -> list[list[bytes]]:
        return [[s.ENCODER.encode(s.AbortReq(rid=rid))] for rid in request_ids]

    def encode_utility(self, call_id: int, method: str, args: Sequence[object]) -> list[bytes]:
        return [s.ENCODER.encode(control_request(call_id, method, args))]

    def decode_output(self, frames: Sequence[bytes]) -> OutputBatch | EngineDead:
        raw = decode_message(frames, s.FROM_SCHEDULER_READ)  # unread columns left as Raw (sglang_structs.py)
        match raw:
            case EngineDead():
                return raw
            case s.BatchTokenIDOutputRead():
                return OutputBatch(0, _token_outputs(raw), frames=frames)
            case s.BatchEmbeddingOutput():
                return OutputBatch(0, _embedding_outputs(raw), frames=frames)
            case s.AbortReq():
                reason = raw.finished_reason or {}
                info = AbortInfo(reason.get("message") or raw.abort_message, reason.get("status_code"),
                                 reason.get("err_type"), reported=True)
                return OutputBatch(0, [SglangOutput(raw.rid or "", [], FinishReason.ABORT, abort=info)], frames=frames)
            case s.FlushCacheReqOutput() | s.ProfileReqOutput():
                return OutputBatch(0, [], utility=_control_reply(raw), frames=frames)
            case s.HealthCheckOutput():
                return OutputBatch(0, [], frames=frames)  # a scheduler push: the link is alive
        raise WireError(f"unexpected SGLang message {type(raw).__name__}")  # pragma: no cover - the union is closed

    @staticmethod
    def cached_tokens(output: SglangOutput) -> int | None:
        return output.cached_tokens

    @staticmethod
    def logprobs(output: SglangOutput, frames: Sequence[bytes]) -> tuple[LogprobRows | None, LogprobRows | None]:
        """This output's (sampled tokens', prompt's) logprobs, read from its batch's columns."""
        batch, i = output._batch, output._index
        if batch is None:
            return None, None
        sample = _rows(batch, "output", i, skip_first=False)
        prompt = _rows(batch, "input", i, skip_first=True)
        return sample, prompt


def _rows(batch: _Columns, side: str, i: int, *, skip_first: bool) -> LogprobRows | None:
    """SGLang's per-position columns as vLLM-layout rows: own token first, then its top-k."""
    values = batch.at(f"{side}_token_logprobs_val", i)
    ids = batch.at(f"{side}_token_logprobs_idx", i)
    if not values:
        return None
    if ids is None or len(ids) != len(values):
        raise WireError(f"SGLang {side} logprob values and ids disagree for {batch.rids[i]!r}")
    top_values = batch.at(f"{side}_top_logprobs_val", i) or []
    top_ids = batch.at(f"{side}_top_logprobs_idx", i) or []
    start = 1 if skip_first and values[0] is None else 0  # the first prompt token has no logprob
    k = max((len(t or ()) for t in top_values[start:]), default=0)
    flat_ids: list[int] = []
    flat_values: list[float] = []
    for pos in range(start, len(values)):
        if values[pos] is None:
            raise WireError(f"SGLang {side} logprob {pos} of {batch.rids[i]!r} is missing")
        row_ids = list(top_ids[pos] or ()) if pos < len(top_ids) else []
        row_values = list(top_values[pos] or ()) if pos < len(top_values) else []
        if len(row_ids) != len(row_values) or len(row_ids) not in (0, k):
            raise WireError(f"SGLang {side} top logprobs at {pos} of {batch.rids[i]!r} are ragged")
        flat_ids += [ids[pos], *row_ids]
        flat_values += [values[pos], *row_values]
        if not row_ids and k:
            raise WireError(f"SGLang {side} top logprobs at {pos} of {batch.rids[i]!r} are missing")
    rows = len(values) - start
    if not rows and not start:
        return None
    # rows 0 after a skipped first: only the start position came (a logprob_start_len at the prompt's
    # last token), which the contract still answers with its one value-less entry.
    # Typed views, as vLLM's zero-copy columns are: the core slices top-k rows by buffer (machines/logprobs.py).
    try:
        return LogprobRows(rows=rows, cols=k + 1, token_ids=memoryview(array("q", flat_ids)),
                           logprobs=memoryview(array("d", flat_values)))
    except (TypeError, OverflowError) as exc:  # a column of the wrong kind (its lists are ``Any`` on the wire)
        raise WireError(f"SGLang {side} logprobs of {batch.rids[i]!r} are not numbers: {exc}") from None


# --------------------------------------------------------------------------
# Engine side: the scheduler's view (the sim personality, tests)
# --------------------------------------------------------------------------


def decode_input(frames: Sequence[bytes]) -> s.ToScheduler:
    """One message as the scheduler's PULL sees it; WireError when it cannot be read."""
    if len(frames) != 1:
        raise WireError(f"an SGLang message is one frame, got {len(frames)}")
    try:
        return s.TO_SCHEDULER.decode(frames[0])
    except (msgspec.DecodeError, ValueError) as exc:
        raise WireError(f"undecodable SGLang request: {exc}") from None


def encode_outputs(message: s.FromScheduler) -> list[bytes]:
    """One scheduler push (an output batch, an abort report or a control reply), one frame."""
    return [s.ENCODER.encode(message)]


def encode_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


def token_batch(rids: list[str], output_ids: list[list[int]], finished_reasons: list[dict | None], *,
                prompt_tokens: list[int], completion_tokens: list[int], cached_tokens: list[int] | None = None,
                **columns: Any) -> s.BatchTokenIDOutput:
    """A ``BatchTokenIDOutput`` as SGLang's output streamer fills it under ``--skip-tokenizer-init``."""
    n = len(rids)
    empty: list = [[] for _ in range(n)]
    fields: dict[str, Any] = dict(
        rids=rids, http_worker_ipcs=[None] * n, finished_reasons=finished_reasons, decoded_texts=[""] * n,
        decode_ids=[s.pack_array(()) for _ in range(n)], read_offsets=[0] * n,
        output_ids=[s.pack_array(ids) for ids in output_ids], skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n, no_stop_trim=[False] * n, prompt_tokens=prompt_tokens,
        reasoning_tokens=[0] * n, completion_tokens=completion_tokens,
        cached_tokens=cached_tokens if cached_tokens is not None else [0] * n,
        input_token_logprobs_val=empty, input_token_logprobs_idx=empty, output_token_logprobs_val=empty,
        output_token_logprobs_idx=empty, input_top_logprobs_val=empty, input_top_logprobs_idx=empty,
        output_top_logprobs_val=empty, output_top_logprobs_idx=empty, input_token_ids_logprobs_val=empty,
        input_token_ids_logprobs_idx=empty, output_token_ids_logprobs_val=empty,
        output_token_ids_logprobs_idx=empty, output_token_entropy_val=None, output_token_sampling_mask=None,
        output_hidden_states=None, routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        # A scheduler without speculative decoding sends these empty (``output_streamer.py``).
        spec_verify_ct=[], spec_num_correct_drafts=[], spec_num_block_accept_tokens=[], spec_num_cap_tokens=[],
        spec_correct_drafts_histogram=[], spec_cap_lens_histogram=[],
    )
    fields.update(columns)
    return s.BatchTokenIDOutput(**fields)


def finish_stop(matched: int | str | None) -> dict:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str, status_code: int | None = None, err_type: str | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


# --------------------------------------------------------------------------
# Layout declaration, for the launch-time check against an installed SGLang
# --------------------------------------------------------------------------


def _layout() -> dict:
    return {"engine": "sglang", "version": SGLANG_VERSION,
            "structs": {name: layout_of(cls) for name, cls in s.STRUCTS.items()}}


LAYOUT: Final = _layout()

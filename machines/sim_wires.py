"""The sim engine's SGLang and TokenSpeed personalities: the shared sim core behind other wires.

``SimEngineCore`` (``sim_core.py``) speaks vLLM's wire, and stays the one
place that decides tokens, stops, scheduling, the prefix cache and KV
events. A personality is a sans-io translator around it, on the engine side
of another wire (codecs: ``wire/sglang.py``, ``wire/tokenspeed.py``):

- an input message is decoded with the wire's engine-side codec, read into
  the engine-neutral ``GenerateSpec`` (as that engine would understand the
  request) and handed to the core as vLLM's ADD; aborts likewise;
- a core step's output frames are read back with vLLM's front-end codec and
  re-emitted as the wire's output columns, with the running totals the wire
  carries (prompt/completion/cached tokens) kept per request here.

So the same request draws the same seeded tokens on every wire. What each
engine does differently, and the sim copies (reference ``sglang-contract.md``,
``sglang-wire.md``, ``tokenspeed.md``):

- SGLang sends greedy as ``temperature 1.0, top_k 1`` (normalised): read back
  as greedy. ``max_new_tokens=0`` (the prefix request of SGLang's ``n > 1``)
  prefills and ends ``length`` with no token. Control requests
  (``FlushCacheReqInput``, ``ProfileReq``) are answered at once, echoing
  ``rid``/``http_worker_ipc``; a flush with requests queued or running fails,
  as the scheduler's does. ``--runner pooling`` takes
  ``TokenizedEmbeddingReqInput`` and answers ``BatchEmbeddingOutput``.
- TokenSpeed fans ``n > 1`` out in its front end: a request with ``n != 1``
  on the wire is answered with an ``abort`` entry (its ``validation_error``
  path); no control calls exist on this wire.
- Both answer an abort of a request they hold with an ``abort`` entry (the
  scheduler finishes it with ``FINISH_ABORT``), unlike vLLM, which is silent.
  A request the core refuses (empty or too long prompt, wrong runner) ends
  ``abort`` with status 400 on SGLang, ``abort`` on TokenSpeed.
- TokenSpeed's outputs end with the load tail (``num_running``,
  ``num_waiting``, KV pages); SGLang's outputs carry no load (its scheduler
  publishes loads in shared memory, which no wire carries).

Rules: sans-io (``now`` is an argument); per-request state lives only while
the core holds the request (bounded by the core's ``max_num_seqs`` plus its
queue); what a wire cannot read raises ``WireError``; a frame a core fault
made unreadable (garbage) passes through as it is, ``ENGINE_CORE_DEAD``
becomes the wire's dead frame.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from typing import Any, Final, Sequence

import msgspec

from enginelink.machines.sim_core import SimEngineCore
from enginelink.machines.sim_legs import SimLeg, room_line
from enginelink.wire import sglang, sglang_structs as ss, tokenspeed, vllm
from enginelink.wire.vllm_mm import DTYPE_BYTES
from enginelink.wire.engine import (
    EngineDead, FinishReason, GenerateSpec, OutputBatch, PoolingSpec, SamplingSpec, WireError,
)

_VLLM: Final = vllm.VllmCodec()
NO_LEG: Final = SimLeg()
SGLANG_PROFILE_OK: Final = "Succeeded"
SGLANG_PROFILE_RUNNING: Final = "Profiling is already in progress. Call /stop_profile first."
SGLANG_PROFILE_IDLE: Final = "Profiling is not in progress. Call /start_profile first."


class _Totals:
    """What one request's outputs have said so far (the wires carry running totals)."""

    __slots__ = ("prompt", "completion", "cached", "prefill_only", "last")

    def __init__(self, prompt: int, prefill_only: bool) -> None:
        self.prompt = prompt
        self.completion = 0
        self.cached = 0
        self.prefill_only = prefill_only  # max_new_tokens=0: the core's one token is dropped
        self.last: int | None = None


class _Personality:
    """The translation both wires share: specs into the core, its outputs back out."""

    def __init__(self, core: SimEngineCore, leg: SimLeg = NO_LEG) -> None:
        self.core = core
        self.leg = leg  # its PD role (machines/sim_legs.py)
        self.notes: list[str] = []  # lines for the shell to log (the PD rooms a leg took); it empties it
        self._totals: dict[str, _Totals] = {}
        self._call_id = 0
        # Prompt logprob rows of a request's first output, for a wire that sends them (SGLang's input columns).
        self._prompt_rows: dict[str, Any] = {}

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def _eos(self) -> tuple[int, ...]:
        eos = self.core.config.eos_token_id
        return () if eos is None else (eos,)

    def _room(self, prompt: Sequence[int]) -> int:
        return max(1, self.core.config.max_model_len - len(prompt))

    def _add(self, spec: GenerateSpec, now: float, *, prefill_only: bool = False) -> list[tuple[Any, Any]]:
        """Queue ``spec`` in the core; the core's immediate answers (a refusal) as (output, totals)."""
        if self.core.has_request(spec.request_id):
            raise WireError(f"duplicate request id {spec.request_id!r}")
        self._totals[spec.request_id] = _Totals(len(spec.prompt_token_ids), prefill_only)
        return self._read(self.core.handle_input(*_VLLM.encode_add(spec), now))

    def _abort(self, request_ids: Sequence[str]) -> list[tuple[str, _Totals]]:
        """Abort what the core holds; (id, totals so far) of those it held (they get an abort entry)."""
        held = [(rid, self._totals[rid]) for rid in request_ids if self.core.has_request(rid) and rid in self._totals]
        self.core.handle_input(*_VLLM.encode_abort(list(request_ids)), 0.0)
        for rid in request_ids:
            self._totals.pop(rid, None)
        return held

    def _flush(self) -> bool:
        self._call_id += 1
        messages = self.core.handle_input(*_VLLM.encode_utility(self._call_id, "reset_prefix_cache", []), 0.0)
        batch = _VLLM.decode_output(messages[0]) if messages else None
        return isinstance(batch, OutputBatch) and batch.utility is not None and batch.utility.result is True

    def step(self, now: float) -> tuple[list[list[bytes]], float]:
        messages, cost = self.core.step(now)
        return [out for message in messages for out in self._emit(message)], cost

    def _emit(self, message: list[bytes]) -> list[list[bytes]]:
        """One core output message as this wire's messages."""
        if message and message[0] == vllm.ENGINE_CORE_DEAD:
            return [self._dead()]
        try:
            entries = self._read([message])
        except WireError:
            return [message]  # a fault's garbage stays garbage on any wire
        return self._batches(entries) if entries else []

    def _read(self, messages: list[list[bytes]]) -> list[tuple[Any, _Totals, Any]]:
        """The core's outputs as (output, totals, logprob rows), totals updated, finished ones forgotten."""
        entries = []
        for frames in messages:
            batch = _VLLM.decode_output(frames)
            if isinstance(batch, EngineDead):
                raise WireError("dead")
            for out in batch.outputs:
                totals = self._totals.get(out.request_id)
                if totals is None:
                    continue  # aborted meanwhile
                cached = vllm.cached_tokens(out)
                if cached is not None:
                    totals.cached = cached
                if totals.prefill_only:
                    out.new_token_ids = []
                    if out.finish_reason is not None and out.finish_reason != FinishReason.ERROR:
                        out.finish_reason, out.stop_reason = FinishReason.LENGTH, None
                totals.completion += len(out.new_token_ids)
                if out.new_token_ids:
                    totals.last = out.new_token_ids[-1]
                rows, prompt_rows = _VLLM.logprobs(out, frames)
                if prompt_rows is not None:
                    self._prompt_rows[out.request_id] = prompt_rows
                entries.append((out, totals, rows))
                if out.finish_reason is not None:
                    del self._totals[out.request_id]
        return entries

    def _batches(self, entries: list) -> list[list[bytes]]:
        """One step's outputs as this wire's messages."""
        raise NotImplementedError

    def _dead(self) -> list[bytes]:
        raise NotImplementedError


def _sampling(temperature: float, top_k: int, **fields: Any) -> SamplingSpec:
    greedy = top_k == 1 or temperature < 1e-6  # both wires' greedy forms
    return SamplingSpec(temperature=0.0 if greedy else temperature, top_k=0 if greedy or top_k < 0 else top_k,
                        **fields)


def _refusal(core: SimEngineCore, prompt: Sequence[int], pooling: bool) -> str:
    """Why the core refused a request, in the engine's words where it has them."""
    cfg = core.config
    if (cfg.runner == "pooling") != pooling:
        kind = "embedding" if pooling else "generation"
        return f"this engine runs the {cfg.runner} runner and does not serve {kind} requests"
    if not prompt:
        return "The input_ids is empty."
    return (f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length "
            f"({cfg.max_model_len - 1} tokens). Use a shorter input or enable --allow-auto-truncate.")


class SglangPersonality(_Personality):
    """The engine side of SGLang 0.5.23's scheduler wire (msgpack mode, ``--skip-tokenizer-init``).

    ``supports_vision``: the model takes images (what the real launcher reports from SGLang's model
    config). A request's ``mm_inputs`` (the scheduler's ``MultimodalProcessorOutput``) is then checked
    as the scheduler would find it (one image item, its feature a tensor whose bytes fit its shape,
    offsets inside the prompt) and its placeholder ranges padded with values drawn from the image's
    bytes, as SGLang's ``pad_input_ids`` pads them with the item's hash-derived sentinels (folded into
    the vocabulary here, so the sim's tokens and KV events stay ordinary ids): the same image gives the
    same tokens and cache blocks, another image others. Without vision such a request ends ``abort`` 400.
    """

    def __init__(self, core: SimEngineCore, leg: SimLeg = NO_LEG, supports_vision: bool = False) -> None:
        super().__init__(core, leg)
        self.supports_vision = supports_vision
        self._profiling = False
        self._pooling: set[str] = set()
        self._prompt_ids: dict[str, tuple[int, int]] = {}

    def handle(self, frames: Sequence[bytes], now: float) -> list[list[bytes]]:
        """One message from the front end's PUSH; the messages to push back now."""
        match sglang.decode_input(frames):
            case ss.TokenizedGenerateReqInput() as req:
                return self._generate(req, now)
            case ss.TokenizedEmbeddingReqInput() as req:
                return self._embed(req, now)
            case ss.AbortReq(abort_all=True):
                return self._aborted(self._abort(list(self._totals)))
            case ss.AbortReq(rid=rid):
                return self._aborted(self._abort([rid or ""]))
            case ss.FlushCacheReqInput(rid=rid, http_worker_ipc=ipc):
                busy = self.core.has_work
                ok = not busy and self._flush()
                running, waiting, _ = self.core.load()
                message = "" if ok else (f"Cache not flushed because there are pending requests. "
                                         f"#queue-req: {waiting}, #running-req: {running}")
                return [sglang.encode_outputs(ss.FlushCacheReqOutput(rid=rid, http_worker_ipc=ipc, success=ok,
                                                                     message=message))]
            case ss.ProfileReq(rid=rid, http_worker_ipc=ipc, req_type=kind):
                start = kind == ss.PROFILE_START
                ok = start != self._profiling
                if ok:
                    self._profiling = start
                message = SGLANG_PROFILE_OK if ok else SGLANG_PROFILE_RUNNING if start else SGLANG_PROFILE_IDLE
                return [sglang.encode_outputs(ss.ProfileReqOutput(rid=rid, http_worker_ipc=ipc, success=ok,
                                                                  message=message))]
        raise WireError(f"the scheduler takes no {type(frames).__name__} here")  # pragma: no cover - union closed

    def _generate(self, req: ss.TokenizedGenerateReqInput, now: float) -> list[list[bytes]]:
        sp = req.sampling_params
        prompt = _ids(req.input_ids, req.rid)
        rank = self.core.config.engine_index
        refused = self.leg.refusal(req.bootstrap_host, req.bootstrap_room, rank)
        if refused is not None:
            return [sglang.encode_outputs(sglang.token_batch(
                [req.rid or ""], [[]], [sglang.finish_abort(*refused)], prompt_tokens=[len(prompt)],
                completion_tokens=[0]))]
        if self.leg.is_leg:
            self.notes.append(room_line(self.leg, rank, req.rid or "", req.bootstrap_host, req.bootstrap_port,
                                        req.bootstrap_room))
        max_new = self.leg.max_new_tokens(sp.max_new_tokens)
        start = req.logprob_start_len
        sampling = _sampling(
            sp.temperature, sp.top_k, max_tokens=self._room(prompt) if max_new is None else max(1, max_new),
            top_p=sp.top_p, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
            min_tokens=sp.min_new_tokens, stop_token_ids=tuple(sp.stop_token_ids or ()), eos_token_ids=self._eos(),
            ignore_eos=sp.ignore_eos, seed=sp.sampling_seed,
            logprobs=req.top_logprobs_num if req.return_logprob else None,
            # SGLang's logprob_start_len N: prompt positions N.. (N's own value is None); -1 or the
            # prompt's end: none.
            prompt_logprobs=req.top_logprobs_num if req.return_logprob and 0 <= start < len(prompt) else None,
        )
        if req.mm_inputs is not None:
            padded = _padded_prompt(req.mm_inputs, prompt, self.core.config.vocab_size, self.supports_vision)
            if isinstance(padded, str):  # the scheduler's refusal, in the sim's words
                return [sglang.encode_outputs(sglang.token_batch(
                    [req.rid or ""], [[]], [sglang.finish_abort(padded, 400, "BadRequestError")],
                    prompt_tokens=[len(prompt)], completion_tokens=[0]))]
            prompt = padded
        spec = GenerateSpec(request_id=req.rid or "", prompt_token_ids=prompt, sampling=sampling,
                            cache_salt=req.cache_salt)
        if req.return_logprob and start > len(prompt):  # the scheduler's own refusal (Scheduler.handle_generate_request)
            message = (f"req.logprob_start_len={start} is higher than the number of input tokens "
                       f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller logprob_start_len.")
            return [sglang.encode_outputs(sglang.token_batch(
                [spec.request_id], [[]], [sglang.finish_abort(message, 400, "BadRequestError")],
                prompt_tokens=[len(prompt)], completion_tokens=[0]))]
        if sampling.prompt_logprobs is not None:
            self._prompt_ids[spec.request_id] = (start, prompt[start])  # the start's id (it has no value)
        return self._now(self._add(spec, now, prefill_only=max_new == 0), prompt, pooling=False)

    def _embed(self, req: ss.TokenizedEmbeddingReqInput, now: float) -> list[list[bytes]]:
        prompt = _ids(req.input_ids, req.rid)
        spec = GenerateSpec(request_id=req.rid or "", prompt_token_ids=prompt,
                            sampling=SamplingSpec(max_tokens=1), pooling=PoolingSpec())
        self._pooling.add(spec.request_id)
        return self._now(self._add(spec, now), prompt, pooling=True)

    def _now(self, entries: list, prompt: Sequence[int], *, pooling: bool) -> list[list[bytes]]:
        if not entries:
            return []
        out, _, _ = entries[0]
        self._pooling.discard(out.request_id)
        reason = sglang.finish_abort(_refusal(self.core, prompt, pooling), 400)
        return [sglang.encode_outputs(sglang.token_batch(
            [out.request_id], [[]], [reason], prompt_tokens=[len(prompt)], completion_tokens=[0]))]

    def _aborted(self, held: list[tuple[str, _Totals]]) -> list[list[bytes]]:
        if not held:
            return []
        rids = [rid for rid, _ in held]
        for rid in rids:
            self._pooling.discard(rid)
            self._prompt_ids.pop(rid, None)
            self._prompt_rows.pop(rid, None)
        reasons = [sglang.finish_abort(None) for _ in rids]  # the scheduler's FINISH_ABORT(): no message, no status
        return [sglang.encode_outputs(sglang.token_batch(
            rids, [[] for _ in rids], reasons, prompt_tokens=[t.prompt for _, t in held],
            completion_tokens=[t.completion for _, t in held], cached_tokens=[t.cached for _, t in held]))]

    def _batches(self, entries: list) -> list[list[bytes]]:
        # A pooling core takes only embedding requests, a generating one none, so a step is one
        # kind; SGLang's scheduler sends the two kinds as separate batch types all the same.
        pooled = [e for e in entries if e[0].request_id in self._pooling]
        tokens = [e for e in entries if e[0].request_id not in self._pooling]
        return ([self._embeddings(pooled)] if pooled else []) + ([self._tokens(tokens)] if tokens else [])

    def _embeddings(self, pooled: list) -> list[bytes]:
        for out, _, _ in pooled:
            self._pooling.discard(out.request_id)
        return sglang.encode_outputs(ss.BatchEmbeddingOutput(
                rids=[o.request_id for o, _, _ in pooled], finished_reasons=[sglang.finish_stop(None)] * len(pooled),
                embeddings=[_vector(o.pooling_output) for o, _, _ in pooled],
                prompt_tokens=[t.prompt for _, t, _ in pooled], cached_tokens=[t.cached for _, t, _ in pooled],
                placeholder_tokens_idx=None, placeholder_tokens_val=None))

    def _tokens(self, entries: list) -> list[bytes]:
        reasons = [self._finish(out, totals) for out, totals, _ in entries]
        columns: dict[str, Any] = {}
        if any(rows is not None for _, _, rows in entries):
            val, idx, top_val, top_idx = [], [], [], []
            for _, _, rows in entries:
                r = rows.rows if rows else 0
                c = rows.cols if rows else 1
                val.append([rows.logprobs[i * c] for i in range(r)])
                idx.append([rows.token_ids[i * c] for i in range(r)])
                top_val.append([list(rows.logprobs[i * c + 1:(i + 1) * c]) for i in range(r)] if c > 1 else [])
                top_idx.append([list(rows.token_ids[i * c + 1:(i + 1) * c]) for i in range(r)] if c > 1 else [])
            columns = dict(output_token_logprobs_val=val, output_token_logprobs_idx=idx,
                           output_top_logprobs_val=top_val, output_top_logprobs_idx=top_idx)
        prompts = [self._prompt_rows.pop(out.request_id, None) for out, _, _ in entries]
        if any(p is not None for p in prompts):
            columns.update(self._input_columns(prompts, [self._prompt_ids.pop(o.request_id, (0, 0))
                                                         for o, _, _ in entries]))
        # The producing rank, as SGLang's output streamer names it (``dp_ranks``; None without DP).
        config = self.core.config
        columns["dp_ranks"] = [config.engine_index if config.data_parallel_size > 1 else None] * len(entries)
        batch = sglang.token_batch(
            [o.request_id for o, _, _ in entries], [list(o.new_token_ids) for o, _, _ in entries], reasons,
            prompt_tokens=[t.prompt for _, t, _ in entries], completion_tokens=[t.completion for _, t, _ in entries],
            cached_tokens=[t.cached for _, t, _ in entries], **columns)
        return sglang.encode_outputs(batch)

    @staticmethod
    def _input_columns(prompts: list, starts: list[tuple[int, int]]) -> dict[str, list]:
        """SGLang's input logprob columns, sent once with a request's first output: from its start position
        (``logprob_start_len``, whose own value is None: ``_process_input_token_logprobs``) to the prompt's end.
        The core's rows are positions 1.. of the whole prompt: row r is position r + 1."""
        val, idx, top_val, top_idx = [], [], [], []
        for rows, (start, first_id) in zip(prompts, starts):
            if rows is None:
                val.append([]), idx.append([]), top_val.append([]), top_idx.append([])
                continue
            c, kept = rows.cols, range(start, rows.rows)
            val.append([None, *(rows.logprobs[i * c] for i in kept)])
            idx.append([first_id, *(rows.token_ids[i * c] for i in kept)])
            top_val.append([[], *([list(rows.logprobs[i * c + 1:(i + 1) * c]) for i in kept])])
            top_idx.append([[], *([list(rows.token_ids[i * c + 1:(i + 1) * c]) for i in kept])])
        return dict(input_token_logprobs_val=val, input_token_logprobs_idx=idx,
                    input_top_logprobs_val=top_val, input_top_logprobs_idx=top_idx)

    @staticmethod
    def _finish(out: Any, totals: _Totals) -> dict | None:
        match out.finish_reason:
            case None:
                return None
            case FinishReason.STOP:
                # SGLang names the matched id for EOS too (FINISH_MATCHED_TOKEN).
                return sglang.finish_stop(out.stop_reason if out.stop_reason is not None else totals.last)
            case FinishReason.LENGTH:
                return sglang.finish_length(totals.completion)
            case _:
                return sglang.finish_abort("the sim engine ended the request", 500)

    def _dead(self) -> list[bytes]:
        return sglang.encode_dead()


class TokenSpeedPersonality(_Personality):
    """The engine side of TokenSpeed 0.1.1's headless wire (``BatchTokenIDOutSlim`` with the load tail)."""

    def handle(self, frames: Sequence[bytes], now: float) -> list[list[bytes]]:
        match tokenspeed.decode_input(frames):
            case tokenspeed.AddRequest(request=req):
                return self._generate(req, now)
            case tokenspeed.AbortRequest(request_ids=ids):
                held = self._abort(ids)
                return [self._slim([(rid, [], "abort", t.prompt, t.completion, t.cached, None)
                                    for rid, t in held])] if held else []
        raise WireError("unreachable")  # pragma: no cover - decode_input's union is closed

    def _generate(self, req: tokenspeed.TokenizedGenerateReqInput, now: float) -> list[list[bytes]]:
        sp = req.sampling_params
        rid = req.rid or ""
        prompt = list(req.input_ids or ())
        rank = self.core.config.engine_index
        if sp.n != 1 or req.validation_error or self.leg.refusal(req.bootstrap_host, req.bootstrap_room, rank):
            return [self._slim([(rid, [], "abort", len(prompt), 0, 0, None)])]
        if self.leg.is_leg:
            self.notes.append(room_line(self.leg, rank, rid, req.bootstrap_host, req.bootstrap_port,
                                        req.bootstrap_room))
        max_new = self.leg.max_new_tokens(sp.max_new_tokens)
        sampling = _sampling(
            sp.temperature, sp.top_k,
            max_tokens=self._room(prompt) if max_new is None else max(1, max_new),
            top_p=sp.top_p, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
            min_tokens=sp.min_new_tokens, stop_token_ids=tuple(sp.stop_token_ids or ()), eos_token_ids=self._eos(),
            ignore_eos=sp.ignore_eos, seed=sp.seed, logprobs=0 if req.return_logprob else None,
        )
        spec = GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
        entries = self._add(spec, now, prefill_only=max_new == 0)
        return [self._slim([(rid, [], "abort", len(prompt), 0, 0, None)])] if entries else []

    def _batches(self, entries: list) -> list[list[bytes]]:
        return [self._slim([
            (out.request_id, list(out.new_token_ids), _TS_FINISH[out.finish_reason], totals.prompt,
             totals.completion, totals.cached, rows) for out, totals, rows in entries])]

    def _slim(self, rows: list[tuple]) -> list[bytes]:
        running, waiting, used = self.core.load()
        return tokenspeed.encode_outputs(tokenspeed.BatchTokenIDOutSlim(
            rids=[r[0] for r in rows], output_ids=[r[1] for r in rows], finished_reasons=[r[2] for r in rows],
            prompt_tokens=[r[3] for r in rows], completion_tokens=[r[4] for r in rows],
            cached_tokens=[r[5] for r in rows],
            output_token_logprobs_val=[list(r[6].logprobs[:: r[6].cols]) if r[6] else [] for r in rows],
            output_token_logprobs_idx=[list(r[6].token_ids[:: r[6].cols]) if r[6] else [] for r in rows],
            engine_index=self.core.config.engine_index, num_running=running, num_waiting=waiting,
            kv_active_pages=used, kv_total_pages=self.core.config.num_gpu_blocks))

    def _dead(self) -> list[bytes]:
        return tokenspeed.encode_dead()


_TS_FINISH: Final = {None: "", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                     FinishReason.ABORT: "abort", FinishReason.ERROR: "abort", FinishReason.REPETITION: "stop"}


def _padded_prompt(mm: ss.MultimodalProcessorOutput, prompt: list[int], vocab: int,
                   supports_vision: bool) -> list[int] | str:
    """The prompt with each image's offsets padded (see ``SglangPersonality``), or why the scheduler refuses."""
    if not supports_vision:
        return "The model does not take multimodal input (it is not multimodal, or --language-model-only)."
    if len(mm.mm_items) != 1 or mm.mm_items[0].modality != ss.MODALITY_IMAGE:
        return f"Expected one image item, got {[item.modality for item in mm.mm_items]}"
    item = mm.mm_items[0]
    digest = hashlib.blake2b(digest_size=8)
    for name, value in [("feature", item.feature), *sorted(item.model_specific_data.items())]:
        if not (isinstance(value, msgspec.msgpack.Ext) and value.code == ss.EXT_TORCH_TENSOR):
            return f"multimodal {name} is not a tensor"
        try:
            shape, dtype, data = ss.unpack_tensor(value.data)
        except ValueError as error:
            return f"multimodal {name}: {error}"
        width = DTYPE_BYTES.get(dtype)
        if width is None or len(data) != math.prod(shape) * width:
            return f"multimodal {name}: {len(data)} bytes for {dtype} {list(shape)}"
        digest.update(name.encode() + data)
    pad = _FIRST_PAD + int.from_bytes(digest.digest(), "little") % (vocab - _FIRST_PAD)
    padded = list(prompt)
    for start, end in item.offsets or ():
        if not 0 <= start <= end < len(prompt):
            return f"Invalid multimodal token offsets: offset=({start}, {end}), num_tokens={len(prompt)}"
        padded[start:end + 1] = [pad] * (end - start + 1)
    return padded


_FIRST_PAD: Final = 16  # pad values stay clear of the low (special) ids


def _ids(ids: Any, rid: str | None) -> list[int]:
    if isinstance(ids, array):
        return ids.tolist()
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids  # SMG's adapter accepts a plain list too
    raise WireError(f"input_ids of {rid!r} are neither an Ext 1 array nor a list of ids")


def _vector(tensor: Any) -> list[float]:
    """A core pooling tensor (float32 bytes) as SGLang's embedding column entry."""
    data = getattr(tensor, "data", None)
    if data is None:
        raise WireError("the core's pooled tensor has no bytes")
    return array("f", data).tolist()


SimWire = SglangPersonality | TokenSpeedPersonality

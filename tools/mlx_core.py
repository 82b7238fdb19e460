"""The MLX engine's core: mlx-lm's ``BatchGenerator`` behind vLLM's EngineCore wire.

It takes input messages exactly as a headless vLLM engine's DEALER receives
them (``wire/vllm.py``'s engine side, as ``machines/sim_core.py`` does) and
returns output frames exactly as its PUSH sends them, so the servicer drives
it like any vLLM rank: the link and request machines, journal, warm-up,
drain, silence and death handling are the same code. ``mlx_engine.py`` owns
the sockets and the loop; this file owns every MLX object.

Theory of operation:
- ONE thread calls everything here (mlx streams are thread-local; the model
  is loaded and force-evaluated on the same thread that steps it).
- ADD -> held (``mlx_admission.Admission``) until its burst is complete,
  then one ``BatchGenerator.insert`` for the burst (a request joining alone
  costs forwards of its own and puts the batch out of step), each with a per-request sampler (greedy:
  argmax; sampled: mlx-lm's top-p/min-p/top-k filters, then a categorical
  draw from the request's OWN ``mx.random`` key, split per token, so a seed
  gives the same tokens whatever is batched beside it) and per-request
  logits processors (logit bias, mlx-lm's penalties, and min_tokens masking
  stop ids). mlx-lm's own stopping is off (an empty state machine): stops
  follow vLLM's ``check_stop`` here, so the wire says what vLLM says: EOS
  (``_eos_token_id``, absent under ignore_eos) -> STOP; a stop id -> STOP
  with ``stop_reason`` = the id; ``max_tokens`` or the context full ->
  LENGTH. The matched token is part of the output, as in vLLM.
- ABORT -> ``BatchGenerator.remove`` (or out of the held burst): the request is gone from the engine
  (nothing is sent for it, as vLLM sends nothing for a client abort).
- ``step`` = one ``BatchGenerator.next()``: one EngineCoreOutputs frame with
  one token per generating request, scheduler stats, finished ids.
- A request the engine cannot serve (prompt logprobs, a grammar, pooling,
  an empty prompt or one that fills the context: the servicer refuses those
  first) ends at once with FinishReason.ERROR, as vLLM answers a request it
  cannot preprocess.
- Logprobs are mlx-lm's: the log-softmax after logits processors, before
  temperature (vLLM's default "raw" logprobs are before processors; the
  difference shows only with a bias or penalty). A row is
  ``[sampled, top1..topk]`` with the sampled token's rank, as vLLM sends.
"""

from __future__ import annotations

import importlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, assert_never

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from enginelink.tools.mlx_admission import GAP_MS_DEFAULT, MAX_MS_DEFAULT, Admission
from enginelink.wire import vllm, vllm_arrays
from enginelink.wire.engine import FinishReason, WireError

_generate = importlib.import_module("mlx_lm.generate")  # the module, not mlx_lm.generate()
_sample_utils = importlib.import_module("mlx_lm.sample_utils")



def _filter_keeping_lists_aligned(original):
    """mlx-lm 0.31.3's ``GenerationBatch.filter`` leaves ``samplers`` / ``logits_processors``
    unfiltered when every entry is None / empty (its ``PromptProcessingBatch.filter`` does not).
    The next sequence to join then sits past stale entries and is sampled with its neighbour's
    sampler: a seeded request run after greedy ones came out greedy after its first token. The
    lists that were all None / empty are cut to the kept length, which is exactly their filter."""

    def filter(self, keep):
        no_samplers, no_processors = not any(self.samplers), not any(self.logits_processors)
        original(self, keep)
        if no_samplers:
            self.samplers = [None] * len(keep)
        if no_processors:
            self.logits_processors = [[] for _ in keep]

    filter.enginelink_aligned = True
    return filter


if not getattr(_generate.GenerationBatch.filter, "enginelink_aligned", False):
    _generate.GenerationBatch.filter = _filter_keeping_lists_aligned(_generate.GenerationBatch.filter)

def _extend_keeping_dtype(original):
    """mlx-lm 0.31.3's ``BatchKVCache.extend`` (and ``BatchRotatingKVCache.extend``) pads a side
    with no keys yet with ``mx.array([])``, which is float32: a bfloat16 cache extended with an
    empty one becomes float32, and every cache merged into it after that too. That happens
    whenever a prompt arrives while another is part-way through its prefill (a burst split
    across a step), so under any traffic that does not arrive in lockstep: the KV cache doubles
    in size and each decode step on the tiny model cost 45-75% more CPU (docs/benchmarks-history.md,
    MLX). The keys and values go back to the dtype the cache had (values that were that dtype
    upcast: exact)."""

    def extend(self, other):
        had = self.keys if self.keys is not None else other.keys
        original(self, other)
        if had is not None and self.keys is not None and self.keys.dtype != had.dtype:
            self.keys, self.values = self.keys.astype(had.dtype), self.values.astype(had.dtype)

    extend.enginelink_dtype_kept = True
    return extend


_cache = importlib.import_module("mlx_lm.models.cache")
for _batch_cache in (_cache.BatchKVCache, _cache.BatchRotatingKVCache):
    if not getattr(_batch_cache.extend, "enginelink_dtype_kept", False):
        _batch_cache.extend = _extend_keeping_dtype(_batch_cache.extend)

# config.json keys that may hold the context length, first positive wins (reference/mlx.md §3.2).
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")
# Reported as the KV "block" size: MLX has no paged cache; the servicer only multiplies it back.
BLOCK_SIZE = 16
_SEED_BITS = 63


@dataclass(frozen=True)
class MlxConfig:
    completion_batch_size: int = 32  # sequences generating at once (mlx_lm.server's default)
    prefill_batch_size: int = 8  # prompts prefilled together
    prefill_step_size: int = 2048  # prompt tokens per prefill chunk
    max_model_len: int | None = None  # default: the model's context (config.json)
    max_logprobs: int = 20  # vLLM's --max-logprobs default; -1: the vocabulary
    engine_index: int = 0
    coalesce_gap_s: float = GAP_MS_DEFAULT / 1000  # a held burst goes in after this long without a new request
    coalesce_max_s: float = MAX_MS_DEFAULT / 1000  # ... or this long after its first (0: every request at once)


def model_context(config: dict) -> int | None:
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eval_all_arrays(model: nn.Module) -> None:
    """Force every array of the model now, on this thread.

    Lazily built private arrays (YaRN's ``_freqs``) otherwise fail with "There
    is no Stream(gpu, 1) in current thread" when first used elsewhere
    (reference/mlx.md §3.3); one thread steps here anyway, and this makes the
    first request's latency the model's, not the load's.
    """
    arrays = [v for _, v in tree_flatten(model.parameters())]
    arrays += [v for _, v in tree_flatten(vars(model)) if isinstance(v, mx.array)]
    for module in model.modules():
        arrays += [v for v in vars(module).values() if isinstance(v, mx.array)]
    mx.eval(arrays)


@mx.compile
def _draw(logprobs: mx.array, key: mx.array, inv_temp: mx.array) -> tuple[mx.array, mx.array]:
    """One draw from the request's key, and the key for its next one.

    Compiled (as mlx-lm's own ``categorical_sampling``): uncompiled, the split, its
    unpacking and the draw were a dozen graph nodes per row per step, each
    paid on this thread and on MLX's, which cost 18% more CPU per token than
    mlx-lm's shared sampler (docs/benchmarks-history.md, MLX); compiled, the same.
    The same tokens either way. ``inv_temp`` is an array so one compiled graph
    serves every temperature.
    """
    key, draw = mx.random.split(key)
    # In the logits' dtype, as a Python float multiplies (a float32 array would promote bf16 rows).
    return key, mx.random.categorical(logprobs * inv_temp.astype(logprobs.dtype), key=draw)


def _seeded_sampler(params: vllm.SamplingParams):
    """A sampler with the request's own random key; None: greedy (the generator's argmax)."""
    temp = params.temperature
    if not temp or temp <= 0:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(_SEED_BITS)
    state = {"key": mx.random.key(seed % (1 << 64))}
    inv_temp = mx.array(1 / temp, dtype=mx.float32)
    filters = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: _sample_utils.apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: _sample_utils.apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: _sample_utils.apply_top_k(x, params.top_k))

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        state["key"], token = _draw(logprobs, state["key"], inv_temp)
        return token

    return sample


def _processors(params: vllm.SamplingParams, stop_ids: frozenset[int], vocab: int) -> list:
    kwargs: dict[str, Any] = {}
    if params.logit_bias:
        kwargs["logit_bias"] = {int(k): float(v) for k, v in params.logit_bias.items()}
    if params.repetition_penalty and params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        kwargs["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        kwargs["frequency_penalty"] = params.frequency_penalty
    processors = list(_sample_utils.make_logits_processors(**kwargs)) if kwargs else []
    if params.min_tokens > 0 and stop_ids:
        # Called once per sampled token of this request: mask its stop ids for the first min_tokens.
        masked = mx.array(sorted(i for i in stop_ids if 0 <= i < vocab))
        calls = [0]

        def min_tokens(_tokens: mx.array, logits: mx.array) -> mx.array:
            calls[0] += 1
            if calls[0] > params.min_tokens:
                return logits
            logits = mx.array(logits)
            logits[:, masked] = -mx.inf
            return logits

        processors.append(min_tokens)
    return processors


class _Request:
    __slots__ = ("rid", "uid", "prompt", "max_tokens", "min_tokens", "eos", "stop_ids", "logprobs", "output",
                 "queued_ts", "sampler", "processors")  # fmt: skip

    def __init__(self, rid: str, prompt: list[int], params: vllm.SamplingParams, room: int, now: float) -> None:
        self.rid = rid
        self.uid = -1
        self.prompt = prompt
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.min_tokens = params.min_tokens
        self.eos = params.eos_token_id  # None under ignore_eos
        self.stop_ids = frozenset(params.stop_token_ids or ())
        self.logprobs = params.logprobs
        self.output: list[int] = []
        self.queued_ts = now
        self.sampler = None  # what insert() takes, kept while the request is held
        self.processors: list = []


class MlxEngineCore:
    """One engine rank over one loaded model. Feed it input messages; call ``step`` while ``has_work``."""

    def __init__(self, model: nn.Module, model_config: dict, config: MlxConfig) -> None:
        self.config = config
        self.vocab_size = int(model_config["vocab_size"])
        context = model_context(model_config)
        if config.max_model_len is not None:
            context = config.max_model_len if context is None else min(config.max_model_len, context)
        if context is None:
            raise ValueError("config.json names no context length (max_position_embeddings, ...): pass --max-model-len")
        self.max_model_len = context
        self.model = model
        self.generator = _generate.BatchGenerator(
            model, completion_batch_size=config.completion_batch_size,
            prefill_batch_size=config.prefill_batch_size, prefill_step_size=config.prefill_step_size,
        )  # fmt: skip
        self._no_stops = _generate.SequenceStateMachine()  # stops are decided here (vLLM's rules)
        self._by_id: dict[str, _Request] = {}  # held or in the generator
        self._by_uid: dict[int, _Request] = {}  # in the generator
        self._held: Admission[_Request] = Admission(config.coalesce_gap_s, config.coalesce_max_s)
        self._step_counter = 0
        self._prefix = vllm.PrefixCacheStats()

    # ---- facts ------------------------------------------------------------

    def ready_response(self, instance_id: str) -> vllm.ReadyResponse:
        cfg = self.config
        # No paged KV pool: capacity is every generating sequence at a full context.
        tokens = cfg.completion_batch_size * self.max_model_len
        return vllm.ReadyResponse(
            max_model_len=self.max_model_len,
            num_gpu_blocks=-(-tokens // BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            dtype=_dtype(self.model),
            vllm_version=vllm.VLLM_VERSION,
            data_parallel_rank=cfg.engine_index,
            max_num_seqs=cfg.completion_batch_size,
            max_num_batched_tokens=cfg.prefill_step_size,
            instance_id=instance_id,
            kv_cache_size_tokens=tokens,
            kv_cache_max_concurrency=float(cfg.completion_batch_size),
            effective_attention_block_size=BLOCK_SIZE,
        )

    @property
    def has_work(self) -> bool:
        """Requests held or in the generator (``step`` admits the held ones when due)."""
        return bool(self._by_id)

    @property
    def generating(self) -> bool:
        """Requests in the generator: the loop steps without waiting."""
        return bool(self._by_uid)

    @property
    def active(self) -> int:
        return len(self._by_id)

    def admission_wait_s(self, now: float) -> float | None:
        """Seconds until the held burst is due (0: now); None: none held. An idle loop waits this long."""
        return self._held.wait_s(now, self._free_slots())

    def _free_slots(self) -> int:
        return max(0, self.config.completion_batch_size - len(self._by_uid))

    # ---- inputs -----------------------------------------------------------

    def handle_input(self, request_type: bytes, payload: bytes, now: float) -> list[list[bytes]]:
        match vllm.decode_input(request_type, payload):
            case vllm.AddRequest(request=req):
                return self._add(req, now)
            case vllm.AbortRequest(request_ids=ids):
                if not self._abort(ids):
                    return []
                # Stats now, not at the next step (there may be none): the servicer's loads
                # must show the engine without the aborted requests.
                frame = vllm.EngineCoreOutputs(self.config.engine_index, [], self._stats(), timestamp=now)
                return [vllm.encode_outputs(frame)]
            case vllm.UtilityCall() as call:
                out = vllm.EngineCoreOutputs(self.config.engine_index, [], timestamp=now,
                                             utility_output=self._utility(call))  # fmt: skip
                return [vllm.encode_outputs(out)]
            case unreachable:
                assert_never(unreachable)

    def _refuse(self, rid: str, now: float) -> list[list[bytes]]:
        out = vllm.EngineCoreOutputs(
            self.config.engine_index, [vllm.EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR)],
            timestamp=now, finished_requests=[rid],
        )  # fmt: skip
        return [vllm.encode_outputs(out)]

    def _add(self, req: vllm.EngineCoreRequest, now: float) -> list[list[bytes]]:
        if req.request_id in self._by_id:
            raise WireError(f"duplicate request id {req.request_id!r}")
        if req.abort_immediately:
            return []  # a PD release: nothing to free here
        params = req.sampling_params or vllm.SamplingParams()
        prompt = list(req.prompt_token_ids or [])
        room = self.max_model_len - len(prompt)
        unservable = (
            req.pooling_params is not None or params.prompt_logprobs is not None or params.structured_outputs
            or not prompt or room < 1 or any(not 0 <= t < self.vocab_size for t in prompt)
        )  # fmt: skip
        if unservable:
            return self._refuse(req.request_id, now)
        r = _Request(req.request_id, prompt, params, room, now)
        stops = set(r.stop_ids) | set(params.all_stop_token_ids)
        if r.eos is not None:
            stops.add(r.eos)
        r.sampler = _seeded_sampler(params)
        r.processors = _processors(params, frozenset(stops), self.vocab_size)
        self._by_id[r.rid] = r
        self._held.hold(r, now)
        return []

    def _admit(self, now: float) -> None:
        """The held burst into the generator, in one insert, once it is due."""
        burst = self._held.take_due(now, self._free_slots())
        if not burst:
            return
        uids = self.generator.insert(
            prompts=[r.prompt for r in burst], max_tokens=[r.max_tokens for r in burst],
            samplers=[r.sampler for r in burst], logits_processors=[r.processors for r in burst],
            state_machines=[self._no_stops] * len(burst),
        )  # fmt: skip
        for r, uid in zip(burst, uids, strict=True):
            r.uid, r.sampler, r.processors = uid, None, []
            self._by_uid[uid] = r

    def _abort(self, ids: list[str]) -> int:
        gone = [r for r in (self._by_id.pop(rid, None) for rid in ids) if r is not None]  # unknown ids: harmless
        if not gone:
            return 0
        ids_gone = {id(r) for r in gone}
        held = {id(r) for r in self._held.drop(lambda r: id(r) in ids_gone)}  # never inserted: nothing to remove
        inserted = [r for r in gone if id(r) not in held]
        for r in inserted:
            del self._by_uid[r.uid]
        if inserted:
            self.generator.remove([r.uid for r in inserted])
        return len(gone)

    def _utility(self, call: vllm.UtilityCall) -> vllm.UtilityOutput:
        match call.method:
            case "reset_prefix_cache":
                return vllm.utility_success(call.call_id, True)  # no prefix cache to reset
            case "get_supported_tasks":
                return vllm.utility_success(call.call_id, ["generate"])
            case "is_sleeping":
                return vllm.utility_success(call.call_id, False)
            case "reset_mm_cache" | "reset_encoder_cache":
                return vllm.utility_success(call.call_id, None)
            case name:
                return vllm.utility_failure(call.call_id, name, f"the MLX engine has no utility method {name!r}")

    # ---- one engine step --------------------------------------------------

    def step(self, now: float) -> list[list[bytes]]:
        """Admit the held burst if due, then one ``BatchGenerator.next()``: the output frames
        (none while it only prefilled, or nothing is in the generator yet)."""
        self._admit(now)
        if not self._by_uid:
            return []
        _prompts, generated = self.generator.next()
        if not generated:
            return []
        self._step_counter += 1
        writer = vllm_arrays.ArrayWriter()
        outputs: list[vllm.EngineCoreOutput] = []
        finished: list[_Request] = []
        for g in generated:
            r = self._by_uid.get(g.uid)
            if r is None:
                continue  # aborted while its step was in flight
            token = int(g.token)
            r.output.append(token)
            finish, stop_reason = self._check_stop(r, token)
            out = vllm.EngineCoreOutput(r.rid, [token], finish_reason=finish, stop_reason=stop_reason)
            if len(r.output) == 1:
                out.events = [vllm.EngineCoreEvent(vllm.EVENT_QUEUED, r.queued_ts),
                              vllm.EngineCoreEvent(vllm.EVENT_SCHEDULED, now)]  # fmt: skip
                out.prefill_stats = vllm.PrefillStats(len(r.prompt), len(r.prompt), 0, 0, 0)
            if r.logprobs is not None:
                out.new_logprobs = self._logprobs(writer, g.logprobs, token, r.logprobs)
            outputs.append(out)
            if finish is not None:
                finished.append(r)
        if finished:
            for r in finished:
                del self._by_id[r.rid]
                del self._by_uid[r.uid]
            # Ones mlx-lm finished itself (max_tokens) are gone already; remove() skips unknown uids.
            self.generator.remove([r.uid for r in finished])
        frame = vllm.EngineCoreOutputs(self.config.engine_index, outputs, self._stats(), timestamp=now,
                                       finished_requests=[r.rid for r in finished] or None)  # fmt: skip
        return [vllm.encode_outputs(frame, writer)]

    def _stats(self) -> vllm.WireSchedulerStats:
        capacity = self.config.completion_batch_size * self.max_model_len
        used = sum(len(r.prompt) + len(r.output) for r in self._by_uid.values())
        # Waiting: held for the burst, or inserted with no token yet (queued or prefilling in the generator).
        prefilling = sum(1 for r in self._by_uid.values() if not r.output)
        waiting = len(self._held) + prefilling
        return vllm.WireSchedulerStats(num_running_reqs=len(self._by_uid) - prefilling, num_waiting_reqs=waiting,
                                       step_counter=self._step_counter, kv_cache_usage=min(1.0, used / capacity))

    def _check_stop(self, r: _Request, token: int) -> tuple[int | None, int | None]:
        n = len(r.output)
        if n >= r.min_tokens:
            if token == r.eos:
                return FinishReason.STOP, None
            if token in r.stop_ids:
                return FinishReason.STOP, token
        if len(r.prompt) + n >= self.max_model_len or n >= r.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _logprobs(self, writer: vllm_arrays.ArrayWriter, logprobs: mx.array, token: int, k: int) -> list:
        values = np.array(logprobs.astype(mx.float32)).reshape(-1)
        k = values.size if k == -1 else min(k, values.size)
        sampled = float(values[token])
        rank = 1 + int(np.count_nonzero(values > sampled))
        if k:
            top = np.argpartition(-values, k - 1)[:k]
            top = top[np.argsort(-values[top], kind="stable")]
        else:
            top = np.empty(0, dtype=np.int64)
        ids = [token, *top.tolist()]
        lps = [sampled, *values[top].tolist()]
        return vllm_arrays.logprobs_lists(writer, ids, lps, [rank], len(ids))

    def summary(self) -> str:
        """One line for the engine's log at stop: its steps and how requests joined the batch."""
        return f"{self._step_counter} steps, {self._held.summary()}"

    def close(self) -> None:
        self.generator.close()


def _dtype(model: nn.Module) -> str:
    for _, value in tree_flatten(model.parameters()):
        return str(value.dtype).removeprefix("mlx.core.")
    return "bfloat16"


def load(model_dir: Path) -> tuple[nn.Module, dict]:
    """The model (force-evaluated) and its config.json, on the calling thread."""
    from mlx_lm import load as mlx_load

    model, _tokenizer = mlx_load(str(model_dir))
    eval_all_arrays(model)
    return model, json.loads((model_dir / "config.json").read_text())


def clock() -> float:
    return time.monotonic()

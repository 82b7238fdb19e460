"""The sim engine's core: a deterministic, sans-io vLLM EngineCore double.

It takes input messages exactly as a headless vLLM engine's DEALER receives
them and returns output messages exactly as its PUSH sends them (codec:
``enginelink.wire.vllm``). The process shell (``sim_engine.py``) owns the
sockets, the clock and the sleeping; this core only computes.

Theory of operation (mirrors vLLM's v1 scheduler where it is observable):
- ``handle_input`` queues ADDs, drops ABORTed requests silently (vLLM sends
  nothing for a client abort) and answers utility calls at once.
- ``step`` schedules FCFS: running requests first (one decode token each, or
  the next prefill chunk), then waiting ones while ``max_num_seqs`` and the
  ``max_num_batched_tokens`` budget allow (chunked prefill). It returns ONE
  EngineCoreOutputs frame carrying one new token per request that finished
  its prefill, scheduler stats, and the ids it retired, plus the step's cost
  in seconds (``step_us`` + ``prefill_us_per_token`` x uncached prompt tokens).
- Tokens are a hash: blake2b of (seed; plus the request id when sampling
  unseeded at temperature > 0) and a rolling hash of every token of the
  context so far (the prompt, then each output), so greedy output is
  reproducible, depends on the prompt, and, like a real model's, depends on
  the tokens alone and not on where the prompt ends: a request re-submitted
  as its prompt plus the tokens it had generated continues exactly as the
  uninterrupted one would (what resuming after an engine restart relies on,
  docs/resume.md). A token lands in [3, vocab); the model's EOS id comes out
  when the hash is 0 mod 16.
  Before ``min_tokens`` stop ids are masked (vLLM's min-tokens processor).
- Stop checks follow vLLM's ``check_stop``: EOS = the request's
  ``_eos_token_id`` (absent when ``ignore_eos``) -> STOP; a stop id -> STOP
  with ``stop_reason`` = the id; context full or ``max_tokens`` -> LENGTH.
- The prefix cache holds full blocks by chained block hash (LRU, at most
  ``num_gpu_blocks``). A newly scheduled request reuses its longest cached
  prefix, never the whole prompt (the last token is always recomputed, as in
  vLLM), and reports it in ``prefill_stats`` on its first output.
- KV space is reserved per request for prompt + max_tokens at admission, so
  the sim never preempts; ``kv_cache_usage`` reports blocks actually filled.
- ``runner="pooling"`` (``--runner pooling``) makes it an embedding engine, as
  vLLM's pooling runner: it takes only requests with pooling params, and once
  a prompt is prefilled answers with no tokens, ``finish_reason`` STOP and a
  ``pooling_output`` float32 tensor (``sim_embedding``: a hash of the prompt,
  L2-normalised), inline or in an extra frame by vLLM's 256-byte rule. Either
  runner answers a request of the other kind with ERROR at once.
- PD (``kv_connector`` set, as ``--kv-transfer-config`` sets it): a request's
  ``sampling_params.extra_args.kv_transfer_params`` come back on its finishing
  output, echoed with what a connector adds (``sim_kv_params``): the other
  leg's block ids, engine id and request id, and for a prefill leg
  (``do_remote_decode``) the flags flipped and this engine's side channel
  (``remote_host``/``remote_port``). Without a connector the params are
  ignored, as vLLM ignores them ("no KVConnector found"). An
  ``abort_immediately`` ADD is added and aborted at once (vLLM's pre-admission
  release): it never runs, nothing comes back, ``kv_releases`` counts it.

Rules: no I/O, no clock (``now`` is an argument), no randomness; every
collection is bounded by a config value. ``SimHooks`` is where KV-event
publishing (``sim_kv.py``: one batch per step, like vLLM) and fault
injection (die, silence, garbage, KV publisher faults) attach.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Final, Sequence, assert_never

import msgspec

from enginelink.machines import sim_logprobs
from enginelink.wire import vllm, vllm_arrays
from enginelink.wire.engine import FinishReason, WireError

_PACK: Final = msgspec.msgpack.Encoder()
_FIRST_TOKEN: Final = 3  # ids 0-2 are special in the test tokenizer
# The context's rolling hash (``_Request.context``): polynomial, modulo a Mersenne prime.
_CONTEXT_BASE: Final = 1_000_003
_CONTEXT_MOD: Final = (1 << 61) - 1


def context_hash(tokens: Sequence[int], start: int = 0) -> int:
    """The rolling hash of ``tokens`` continued from ``start``: the same for one sequence however it is split."""
    h = start
    for token in tokens:
        h = (h * _CONTEXT_BASE + token + 1) % _CONTEXT_MOD
    return h


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int = 4096
    max_model_len: int = 1024
    eos_token_id: int | None = None  # the model's EOS (config.json)
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_us_per_token: float = 0.0
    step_us: float = 0.0
    engine_index: int = 0
    data_parallel_size: int = 1  # ranks of the launch (its ready response says so, as vLLM's does)
    log_stats: bool = True  # vLLM --headless default: stats on
    dtype: str = "bfloat16"
    instance_id: str = "sim"
    runner: str = "generate"  # or "pooling": an embedding engine (vLLM's --runner)
    embed_dim: int = 256  # pooled vector length (the model's hidden size)
    # PD: the connector --kv-transfer-config names (None: no KV transfer), and its identity.
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_engine_id: str = "sim-kv-engine"
    kv_port: int = 14579  # vLLM's KVTransferConfig.kv_port default

    def __post_init__(self) -> None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")
        if self.embed_dim < 1:
            raise ValueError("embed_dim must be >= 1")
        if self.vocab_size <= _FIRST_TOKEN:
            raise ValueError(f"vocab_size must exceed {_FIRST_TOKEN}, got {self.vocab_size}")
        for name in ("max_model_len", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def ready_response(config: SimConfig) -> vllm.ReadyResponse:
    tokens = config.num_gpu_blocks * config.block_size
    return vllm.ReadyResponse(
        max_model_len=config.max_model_len,
        num_gpu_blocks=config.num_gpu_blocks,
        block_size=config.block_size,
        dtype=config.dtype,
        vllm_version=vllm.VLLM_VERSION,
        data_parallel_rank=config.engine_index,
        data_parallel_size=config.data_parallel_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        instance_id=config.instance_id,
        kv_cache_size_tokens=tokens,
        kv_cache_max_concurrency=tokens / config.max_model_len,
        effective_attention_block_size=config.block_size,
    )


class SimHooks:
    """Extension points of the core; this base does nothing (KV events off)."""

    def attach(self, core: "SimEngineCore") -> None:
        """The core these hooks serve (called once, from its constructor)."""

    def blocks_stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int],
                      extra_keys: list[list | None] | None = None) -> None:  # fmt: skip
        """A run of full blocks entered the prefix cache (a KV BlockStored event):
        ``token_ids`` are exactly theirs, ``parent`` the block before the first."""

    def blocks_removed(self, block_hashes: list[int]) -> None:
        """Blocks left the prefix cache (a KV BlockRemoved event)."""

    def cache_cleared(self) -> None:
        """reset_prefix_cache emptied the cache (a KV AllBlocksCleared event)."""

    def step_done(self, now: float) -> None:
        """An engine step ran (vLLM publishes the step's KV events here, and only here)."""

    def kv_fault(self, kind: str, count: int) -> str | None:
        """Inject a KV publisher fault (``tools/sim_kv.py``); None if done, else why not."""
        return "KV events are off: start the sim engine with --kv-events-config"

    def outgoing(self, messages: list[list[bytes]], now: float) -> list[list[bytes]]:
        """Every output message passes here; faults replace or drop them."""
        return messages


def block_hash(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Chained 64-bit block hash; the salt enters the first block only."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\0" * 8 if parent is None else parent.to_bytes(8, "little"))
    h.update(_PACK.encode([list(token_ids), salt]))
    return int.from_bytes(h.digest(), "little")


class _Request:
    __slots__ = (
        "rid", "prompt", "salt", "max_tokens", "min_tokens", "eos", "model_eos",
        "stop_ids", "masked", "digest", "base", "context", "step_digest", "queued_ts", "scheduled_ts", "num_computed",
        "cached", "output", "block_hashes", "num_committed", "reserved", "logprobs", "prompt_logprobs", "greedy", "pooling", "kv_params",
    )  # fmt: skip

    def __init__(self, req: vllm.EngineCoreRequest, config: SimConfig, now: float) -> None:
        params = req.sampling_params or vllm.SamplingParams()
        prompt = req.prompt_token_ids or []
        self.rid = req.request_id
        self.prompt = prompt
        self.salt = req.cache_salt
        room = config.max_model_len - len(prompt)
        self.pooling = req.pooling_params
        # vLLM's Request has max_tokens 1 for a pooling request: its KV need is the prompt's.
        self.max_tokens = 1 if self.pooling is not None else room if params.max_tokens is None else params.max_tokens
        self.min_tokens = params.min_tokens
        self.eos = params.eos_token_id  # what stops it; None under ignore_eos
        self.model_eos = config.eos_token_id if config.eos_token_id is not None else params.eos_token_id
        self.stop_ids = frozenset(params.stop_token_ids or ())
        masked = set(params.all_stop_token_ids) | self.stop_ids
        if self.eos is not None:
            masked.add(self.eos)
        self.masked = frozenset(masked)
        # Greedy (temperature 0) or seeded sampling is reproducible from the
        # prompt; unseeded sampling also depends on the request id, so the n
        # choices of one call differ as they would on a real engine.
        salt = req.request_id if (params.temperature or 0) > 0 and params.seed is None else None
        self.digest = request_digest(params.seed, salt, prompt)
        # What sampling hashes: the seed (and salt), and the whole context so far (``_sample``).
        self.base = sampling_base(params.seed, salt)
        self.context = context_hash(prompt)
        self.step_digest = self.base
        # Logprobs as the request asked (machines/sim_logprobs.py); None: none.
        self.logprobs = params.logprobs
        self.prompt_logprobs = params.prompt_logprobs
        self.greedy = not (params.temperature or 0) > 0
        self.queued_ts = now
        self.scheduled_ts = now
        self.num_computed = 0
        self.cached: int | None = None  # prefix hits, fixed when first scheduled
        self.output: list[int] = []
        bs = config.block_size
        self.block_hashes: list[int] = []
        for i in range(len(prompt) // bs):
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(block_hash(parent, prompt[i * bs : (i + 1) * bs], self.salt if i == 0 else None))
        self.num_committed = 0
        self.reserved = 0
        extra = params.extra_args or {}
        kv_params = extra.get("kv_transfer_params") if config.kv_connector else None
        self.kv_params: dict | None = kv_params if isinstance(kv_params, dict) else None


def request_digest(seed: int | None, salt: str | None, prompt: Sequence[int]) -> bytes:
    """A request's own digest: its seed, its id where sampling is unseeded at temperature > 0
    (``salt``), and its prompt (its prompt logprobs come from it; its tokens from ``step_digest``)."""
    return hashlib.blake2b(_PACK.encode([seed, salt, list(prompt)]), digest_size=16).digest()


def sampling_base(seed: int | None, salt: str | None) -> bytes:
    """What every sampling step of a request hashes besides its context: its seed and ``salt``."""
    return hashlib.blake2b(_PACK.encode([seed, salt]), digest_size=16).digest()


def step_digest(base: bytes, context: int) -> bytes:
    """One sampling step's digest: the request's ``base`` and the whole context so far (prompt and
    output, ``context_hash``), so a request re-sent as its prompt plus its tokens continues alike."""
    return hashlib.blake2b(base + context.to_bytes(8, "little"), digest_size=8).digest()


def expected_tokens(prompt: Sequence[int], count: int, *, vocab_size: int, eos_token_id: int | None,
                    seed: int | None = None) -> list[int]:
    """The first ``count`` tokens the sim engine samples for a greedy or seeded request on ``prompt``
    (no ``min_tokens``): what a client checks a stream against (``enginelink bench --soak``).

    ``eos_token_id`` is the model's (``config.json``): it comes out where the hash says so, whether or
    not the request ignores EOS; a request that does not ignore it ends there."""
    base, context = sampling_base(seed, None), context_hash(prompt)
    span = vocab_size - _FIRST_TOKEN
    out: list[int] = []
    for _ in range(count):
        if out:
            context = context_hash(out[-1:], context)
        h = int.from_bytes(step_digest(base, context), "little")
        out.append(eos_token_id if eos_token_id is not None and h % 16 == 0 else _FIRST_TOKEN + (h >> 4) % span)
    return out


def sim_kv_params(params: dict, request_id: str, prompt_tokens: int, config: SimConfig) -> dict:
    """What the sim's connector hands the other leg at a request's end: the params, echoed and extended.

    Deterministic: block ids are the prompt's block positions.
    """
    out = dict(params)
    out.update(
        remote_block_ids=list(range(_blocks(prompt_tokens, config.block_size))),
        remote_engine_id=config.kv_engine_id,
        remote_request_id=request_id,
    )
    if params.get("do_remote_decode"):
        # A prefill leg: the decode side pulls from here next.
        out.update(do_remote_decode=False, do_remote_prefill=True, remote_host="127.0.0.1",
                   remote_port=config.kv_port + config.engine_index)
    return out


def sim_embedding(prompt: Sequence[int], dim: int, normalize: bool = True) -> list[float]:
    """The sim's pooled vector for a prompt: deterministic, in [-1, 1) per element, unit length if ``normalize``.

    As float64; on the wire it is float32 (``array("f", sim_embedding(...))`` is what a client gets).
    """
    seed = hashlib.blake2b(_PACK.encode(list(prompt)), digest_size=16).digest()
    values = []
    for i in range(0, dim, 8):  # 8 elements per 64-byte hash
        block = hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=64).digest()
        values += [int.from_bytes(block[j : j + 8], "little") / 2**63 - 1.0 for j in range(0, 64, 8)]
    values = values[:dim]
    if normalize:
        norm = sum(v * v for v in values) ** 0.5 or 1.0
        values = [v / norm for v in values]
    return values


# vLLM 0.32's grammar backends (v1/structured_output/__init__.py grammar_init).
_GRAMMAR_BACKENDS: Final = frozenset({"xgrammar", "guidance", "outlines", "lm-format-enforcer"})


def _grammar_fails(params: vllm.SamplingParams | None) -> bool:
    """Whether vLLM would end this request ERROR for its constraint before its first step.

    The sim does not enforce constraints (its tokens are hashes). It fails
    the two cases it can judge without a grammar compiler, so the servicer's
    handling of an engine-side constraint failure runs against it: no or an
    unknown ``_backend`` (vLLM's grammar_init raises "Unsupported structured
    output backend") and an EBNF grammar with no ``root`` rule (xgrammar's
    parser refuses it).
    """
    so = params.structured_outputs if params is not None else None
    if not so:
        return False
    if so.get("_backend") not in _GRAMMAR_BACKENDS:
        return True
    grammar = so.get("grammar")
    return isinstance(grammar, str) and "::=" in grammar and not any(
        line.strip().startswith("root") for line in grammar.splitlines())


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class SimEngineCore:
    """One engine rank. Feed it input messages and call ``step`` while ``has_work``."""

    def __init__(self, config: SimConfig, hooks: SimHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks or SimHooks()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._reserved_blocks = 0
        self._step_counter = 0
        self._pcs = vllm.PrefixCacheStats()
        self.kv_releases = 0  # abort_immediately ADDs: PD releases (never scheduled)
        self.hooks.attach(self)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (the wire personalities answer aborts of these)."""
        return request_id in self._by_id

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, KV blocks filled): the load a step reports (vLLM's stats, TokenSpeed's tail)."""
        bs = self.config.block_size
        used = sum(_blocks(len(r.prompt) + len(r.output), bs) for r in self._running)
        return len(self._running), len(self._waiting), used

    # ---- inputs -----------------------------------------------------------

    def handle_input(self, request_type: bytes, payload: bytes, now: float) -> list[list[bytes]]:
        """One input message; returns output messages to send now (maybe none).

        Raises WireError for a message vLLM would not accept.
        """
        match vllm.decode_input(request_type, payload):
            case vllm.AddRequest(request=req):
                return self._add(req, now)
            case vllm.AbortRequest(request_ids=ids):
                self._abort(ids)
                return []
            case vllm.UtilityCall() as call:
                out = vllm.EngineCoreOutputs(
                    self.config.engine_index, [], timestamp=now, utility_output=self._utility(call)
                )
                return self.hooks.outgoing([vllm.encode_outputs(out)], now)
            case unreachable:
                assert_never(unreachable)

    def _add(self, req: vllm.EngineCoreRequest, now: float) -> list[list[bytes]]:
        if req.request_id in self._by_id:
            raise WireError(f"duplicate request id {req.request_id!r}")
        cfg = self.config
        if req.abort_immediately:
            # vLLM adds it and aborts it in the same call: only the connector's
            # request_finished hook runs (it frees the prefill side's KV); no output.
            self.kv_releases += 1
            return []
        r = _Request(req, cfg, now)
        need = _blocks(min(len(r.prompt) + r.max_tokens, cfg.max_model_len), cfg.block_size)
        wrong_runner = (r.pooling is not None) != (cfg.runner == "pooling")
        # A pooling prompt may fill the context (nothing is generated after it), as vLLM allows.
        room = 0 if r.pooling is not None else 1
        if (wrong_runner or not r.prompt or len(r.prompt) + room > cfg.max_model_len or need > cfg.num_gpu_blocks
                or _grammar_fails(req.sampling_params)):
            # vLLM answers a request it cannot preprocess with ERROR at once.
            out = vllm.EngineCoreOutputs(
                cfg.engine_index,
                [vllm.EngineCoreOutput(r.rid, [], finish_reason=FinishReason.ERROR)],
                timestamp=now,
                finished_requests=[r.rid],
            )
            return self.hooks.outgoing([vllm.encode_outputs(out)], now)
        self._waiting.append(r)
        self._by_id[r.rid] = r
        return []

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            r = self._by_id.pop(rid, None)  # unknown ids are harmless
            if r is None:
                continue
            if r in self._waiting:
                self._waiting.remove(r)
            else:
                self._running.remove(r)
                self._reserved_blocks -= r.reserved

    def _utility(self, call: vllm.UtilityCall) -> vllm.UtilityOutput:
        args = call.args
        match call.method:
            case "reset_prefix_cache" if len(args) <= 2:
                reset_running = bool(args[0]) if args else False
                # vLLM refuses while running requests hold blocks.
                if self._running and not reset_running:
                    return vllm.utility_success(call.call_id, False)
                self._clear_cache()
                return vllm.utility_success(call.call_id, True)
            case "enginelink_sim_kv_fault" if 1 <= len(args) <= 2:
                # Test-only fault injection (vLLM itself has no such method).
                error = self.hooks.kv_fault(str(args[0]), int(args[1]) if len(args) > 1 else 1)
                if error is not None:
                    return vllm.utility_failure(call.call_id, call.method, error)
                return vllm.utility_success(call.call_id, None)
            case "get_supported_tasks" if not args:
                return vllm.utility_success(call.call_id, ["generate"])
            case "is_sleeping" if not args:
                return vllm.utility_success(call.call_id, False)
            case "reset_mm_cache" | "reset_encoder_cache" if not args:
                return vllm.utility_success(call.call_id, None)
            case "profile" if len(args) <= 4:
                return vllm.utility_failure(call.call_id, call.method, _PROFILE_OFF)
            case "list_loras" | "add_lora" | "remove_lora" | "pin_lora":
                return vllm.utility_failure(call.call_id, call.method, _LORA_OFF)
            case name if name in _KNOWN_METHODS:
                return vllm.utility_failure(
                    call.call_id, name, f"{name}() got an unexpected number of arguments ({len(args)})"
                )
            case name:
                return vllm.utility_failure(
                    call.call_id, name, f"'EngineCoreProc' object has no attribute '{name}'"
                )

    def _clear_cache(self) -> None:
        self._cache.clear()
        self._pcs.reset = True
        self.hooks.cache_cleared()

    def forget_prefix_cache(self) -> None:
        """Empty the cache without an event: what an engine restart does (a KV fault)."""
        self._cache.clear()

    # ---- one engine step --------------------------------------------------

    def step(self, now: float) -> tuple[list[list[bytes]], float]:
        """Run one scheduler step: (output messages, cost in seconds)."""
        if not self.has_work:
            return [], 0.0  # vLLM does not step an engine without requests
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        computed = 0  # uncached prompt tokens computed this step
        scheduled: list[_Request] = []
        for r in self._running:
            if budget == 0:
                break
            n = 1 if r.num_computed >= len(r.prompt) else min(len(r.prompt) - r.num_computed, budget)
            if r.num_computed < len(r.prompt):
                r.num_computed += n
                computed += n
            budget -= n
            scheduled.append(r)
        while self._waiting and len(self._running) < cfg.max_num_seqs and budget > 0:
            r = self._waiting[0]
            need = _blocks(min(len(r.prompt) + r.max_tokens, cfg.max_model_len), cfg.block_size)
            if self._reserved_blocks + need > cfg.num_gpu_blocks:
                break  # FCFS: the head waits for space, nothing jumps it
            self._waiting.popleft()
            self._reserved_blocks += need
            r.reserved = need
            r.scheduled_ts = now
            r.num_computed = r.cached = self._lookup(r)
            n = min(len(r.prompt) - r.num_computed, budget)
            r.num_computed += n
            computed += n
            budget -= n
            self._running.append(r)
            scheduled.append(r)
        if not scheduled:
            self.hooks.step_done(now)
            return [], 0.0
        self._step_counter += 1
        writer = vllm_arrays.ArrayWriter()  # logprob arrays, as vLLM writes them
        outputs, finished = self._sample_all(scheduled, now, writer)
        for r in finished:
            self._running.remove(r)
            del self._by_id[r.rid]
            self._reserved_blocks -= r.reserved
        out = vllm.EngineCoreOutputs(
            cfg.engine_index,
            outputs,
            self._stats() if cfg.log_stats else None,
            timestamp=now,
            finished_requests=[r.rid for r in finished] or None,
        )
        cost_s = (cfg.step_us + computed * cfg.prefill_us_per_token) * 1e-6
        self.hooks.step_done(now)
        return self.hooks.outgoing([vllm.encode_outputs(out, writer)], now), cost_s

    def _sample_all(
        self, scheduled: list[_Request], now: float, writer: vllm_arrays.ArrayWriter
    ) -> tuple[list[vllm.EngineCoreOutput], list[_Request]]:
        outputs: list[vllm.EngineCoreOutput] = []
        finished: list[_Request] = []
        for r in scheduled:
            if r.num_computed < len(r.prompt):
                continue  # a prefill chunk that does not finish the prompt samples nothing
            if r.pooling is not None:
                # A pooling request ends with its prefill: no token, the pooled vector.
                vector = sim_embedding(r.prompt, self.config.embed_dim, r.pooling.use_activation is not False)
                r.output.append(-1)  # one step done (the stats below key on the first)
                finish, stop_reason = FinishReason.STOP, None
                out = vllm.EngineCoreOutput(r.rid, [], pooling_output=writer.array("float32", [len(vector)], vector),
                                            finish_reason=finish)
            else:
                token = self._sample(r)
                r.output.append(token)
                finish, stop_reason = self._check_stop(r, token)
                out = vllm.EngineCoreOutput(r.rid, [token], finish_reason=finish, stop_reason=stop_reason)
                if finish is not None and r.kv_params is not None:
                    out.kv_transfer_params = sim_kv_params(r.kv_params, r.rid, len(r.prompt), self.config)
            if len(r.output) == 1 and self.config.log_stats:
                out.events = [
                    vllm.EngineCoreEvent(vllm.EVENT_QUEUED, r.queued_ts),
                    vllm.EngineCoreEvent(vllm.EVENT_SCHEDULED, r.scheduled_ts),
                ]
                cached = r.cached or 0
                out.prefill_stats = vllm.PrefillStats(
                    len(r.prompt), len(r.prompt) - cached, cached, cached, 0
                )
            if r.logprobs is not None or r.prompt_logprobs is not None:
                self._logprobs(r, out, token, writer)
            outputs.append(out)
            self._commit_blocks(r)
            if finish is not None:
                finished.append(r)
        return outputs, finished

    def _logprobs(self, r: _Request, out: vllm.EngineCoreOutput, token: int, writer: vllm_arrays.ArrayWriter) -> None:
        vocab = self.config.vocab_size
        if r.logprobs is not None:
            # The step's own digest and the token's place in the whole context: the same row
            # for the same context, however the request was split (a resumed one).
            out.new_logprobs = sim_logprobs.sample_logprobs(
                writer, r.step_digest, len(r.prompt) + len(r.output) - 1, token, vocab, r.logprobs, r.greedy)
        if r.prompt_logprobs is not None and len(r.output) == 1:
            # vLLM sends every prompt row at once, with the first token (no partial prefill outputs).
            out.new_prompt_logprobs_tensors = sim_logprobs.prompt_logprobs(
                writer, r.digest, r.prompt, vocab, r.prompt_logprobs)

    def _sample(self, r: _Request) -> int:
        i = len(r.output)
        if i:  # the context grew by the last output token
            r.context = context_hash(r.output[-1:], r.context)
        r.step_digest = step_digest(r.base, r.context)
        h = int.from_bytes(r.step_digest, "little")
        span = self.config.vocab_size - _FIRST_TOKEN
        token = r.model_eos if r.model_eos is not None and h % 16 == 0 else _FIRST_TOKEN + (h >> 4) % span
        if i < r.min_tokens and token in r.masked:
            k = h >> 4
            for _ in range(span):  # bounded: gives up only if every id is a stop id
                k += 1
                token = _FIRST_TOKEN + k % span
                if token not in r.masked:
                    break
        return token

    def _check_stop(self, r: _Request, token: int) -> tuple[int | None, int | None]:
        n = len(r.output)
        if n < r.min_tokens:
            return None, None
        if token == r.eos:
            return FinishReason.STOP, None
        if token in r.stop_ids:
            return FinishReason.STOP, token
        if len(r.prompt) + n >= self.config.max_model_len or n >= r.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    # ---- prefix cache -----------------------------------------------------

    def _lookup(self, r: _Request) -> int:
        """Cached prompt tokens for a newly scheduled request; records stats."""
        bs = self.config.block_size
        hits = 0
        for h in r.block_hashes[: (len(r.prompt) - 1) // bs]:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            hits += 1
        self._pcs.requests += 1
        self._pcs.queries += len(r.prompt)
        self._pcs.hits += hits * bs
        return hits * bs

    def _commit_blocks(self, r: _Request) -> None:
        """Put the request's newly full blocks (KV computed) into the cache."""
        bs = self.config.block_size
        n_full = (len(r.prompt) + len(r.output) - 1) // bs
        if n_full <= r.num_committed:
            return
        tokens = r.prompt + r.output
        while len(r.block_hashes) < n_full:
            i = len(r.block_hashes)
            parent, salt = (r.block_hashes[-1], None) if i else (None, r.salt)
            r.block_hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], salt))
        runs: list[tuple[int, list[int]]] = []  # (index of the first block, hashes) per run of new blocks
        for i in range(r.num_committed, n_full):
            h = r.block_hashes[i]
            if h in self._cache:
                self._cache.move_to_end(h)
            else:
                self._cache[h] = None
                if runs and runs[-1][0] + len(runs[-1][1]) == i:
                    runs[-1][1].append(h)
                else:
                    runs.append((i, [h]))
        # One event per run: a block already cached splits the run, so each event's
        # tokens are exactly its blocks' and its parent is the block before it.
        for first, hashes in runs:
            parent = r.block_hashes[first - 1] if first else None
            extra = [[r.salt] if first + k == 0 and r.salt else None for k in range(len(hashes))]
            self.hooks.blocks_stored(hashes, parent, tokens[first * bs : (first + len(hashes)) * bs], extra)
        r.num_committed = n_full
        evicted = []
        while len(self._cache) > self.config.num_gpu_blocks:
            evicted.append(self._cache.popitem(last=False)[0])
        if evicted:
            self.hooks.blocks_removed(evicted)

    def _stats(self) -> vllm.WireSchedulerStats:
        _, _, used = self.load()
        pcs, self._pcs = self._pcs, vllm.PrefixCacheStats()
        return vllm.WireSchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            step_counter=self._step_counter,
            kv_cache_usage=min(1.0, used / self.config.num_gpu_blocks),
            prefix_cache_stats=pcs,
        )


_PROFILE_OFF: Final = (
    "Profiling is not enabled. Please set --profiler-config to enable profiling. Example: "
    "'--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE'"
)
_LORA_OFF: Final = "LoRA is not enabled. Use --enable-lora to enable LoRA."
_KNOWN_METHODS: Final = frozenset(
    {"reset_prefix_cache", "get_supported_tasks", "is_sleeping", "reset_mm_cache", "reset_encoder_cache", "profile"}
)

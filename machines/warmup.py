"""The planned warm-up: the knob, the engine's facts, and the plan (smg contract §13).

Why: an engine picks kernels (and captures graphs) lazily, per batch shape,
so the first real requests of each shape pay for it. The warm-up sends the
shapes real traffic will hit before readiness says SERVING.

Theory of operation. ``parse_warmup_knob`` turns the operator's knob into a
``WarmupSetting`` (level and budget) or refuses it with the accepted forms.
``plan_warmup`` turns the engine's facts and the level into an ordered list
of ``WarmupStep``s: a decode staircase, a prefill ladder, a second pass over
the bucket grid ("again"), and a final prefix-cache flush. The driver
(``runtime/lifetime/warmup.py``) runs the steps in order, the requests of a step
concurrently, under a time budget.

Rules:
- pure: no I/O, no clock, no randomness; the same facts give the same plan,
  request ids and prompt token ids, on every machine;
- every request fits: prompt + max_tokens <= context - reserve, and no
  prompt exceeds one scheduler step (``limit``);
- prompts are distinct from their first two tokens on (the ordinal spelled in
  base ``span``), so a prefix cache never hides a prefill.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from enginelink.machines.link import WARMUP_REQUEST_PREFIX

KNOB: Final = "SMG_VLLM_SERVICER_WARMUP"
OWN_KNOB: Final = "ENGINELINK_WARMUP"  # same grammar; wins when both are set
DEFAULT_BUDGET_S: Final = 300.0
# TokenSpeed's default budget (the reference's tokenspeed/warmup.py): room for the chunk remainders
# at a 4,096-token chunk; a larger step is cut evenly by the spread order.
TOKENSPEED_BUDGET_S: Final = 900.0
# What TokenSpeed's scheduler keeps back beyond a prompt and its output budget (its request handler
# takes one off the context, one off the output clamp): a prompt one below the context is refused.
TOKENSPEED_RESERVE_TOKENS: Final = 2

WINDOW_DEFAULT: Final = 128  # vLLM's max_num_seqs when the engine says 0
STAIRCASE_PROMPT_TOKENS: Final = 8
ODD_VARIANT_MIN: Final = 16  # buckets from here on also get bucket + 1
CLASS_TOKENS: Final = 128  # full: every multiple of this up to the limit
TOKEN_BASE: Final = 1000  # prompt ids start here (clear of special tokens)
TOKEN_SPAN_MAX: Final = 30000

_OFF_WORDS: Final = frozenset({"off", "0", "false", "no", "none"})


class WarmupLevel(StrEnum):
    OFF = "off"
    FAST = "fast"
    FULL = "full"


class StepKind(StrEnum):
    DECODE = "decode"  # the staircase: a batch that shrinks by one per engine step
    PREFILL = "prefill"  # one prompt length of the ladder
    AGAIN = "again"  # the bucket grid once more
    REMAINDER = "remainder"  # TokenSpeed: a prompt length the ladder left out, up to the step (spread order)
    FLUSH = "flush"  # reset the prefix cache; always last, never cut by the budget


class WarmupKnobError(ValueError):
    """The operator's warm-up knob is not one of the accepted forms (exit 2)."""


@dataclass(frozen=True)
class WarmupSetting:
    level: WarmupLevel
    budget_s: float


@dataclass(frozen=True)
class WarmupFacts:
    """What the plan needs to know about the engine."""

    window: int  # max_num_seqs (0: the engine's default, 128)
    step: int  # max_num_batched_tokens
    context: int  # max_model_len
    vocab: int
    dp_size: int = 1
    capture_sizes: tuple[int, ...] = ()  # CUDA-graph capture sizes, when known
    reserve: int = 0  # context positions the scheduler keeps back (0 for vLLM)
    # TokenSpeed of more than one process: every prompt length up to the step, once, before serving. A
    # chunked prefill's last chunk is any count below the step; its first use launched while the previous
    # chunk's collective is in flight loads a kernel lazily and has deadlocked every rank (the reference's
    # tokenspeed/warmup.py). A one-process engine pays a first use as a pause, so it plans none.
    every_prefill_length: bool = False

    def __post_init__(self) -> None:
        for name in ("window", "reserve"):
            if getattr(self, name) < 0:
                raise ValueError(f"warm-up facts: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("step", "context", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm-up facts: {name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 2:
            raise ValueError(f"warm-up facts: vocab must be >= 2, got {self.vocab}")

    @property
    def limit(self) -> int:
        """The longest prompt the plan sends: one scheduler step, one token of room."""
        return min(self.step, self.context - 1 - self.reserve)


@dataclass(frozen=True)
class WarmupRequest:
    """One warm-up Generate. Its prompt is computed on demand (it can be long)."""

    request_id: str
    ordinal: int
    prompt_len: int
    max_tokens: int
    vocab: int
    data_parallel_rank: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True

    @property
    def prompt_token_ids(self) -> list[int]:
        return warmup_prompt(self.ordinal, self.prompt_len, self.vocab)


@dataclass(frozen=True)
class WarmupStep:
    kind: StepKind
    tokens: int  # prompt length of each request (0 for the flush)
    requests: tuple[WarmupRequest, ...] = ()

    @property
    def label(self) -> str:
        match self.kind:
            case StepKind.DECODE:
                per_rank = len(self.requests) // max(1, len({r.data_parallel_rank for r in self.requests}))
                return f"decode staircase {per_rank} x {self.tokens}-token prompts, 2..{per_rank + 1} tokens out"
            case StepKind.PREFILL:
                return f"prefill {self.tokens} tokens"
            case StepKind.AGAIN:
                return f"prefill {self.tokens} tokens again"
            case StepKind.REMAINDER:
                return f"prefill {self.tokens} tokens (chunk remainder)"
            case StepKind.FLUSH:
                return "prefix-cache flush"


# -- the knob ---------------------------------------------------------------------------


def parse_warmup_knob(
    value: str | None, default_budget_s: float = DEFAULT_BUDGET_S, *, knob: str = KNOB
) -> WarmupSetting:
    """The setting a knob value asks for; ``WarmupKnobError`` names the accepted forms.

    unset/empty → full at the default budget; off|0|false|no|none → off;
    fast|full → that level; a number of seconds → full with that budget;
    ``<level>:<seconds>`` (level fast or full). Case and surrounding blanks
    do not matter. Budgets must be finite and positive (a bare 0 is off).
    """
    text = (value or "").strip().lower()
    if not text:
        return WarmupSetting(WarmupLevel.FULL, default_budget_s)
    if text in _OFF_WORDS:
        return WarmupSetting(WarmupLevel.OFF, default_budget_s)
    if text in (WarmupLevel.FAST, WarmupLevel.FULL):
        return WarmupSetting(WarmupLevel(text), default_budget_s)
    level_text, colon, seconds_text = text.partition(":")
    if colon:
        seconds = _seconds(seconds_text)
        if level_text in (WarmupLevel.FAST, WarmupLevel.FULL) and seconds is not None and seconds > 0:
            return WarmupSetting(WarmupLevel(level_text), seconds)
    else:
        seconds = _seconds(text)
        if seconds == 0:
            return WarmupSetting(WarmupLevel.OFF, default_budget_s)
        if seconds is not None and seconds > 0:
            return WarmupSetting(WarmupLevel.FULL, seconds)
    raise WarmupKnobError(
        f"{knob}={value!r}: expected one of off, fast, full, a budget in seconds, "
        f"or <level>:<seconds> (the default is full:{default_budget_s:g})"
    )


def warmup_setting(environ: Mapping[str, str], default_budget_s: float = DEFAULT_BUDGET_S,
                   knobs: tuple[str, ...] = (OWN_KNOB, KNOB)) -> WarmupSetting:
    """The setting from the environment: the first of ``knobs`` set (``ENGINELINK_WARMUP``, else the
    reference's knob; the caller names the served engine's, ``tools/knobs.py``)."""
    for knob in knobs:
        value = environ.get(knob)
        if value and value.strip():
            return parse_warmup_knob(value, default_budget_s, knob=knob)
    return parse_warmup_knob(None, default_budget_s)


def _seconds(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


# -- the engine's facts -----------------------------------------------------------------


def facts_from_ready(ready: Mapping[str, object], vocab: int) -> WarmupFacts:
    """Facts from a vLLM-shaped ready response (the handshake; TokenSpeed's says ``tokenspeed-<release>``)
    and the model's vocabulary."""
    tokenspeed = str(ready.get("vllm_version") or ready.get("engine_version") or "").startswith("tokenspeed-")
    return WarmupFacts(
        window=int(ready.get("max_num_seqs") or 0),
        step=int(ready.get("max_num_batched_tokens") or 0),
        context=int(ready.get("max_model_len") or 0),
        vocab=vocab,
        dp_size=int(ready.get("data_parallel_size") or 1),
        reserve=TOKENSPEED_RESERVE_TOKENS if tokenspeed else 0,
        # An unknown layout (no world_size) keeps the remainders, as the reference does.
        every_prefill_length=tokenspeed and int(ready.get("world_size") or 0) != 1,
    )


# -- the plan ---------------------------------------------------------------------------


def bucket_grid(limit: int) -> list[int]:
    """Powers of two to 256, +256 to 2048, +512 to 4096, powers of two above; plus ``limit``."""
    grid: list[int] = []
    n = 1
    while n <= min(256, limit):
        grid.append(n)
        n *= 2
    for start, stop, stride in ((512, 2048, 256), (2560, 4096, 512)):
        grid += range(start, min(stop, limit) + 1, stride)
    n = 8192
    while n <= limit:
        grid.append(n)
        n *= 2
    if limit >= 1 and limit not in grid:
        grid.append(limit)
    return grid


def prefill_lengths(facts: WarmupFacts, level: WarmupLevel) -> list[int]:
    """The ladder: the bucket grid, (full) every 128-token class, capture sizes, odd variants."""
    limit = facts.limit
    grid = bucket_grid(limit)
    lengths = set(grid)
    if level is WarmupLevel.FULL:
        lengths.update(range(CLASS_TOKENS, limit + 1, CLASS_TOKENS))
    lengths.update(size for size in facts.capture_sizes if 1 <= size <= limit)
    lengths.update(bucket + 1 for bucket in grid if bucket >= ODD_VARIANT_MIN and bucket + 1 <= limit)
    return sorted(lengths)


def staircase_size(facts: WarmupFacts) -> int:
    """Concurrent decode requests: the window, as many 8-token prompts as fit one step and the context."""
    window = facts.window or WINDOW_DEFAULT
    room = facts.context - 1 - facts.reserve - STAIRCASE_PROMPT_TOKENS
    return max(0, min(window, facts.step // STAIRCASE_PROMPT_TOKENS, room))


def plan_warmup(facts: WarmupFacts, level: WarmupLevel | str) -> list[WarmupStep]:
    """The steps to run, in order; the last is the flush. ``off`` (or nothing to send) → []."""
    level = WarmupLevel(level)
    if level is WarmupLevel.OFF:
        return []
    ranks: list[int | None] = list(range(facts.dp_size)) if facts.dp_size > 1 else [None]
    made: list[WarmupRequest] = []

    def requests(prompt_len: int, max_tokens_each: list[int]) -> tuple[WarmupRequest, ...]:
        # Each rank is its own engine: every rank gets the same shapes, pinned to it.
        step_requests = []
        for rank in ranks:
            for max_tokens in max_tokens_each:
                ordinal = len(made)
                request = WarmupRequest(
                    f"{WARMUP_REQUEST_PREFIX}{ordinal}", ordinal, prompt_len, max_tokens, facts.vocab, rank
                )
                made.append(request)
                step_requests.append(request)
        return tuple(step_requests)

    steps: list[WarmupStep] = []
    count = staircase_size(facts)
    if count >= 1:
        prompt = STAIRCASE_PROMPT_TOKENS
        steps.append(WarmupStep(StepKind.DECODE, prompt, requests(prompt, list(range(2, count + 2)))))
    for length in prefill_lengths(facts, level):
        steps.append(WarmupStep(StepKind.PREFILL, length, requests(length, [1])))
    for length in bucket_grid(facts.limit):
        steps.append(WarmupStep(StepKind.AGAIN, length, requests(length, [1])))
    if facts.every_prefill_length and level is WarmupLevel.FULL:
        # Last, so a budget cut falls on them, in an order whose every prefix spreads evenly over the range.
        planned = set(prefill_lengths(facts, level))
        for length in spread_order(facts.limit):
            if length not in planned:
                steps.append(WarmupStep(StepKind.REMAINDER, length, requests(length, [1])))
    if steps:
        steps.append(WarmupStep(StepKind.FLUSH, 0))
    return steps


def spread_order(count: int) -> list[int]:
    """``1..count`` in bit-reversed (van der Corput) order: the top power of two, then the halves, the
    quarters, ...; every prefix covers the range near uniformly, so a pass cut short leaves no gap at the end."""
    bits = max(count, 0).bit_length()
    order = []
    for index in range(1 << bits):
        value = int(format(index, f"0{bits}b")[::-1], 2) if bits else 0
        if 1 <= value <= count:
            order.append(value)
    return order


# -- prompts ----------------------------------------------------------------------------


def token_range(vocab: int) -> tuple[int, int]:
    """(low, span): prompt ids come from [low, low + span).

    [1000, 1000 + min(vocab - 1000, 30000)) as the reference draws them; a
    vocabulary too small for that (test models) uses its upper half.
    """
    span = min(vocab - TOKEN_BASE, TOKEN_SPAN_MAX)
    if span >= 2:
        return TOKEN_BASE, span
    low = vocab // 2
    return low, vocab - low


def warmup_prompt(ordinal: int, length: int, vocab: int) -> list[int]:
    """The prompt of warm-up request ``ordinal``: deterministic, distinct per ordinal.

    The body is blake2b of (ordinal, block counter), 32 ids per digest; the
    first two ids spell the ordinal in base ``span``, so two warm-up prompts
    never share a first block (distinct for ordinals below span²).
    """
    low, span = token_range(vocab)
    ids: list[int] = []
    counter = 0
    while len(ids) < length:
        digest = hashlib.blake2b(struct.pack("<QQ", ordinal, counter), digest_size=64).digest()
        ids += (low + value % span for value in struct.unpack("<32H", digest))
        counter += 1
    del ids[length:]
    if length >= 1:
        ids[0] = low + ordinal % span
    if length >= 2:
        ids[1] = low + (ordinal // span) % span
    return ids

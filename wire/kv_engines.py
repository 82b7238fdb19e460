"""The KV-event wire as SGLang 0.5.23 and TokenSpeed 0.1.1 speak it: their configs and their batches, sans-io.

vLLM's dialect is ``kv_events.py``; the PUB framing (``[topic, seq, payload]``),
the replay protocol and the relay's lenient decoder are shared, and live
there. What differs per engine, read from each engine's own
``kv_events.py`` (``sglang/srt/disaggregation/kv_events.py``,
``tokenspeed/runtime/pd/kv_events.py``):

- the ``--kv-events-config`` JSON. SGLang's ``KVEventsConfig`` publishes
  whenever ``publisher`` is ``zmq`` (its default is ``null``; there is no
  ``enable_kv_cache_events``) and has ``bind`` (force the PUB to bind or
  connect) and ``format`` (``default``/``dynamo``); TokenSpeed's is vLLM's
  (``enable_kv_cache_events``, the publisher ``zmq`` when enabled and unset).
  Both are pydantic models that ignore keys they do not know, so these
  structs do too (vLLM's refuses them);
- where the PUB binds: SGLang's heuristic also binds ``0.0.0.0``, and its
  ``bind`` overrides the heuristic;
- the batches. Both are ``[ts, events, attn_dp_rank]``. SGLang's events are
  tagged maps like vLLM's, with its own fields (``cache_salt``, no
  ``extra_keys``), one BlockStored per page, hashes signed int64; its batch
  always carries the rank. TokenSpeed's events are tag-first *arrays*
  (``["BlockStored", hashes, parent, tokens, block_size]``), its batch
  omits a None rank, and its scheduler never publishes a clear;
- the replay replies: SGLang 0.5.23's carry the topic frame (as vLLM's);
  TokenSpeed's do not (``kv_events.replay_reply(None, ...)``);
- what the engine's ready report says: vLLM's ready response names the port
  a ``tcp://...:0`` endpoint got; neither SGLang's ready report nor
  TokenSpeed's ready response does (TokenSpeed's has the key, never filled),
  so a port 0 cannot be followed there.

The publisher structs below are field for field the engines' own (the tests
decode them with the engines' own classes, imported in their venvs); the sim
engine publishes with them (``tools/sim_kv.py``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Final, Literal

import msgspec

from enginelink.wire import kv_events as kv

DIALECTS: Final = ("vllm", "sglang", "tokenspeed")
_PUBLISHERS: Final = ("null", "zmq")  # both engines' EventPublisherFactory registry


# --------------------------------------------------------------------------
# --kv-events-config
# --------------------------------------------------------------------------


class SglangKvEventsConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's ``KVEventsConfig``: same keys, same defaults; unknown keys ignored, as pydantic does."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: Literal["default", "dynamo"] = "default"

    dialect: ClassVar[str] = "sglang"
    # SGLang's ready report names no bound port (Scheduler.get_init_info: kv_event_sources only for its Rust server).
    learns_ports: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check(self.publisher, self.buffer_steps)

    @property
    def publishing(self) -> bool:
        """``EventPublisherFactory.create``: a non-empty config with publisher ``zmq``."""
        return self.publisher == "zmq"

    def pub_binds(self, endpoint: str) -> bool:
        """``ZmqEventPublisher._socket_setup``: ``bind`` if given, else wildcard, ``0.0.0.0``, ipc, inproc."""
        if self.bind is not None:
            return self.bind
        return "0.0.0.0" in endpoint or kv.publisher_binds(endpoint)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class TokenSpeedKvEventsConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """TokenSpeed's ``KVEventsConfig`` (vLLM's keys); unknown keys ignored, as pydantic does."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    dialect: ClassVar[str] = "tokenspeed"
    learns_ports: ClassVar[bool] = False  # its ready response's kv_events_config is never filled

    def __post_init__(self) -> None:
        _check(self.publisher if self.publisher is not None else "zmq", self.buffer_steps)

    @property
    def publishing(self) -> bool:
        """``EventPublisherFactory.create``: enabled, and the publisher ``zmq`` (its default when enabled)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def pub_binds(self, endpoint: str) -> bool:
        return kv.publisher_binds(endpoint)  # vLLM's heuristic, word for word

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def _check(publisher: str, buffer_steps: int) -> None:
    if publisher not in _PUBLISHERS:  # the engine's factory raises "Unknown event publisher" at start-up
        raise ValueError(f"unknown publisher {publisher!r}; the engine knows {', '.join(_PUBLISHERS)}")
    if buffer_steps < 1:
        raise ValueError("buffer_steps must be >= 1")


EngineKvConfig = kv.KvEventsConfig | SglangKvEventsConfig | TokenSpeedKvEventsConfig
_CONFIGS: Final = {"vllm": kv.KvEventsConfig, "sglang": SglangKvEventsConfig, "tokenspeed": TokenSpeedKvEventsConfig}


def parse_config(text: str, dialect: str) -> EngineKvConfig:
    """``--kv-events-config JSON`` as ``dialect``'s engine reads it; ValueError (with the reason) for a bad one."""
    if dialect == "vllm":
        return kv.parse_config(text)
    try:
        return msgspec.convert(json.loads(text), _CONFIGS[dialect])
    except (json.JSONDecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None


def publishing_config(dialect: str, **fields: Any) -> EngineKvConfig:
    """A config that turns ``dialect``'s publisher on (``runtime/kv/kv_config.py``'s default)."""
    switch = {"publisher": "zmq"} if dialect == "sglang" else {"enable_kv_cache_events": True, "publisher": "zmq"}
    return _CONFIGS[dialect](**switch, **fields)


def pub_binds(config: EngineKvConfig, endpoint: str) -> bool:
    """Whether ``config``'s engine binds its PUB at ``endpoint`` (else it connects, and the subscriber binds)."""
    binds = getattr(config, "pub_binds", None)
    return binds(endpoint) if binds is not None else kv.publisher_binds(endpoint)


def learns_ports(config: EngineKvConfig) -> bool:
    """Whether the engine's ready report names the port it bound for a ``tcp://...:0`` endpoint (vLLM's does)."""
    return getattr(config, "learns_ports", True)


def replay_has_topic(dialect: str) -> bool:
    """Whether the dialect's replay replies carry the topic frame (vLLM's and SGLang 0.5.23's do)."""
    return dialect != "tokenspeed"


# --------------------------------------------------------------------------
# What SGLang's publisher encodes (sglang/srt/disaggregation/kv_events.py)
# --------------------------------------------------------------------------


class SglangBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class SglangAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class SglangKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """``KVEventBatch``: a positional array, the rank always there (not ``omit_defaults``)."""

    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared]
    attn_dp_rank: int | None = None


# --------------------------------------------------------------------------
# What TokenSpeed's publisher encodes (tokenspeed/runtime/pd/kv_events.py)
# --------------------------------------------------------------------------


class TokenSpeedBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class TokenSpeedBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[int]


class TokenSpeedAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True,
                                 gc=False):  # fmt: skip
    pass


class TokenSpeedKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[TokenSpeedBlockStored | TokenSpeedBlockRemoved | TokenSpeedAllBlocksCleared]
    attn_dp_rank: int | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_I64: Final = 1 << 63


def _signed64(value: int) -> int:
    """A hash as SGLang publishes it: a signed int64 (``hash_str_to_int64``)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= _I64 else value


def _salt(extra_keys: list | None) -> str | None:
    for keys in extra_keys or ():
        for item in keys or ():
            if isinstance(item, str) and item:
                return item
    return None


def encode_batch(dialect: str, ts: float, events: list[kv.EngineKvEvent], rank: int | None) -> bytes:
    """vLLM-form events (what the sim core reports) as ``dialect``'s publisher would encode its batch.

    SGLang: one BlockStored per page, signed hashes, the salt in ``cache_salt``.
    TokenSpeed: its four-field BlockStored, one-field BlockRemoved, no clear
    (its scheduler's events are only stores and removals).
    """
    if dialect == "vllm":
        return kv.encode_batch(kv.KVEventBatch(ts, events, rank))
    if dialect == "sglang":
        return _ENCODER.encode(SglangKVEventBatch(ts, [e for event in events for e in _sglang(event)], rank))
    if dialect == "tokenspeed":
        return _ENCODER.encode(TokenSpeedKVEventBatch(ts, [e for event in events for e in _tokenspeed(event)], rank))
    raise ValueError(f"no KV event dialect {dialect!r}; known: {', '.join(DIALECTS)}")


def _sglang(event: kv.EngineKvEvent) -> list:
    match event:
        case kv.BlockStored():
            size, salt = event.block_size, _salt(event.extra_keys)
            out, parent = [], event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                out.append(SglangBlockStored(
                    [_signed64(block)], None if parent is None else _signed64(parent),
                    list(event.token_ids[i * size:(i + 1) * size]), size, None, medium=event.medium or "GPU",
                    cache_salt=salt, lora_name=event.lora_name))  # fmt: skip
                parent = block
            return out
        case kv.BlockRemoved():
            return [SglangBlockRemoved([_signed64(h) for h in event.block_hashes], medium=event.medium or "GPU")]
        case kv.AllBlocksCleared():
            return [SglangAllBlocksCleared()]
    raise AssertionError(f"unknown event {event!r}")  # pragma: no cover - the union is closed


def _tokenspeed(event: kv.EngineKvEvent) -> list:
    match event:
        case kv.BlockStored():
            return [TokenSpeedBlockStored(list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                                          event.block_size)]  # fmt: skip
        case kv.BlockRemoved():
            return [TokenSpeedBlockRemoved(list(event.block_hashes))]
        case kv.AllBlocksCleared():
            return []  # scheduler_kv_event_to_wire_event knows no clear
    raise AssertionError(f"unknown event {event!r}")  # pragma: no cover - the union is closed

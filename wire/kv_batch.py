"""The engine-neutral KV-event batch: what the relay serves to subscribers.

These structs map one to one onto ``common.proto``'s ``KvEventBatch`` family
(smg-grpc-proto 0.4.28): same names, same fields, same optionality, so the
relay machine and its tests speak them without importing protobuf, and the
gRPC handler turns each into a message at the last moment
(``runtime/contracts/shared/kv_messages.py``).
Every engine's KV codec (``kv_events.py`` for vLLM and SGLang) normalises into
them; nothing here knows an engine.

Rules:
- sans-io and immutable: frozen structs, tuples, so one batch can sit in the
  relay's history and in any number of subscribers' hands at once, and one
  ``KvBlock`` can be shared by the batch that stored it and the live set;
- ``None`` means "unset" wherever the proto field is ``optional``; ``tier``
  and ``locality`` hold the proto enum numbers (``Tier``, ``Locality``);
- no protobuf here, not even lazily: the gRPC contract is the shell's.
"""

from __future__ import annotations

import enum

import msgspec


class Tier(enum.IntEnum):
    """``KvCacheTier``; ``KvBlock.cache_level`` mirrors it as tier - 1 (device unset)."""

    UNSPECIFIED = 0
    DEVICE = 1
    HOST = 2
    DISK = 3
    EXTERNAL = 4


class Locality(enum.IntEnum):
    """``KvCacheLocality``."""

    UNSPECIFIED = 0
    LOCAL = 1
    REMOTE = 2


def cache_level_of(tier: int) -> int | None:
    """``KvBlock.cache_level`` for a tier: unset on the device (older consumers read unset as device)."""
    return None if tier in (Tier.UNSPECIFIED, Tier.DEVICE) else tier - 1


class ExtraKey(msgspec.Struct, frozen=True, gc=False):
    """One ``KvBlockExtraKey``: exactly one of text / blob / number / multimodal."""

    text: str | None = None
    blob: bytes | None = None
    number: int | None = None
    multimodal: tuple[str, int] | None = None  # (identifier, offset)


class KvBlock(msgspec.Struct, frozen=True, gc=False):
    block_hash: int  # int64
    token_ids: tuple[int, ...]  # uint32 each
    block_size: int
    lora_id: int | None = None
    cache_level: int | None = None
    extra_keys: tuple[ExtraKey, ...] = ()


class KvStored(msgspec.Struct, frozen=True, gc=False):
    blocks: tuple[KvBlock, ...]
    parent_block_hash: int | None = None
    tier: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: int | None = None
    ownership: str | None = None
    session_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class KvRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    cache_level: int | None = None
    tier: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    locality: int | None = None
    ownership: str | None = None


class KvCleared(msgspec.Struct, frozen=True, gc=False):
    ownership: str | None = None


class KvEvent(msgspec.Struct, frozen=True, gc=False):
    event_id: int
    data: KvStored | KvRemoved | KvCleared


class KvSnapshotChunk(msgspec.Struct, frozen=True, gc=False):
    index: int
    count: int
    blocks: int
    unknown_before: int


class KvBatch(msgspec.Struct, frozen=True, gc=False):
    """``KvEventBatch`` without ``load``: the runtime attaches the load record it holds."""

    sequence_number: int
    timestamp: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    snapshot: KvSnapshotChunk | None = None

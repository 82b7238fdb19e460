"""The engine-neutral KV-event batch: what the relay serves to subscribers.

These structs map one to one onto ``common.proto``'s ``KvEventBatch`` family
(smg-grpc-proto 0.4.28): same names, same fields, same optionality, so the
relay machine and its tests speak them without importing protobuf, and the
gRPC handler turns each into a message with ``to_proto`` at the last moment.
Every engine's KV codec (``kv_events.py`` for vLLM and SGLang) normalises into
them; nothing here knows an engine.

Rules:
- sans-io and immutable: frozen structs, tuples, so one batch can sit in the
  relay's history and in any number of subscribers' hands at once, and one
  ``KvBlock`` can be shared by the batch that stored it and the live set;
- ``None`` means "unset" wherever the proto field is ``optional``; ``tier``
  and ``locality`` hold the proto enum numbers (``Tier``, ``Locality``);
- ``to_proto`` is the only place that imports the generated messages.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from smg_grpc_proto.generated import common_pb2


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


# --------------------------------------------------------------------------
# to protobuf
# --------------------------------------------------------------------------


def to_proto(batch: KvBatch, load: Any = None) -> "common_pb2.KvEventBatch":
    """The ``common_pb2.KvEventBatch`` for a batch; ``load`` is an ``EngineLoad`` message or None."""
    from smg_grpc_proto.generated import common_pb2 as pb

    message = pb.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
    if batch.dp_rank is not None:
        message.dp_rank = batch.dp_rank
    if batch.snapshot is not None:
        s = batch.snapshot
        message.snapshot.CopyFrom(
            pb.KvSnapshotChunk(index=s.index, count=s.count, blocks=s.blocks, unknown_before=s.unknown_before)
        )
    if load is not None:
        message.load.CopyFrom(load)
    events = message.events
    for event in batch.events:
        out = events.add(event_id=event.event_id)
        match event.data:
            case KvStored() as data:
                _stored(out.stored, data)
            case KvRemoved() as data:
                _set_optional(out.removed, data, _REMOVED_OPTIONAL)
                out.removed.block_hashes.extend(data.block_hashes)
            case KvCleared(ownership=ownership):
                out.cleared.SetInParent()
                if ownership is not None:
                    out.cleared.ownership = ownership
    return message


_STORED_OPTIONAL = (
    "parent_block_hash", "tier", "medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lora_name", "cache_salt",
)  # fmt: skip
_REMOVED_OPTIONAL = ("cache_level", "tier", "medium", "group_idx", "locality", "ownership")


def _set_optional(message: Any, data: msgspec.Struct, names: tuple[str, ...]) -> None:
    message.SetInParent()  # an empty stored/removed still selects its oneof arm
    for name in names:
        value = getattr(data, name)
        if value is not None:
            setattr(message, name, value)


def _stored(message: Any, data: KvStored) -> None:
    _set_optional(message, data, _STORED_OPTIONAL)
    for block in data.blocks:
        out = message.blocks.add(block_hash=block.block_hash, block_size=block.block_size)
        out.token_ids.extend(block.token_ids)
        if block.lora_id is not None:
            out.lora_id = block.lora_id
        if block.cache_level is not None:
            out.cache_level = block.cache_level
        for key in block.extra_keys:
            item = out.extra_keys.add()
            if key.text is not None:
                item.text = key.text
            elif key.blob is not None:
                item.blob = key.blob
            elif key.number is not None:
                item.number = key.number
            elif key.multimodal is not None:
                item.multimodal.identifier, item.multimodal.offset = key.multimodal

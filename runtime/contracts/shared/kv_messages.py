"""The KV event stream's messages: the relay's neutral batches and load records as ``common.proto``'s.

``wire/kv_batch.py``'s structs (what every engine's KV codec normalises
into) and ``runtime/kv/kv_loads.py``'s ``LoadRecord`` map one to one onto
``KvEventBatch`` and ``EngineLoad`` (same names, same fields, same
optionality: ``None`` is unset); the SubscribeKvEvents handler
(``grpc_kv.py``) turns each into a message here, at the last moment, so
nothing below the contracts imports the generated messages.
"""

from __future__ import annotations

from typing import Any

import msgspec
from smg_grpc_proto.generated import common_pb2 as pb

from enginelink.runtime.kv.kv_loads import LoadRecord
from enginelink.wire.kv_batch import KvBatch, KvCleared, KvRemoved, KvStored

# The load record's fields that are optional in EngineLoad: set only when not None.
_LOAD_OPTIONAL = ("engine_silence_ms", "cache_hit_rate", "num_used_tokens", "max_total_num_tokens")


def load_message(record: LoadRecord) -> pb.EngineLoad:
    """The ``EngineLoad`` of a load record."""
    load = pb.EngineLoad(
        running_requests=record.running_requests,
        waiting_requests=record.waiting_requests,
        token_usage=record.token_usage,
        gen_throughput=record.gen_throughput,
        max_running_requests=record.max_running_requests,
        age_ms=record.age_ms,
        sample=record.sample,
        load_only=record.load_only,
        engine_reports_steps=record.engine_reports_steps,
        prefill_pending_tokens=record.prefill_pending_tokens,
    )
    for name in _LOAD_OPTIONAL:
        value = getattr(record, name)
        if value is not None:
            setattr(load, name, value)
    if record.memory_token_capacity is not None:
        load.memory.token_capacity = record.memory_token_capacity
    if record.queues_waiting is not None:
        load.queues.waiting = record.queues_waiting
    return load


def batch_message(batch: KvBatch, load: LoadRecord | None = None) -> pb.KvEventBatch:
    """The ``KvEventBatch`` for a batch and the load record it carries (None: none)."""
    message = pb.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
    if batch.dp_rank is not None:
        message.dp_rank = batch.dp_rank
    if batch.snapshot is not None:
        s = batch.snapshot
        message.snapshot.CopyFrom(
            pb.KvSnapshotChunk(index=s.index, count=s.count, blocks=s.blocks, unknown_before=s.unknown_before)
        )
    if load is not None:
        message.load.CopyFrom(load_message(load))
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

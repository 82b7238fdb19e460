"""The KV event stream's messages (``runtime/contracts/shared/kv_messages.py``): the neutral batch and load record
as ``common.proto``'s ``KvEventBatch`` and ``EngineLoad``, every field mapped, unset kept unset."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as pb

from enginelink.runtime.contracts.shared.kv_messages import batch_message, load_message
from enginelink.runtime.kv.kv_loads import LoadRecord
from enginelink.wire.kv_batch import (
    ExtraKey,
    KvBatch,
    KvBlock,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshotChunk,
    KvStored,
)

CORE = dict(running_requests=3, waiting_requests=2, token_usage=0.25, gen_throughput=12.5, max_running_requests=8,
            age_ms=250, sample=4, load_only=True, engine_reports_steps=True, prefill_pending_tokens=7)


def test_a_batch_maps_every_field_and_keeps_unset_unset():
    batch = KvBatch(
        sequence_number=7,
        timestamp=2.5,
        events=(
            KvEvent(1, KvStored(
                blocks=(KvBlock(-3, (1, 2), 2, lora_id=4, cache_level=1,
                                extra_keys=(ExtraKey(text="t"), ExtraKey(blob=b"b"), ExtraKey(number=-9),
                                            ExtraKey(multimodal=("img", 3)))),),
                parent_block_hash=-1, tier=2, medium="CPU", group_idx=0, kv_cache_spec_kind="full_attention",
                locality=1, lora_name="l", cache_salt="s")),
            KvEvent(2, KvRemoved((-3, 5), cache_level=1, tier=2, medium="CPU")),
            KvEvent(3, KvCleared()),
            KvEvent(4, KvRemoved(())),
        ),
        dp_rank=0,
        snapshot=KvSnapshotChunk(0, 2, 10, 1),
    )  # fmt: skip
    load = LoadRecord(running_requests=3, waiting_requests=0, token_usage=0.0, gen_throughput=0.0,
                      max_running_requests=0, age_ms=0, sample=9, load_only=False, engine_reports_steps=True,
                      prefill_pending_tokens=0)
    m = batch_message(batch, load)
    assert (m.sequence_number, m.timestamp, m.dp_rank, m.HasField("dp_rank")) == (7, 2.5, 0, True)
    assert (m.snapshot.index, m.snapshot.count, m.snapshot.blocks, m.snapshot.unknown_before) == (0, 2, 10, 1)
    assert (m.load.running_requests, m.load.sample) == (3, 9)
    stored, removed, cleared, empty = m.events
    assert [e.event_id for e in m.events] == [1, 2, 3, 4]
    assert [e.WhichOneof("data") for e in m.events] == ["stored", "removed", "cleared", "removed"]
    block = stored.stored.blocks[0]
    assert (block.block_hash, list(block.token_ids), block.block_size, block.lora_id, block.cache_level) == (
        -3, [1, 2], 2, 4, 1)  # fmt: skip
    assert [k.WhichOneof("key") for k in block.extra_keys] == ["text", "blob", "number", "multimodal"]
    assert (block.extra_keys[3].multimodal.identifier, block.extra_keys[3].multimodal.offset) == ("img", 3)
    s = stored.stored
    assert (s.parent_block_hash, s.tier, s.medium, s.group_idx, s.locality, s.lora_name, s.cache_salt) == (
        -1, pb.KV_CACHE_TIER_HOST, "CPU", 0, pb.KV_CACHE_LOCALITY_LOCAL, "l", "s")  # fmt: skip
    assert not s.HasField("ownership") and not s.HasField("session_id")
    assert list(removed.removed.block_hashes) == [-3, 5] and removed.removed.tier == pb.KV_CACHE_TIER_HOST
    assert not cleared.cleared.HasField("ownership")
    assert pb.KvEventBatch.FromString(m.SerializeToString()) == m

    bare = batch_message(KvBatch(0, 0.0, ()))
    assert not bare.HasField("dp_rank") and not bare.HasField("snapshot") and not bare.HasField("load")


def test_a_load_record_sets_its_core_and_only_the_optional_fields_it_has():
    core = load_message(LoadRecord(**CORE))
    assert (core.running_requests, core.waiting_requests, core.token_usage, core.gen_throughput) == (3, 2, 0.25, 12.5)
    assert (core.max_running_requests, core.age_ms, core.sample, core.load_only) == (8, 250, 4, True)
    assert (core.engine_reports_steps, core.prefill_pending_tokens) == (True, 7)
    for name in ("engine_silence_ms", "cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "memory", "queues"):
        assert not core.HasField(name), name
    full = load_message(LoadRecord(**CORE, engine_silence_ms=0, cache_hit_rate=0.0, num_used_tokens=0,
                                   max_total_num_tokens=64, memory_token_capacity=64, queues_waiting=0))
    for name in ("engine_silence_ms", "cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "memory", "queues"):
        assert full.HasField(name), name  # a zero is sent as a zero, not left unset
    assert (full.max_total_num_tokens, full.memory.token_capacity, full.queues.waiting) == (64, 64, 0)
    assert pb.EngineLoad.FromString(full.SerializeToString()) == full

"""The KV relay machine: normalisation and drop rules, sequencing, gap repair,
holes, publisher restarts, cursors, snapshots, slow subscribers, the fold —
and a Hypothesis property over a sim publisher on a lossy wire."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from enginelink.journal.records import KIND_TRANSITION
from enginelink.machines.kv_relay import (
    KIND_KV_BATCH,
    KIND_KV_INCARNATION,
    KIND_KV_LOST,
    RANK_TABLE,
    SUBSCRIBER_TABLE,
    FetchReplay,
    Journal,
    KvRelay,
    KvRelayConfig,
    Wake,
)
from enginelink.machines.kv_state import DROP_RULES
from enginelink.machines.table import ProtocolError
from enginelink.wire import kv_events as kv
from enginelink.wire.kv_batch import KvCleared, KvStored, Locality, Tier
from tests.machines.kv_pair import Pair, Subscriber, cleared, msg, payload, removed, state_at, stored


def relay(**config) -> KvRelay:
    return KvRelay([0], KvRelayConfig(**config))


def feed(r: KvRelay, *messages: list[bytes], rank: int = 0) -> list:
    actions = []
    for m in messages:
        actions += r.on_live(rank, m, 0.0)
    return actions


def fetches(actions: list) -> list[FetchReplay]:
    return [a for a in actions if isinstance(a, FetchReplay)]


def replies(*pairs: tuple[int, bytes], end: bool = True) -> list[list[bytes]]:
    out = [kv.replay_reply(b"kv", seq, p) for seq, p in pairs]
    return out + ([kv.replay_end()] if end else [])


def only_batch(sub: Subscriber):
    assert len(sub.received) == 1
    return sub.received[0]


# ---- tables --------------------------------------------------------------------


def test_tables_are_declared_and_refuse_what_they_do_not_allow():
    assert "idle --> live: first_batch" in RANK_TABLE.diagram()
    assert "catching_up --> live: caught_up" in SUBSCRIBER_TABLE.diagram()
    with pytest.raises(ProtocolError, match="kv_rank '0': event 'repaired' is not allowed in state 'live'"):
        RANK_TABLE.next_state("0", "live", "repaired")


# ---- normalisation (§12.6) -----------------------------------------------------


def test_a_store_is_normalised_block_by_block():
    r = relay()
    feed(r, msg(0, stored([11, 12], parent=10, tokens=[1, 2, 3, 4], group_idx=0, kv_cache_spec_kind="full_attention")))
    sub = Subscriber(r, 0)
    sub.drain()
    (event,) = only_batch(sub).events
    data = event.data
    assert isinstance(data, KvStored) and event.event_id == 1
    assert [(b.block_hash, b.token_ids, b.block_size, b.cache_level) for b in data.blocks] == [
        (11, (1, 2), 2, None), (12, (3, 4), 2, None),
    ]  # fmt: skip
    assert (data.parent_block_hash, data.tier, data.medium, data.locality) == (10, Tier.DEVICE, "GPU", Locality.LOCAL)
    assert r.live_set() == {(0, 1, 11): 1, (0, 1, 12): 1}
    assert sub.blocks == r.live_set()


@pytest.mark.parametrize(
    ("medium", "tier", "level"),
    [(None, Tier.DEVICE, None), ("GPU", Tier.DEVICE, None), ("cpu", Tier.HOST, 1), ("CPU_PINNED", Tier.HOST, 1),
     ("CPU_TIER2", Tier.DISK, 2), ("NVME", Tier.DISK, 2), ("STORAGE", Tier.DISK, 2), ("SHARED", Tier.EXTERNAL, 3),
     ("NETWORK", Tier.EXTERNAL, 3)],
)  # fmt: skip
def test_medium_maps_to_tier_and_cache_level(medium, tier, level):
    r = relay()
    feed(r, msg(0, stored([5], medium=medium), removed([5], medium=medium)))
    sub = Subscriber(r, 0)
    sub.drain()
    store, remove = (e.data for e in only_batch(sub).events)
    assert (store.tier, store.blocks[0].cache_level) == (tier, level)
    assert (remove.tier, remove.cache_level) == (tier, level)


@pytest.mark.parametrize(
    ("rule", "event"),
    [
        ("unknown_type", {"type": "BlockMoved", "block_hashes": [1]}),
        ("malformed", {"type": "BlockStored", "block_hashes": "nope", "token_ids": [1], "block_size": 1}),
        ("malformed", {"type": "BlockRemoved"}),
        ("unsupported_ownership", stored([1], ownership="kvcr")),
        ("unsupported_ownership", {"type": "AllBlocksCleared", "ownership": "KVCR"}),
        ("non_local_locality", stored([1], locality="REMOTE")),
        ("unknown_medium", stored([1], medium="TAPE")),
        ("non_main_attention_group", stored([1], group_idx=1, kv_cache_spec_kind="sliding_window")),
        ("placeholder", stored([1], tokens=[])),
        ("placeholder", stored([], tokens=[1, 2])),
        ("unaligned_blocks", stored([1, 2], tokens=[1, 2, 3])),
        ("unaligned_blocks", stored([1], bs=0, tokens=[1])),
        ("self_referencing_hashes", stored([1, 1])),
        ("self_referencing_hashes", stored([2, 3], parent=3)),
    ],
)
def test_each_drop_rule_is_counted_by_name_and_event_ids_still_advance(rule, event):
    r = relay()
    feed(r, msg(0, event, stored([9])))
    counters = r.counters()
    assert counters[f"dropped.{rule}"] == 1
    assert sum(counters[f"dropped.{name}"] for name in DROP_RULES) == 1
    sub = Subscriber(r, 0)
    sub.drain()
    (kept,) = only_batch(sub).events
    assert kept.event_id == 2  # the dropped event took id 1
    assert r.live_set() == {(0, 1, 9): 1}


def test_a_removal_follows_what_its_group_was_learned_as():
    r = relay()
    feed(
        r,
        msg(0, stored([1], group_idx=0, kv_cache_spec_kind="full_attention"),
            stored([1], group_idx=1, kv_cache_spec_kind="sliding_window")),
        msg(1, removed([1], group_idx=1), removed([7], group_idx=5)),  # 5: never learned, counts as main
    )  # fmt: skip
    assert r.counters()["dropped.non_main_attention_group"] == 2
    assert r.counters()["forwarded.removed"] == 1
    assert r.live_set() == {(0, 1, 1): 1}


def test_lora_name_and_cache_salt_are_inherited_from_the_parent():
    r = relay()
    feed(
        r,
        msg(0, stored([1], lora_name="adapter", extra_keys=[["adapter", "salty"]])),
        msg(1, stored([2], parent=1), stored([3], parent=99)),
    )
    sub = Subscriber(r, 0)
    sub.drain()
    first, child, orphan = (e.data for b in sub.received for e in b.events)
    assert (first.lora_name, first.cache_salt) == ("adapter", "salty")
    assert first.blocks[0].extra_keys[1].text == "salty"
    assert (child.lora_name, child.cache_salt) == ("adapter", "salty")
    assert (orphan.lora_name, orphan.cache_salt) == (None, None)


def test_copies_are_counted_and_capped_at_eight():
    r = relay()
    feed(r, *(msg(i, stored([4])) for i in range(10)), msg(10, removed([4])))
    assert r.live_set() == {(0, 1, 4): 7}
    feed(r, msg(11, cleared()))
    assert r.live_set() == {}


def test_an_undecodable_payload_goes_out_empty_under_its_sequence():
    r = relay()
    feed(r, msg(0, stored([1])), kv.pub_message(b"kv", 1, b"\xc1 not msgpack"), msg(2, stored([2])))
    sub = Subscriber(r, 0)
    sub.drain()
    assert [(b.sequence_number, len(b.events)) for b in sub.received] == [(0, 1), (1, 0), (2, 1)]
    assert r.counters()["undecodable"] == 1


def test_a_frame_that_is_not_a_pub_message_is_counted_and_ignored():
    r = relay()
    assert feed(r, [b"kv", b"\x00"]) == []
    assert r.counters()["bad_frames"] == 1


# ---- sequencing, repair, holes ----------------------------------------------------


def test_in_order_batches_are_journaled_and_wake_subscribers():
    r = relay()
    sub = Subscriber(r, 0)
    assert sub.modes == {0: "live"}
    actions = feed(r, msg(0, stored([1])))
    kinds = [(a.kind, a.payload.get("dest")) for a in actions if isinstance(a, Journal)]
    assert kinds == [(KIND_KV_BATCH, None), (KIND_TRANSITION, "live")]
    assert Wake((sub.id,)) in actions
    sub.drain()
    assert [b.sequence_number for b in sub.received] == [0]


def test_a_gap_is_repaired_live_first_then_replay_without_overlap():
    r = relay()
    p = [payload(stored([h])) for h in range(6)]
    feed(r, kv.pub_message(b"kv", 0, p[0]), kv.pub_message(b"kv", 1, p[1]))
    sub = Subscriber(r, 1)  # resumes after 1
    (fetch,) = fetches(feed(r, kv.pub_message(b"kv", 4, p[4])))
    assert fetch.start_seq == 1  # one batch of overlap, to verify the publisher
    assert r.gauges()[0]["state"] == "repairing"
    feed(r, kv.pub_message(b"kv", 3, p[3]))  # arrives live while the repair is out
    actions = r.on_replay(0, fetch.token, replies((1, p[1]), (2, p[2]), (3, payload(stored([99]))), (5, p[5])),
                          True, 0.0)  # fmt: skip
    assert r.gauges()[0] | {} == r.gauges()[0] and r.gauges()[0]["state"] == "live"
    assert Wake((sub.id,)) in actions
    sub.drain()
    assert [b.sequence_number for b in sub.received] == [2, 3, 4, 5]
    assert (0, 1, 99) not in r.live_set()  # live won over the replay's copy of 3
    c = r.counters()
    assert (c["gaps"], c["repairs"], c["recovered"], c["holes"]) == (1, 1, 2, 0)
    feed(r, kv.pub_message(b"kv", 5, p[5]))  # the live copy of 5, already replayed
    assert r.counters()["duplicates"] == 1


def test_what_the_replay_cannot_give_is_a_hole_that_ends_streams_and_refuses_cursors():
    r = relay()
    feed(r, msg(0, stored([1])), msg(1, stored([2])))
    live = Subscriber(r, 0)
    live.drain()
    (fetch,) = fetches(feed(r, msg(3, stored([3]))))
    r.on_replay(0, fetch.token, replies((1, payload(stored([2]))), (3, payload(stored([3])))), True, 0.0)
    c = r.counters()
    assert (c["holes"], r.gauges()[0]["history_holes"]) == (1, 1)
    live.drain()
    assert live.end.status == "DATA_LOSS" and "batch 2 was lost" in live.end.message
    assert [b.sequence_number for b in live.received] == [0, 1]
    refused = Subscriber(r, 1)
    assert refused.refused.status == "OUT_OF_RANGE" and "batch 2" in refused.refused.message
    after = Subscriber(r, 2)  # past the hole: fine
    after.drain()
    assert [b.sequence_number for b in after.received] == [3] and after.open
    fresh = Subscriber(r, 0)
    fresh.drain()
    assert fresh.modes == {0: "snapshot"}
    assert fresh.received[0].snapshot.unknown_before == 1
    assert fresh.blocks == r.live_set() == {(0, 1, 1): 1, (0, 1, 2): 1, (0, 1, 3): 1}


def test_a_replay_that_times_out_loses_what_it_did_not_bring():
    r = relay()
    feed(r, msg(0, stored([1])))
    (fetch,) = fetches(feed(r, msg(4, stored([4]))))
    r.on_replay(0, fetch.token, replies((0, payload(stored([1]))), (1, payload(stored([2]))), end=False), False, 0.0)
    c = r.counters()
    assert (c["replay_timeouts"], c["recovered"], c["holes"]) == (1, 1, 2)
    assert r.gauges()[0]["newest"] == 4


def test_a_newer_gap_after_the_replay_starts_another_round():
    r = relay()
    p = [payload(stored([h])) for h in range(8)]
    feed(r, kv.pub_message(b"kv", 0, p[0]))
    (first,) = fetches(feed(r, kv.pub_message(b"kv", 2, p[2])))
    feed(r, kv.pub_message(b"kv", 6, p[6]))  # 3..5 lost on the wire after the replay was served
    (second,) = fetches(r.on_replay(0, first.token, replies((0, p[0]), (1, p[1]), (2, p[2])), True, 0.0))
    assert second.start_seq == 2
    r.on_replay(0, second.token, replies(*((i, p[i]) for i in range(2, 8))), True, 0.0)
    assert r.gauges()[0]["newest"] == 7 and r.counters()["holes"] == 0
    assert r.on_replay(0, first.token, [], True, 0.0) == [] and r.counters()["stale_replies"] == 1


def test_without_a_replay_endpoint_a_gap_is_a_hole_at_once():
    r = relay(replay=False)
    assert fetches(feed(r, msg(0, stored([1])), msg(3, stored([3])))) == []
    assert (r.counters()["holes"], r.gauges()[0]["newest"]) == (2, 3)


def test_a_relay_that_joins_late_counts_what_came_before_it_as_unknown():
    r = relay()
    (fetch,) = fetches(feed(r, msg(5, stored([5]))))
    assert fetch.start_seq == 0
    r.on_replay(0, fetch.token, replies((3, payload(stored([3]))), (4, payload(stored([4])))), True, 0.0)
    g = r.gauges()[0]
    assert (g["oldest"], g["newest"], g["unknown_before"], g["history_holes"]) == (3, 5, 3, 0)
    sub = Subscriber(r, 0)
    sub.drain()
    assert sub.modes == {0: "snapshot"} and sub.received[0].snapshot.unknown_before == 3
    assert Subscriber(r, 1).refused.status == "OUT_OF_RANGE"
    assert Subscriber(r, 2).open  # 2 + 1 is the oldest kept


def test_too_many_batches_held_during_a_repair_end_it_with_holes():
    r = relay(repair_pending_max=3)
    feed(r, msg(0, stored([0])))
    (fetch,) = fetches(feed(r, msg(2, stored([2]))))
    feed(r, msg(3, stored([3])), msg(4, stored([4])), msg(5, stored([5])))
    assert r.counters()["repair_overflows"] == 1 and r.counters()["holes"] == 1
    assert r.gauges()[0] == r.gauges()[0] | {"state": "live", "newest": 5}
    assert r.on_replay(0, fetch.token, [], True, 0.0) == []


# ---- publisher restarts ----------------------------------------------------------


def test_a_sequence_going_backwards_is_a_new_incarnation():
    r = relay()
    feed(r, msg(0, stored([1])), msg(1, stored([2])), msg(2, stored([3])))
    live = Subscriber(r, 0)
    live.drain()
    feed(r, msg(0, stored([7]), ts=9.0))  # a different batch 0
    live.drain()
    assert live.end.status == "DATA_LOSS" and "restarted" in live.end.message
    assert r.counters()["incarnations"] == 1 and r.live_set() == {(0, 1, 7): 1}
    fresh = Subscriber(r, 0)
    fresh.drain()
    assert fresh.modes == {0: "history"} and fresh.blocks == r.live_set()
    # Served numbers only grow: the new incarnation's 0 is served as 4 (two past the old 2),
    # so the old incarnation's cursors are below the window, never inside it.
    assert [b.sequence_number for b in fresh.received] == [4]
    assert "below" in Subscriber(r, 2).refused.message
    feed(r, msg(1, stored([8]), ts=9.0), msg(2, stored([9]), ts=9.0), msg(3, stored([10]), ts=9.0))
    assert "below" in Subscriber(r, 2).refused.message and Subscriber(r, 5).open


def test_a_duplicate_is_not_a_restart():
    r = relay()
    first = msg(0, stored([1]))
    feed(r, first, msg(1, stored([2])), first)
    assert (r.counters()["duplicates"], r.counters()["incarnations"]) == (1, 0)


def test_a_startup_clear_under_an_old_sequence_is_a_restart_even_when_evicted():
    r = relay(history_batches_max=2)
    feed(r, *(msg(i, stored([i])) for i in range(6)))
    feed(r, msg(3, stored([3]), ts=5.0))  # evicted slot, no clear: a late copy, ignored
    assert (r.counters()["late"], r.counters()["incarnations"]) == (1, 0)
    actions = feed(r, msg(2, cleared(), stored([9])))
    assert r.counters()["incarnations"] == 1
    assert any(isinstance(a, Journal) and a.kind == KIND_KV_INCARNATION and "startup clear" in a.payload["reason"]
               for a in actions)  # fmt: skip
    assert fetches(actions)[0].start_seq == 0  # the new incarnation's 0 and 1 are fetched


def test_a_replay_whose_overlap_differs_reveals_a_restart():
    r = relay()
    feed(r, msg(0, stored([1])), msg(1, stored([2])))
    (fetch,) = fetches(feed(r, msg(3, stored([3]))))
    new = [payload(cleared(), ts=50.0)] + [payload(stored([40 + i]), ts=50.0) for i in range(1, 5)]
    (again,) = fetches(r.on_replay(0, fetch.token, replies(*((i, new[i]) for i in range(1, 5))), True, 0.0))
    assert r.counters()["incarnations"] == 1 and again.start_seq == 0
    r.on_replay(0, again.token, replies(*enumerate(new)), True, 0.0)
    assert r.live_set() == {(0, 1, 40 + i): 1 for i in range(1, 5)}
    g = r.gauges()[0]
    assert g["oldest"] == g["sequence_base"] == 3 and Subscriber(r, 0).modes == {0: "history"}


# ---- cursors -------------------------------------------------------------------


@pytest.fixture
def rolled() -> KvRelay:
    """Batches 0..9 relayed; the window keeps 5..9."""
    r = relay(history_batches_max=5)
    feed(r, *(msg(i, stored([100 + i], parent=100 + i - 1 if i else None)) for i in range(10)))
    return r


def test_cursor_inside_the_window_gets_the_batches_after_it_then_live(rolled):
    sub = Subscriber(rolled, 6)
    sub.drain()
    assert sub.modes == {0: "resume"} and [b.sequence_number for b in sub.received] == [7, 8, 9]
    feed(rolled, msg(10, stored([110], parent=109)))
    sub.drain()
    assert sub.received[-1].sequence_number == 10
    edge = Subscriber(rolled, 5)  # the window is 6..10 now: oldest - 1 is inside
    edge.drain()
    assert [b.sequence_number for b in edge.received] == [6, 7, 8, 9, 10]
    newest = Subscriber(rolled, 10)
    newest.drain()
    assert newest.received == [] and newest.open


def test_cursor_zero_with_a_complete_history_gets_all_of_it():
    r = relay()
    feed(r, *(msg(i, stored([i])) for i in range(4)))
    sub = Subscriber(r, 0)
    sub.drain()
    assert sub.modes == {0: "history"} and [b.sequence_number for b in sub.received] == [0, 1, 2, 3]
    assert all(b.snapshot is None for b in sub.received) and sub.blocks == r.live_set()


def test_cursor_zero_after_the_window_rolled_gets_a_snapshot(rolled):
    sub = Subscriber(rolled, 0)
    sub.drain()
    assert sub.modes == {0: "snapshot"}
    (chunk,) = sub.received
    assert (chunk.sequence_number, chunk.snapshot.index, chunk.snapshot.count) == (9, 0, 1)
    assert (chunk.snapshot.blocks, chunk.snapshot.unknown_before) == (10, 0)  # evicted is not unknown
    assert isinstance(chunk.events[0].data, KvCleared)
    (store,) = (e.data for e in chunk.events[1:])
    assert [b.block_hash for b in store.blocks] == list(range(100, 110))  # one chain, parents first
    assert sub.blocks == rolled.live_set()
    feed(rolled, msg(10, removed([109])))
    sub.drain()
    assert sub.received[-1].sequence_number == 10 and sub.blocks == rolled.live_set()


def test_cursor_below_the_window_is_out_of_range(rolled):
    sub = Subscriber(rolled, 3)
    assert sub.refused.status == "OUT_OF_RANGE" and "below" in sub.refused.message
    assert rolled.counters()["out_of_range"] == 1


def test_cursor_ahead_of_the_newest_is_out_of_range(rolled):
    sub = Subscriber(rolled, 11)
    assert sub.refused.status == "OUT_OF_RANGE" and "ahead" in sub.refused.message
    assert Subscriber(relay(), 5).refused.status == "OUT_OF_RANGE"  # nothing relayed yet


def test_a_snapshot_is_chunked_parents_first_one_block_per_copy():
    r = relay(history_batches_max=1, snapshot_chunk_blocks=3)
    feed(
        r,
        msg(0, stored([1, 2, 3], tokens=list(range(6)))),
        msg(1, stored([4], parent=2), stored([5, 6], parent=3)),
        msg(2, stored([2], parent=1), stored([7], medium="CPU")),  # a second copy of 2; a host block
        msg(3, stored([8], parent=3)),
    )
    sub = Subscriber(r, 0)
    sub.drain()
    chunks = sub.received
    assert [c.sequence_number for c in chunks] == [1, 2, 3]  # consecutive, ending at the cut
    assert {(c.snapshot.count, c.snapshot.blocks) for c in chunks} == {(3, 9)}
    order = [(e.data.tier, b.block_hash) for c in chunks for e in c.events if isinstance(e.data, KvStored)
             for b in e.data.blocks]  # fmt: skip
    assert len(order) == 9 and all(sum(isinstance(e.data, KvStored) and len(e.data.blocks) for e in c.events) <= 3
                                   for c in chunks)  # fmt: skip
    seen = set()
    parents = {2: 1, 3: 2, 4: 2, 5: 3, 6: 5, 8: 3}
    for tier, h in order:
        assert h not in parents or (tier, parents[h]) in seen, f"{h} before its parent"
        seen.add((tier, h))
    assert order.count((1, 2)) == 2 and (2, 7) in order
    assert sub.blocks == r.live_set()


def test_snapshot_chunks_never_go_below_sequence_zero():
    r = relay(history_batches_max=1, snapshot_chunk_blocks=1)
    feed(r, msg(0, stored([1])), msg(1, stored([2, 3, 4], parent=1)))
    sub = Subscriber(r, 0)
    sub.drain()
    assert [c.sequence_number for c in sub.received] == [0, 1] and sub.blocks == r.live_set()


# ---- slow subscribers ---------------------------------------------------------------


def test_a_slow_subscriber_is_refilled_from_history_without_blocking_anyone():
    r = relay(history_batches_max=50, pull_batches_max=4)
    slow, fast = Subscriber(r, 0), Subscriber(r, 0)
    for i in range(40):
        feed(r, msg(i, stored([i])))
        fast.drain()
    slow.drain()
    assert [b.sequence_number for b in slow.received] == list(range(40))
    assert slow.blocks == fast.blocks == r.live_set()


def test_a_subscriber_the_window_rolled_past_ends_with_data_loss(rolled):
    sub = Subscriber(rolled, 5)
    feed(rolled, *(msg(i, stored([200 + i])) for i in range(10, 20)))
    sub.drain()
    assert sub.received == [] and sub.end.status == "DATA_LOSS" and "fell behind" in sub.end.message
    assert rolled.counters()["data_loss.behind"] == 1


def test_subscribers_are_bounded_and_close_ends_every_stream():
    r = relay(subscribers_max=2)
    a = Subscriber(r, 0)
    Subscriber(r, 0)
    assert Subscriber(r, 0).refused.status == "UNAVAILABLE"
    r.close(0.0)
    a.drain()
    assert a.end.status == "UNAVAILABLE" and r.gauges()[0]["state"] == "closed"
    assert feed(r, msg(0, stored([1]))) == [] and r.live_set() == {}


# ---- several ranks ------------------------------------------------------------------


def test_ranks_are_independent_and_every_batch_names_its_rank():
    r = KvRelay([0, 1], KvRelayConfig(history_batches_max=2))
    feed(r, *(msg(i, stored([i]), rank=0) for i in range(4)), rank=0)
    feed(r, msg(0, stored([50]), rank=None), rank=1)  # a publisher that names no rank: the socket's
    sub = Subscriber(r, 0)
    sub.drain()
    assert sub.modes == {0: "snapshot", 1: "history"}
    assert {b.dp_rank for b in sub.received} == {0, 1} and sub.blocks == r.live_set()
    feed(r, msg(0, stored([60]), ts=3.0, rank=1), rank=1)  # rank 1 restarts
    sub.drain()
    assert sub.end.status == "DATA_LOSS" and "rank 1" in sub.end.message
    assert r.live_set() == {(0, 1, 2): 1, (0, 1, 3): 1, (0, 1, 0): 1, (0, 1, 1): 1, (1, 1, 60): 1}


# ---- replay = fold ---------------------------------------------------------------------


def test_folding_the_journal_rebuilds_the_window_and_the_live_set():
    pair = Pair(KvRelay([0], KvRelayConfig(history_batches_max=6)), num_gpu_blocks=6)
    for i in range(12):
        pair.request([3 + (i % 3)] * 8 + [10 + i] * 4)
        if i == 4:
            pair.publisher.skip_next = 1
        if i == 8:
            pair.hooks.kv_fault("restart", 1)
        pair.settle()
    folded = KvRelay([0], KvRelayConfig(history_batches_max=6))
    for j in pair.journal:
        folded.apply_record(j.kind, j.payload)
    assert folded.live_set() == pair.relay.live_set()
    keys = ("incarnation", "oldest", "newest", "history_batches", "history_holes", "unknown_before", "live_blocks")
    assert {k: folded.gauges()[0][k] for k in keys} == {k: pair.relay.gauges()[0][k] for k in keys}
    assert any(j.kind == KIND_KV_LOST for j in pair.journal)


def test_history_bounds_come_from_the_environment():
    config = KvRelayConfig.from_env({"SMG_KV_EVENT_HISTORY_BATCHES": "12", "SMG_KV_EVENT_HISTORY_BYTES": "4096"})
    assert (config.history_batches_max, config.history_bytes_max) == (12, 4096)
    assert KvRelayConfig.from_env({}) == KvRelayConfig()
    assert (KvRelayConfig().history_batches_max, KvRelayConfig().history_bytes_max) == (10_000, 256 << 20)
    with pytest.raises(ValueError, match="SMG_KV_EVENT_HISTORY_BYTES"):
        KvRelayConfig.from_env({"SMG_KV_EVENT_HISTORY_BYTES": "lots"})


def test_the_byte_budget_bounds_the_window():
    r = relay(history_bytes_max=1000)
    feed(r, *(msg(i, stored([i], tokens=list(range(100)), bs=100)) for i in range(20)))
    g = r.gauges()[0]
    assert g["history_bytes"] <= 1000 and g["history_batches"] < 20 and g["newest"] == 19


# ---- the property -------------------------------------------------------------------------

PREFIXES = [[3 + i] * 12 for i in range(4)]

_OPS = {
    "req": st.tuples(st.just("req"), st.integers(0, 3), st.integers(1, 20), st.integers(1, 3)),
    "reset": st.tuples(st.just("reset")),
    "skip": st.tuples(st.just("skip"), st.integers(1, 2)),
    "drop": st.tuples(st.just("drop"), st.integers(1, 3)),
    "restart": st.tuples(st.just("restart")),
    "deliver": st.tuples(st.just("deliver"), st.integers(1, 6)),
    "dup": st.tuples(st.just("dup")),
    "swap": st.tuples(st.just("swap"), st.integers(0, 4)),
    "answer": st.tuples(st.just("answer"), st.booleans(), st.integers(0, 6)),
    "settle": st.tuples(st.just("settle")),
    "sub": st.tuples(st.just("sub"), st.sampled_from(["zero", "newest", "inside", "oldest", "below", "ahead"]),
                     st.integers(0, 20)),
    "pull": st.tuples(st.just("pull"), st.integers(0, 7), st.integers(1, 5)),
    "reconnect": st.tuples(st.just("reconnect"), st.integers(0, 7)),
}
# Weighted: the engine and the wire move most of the time; faults are the seasoning.
_KINDS = ["req"] * 6 + ["deliver"] * 6 + ["answer"] * 3 + ["sub"] * 3 + ["pull"] * 4 + ["settle"] * 2 + ["reconnect"] * 2 + [
    "reset", "skip", "drop", "drop", "restart", "dup", "swap", "swap"]  # fmt: skip
op = st.sampled_from(_KINDS).flatmap(_OPS.__getitem__)


def cursor_for(r: KvRelay, kind: str, k: int) -> int:
    g = r.gauges()[0]
    newest, oldest = g["newest"], g["oldest"]
    if kind == "zero" or newest is None:
        return 0 if kind != "ahead" else 1 + k
    return {
        "newest": newest,
        "inside": oldest - 1 + k % (newest - oldest + 2),
        "oldest": max(oldest - 1, 0),
        "below": max(oldest - 2, 0),
        "ahead": newest + 1 + k,
    }[kind]


# KV_RELAY_EXAMPLES=20000 for a soak; a failure prints the ops that replay it exactly.
@settings(max_examples=int(os.environ.get("KV_RELAY_EXAMPLES", "400")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    ops=st.lists(op, min_size=15, max_size=80),
    history=st.integers(2, 20),
    buffer_steps=st.integers(1, 30),
    chunk_blocks=st.integers(1, 8),
    replay=st.booleans(),
)
def test_property_subscribers_converge_or_are_told(ops, history, buffer_steps, chunk_blocks, replay):
    relay_ = KvRelay([0], KvRelayConfig(history_batches_max=history, snapshot_chunk_blocks=chunk_blocks,
                                        replay=replay, subscribers_max=1000))  # fmt: skip
    pair = Pair(relay_, buffer_steps=buffer_steps, num_gpu_blocks=8)
    subs: list[Subscriber] = []
    for o in ops:
        match o:
            case ("req", family, suffix, max_tokens):
                pair.request(PREFIXES[family][: 4 + suffix % 9] + [20 + suffix] * (suffix % 7), max_tokens)
            case ("reset",):
                pair.reset_cache()
            case ("skip", n):
                pair.publisher.skip_next += n
            case ("drop", n):
                pair.publisher.drop_next += n
            case ("restart",):
                pair.hooks.kv_fault("restart", 1)
            case ("deliver", n):
                pair.deliver(n)
            case ("dup",) if pair.wire:
                pair.wire.insert(1, pair.wire[0])
            case ("swap", i) if i + 1 < len(pair.wire) and pair.wire[i][0] == pair.wire[i + 1][0]:
                pair.wire[i], pair.wire[i + 1] = pair.wire[i + 1], pair.wire[i]
            case ("answer", complete, keep):
                pair.answer(complete, keep)
            case ("settle",):
                pair.settle()
            case ("sub", kind, k):
                cursor = cursor_for(relay_, kind, k)
                held = state_at(pair.journal, [0], relay_.config, 0, cursor) if cursor else None
                subs.append(Subscriber(relay_, cursor, held))
            case ("pull", i, n) if subs:
                subs[i % len(subs)].pull(n)
            case ("reconnect", i) if subs and (old := subs[i % len(subs)]).open and 0 in old.last and not old.mid_snapshot:
                # A router whose stream broke: resubscribe from its last sequence. (Not in the middle
                # of a snapshot: a chunk's number is where the resync ends, not a state to resume from.)
                relay_.unsubscribe(old.id, 0.0)
                old.end = "reconnected"
                # (0 is "no cursor" in the contract: that subscription starts from nothing)
                subs.append(Subscriber(relay_, old.last[0], old.blocks if old.last[0] else None))
    pair.settle()
    for sub in subs:
        sub.drain()
        note(f"sub cursor={sub.cursor} modes={sub.modes} refused={sub.refused} end={sub.end}")
        if sub.refused is not None:
            assert sub.refused.status == "OUT_OF_RANGE"
        elif sub.end == "reconnected":
            continue
        elif sub.end is not None:
            assert sub.end.status == "DATA_LOSS"
        else:
            assert sub.blocks == relay_.live_set()
    # What a router does after OUT_OF_RANGE / DATA_LOSS: clear, resubscribe from 0.
    fresh = Subscriber(relay_, 0)
    fresh.drain()
    assert fresh.open and fresh.blocks == relay_.live_set()
    # When the relay's incarnation holds every batch of the publisher's, it knows the engine's
    # cache exactly. (A lost last batch, or a restart whose first batches were lost and whose
    # numbers catch up with the old ones, shows nothing on the wire until later: the
    # publisher protocol's limit, not the relay's.)
    if pair.relay_saw_everything():
        assert relay_.live_set() == pair.engine_blocks()
    # Replay = fold.
    folded = KvRelay([0], relay_.config)
    for j in pair.journal:
        folded.apply_record(j.kind, j.payload)
    assert folded.live_set() == relay_.live_set()

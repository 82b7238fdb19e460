"""SubscribeKvEvents end to end: a real ``enginelink serve`` over the sim engine, a grpcio client.

KV events are on by default (no flag): the relay subscribes to the sim's
publisher before the warm-up, so a subscriber from 0 gets the whole history
from the engine's first batch; stored blocks carry the prompts' token ids
and their parent chain (the sim's block size is 16); FlushCache produces a
cleared event (with the next engine step, as vLLM publishes); cursors inside
the window resume exactly, one ahead of the newest is refused; load records
ride on every batch and ``load_only`` heartbeats repeat the last number.
"""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from enginelink.journal.records import KIND_ENGINE_HANDSHAKE, KIND_KV_BATCH
from enginelink.journal.store import open_reader
from enginelink.machines.sim_core import block_hash
from enginelink.wire.kv_events import fold_hash
from tests.harness import wait_until
from tests.kv.conftest import sequence_base
from tests.kv.kv_client import Chain, KvSubscription, generate, metric, newest_sequence, prompt, scrape

BLOCK = 16


def expected_hashes(tokens: list[int], blocks: int) -> list[int]:
    """The sim's chained block hashes, as the relay folds them to int64."""
    out, parent = [], None
    for i in range(blocks):
        parent = block_hash(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        out.append(fold_hash(parent))
    return out


def test_history_from_zero_holds_the_prompts_blocks_from_the_engines_first_batch(kv_default):
    p1 = prompt(1, 4 * BLOCK)
    p2 = p1[: 2 * BLOCK] + prompt(2, 2 * BLOCK)  # shares two blocks with p1
    generate(kv_default, "kv-p1", p1)
    with KvSubscription(kv_default, 0) as sub:
        sub.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(p1, BLOCK) == 4, what="p1's four blocks")
        batches = sub.kv_batches()
        numbers = [b.sequence_number for b in batches]
        # The whole history: from the publisher's first batch (the warm-up's), consecutive.
        assert numbers[0] == sequence_base(kv_default)
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert all(b.dp_rank == 0 and b.HasField("load") for b in batches)
        samples = [b.load.sample for b in sub.snapshot()]
        assert samples == sorted(samples) and len(set(samples)) == len(samples)

        chain = Chain().apply(batches)
        hashes = expected_hashes(p1, 4)
        for i, h in enumerate(hashes):
            parent, tokens = chain.blocks[h]
            assert tokens == tuple(p1[i * BLOCK : (i + 1) * BLOCK])
            assert parent == (hashes[i - 1] if i else None)

        # Live: p2 stores only its two new blocks, under p1's second block.
        seen = len(batches)
        generate(kv_default, "kv-p2", p2)
        sub.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(p2, BLOCK) == 4, what="p2's blocks")
        stored = [e.stored for b in sub.kv_batches()[seen:] for e in b.events if e.WhichOneof("data") == "stored"]
        mine = [s for s in stored if s.blocks and tuple(s.blocks[0].token_ids) == tuple(p2[2 * BLOCK : 3 * BLOCK])]
        assert len(mine) == 1
        assert mine[0].parent_block_hash == hashes[1]
        assert [list(b.token_ids) for b in mine[0].blocks] == [p2[2 * BLOCK : 3 * BLOCK], p2[3 * BLOCK :]]
        assert all(b.block_size == BLOCK for b in mine[0].blocks)
        assert mine[0].tier == common_pb2.KV_CACHE_TIER_DEVICE and mine[0].medium == "GPU"


def test_the_relay_subscribed_before_the_warm_up(kv_default):
    """The journal's first KV batch is the publisher's 0, before the first non-warm-up request."""
    reader = open_reader(kv_default.journal)
    batches = wait_until(lambda: reader.records(kinds=[KIND_KV_BATCH], limit=3), 5, "kv.batch records")
    assert [r.payload["seq"] for r in batches] == [0, 1, 2]
    assert all(r.payload["source"] == "live" for r in batches)
    launch = reader.records(kinds=[KIND_ENGINE_HANDSHAKE], limit=1)[0].payload["message"]["argv"]
    config = launch[launch.index("--kv-events-config") + 1]
    assert '"endpoint":"ipc://' in config and '"replay_endpoint":"ipc://' in config and "*" not in config


def test_flush_cache_publishes_a_cleared_event(kv_default):
    with KvSubscription(kv_default, 0) as sub:
        sub.caught_up()
        reply = kv_default.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=10)
        assert reply.success and reply.message == "Local KV prefix cache flushed successfully"
        seen = len(sub.kv_batches())
        p3 = prompt(3, 3 * BLOCK)
        generate(kv_default, "kv-p3", p3)  # events go out with the engine's next step
        sub.wait(lambda s: Chain().apply(s.kv_batches()[seen:]).prefix_of(p3, BLOCK) == 3, what="p3 after the clear")
        kinds = [e.WhichOneof("data") for b in sub.kv_batches()[seen:] for e in b.events]
        assert kinds[0] == "cleared" and "stored" in kinds
        chain = Chain().apply(sub.kv_batches())
        assert chain.clears >= 1 and chain.prefix_of(prompt(1, 4 * BLOCK), BLOCK) == 0  # p1 went with the clear


def test_flush_cache_refuses_a_bad_timeout(kv_default):
    with pytest.raises(grpc.RpcError) as error:
        kv_default.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = kv_default.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=10)
    assert reply.success  # idle engine: one attempt is enough


def test_a_cursor_inside_the_window_resumes_after_it(kv_default):
    generate(kv_default, "kv-p4", prompt(4, 2 * BLOCK))
    with KvSubscription(kv_default, 0) as full:
        full.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(prompt(4, 2 * BLOCK), BLOCK) == 2, what="p4")
        reference = full.kv_batches()
    cursor = reference[len(reference) // 2].sequence_number
    with KvSubscription(kv_default, cursor) as sub:
        sub.wait(lambda s: newest_sequence(s.snapshot()) == reference[-1].sequence_number, what="the newest batch")
        got = sub.kv_batches()
        assert got[0].sequence_number == cursor + 1
        assert [b.events for b in got] == [b.events for b in reference if b.sequence_number > cursor]
        # Live after it: the next batch is newest + 1.
        generate(kv_default, "kv-p5", prompt(5, 2 * BLOCK))
        sub.wait(lambda s: newest_sequence(s.snapshot()) == reference[-1].sequence_number + 1, what="a live batch")


def test_a_cursor_ahead_of_the_newest_is_out_of_range(kv_default):
    with KvSubscription(kv_default, 0) as full:
        newest = full.caught_up()
    for cursor in (newest + 5, 1 << 62):
        sub = KvSubscription(kv_default, cursor)
        assert sub.wait_end() == grpc.StatusCode.OUT_OF_RANGE
        assert "ahead" in sub.details() and "resubscribe" in sub.details()
        assert sub.snapshot() == []


def test_load_only_heartbeats_repeat_the_last_sequence(kv_default):
    with KvSubscription(kv_default, 0) as sub:
        sub.wait(lambda s: any(b.load.load_only for b in s.snapshot()), timeout_s=5, what="a load_only batch")
        last_kv = newest_sequence(sub.snapshot())
        beats = [b for b in sub.snapshot() if b.load.load_only]
        assert all(b.sequence_number == last_kv and not b.events and b.dp_rank == 0 for b in beats)
        load = beats[0].load
        assert load.max_total_num_tokens > 0 and load.max_running_requests > 0 and load.engine_reports_steps


def test_relay_counters_are_metrics(kv_default):
    # Its own traffic, not what the module's earlier tests left (a split run may give it a fresh servicer):
    # a stored prompt, and a subscriber from 0 (history) that sees it.
    p6 = prompt(6, 2 * BLOCK)
    generate(kv_default, "kv-p6", p6)
    with KvSubscription(kv_default, 0) as sub:
        sub.wait(lambda s: Chain().apply(s.kv_batches()).prefix_of(p6, BLOCK) == 2, what="p6's two blocks")
    samples = scrape(kv_default.metrics_port)
    assert metric(samples, "smg_servicer_kv_relay_events_total", event="relayed") > 0
    assert metric(samples, "smg_servicer_kv_forwarded_events_total", kind="stored") > 0
    assert "smg_servicer_kv_dropped_events_total" in {n.split("{")[0] for n in samples}
    assert metric(samples, "smg_servicer_kv_dropped_events_total", rule="unaligned_blocks") == 0
    assert metric(samples, "smg_servicer_kv_subscriptions_total", mode="history") > 0
    assert metric(samples, "smg_servicer_kv_history_batches", rank="0") > 0
    assert metric(samples, "smg_servicer_kv_history_batches_max") == 10_000

"""Attacks on KV event subscribers: clients that never read must not hold the slots.

Two ways a subscriber is let go, each ending its stream with DATA_LOSS and
freeing its slot (``ENGINELINK_KV_MAX_SUBSCRIBERS``): the history window rolls
past what it has not taken (at once, even while flow control holds its
stream), or flow control holds one of its messages longer than
``ENGINELINK_KV_SEND_STALL_SECS``. A subscriber that reads is not touched.
"""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from enginelink.machines.kv_relay import KvRelay, KvRelayConfig, Wake
from tests.adversarial.conftest import limited_servicer, metric
from tests.adversarial.h2_client import SUBSCRIBE_KV, H2Client, grpc_frame
from tests.harness import shared, wait_until
from tests.kv.kv_client import KvSubscription, generate, newest_sequence, prompt, scrape
from tests.kv.kv_client import metric as labelled
from tests.machines.kv_pair import Subscriber, msg, stored

DATA_LOSS = grpc.StatusCode.DATA_LOSS.value[0]
BLOCK = 16


# ---- the machine: slots come back without the subscriber's help ----------------------


def test_subscribers_that_never_pull_are_ended_when_the_window_rolls_past_them():
    relay = KvRelay([0], KvRelayConfig(history_batches_max=4, subscribers_max=3))
    stuck = [Subscriber(relay, 0) for _ in range(3)]
    assert Subscriber(relay, 0).refused.status == "UNAVAILABLE"
    actions = []
    for seq in range(4):
        actions += relay.on_live(0, msg(seq, stored([seq])), 0.0)
    assert Subscriber(relay, 0).refused.status == "UNAVAILABLE"  # the window still holds all they missed
    actions = relay.on_live(0, msg(4, stored([4])), 0.0)  # batch 0 leaves the window
    woken = {sid for a in actions if isinstance(a, Wake) for sid in a.subscribers}
    assert {s.id for s in stuck} <= woken  # their streams wake to end, whatever they were doing
    fresh = Subscriber(relay, 0)
    assert fresh.refused is None
    for sub in stuck:
        sub.pull()
        assert sub.received == [] and sub.end.status == "DATA_LOSS" and "fell behind" in sub.end.message
    assert relay.counters()["data_loss.behind"] == 3
    fresh.drain()
    assert fresh.end is None and fresh.blocks == relay.live_set()


def test_a_stalled_subscriber_ends_with_data_loss_and_an_earlier_end_stands():
    relay = KvRelay([0], KvRelayConfig(history_batches_max=2, subscribers_max=2))
    stalled, behind = Subscriber(relay, 0), Subscriber(relay, 0)
    relay.on_live(0, msg(0, stored([1])), 0.0)
    end = relay.stalled(stalled.id, 0.0).end
    assert end.status == "DATA_LOSS" and "ENGINELINK_KV_SEND_STALL_SECS" in end.message
    assert Subscriber(relay, 0).refused is None  # its slot is free
    for seq in range(1, 4):
        relay.on_live(0, msg(seq, stored([seq + 1])), 0.0)
    assert "fell behind" in relay.stalled(behind.id, 0.0).end.message  # ended by the window first
    counters = relay.counters()
    assert counters["data_loss.stalled"] == 1 and counters["data_loss.behind"] >= 1


# ---- end to end: raw HTTP/2 subscribers whose window never opens -----------------------


def subscribe_request(loads_first: bool = True) -> bytes:
    request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=0, load_records_before_first_batch=loads_first)
    return grpc_frame(request.SerializeToString())


def non_reader(servicer, loads_first: bool = True):
    """A subscriber that announces a zero receive window and never opens it: no message can reach it."""
    before = metric(servicer, "smg_servicer_kv_subscribers")
    client = H2Client(servicer.port, initial_window=0)
    call = client.start(SUBSCRIBE_KV, subscribe_request(loads_first), end=True)
    # Subscribed: the relay counts it (its response headers wait for its first message).
    wait_until(lambda: metric(servicer, "smg_servicer_kv_subscribers") == before + 1, 10, "the subscription")
    client.pump(0.05)
    assert not call.ended, (call.status, call.message)
    return client, call


@pytest.fixture(scope="module")
def stall_servicer(tmp_path_factory, test_model_dir):
    env = {"ENGINELINK_KV_MAX_SUBSCRIBERS": "4", "ENGINELINK_KV_SEND_STALL_SECS": "2"}
    with shared(limited_servicer(tmp_path_factory.mktemp("adv-kv-stall"), test_model_dir, env)) as running:
        yield running


@pytest.mark.process
@pytest.mark.slow
def test_subscribers_that_never_read_end_with_data_loss_and_free_every_slot(stall_servicer):
    servicer = stall_servicer
    stuck = [non_reader(servicer) for _ in range(4)]
    try:
        with KvSubscription(servicer, 0) as extra:  # the cap is reached: refused while they hold it
            assert extra.wait_end() == grpc.StatusCode.UNAVAILABLE and "4 KV event subscribers" in extra.details()
        for client, call in stuck:
            client.finish(call, timeout_s=10)
            assert call.status == DATA_LOSS and "ENGINELINK_KV_SEND_STALL_SECS" in call.message, call.trailers
    finally:
        for client, _ in stuck:
            client.close()
    assert labelled(scrape(servicer.metrics_port), "smg_servicer_kv_data_loss_total", reason="stalled") >= 4
    wait_until(lambda: metric(servicer, "smg_servicer_kv_subscribers") == 0, 5, "every slot free")
    assert metric(servicer, "smg_servicer_kv_subscribers_max") == 4
    assert metric(servicer, "smg_servicer_kv_send_stall_seconds") == 2
    with KvSubscription(servicer, 0) as reader:  # the slots are back
        reader.wait(lambda s: s.snapshot(), what="a first record")
        assert reader.error is None


@pytest.fixture(scope="module")
def window_servicer(tmp_path_factory, test_model_dir):
    # A stall bound far beyond the test: only the window can end the slow reader.
    env = {"ENGINELINK_KV_MAX_SUBSCRIBERS": "2", "ENGINELINK_KV_SEND_STALL_SECS": "600",
           "SMG_KV_EVENT_HISTORY_BATCHES": "8"}  # fmt: skip
    with shared(limited_servicer(tmp_path_factory.mktemp("adv-kv-window"), test_model_dir, env)) as running:
        yield running


@pytest.mark.process
@pytest.mark.slow
def test_a_slow_reader_left_behind_by_the_window_ends_while_a_fast_one_continues(window_servicer):
    servicer = window_servicer
    with KvSubscription(servicer, 0) as fast:
        fast.caught_up()
        slow_client, slow = non_reader(servicer, loads_first=False)
        try:
            with KvSubscription(servicer, 0) as third:  # two of two slots are held
                assert third.wait_end() == grpc.StatusCode.UNAVAILABLE
            prompts = [prompt(40 + i, 2 * BLOCK) for i in range(12)]
            for i, tokens in enumerate(prompts):  # one KV batch or more each: 12 > the 8-batch window
                generate(servicer, f"adv-kv-{i}", tokens)
            slow_client.finish(slow, timeout_s=10)
            assert slow.status == DATA_LOSS and "fell behind" in slow.message, slow.trailers
            assert slow.data == b""  # nothing reached it: it was ended while its stream was held
        finally:
            slow_client.close()
        # The reader kept everything, in order, and goes on.
        last = fast.wait(lambda s: newest_sequence(s.snapshot()), what="batches")
        generate(servicer, "adv-kv-after", prompt(99, 2 * BLOCK))
        fast.wait(lambda s: newest_sequence(s.snapshot()) > last, what="a batch after the slow reader ended")
        numbers = [b.sequence_number for b in fast.kv_batches()]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and fast.error is None
        with KvSubscription(servicer, 0) as again:  # the slow reader's slot is free
            again.wait(lambda s: s.kv_batches(), what="a first batch")
            assert again.error is None
    assert labelled(scrape(servicer.metrics_port), "smg_servicer_kv_data_loss_total", reason="behind") >= 1

"""Who gets a KV subscriber slot (machines/kv_admission.py through KvRelay.subscribe): per-peer
bounds, and a subscriber that does not take its events gives way to a new one (issue 38, item 5)."""

from __future__ import annotations

from enginelink.machines.kv_admission import HELD_GIVES_WAY_S
from enginelink.machines.kv_relay import KvRelay, KvRelayConfig, Plan, Refused, Wake
from tests.machines.kv_pair import msg, stored


def relay(**config) -> KvRelay:
    r = KvRelay([0], KvRelayConfig(**config))
    r.on_live(0, msg(0, stored([1])), 0.0)  # something to resume from
    return r


def subscribe(r: KvRelay, peer: str, now: float = 0.0, cursor: int = 0) -> Plan | Refused:
    return r.subscribe(cursor, now, peer)


def reads(r: KvRelay, plan: Plan, now: float = 0.0) -> Plan:
    """The shell sent it a message and it took it."""
    r.sending(plan.subscriber, now)
    r.sent(plan.subscriber)
    return plan


def held(r: KvRelay, plan: Plan, since: float) -> Plan:
    """The shell's send to it waits for a window that does not open."""
    r.sending(plan.subscriber, since)
    return plan


def test_a_held_subscriber_that_never_took_a_message_gives_way_to_a_new_one():
    r = relay(subscribers_max=2)
    reader = reads(r, subscribe(r, "10.0.0.1"))
    stuck = held(r, subscribe(r, "10.0.0.2"), since=0.0)
    new = subscribe(r, "10.0.0.3", now=0.01)
    assert isinstance(new, Plan)
    assert Wake((stuck.subscriber,)) in new.actions  # its held send stops and its stream ends
    end = r.pull(stuck.subscriber).end
    assert end.status == "DATA_LOSS" and "ENGINELINK_KV_MAX_SUBSCRIBERS" in end.message
    assert r.ended(reader.subscriber) is None
    assert r.counters()["data_loss.evicted"] == 1


def test_a_first_send_that_fits_the_window_is_not_a_non_reader():
    """The router's first message is in progress on a busy servicer (it fits the window the router gave):
    a new subscriber takes the slot of a stuck one that never opened its window, not the router's."""
    r = relay(subscribers_max=2)
    stuck = held(r, subscribe(r, "10.0.0.2"), since=0.5)
    router = subscribe(r, "10.0.0.1")
    r.sending(router.subscriber, 0.0, window_shut=False)  # held longer than the stuck one, but not by the client
    assert isinstance(subscribe(r, "10.0.0.3", now=0.6), Plan)
    assert r.ended(stuck.subscriber) is not None and r.ended(router.subscriber) is None
    # With no stuck one left, the router's pending send is not a reason to go until the grace has passed.
    assert isinstance(subscribe(r, "10.0.0.4", now=0.7), Refused)
    assert isinstance(subscribe(r, "10.0.0.4", now=HELD_GIVES_WAY_S + 0.1), Plan)
    assert r.ended(router.subscriber) is not None


def test_a_subscriber_that_takes_its_events_keeps_its_slot():
    r = relay(subscribers_max=2)
    first, second = reads(r, subscribe(r, "10.0.0.1")), reads(r, subscribe(r, "10.0.0.2"))
    refused = subscribe(r, "10.0.0.3")
    assert isinstance(refused, Refused) and refused.status == "UNAVAILABLE"
    assert "2 KV event subscribers already" in refused.message
    held(r, first, since=1.0)  # a send that waits a moment (its connection is busy): no reason to go
    assert isinstance(subscribe(r, "10.0.0.3", now=1.0 + HELD_GIVES_WAY_S / 2), Refused)
    r.sent(first.subscriber)
    # Long quiet is not "not reading": with nothing to send, a subscriber is never held.
    assert isinstance(subscribe(r, "10.0.0.3", now=100.0), Refused)
    assert r.ended(first.subscriber) is None and r.ended(second.subscriber) is None
    assert r.counters()["refused_busy"] == 3


def test_a_reader_whose_send_is_held_past_the_grace_gives_way_after_any_that_never_read():
    r = relay(subscribers_max=3)
    reader = held(r, reads(r, subscribe(r, "10.0.0.1")), since=0.0)  # took one, then stopped: held since 0
    never = held(r, subscribe(r, "10.0.0.2"), since=5.0)  # never took one, held since later
    quiet = subscribe(r, "10.0.0.3")  # nothing sent to it yet
    assert isinstance(subscribe(r, "10.0.0.4", now=10.0), Plan)
    assert r.ended(never.subscriber) is not None  # first those that never took a message
    assert r.ended(reader.subscriber) is None
    assert isinstance(subscribe(r, "10.0.0.5", now=10.0), Plan)
    assert r.ended(reader.subscriber) is not None  # then one held past the grace
    assert r.ended(quiet.subscriber) is None


def test_a_peer_at_its_bound_displaces_only_its_own_subscribers():
    r = relay(subscribers_max=8, subscribers_per_peer_max=2)
    other = held(r, subscribe(r, "10.0.0.9"), since=0.0)  # the oldest held of all, another peer's
    mine_old = held(r, subscribe(r, "10.0.0.1"), since=1.0)
    mine = reads(r, subscribe(r, "10.0.0.1"))
    assert isinstance(subscribe(r, "10.0.0.1", now=2.0), Plan)
    assert r.ended(mine_old.subscriber) is not None and "PER_PEER" in r.pull(mine_old.subscriber).end.message
    assert r.ended(other.subscriber) is None and r.ended(mine.subscriber) is None
    # Its two are a reader and a new one with nothing held: none gives way, the next is refused.
    refused = subscribe(r, "10.0.0.1", now=3.0)
    assert isinstance(refused, Refused) and "ENGINELINK_KV_MAX_SUBSCRIBERS_PER_PEER" in refused.message
    assert r.counters()["refused_peer"] == 1
    assert isinstance(subscribe(r, "10.0.0.2", now=3.0), Plan)  # another peer still has room


def test_a_refused_cursor_costs_nobody_a_slot():
    r = relay(subscribers_max=1)
    stuck = held(r, subscribe(r, "10.0.0.1"), since=0.0)
    refused = subscribe(r, "10.0.0.2", now=5.0, cursor=10**12)  # ahead of the newest batch
    assert isinstance(refused, Refused) and refused.status == "OUT_OF_RANGE"
    assert r.ended(stuck.subscriber) is None

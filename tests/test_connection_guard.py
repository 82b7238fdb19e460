"""Who gives way to a new gRPC connection (``runtime/rpc/grpc_limits.py``'s ``ConnectionGuard``), and
who a peer is (``runtime/peers.py``), without sockets: fake slots, explicit time (issue 38, item 5)."""

from __future__ import annotations

import pytest

from enginelink.runtime.peers import LOCAL, peer_key
from enginelink.runtime.rpc.grpc_limits import CONNECTION_LIMIT, PEER_LIMIT, ConnectionGuard, GrpcLimits


class FakeSlot:
    def __init__(self, peer: str, *, unread: bool = False) -> None:
        self.peer = peer
        self.waiting = unread  # bytes in its socket not read yet
        self.last = 0.0
        self.calls = 0

    def idle_since(self) -> float | None:
        return None if self.calls else self.last

    def unread(self) -> bool:
        return self.waiting


def guard(**limits) -> ConnectionGuard:
    return ConnectionGuard(GrpcLimits(**limits))


def open_(g: ConnectionGuard, peer: str, now: float = 0.0, *, done: bool = False, unread: bool = False):
    slot = FakeSlot(peer, unread=unread)
    admission = g.admit(slot, now)
    for victim, _ in admission.evict:  # the server closes them; the guard has forgotten them already
        victim.closed = True
    if done and admission.refused is None:
        g.handshake_done(slot)
        slot.last = now
    return slot, admission


def test_connections_in_their_handshake_hold_at_most_their_share_and_the_oldest_gives_way():
    g = guard(max_connections=8, max_handshaking=2)
    first, _ = open_(g, "10.0.0.1")
    second, _ = open_(g, "10.0.0.2")
    third, admission = open_(g, "10.0.0.3")
    assert admission.evict == ((first, "handshaking"),) and admission.refused is None
    assert list(g.handshaking) == [second, third]
    assert g.read().evicted_handshaking == 1 and g.read().connections == 2


def test_a_client_whose_preface_waits_unread_is_not_the_one_that_gives_way():
    g = guard(max_connections=8, max_handshaking=2)
    client, _ = open_(g, "10.0.0.1", unread=True)  # accepted in the same burst, its preface not yet read
    attacker, _ = open_(g, "10.0.0.2")
    _, admission = open_(g, "10.0.0.3")
    assert admission.evict == ((attacker, "handshaking"),)
    # When every one in the share is such a client, none gives way: over the share for a moment.
    g = guard(max_connections=8, max_handshaking=1)
    open_(g, "10.0.0.1", unread=True)
    _, admission = open_(g, "10.0.0.2", unread=True)
    assert admission.evict == () and admission.refused is None and len(g.handshaking) == 2


def test_the_share_past_the_handshake_is_reserved_and_at_the_cap_only_the_long_idle_give_way():
    g = guard(max_connections=4, max_handshaking=2, evict_idle_s=60.0)
    established = [open_(g, f"10.0.0.{i}", done=True)[0] for i in range(4)]
    established[0].calls = 1  # a call open: never idle
    established[1].last = 10.0
    established[2].last = 5.0
    established[3].last = 50.0
    _, admission = open_(g, "10.0.1.1", now=30.0)  # nobody idle 60 s yet
    assert admission.refused == CONNECTION_LIMIT and g.read().connections_refused == 1
    _, admission = open_(g, "10.0.1.1", now=66.0)  # 2 (idle since 5) is past 60 s, 1 (since 10) not yet
    assert admission.evict == ((established[2], "idle"),)
    _, admission = open_(g, "10.0.1.2", now=70.0)  # the newcomer is in its handshake: it goes first
    assert admission.evict[0][1] == "handshaking"
    assert g.read().evicted_idle == 1


def test_a_full_server_is_not_scanned_again_before_anyone_can_be_idle_long_enough():
    g = guard(max_connections=2, max_handshaking=1, evict_idle_s=60.0)
    a, _ = open_(g, "10.0.0.1", now=0.0, done=True)
    b, _ = open_(g, "10.0.0.2", now=10.0, done=True)
    looked = []
    a.idle_since = lambda: looked.append("a") or 0.0
    assert open_(g, "10.0.1.1", now=20.0)[1].refused == CONNECTION_LIMIT
    assert open_(g, "10.0.1.1", now=40.0)[1].refused == CONNECTION_LIMIT
    assert len(looked) == 2  # one scan (its pick and its soonest): the next is due at 0 + 60
    assert open_(g, "10.0.1.1", now=61.0)[1].evict == ((a, "idle"),)


def test_a_peer_at_its_bound_displaces_only_its_own_connections():
    g = guard(max_connections=16, max_handshaking=16, max_connections_per_peer=2, evict_idle_s=60.0)
    other, _ = open_(g, "10.0.0.9")  # older, in its handshake, another peer's
    mine_old, _ = open_(g, "10.0.0.1")
    mine, _ = open_(g, "10.0.0.1", done=True)
    _, admission = open_(g, "10.0.0.1", now=1.0)
    assert admission.evict == ((mine_old, "handshaking"),)
    assert other in g.open and mine in g.open
    # Now the peer holds one past its handshake (not idle long) and one in it (unread): refused.
    g2 = guard(max_connections=16, max_connections_per_peer=2)
    open_(g2, "10.0.0.1", done=True)
    open_(g2, "10.0.0.1", unread=True)
    _, admission = open_(g2, "10.0.0.1", now=1.0)
    assert admission.refused == PEER_LIMIT and g2.read().connections_refused_peer == 1


def test_forget_frees_the_slot_once():
    g = guard(max_connections=2)
    slot, _ = open_(g, "10.0.0.1")
    g.forget(slot)
    g.forget(slot)  # connection_lost after an eviction: already forgotten
    assert g.read().connections == 0 and g.read().peers == 0 and not g.handshaking


@pytest.mark.parametrize("peername, key", [
    (("127.0.0.2", 40000), "127.0.0.2"),
    (("::ffff:10.1.2.3", 1, 0, 0), "10.1.2.3"),
    (("2001:db8:1:2:aaaa::1", 1, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:bbbb::7", 1, 0, 0), "2001:db8:1:2::/64"),  # the same /64: the same peer
    (("fe80::1%eth0", 1, 0, 2), "fe80::/64"),
    ("/run/smg.sock", LOCAL), (None, LOCAL), (("not an address", 1), LOCAL),
])  # fmt: skip
def test_a_peer_is_an_ipv4_address_or_an_ipv6_64(peername, key):
    assert peer_key(peername) == key


@pytest.mark.parametrize("env", [
    {"ENGINELINK_GRPC_MAX_CONNECTIONS_PER_PEER": "0"}, {"ENGINELINK_GRPC_EVICT_IDLE_SECS": "nan"},
    {"ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS": "x"},
    {"ENGINELINK_GRPC_MAX_CONNECTIONS": "8", "ENGINELINK_GRPC_MAX_HANDSHAKING_CONNECTIONS": "9"},
])  # fmt: skip
def test_a_bad_fairness_knob_is_named(env):
    with pytest.raises(ValueError, match=list(env)[-1]):
        GrpcLimits.from_env(env)


def test_the_handshake_share_defaults_to_a_quarter_of_the_cap():
    assert GrpcLimits().handshaking_max == 256
    assert GrpcLimits.from_env({"ENGINELINK_GRPC_MAX_CONNECTIONS": "8"}).handshaking_max == 2
    assert GrpcLimits.from_env({"ENGINELINK_GRPC_MAX_CONNECTIONS": "2"}).handshaking_max == 1

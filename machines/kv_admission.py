"""Who gets a KV subscriber slot: per-peer bounds, and the subscriber not taking its events gives way.

Before, a subscriber over ``subscribers_max`` was refused while the slots
were held, and a client that re-subscribed as fast as its non-reading
streams were dropped (``send_stall_s``) kept the router's own subscriber
out (issue 38, item 5: 1 of 133 attempts served in 70 s). Now a new
subscriber is refused only when no open one is failing to take its events.

What the relay knows of a subscriber's reading comes from its shell: a send
started (``KvRelay.sending``) and not yet done (``KvRelay.sent``) is *held*
by the client's flow control. The rules, in order:

1. a peer (``runtime/peers.py``: an IPv4 address, an IPv6 /64) at
   ``subscribers_per_peer_max`` open subscribers: one of its own gives way,
   else the new one is refused UNAVAILABLE. A peer never displaces another;
2. at ``subscribers_max``: one of anyone's gives way, else refused UNAVAILABLE;
3. who gives way: the one held longest among those that have never taken a
   message and whose send waits for a window the client never opened (a
   first message that fits the client's window is held only while the
   servicer gets to it: on a loaded servicer the router's own first send,
   in progress, was once taken for a non-reader's and its stream ended);
   else the one held longest among those held ``HELD_GIVES_WAY_S`` at
   least. A subscriber that takes its
   messages (the router's: it reads continuously) is held only for moments
   and is never chosen; that is the share reserved for established
   subscribers. One with nothing to send yet is not held either.

The one that gives way ends with DATA_LOSS at once (``data_loss`` reason
``evicted``), as a stalled one would after ``send_stall_s``: its slot is free
before the new one is counted. Pure: the caller passes the open subscribers
and the time.
"""

from __future__ import annotations

from typing import Final, Iterable, Protocol

from enginelink.machines.kv_relay_api import MAX_SUBSCRIBERS_ENV, MAX_SUBSCRIBERS_PER_PEER_ENV, KvRelayConfig, Refused

# A subscriber that has taken messages (or whose send fits the window it gave) gives way only
# once a send to it has been held this long: the router's stream may wait behind its own
# connection's other streams, or behind this servicer's other work, and on a busy node (a
# suite at a load of 15-30 on two cores) that can come near a second. A subscriber that never
# took a message and never opened its window goes at once anyway, so 5 s costs an attack nothing.
HELD_GIVES_WAY_S: Final = 5.0


class Standing(Protocol):
    id: int
    peer: str
    taken: bool  # a send to it has completed
    held_since: float | None  # a send to it started then and has not completed
    window_shut: bool  # that send waits for a flow-control window the client has not opened


def admit(open_subscribers: Iterable[Standing], peer: str, config: KvRelayConfig,
          now: float) -> tuple[str, Standing | None, Refused | None]:  # fmt: skip
    """For a new subscriber from ``peer``: (the knob that binds, or ""; who gives way; the refusal).

    Rules 1 and 2; at most one of the last two is not None.
    """
    everyone = list(open_subscribers)
    mine = [s for s in everyone if s.peer == peer]
    if len(mine) >= config.subscribers_per_peer_max:
        victim = gives_way(mine, now)
        refused = None if victim is not None else Refused(
            "UNAVAILABLE", f"{config.subscribers_per_peer_max} KV event subscribers from this peer already "
                           f"({MAX_SUBSCRIBERS_PER_PEER_ENV}); retry later")  # fmt: skip
        return MAX_SUBSCRIBERS_PER_PEER_ENV, victim, refused
    if len(everyone) >= config.subscribers_max:
        victim = gives_way(everyone, now)
        refused = None if victim is not None else Refused(
            "UNAVAILABLE", f"{config.subscribers_max} KV event subscribers already; retry later")
        return MAX_SUBSCRIBERS_ENV, victim, refused
    return "", None, None


def gives_way(subscribers: Iterable[Standing], now: float) -> Standing | None:
    """Rule 3: the one that never took a message and whose send waits on a window it never opened, held
    longest; else the longest held past the grace."""
    never, past = None, None
    for s in subscribers:
        since = s.held_since
        if since is None:
            continue
        if not s.taken and s.window_shut:
            if never is None or since < never.held_since:
                never = s
        elif now - since >= HELD_GIVES_WAY_S and (past is None or since < past.held_since):
            past = s
    return never or past

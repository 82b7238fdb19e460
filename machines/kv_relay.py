"""The KV-event relay machine: publisher batches in, subscriber streams out.

One ``KvRelay`` per engine, one publisher per DP rank. Sans-io: the shell
feeds it what the rank's SUB socket and replay DEALER received and what
subscribers ask; it returns actions (replay fetches, journal records,
subscribers to wake) and the batches each subscriber may send. It keeps, per
rank: the publisher's sequence, a bounded window of normalised batches
(``kv_history.History``) and the live block set (``kv_state.RankKv``).

Theory of operation, per rank (table ``kv_rank``: idle → live ⇄ repairing):
- the batch numbered ``next_seq`` is accepted: normalised, appended to the
  window, journaled (``kv.batch``, the payload as received);
- a number above it is a *gap*: the batch is held, a ``FetchReplay`` asks the
  publisher's replay socket from the newest sequence held (one batch of
  overlap, to verify the publisher is still the one we know). When the
  replies come (``on_replay``): live batches first, replayed ones fill only
  what live did not bring, the overlap is dropped; what neither brought, up
  to the newest sequence the replay could have had, becomes a recorded
  *hole* (``kv.lost``); a newer gap starts another round. Before the rank's
  first batch, what is missing is counted as ``unknown_before`` instead;
- a number at or below the newest is a duplicate when its payload matches
  what the window holds; otherwise (a different batch under an old number, a
  startup clear under an old number, or a replay whose overlap differs) the
  publisher restarted: a new *incarnation* (``kv.incarnation``) — window and
  live set cleared, every subscriber of the rank ends with DATA_LOSS.

Served sequence numbers: a subscriber sees ``base + publisher sequence``.
``base`` starts at ``sequence_base`` (0: the publisher's own numbers) and, at
each new incarnation, moves two past the last number served, so numbers only
grow per rank for the relay's life and a cursor from an older incarnation is
always below the window (OUT_OF_RANGE), never mistaken for a position in the
new one. A shell that passes a ``sequence_base`` growing with wall time
(e.g. seconds << 20) extends that across servicer restarts.

Subscribers (table ``kv_subscriber``: catching_up → live → ended) read the
window at their own pace through ``pull``; the window is their buffer, so a
slow one costs nothing until the window rolls past it: then it ends with
DATA_LOSS at once, freeing its slot (``subscribers_max``) even while its
stream is held by flow control; one the shell could not send to for its
stall bound ends the same way (``stalled``), and one not taking its events
ends so when a new subscriber needs its slot (``kv_admission``). A
subscriber is never fed a gap: a hole ends it with DATA_LOSS, and a cursor
whose way forward crosses a hole is refused with OUT_OF_RANGE. ``subscribe``
with cursor 0 gets the whole window when it is complete from the
publisher's first batch, else a snapshot of the live set (``RankKv.snapshot``)
cut at the newest sequence, then what follows it.

Rules: no I/O, no clock (``now`` is taken for the shell's symmetry; nothing
here decides by time: a replay timeout is the shell's, reported as
``complete=False``), every collection bounded by ``KvRelayConfig``; an event
the tables do not allow is our bug and raises ``ProtocolError``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Final, Iterable, Sequence, cast

from enginelink.journal.records import KIND_TRANSITION, Transition
from enginelink.machines import kv_admission
from enginelink.machines.kv_history import History
from enginelink.machines.kv_relay_api import (
    HISTORY_BATCHES_ENV,
    HISTORY_BYTES_ENV,
    KIND_KV_BATCH,
    KIND_KV_GAP,
    KIND_KV_INCARNATION,
    KIND_KV_LOST,
    MAX_SUBSCRIBERS_PER_PEER_ENV,
    RANK_TABLE,
    SUBSCRIBER_TABLE,
    Action,
    Ended,
    FetchReplay,
    Journal,
    KvRelayConfig,
    Plan,
    Pull,
    RankEvent,
    RankState,
    Refused,
    SubEvent,
    SubState,
    Wake,
    kv_stream,
)
from enginelink.machines.kv_state import DROP_RULES, RankKv
from enginelink.wire.engine import WireError
from enginelink.wire.kv_batch import KvBatch
from enginelink.wire.kv_events import ReplayEnd, WireCleared, decode_batch, parse_pub_message, parse_replay_reply

# The shell imports the whole vocabulary from here.
__all__ = [
    "HISTORY_BATCHES_ENV", "HISTORY_BYTES_ENV", "KIND_KV_BATCH", "KIND_KV_GAP", "KIND_KV_INCARNATION", "KIND_KV_LOST",
    "RANK_TABLE", "SUBSCRIBER_TABLE", "Action", "Ended", "FetchReplay", "Journal", "KvRelay", "KvRelayConfig", "Plan",
    "Pull", "Refused", "Wake", "kv_stream",
]  # fmt: skip


# ---- state -------------------------------------------------------------------


class _Rank:
    def __init__(self, rank: int, config: KvRelayConfig, drops: Counter, base: int) -> None:
        self.rank = rank
        self.state = RankState.IDLE
        self.inc = 0
        self.history = History(config.history_batches_max, config.history_bytes_max)
        self.kv = RankKv(rank, drops)
        self.next_seq = 0
        self.pending: dict[int, tuple[bytes, int, str]] = {}  # seq -> (payload, digest, source)
        self.repair_token: int | None = None
        self.repair_upto = -1
        self.unknown_before = 0  # this incarnation's sequences before its first batch that nobody had
        self.holes_total = 0  # this incarnation's holes, evicted ones included
        self.last_ts = 0.0
        self.base = base  # served number = base + publisher sequence

    @property
    def newest(self) -> int | None:
        return self.history.newest

    @property
    def complete(self) -> bool:
        """The window is everything the publisher numbered: from 0, nothing lost."""
        return self.newest is not None and self.history.first == 0 and not (self.unknown_before or self.holes_total)

    def served(self, seq: int) -> int:
        return self.base + seq

    def new_incarnation(self) -> None:
        self.base += self.next_seq + 1  # one number left unused: an old cursor is always below
        self.inc += 1
        self.history.clear()
        self.kv.reset()
        self.pending.clear()
        self.repair_token = None
        self.next_seq = 0
        self.unknown_before = self.holes_total = 0


class _Cursor:
    __slots__ = ("inc", "last")

    def __init__(self, inc: int, last: int | None) -> None:
        self.inc = inc
        self.last = last  # last sequence delivered; None: waiting for the rank's first batch


class _Subscriber:
    def __init__(self, sid: int, cursors: dict[int, _Cursor], chunks: list[KvBatch], peer: str) -> None:
        self.id = sid
        self.state = SubState.CATCHING_UP
        self.cursors = cursors
        self.chunks = deque(chunks)
        self.end: Ended | None = None
        self.turn = 0  # which rank pull serves first
        # Its standing for kv_admission: who it is, whether it reads (the shell's sending / sent).
        self.peer = peer
        self.taken = False
        self.held_since: float | None = None
        self.window_shut = False  # the held send (``held_since``) waits for a window the client has not opened


class _Out:
    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.wake = False
        self.ended: list[int] = []  # subscribers ended by this step: woken to send their end

    def journal(self, stream: str, kind: str, payload: dict) -> None:
        self.actions.append(Journal(stream, kind, payload))


# ---- the machine -------------------------------------------------------------


class KvRelay:
    def __init__(self, ranks: Sequence[int], config: KvRelayConfig | None = None, sequence_base: int = 0) -> None:
        if not ranks:
            raise ValueError("a relay needs at least one rank")
        self.config = config or KvRelayConfig()
        self.counts: Counter = Counter()
        self.drops: Counter = Counter()
        self.ranks = {rank: _Rank(rank, self.config, self.drops, sequence_base) for rank in ranks}
        self._subscribers: dict[int, _Subscriber] = {}
        self._next_id = 1
        self._next_token = 1

    # ---- inputs from the publisher ------------------------------------------

    def on_live(self, rank: int, frames: list[bytes], now: float) -> list[Action]:
        """One message off the rank's SUB socket."""
        out = _Out()
        try:
            _topic, seq, payload = parse_pub_message(frames)
        except WireError:
            self.counts["bad_frames"] += 1
            return []
        self.counts["live_batches"] += 1
        r = self.ranks[rank]
        if r.state is not RankState.CLOSED:
            self._live(r, seq, payload, out)
        return self._finish(out)

    def on_replay(self, rank: int, token: int, messages: Iterable[list[bytes]], complete: bool,
                  now: float) -> list[Action]:  # fmt: skip
        """The replies to ``FetchReplay(rank, token)``: all of them up to the end marker
        (``complete``), or what came before the shell's timeout (``complete=False``)."""
        r = self.ranks[rank]
        if token != r.repair_token or r.state is not RankState.REPAIRING:
            self.counts["stale_replies"] += 1
            return []
        r.repair_token = None
        out = _Out()
        items: dict[int, bytes] = {}
        for message in messages:
            try:
                reply = parse_replay_reply(message)
            except WireError:
                self.counts["bad_replay_frames"] += 1
                continue
            if isinstance(reply, ReplayEnd):
                break
            items[reply[0]] = reply[1]
        if not complete:
            self.counts["replay_timeouts"] += 1
        newest = r.newest
        if newest is not None and newest in items:
            held = r.history.digest_of(newest)
            if held is not None and hash(items[newest]) != held:
                self._restart(r, "replay differs from the relay's history", newest, out)
                r.pending = {s: (p, hash(p), "replay") for s, p in items.items()}
                self._resolve(r, -1, out)  # the new incarnation's first batches: fetched from 0
                return self._finish(out)
        for seq, payload in items.items():
            if seq >= r.next_seq and seq not in r.pending:  # live first: replay only fills
                r.pending[seq] = (payload, hash(payload), "replay")
        self._resolve(r, max(r.repair_upto, max(items, default=-1)), out)
        return self._finish(out)

    def _live(self, r: _Rank, seq: int, payload: bytes, out: _Out) -> None:
        digest = hash(payload)
        newest = r.newest
        if newest is not None and seq <= newest:
            self._behind(r, seq, payload, digest, out)
        elif r.state is RankState.REPAIRING:
            held = r.pending.get(seq)
            if held is None:
                r.pending[seq] = (payload, digest, "live")
                if len(r.pending) > self.config.repair_pending_max:
                    self.counts["repair_overflows"] += 1
                    r.repair_token = None
                    self._resolve(r, max(r.pending), out)
            elif held[1] == digest:
                self.counts["duplicates"] += 1
            else:
                self._restart(r, "a different batch under a pending sequence", seq, out)
                self._live(r, seq, payload, out)
        elif seq == r.next_seq:
            self._accept(r, seq, payload, digest, "live", out)
        else:
            r.pending[seq] = (payload, digest, "live")
            self._gap(r, seq - 1, out)

    def _behind(self, r: _Rank, seq: int, payload: bytes, digest: int, out: _Out) -> None:
        held = r.history.digest_of(seq)
        if held == digest:
            self.counts["duplicates"] += 1
            return
        clear = _starts_with_clear(payload)
        if held is None and seq != 0 and not clear:
            self.counts["late"] += 1  # for a hole or an evicted slot: nothing to compare, nothing to do
            return
        reason = "startup clear under an old sequence" if clear else "sequence went backwards"
        self._restart(r, reason, seq, out)
        self._live(r, seq, payload, out)

    def _gap(self, r: _Rank, upto: int, out: _Out) -> None:
        self.counts["gaps"] += 1
        out.journal(kv_stream(r.rank), KIND_KV_GAP, {"rank": r.rank, "inc": r.inc, "first": r.next_seq, "last": upto})
        if not self.config.replay:
            self._resolve(r, upto, out)
            return
        self._step(r, RankEvent.GAP, out)
        r.repair_token = self._next_token
        self._next_token += 1
        r.repair_upto = upto
        self.counts["repairs"] += 1
        out.actions.append(FetchReplay(r.rank, r.repair_token, r.newest if r.newest is not None else 0))

    def _resolve(self, r: _Rank, covered: int, out: _Out) -> None:
        """Accept what is contiguous; lose what nobody has up to ``covered``; chase newer gaps."""
        for seq in sorted(r.pending):
            if seq < r.next_seq:
                del r.pending[seq]
                continue
            if seq > r.next_seq and r.next_seq <= covered:
                self._lose(r, r.next_seq, min(seq - 1, covered), out)
            if seq > r.next_seq:
                self._gap(r, seq - 1, out)  # beyond what the replay could have had: another round
                return
            payload, digest, source = r.pending.pop(seq)
            self._accept(r, seq, payload, digest, source, out)
        if r.state is RankState.REPAIRING:
            self._step(r, RankEvent.REPAIRED, out)

    def _accept(self, r: _Rank, seq: int, payload: bytes, digest: int, source: str, out: _Out | None) -> None:
        first = r.newest is None
        try:
            batch = r.kv.normalise(decode_batch(payload), r.served(seq))
        except WireError:
            self.counts["undecodable"] += 1
            batch = KvBatch(r.served(seq), r.last_ts, (), r.rank)  # under its number: nobody sees a gap
        r.history.push(seq, batch, digest, len(payload))
        if out is not None:
            self._left_behind(r, out)
        r.next_seq = seq + 1
        r.last_ts = batch.timestamp
        self.counts["relayed"] += 1
        if source == "replay":
            self.counts["recovered"] += 1
        if out is None:
            return
        out.journal(kv_stream(r.rank), KIND_KV_BATCH,
                    {"rank": r.rank, "inc": r.inc, "seq": seq, "source": source, "payload": payload})  # fmt: skip
        if first:
            for sub in self._subscribers.values():
                cursor = sub.cursors[r.rank]
                if cursor.last is None and cursor.inc == r.inc:
                    cursor.last = seq - 1
            if r.state is RankState.IDLE:
                self._step(r, RankEvent.FIRST_BATCH, out)
        out.wake = True

    def _left_behind(self, r: _Rank, out: _Out) -> None:
        """End, at once, every subscriber whose unsent backlog the window just rolled past.

        Without this a subscriber whose sends are held by flow control would
        learn it only at its next pull, keeping its slot (``subscribers_max``)
        meanwhile; now the slot is free and its stream is woken to end.
        """
        first = r.history.first
        for sub in self._subscribers.values():
            cursor = sub.cursors[r.rank]
            if sub.end is None and cursor.inc == r.inc and cursor.last is not None and cursor.last + 1 < first:
                self._end(sub, self._loss("behind", f"the subscriber fell behind DP rank {r.rank}'s KV history window"),
                          out)  # fmt: skip

    def _lose(self, r: _Rank, first: int, last: int, out: _Out | None) -> None:
        n = last - first + 1
        if r.newest is None:
            why = "before_start"
            r.unknown_before += n
            self.counts["unknown_before"] += n
        else:
            why = "hole"
            r.history.push_holes(first, last)
            if out is not None:
                self._left_behind(r, out)  # holes take window slots too
            r.holes_total += n
            self.counts["holes"] += n
        r.next_seq = last + 1
        if out is not None:
            out.journal(kv_stream(r.rank), KIND_KV_LOST,
                        {"rank": r.rank, "inc": r.inc, "first": first, "last": last, "why": why})  # fmt: skip
            out.wake = True

    def _restart(self, r: _Rank, reason: str, seq: int, out: _Out) -> None:
        self._step(r, RankEvent.RESTART, out)
        r.new_incarnation()
        self.counts["incarnations"] += 1
        out.journal(kv_stream(r.rank), KIND_KV_INCARNATION,
                    {"rank": r.rank, "inc": r.inc, "base": r.base, "reason": reason, "seq": seq})  # fmt: skip
        out.wake = True

    def _step(self, r: _Rank, event: RankEvent, out: _Out) -> None:
        dest = RankState(RANK_TABLE.next_state(str(r.rank), r.state, event))
        t = Transition("kv_rank", str(r.rank), r.state.value, dest.value, event.value)
        r.state = dest
        out.journal(kv_stream(r.rank), KIND_TRANSITION, t.payload())

    def _finish(self, out: _Out) -> list[Action]:
        if out.wake:
            ids = tuple(s.id for s in self._subscribers.values() if s.end is None or s.id in out.ended)
            if ids:
                out.actions.append(Wake(ids))
        return out.actions

    # ---- subscribers ----------------------------------------------------------

    def subscribe(self, cursor: int, now: float, peer: str = "") -> Plan | Refused:
        """A SubscribeKvEvents call with ``start_sequence_number = cursor`` (0: no cursor) from ``peer``.

        Over a bound (``kv_admission``), an open subscriber not taking its
        events gives way (DATA_LOSS, woken in the plan's actions), else the
        new one is refused. A cursor is checked first: a refused cursor costs
        nobody a slot.
        """
        if any(r.state is RankState.CLOSED for r in self.ranks.values()):
            return Refused("UNAVAILABLE", "the servicer is stopping")
        if cursor != 0:
            for r in self.ranks.values():
                why = self._cursor_refusal(r, cursor)
                if why is not None:
                    self.counts["out_of_range"] += 1
                    return Refused("OUT_OF_RANGE", f"{why}; resubscribe with start_sequence_number 0 and rebuild")
        open_now = (s for s in self._subscribers.values() if s.end is None)
        bound, victim, refused = kv_admission.admit(open_now, peer, self.config, now)
        if refused is not None:
            self.counts["refused_peer" if bound == MAX_SUBSCRIBERS_PER_PEER_ENV else "refused_busy"] += 1
            return refused
        out = _Out()
        if victim is not None:
            self._end(cast(_Subscriber, victim), self._loss("evicted", (
                f"the subscriber did not take its KV events and a new subscriber needed its slot ({bound})")), out)
            out.actions.append(Wake((victim.id,)))  # its held send stops, its stream ends
        cursors: dict[int, _Cursor] = {}
        modes: dict[int, str] = {}
        chunks: list[KvBatch] = []
        for rank, r in self.ranks.items():
            newest = r.newest
            if cursor != 0:
                modes[rank], last = "resume", cursor - r.base
            elif newest is None:
                modes[rank], last = "live", None
            elif r.complete:
                modes[rank], last = "history", -1
            else:
                modes[rank], last = "snapshot", newest
                chunks += r.kv.snapshot(r.served(newest), r.last_ts, r.unknown_before + r.holes_total,
                                        self.config.snapshot_chunk_blocks, newest + 1)  # fmt: skip
            cursors[rank] = _Cursor(r.inc, last)
        sub = _Subscriber(self._next_id, cursors, chunks, peer)
        self._next_id += 1
        self._subscribers[sub.id] = sub
        for mode in modes.values():
            self.counts[f"served_{mode}"] += 1
        out.journal(f"kv/sub-{sub.id}", KIND_TRANSITION,
                    Transition("kv_subscriber", str(sub.id), "", sub.state.value, f"subscribe:{cursor}").payload())
        return Plan(sub.id, modes, tuple(out.actions))

    def sending(self, subscriber: int, now: float, window_shut: bool = True) -> None:
        """The shell starts sending the subscriber a message: held until ``sent``. ``window_shut``: the message
        does not fit the flow-control window the client has given (False: it goes out as soon as the
        servicer gets to it, and waits only on the servicer or the socket)."""
        sub = self._subscribers.get(subscriber)
        if sub is not None and sub.held_since is None:
            sub.held_since = now
            sub.window_shut = window_shut

    def sent(self, subscriber: int) -> None:
        """The subscriber took the message ``sending`` announced: it reads (``kv_admission``)."""
        sub = self._subscribers.get(subscriber)
        if sub is not None:
            sub.held_since = None
            sub.taken = True

    @staticmethod
    def _cursor_refusal(r: _Rank, cursor: int) -> str | None:
        newest = r.newest
        if newest is None or cursor > r.served(newest):
            shown = None if newest is None else r.served(newest)
            return f"start_sequence_number {cursor} is ahead of DP rank {r.rank}'s newest batch ({shown})"
        last = cursor - r.base
        if last + 1 < r.history.first:
            return (f"start_sequence_number {cursor} is below DP rank {r.rank}'s history window "
                    f"(oldest kept: {r.served(r.history.first)})")  # fmt: skip
        hole = r.history.hole_after(last)
        if hole is not None:
            return f"DP rank {r.rank}'s batch {r.served(hole)}, after start_sequence_number {cursor}, was lost"
        return None

    def pull(self, subscriber: int, max_batches: int | None = None) -> Pull:
        """What the subscriber may send now, in order; an ``end`` closes its stream after them."""
        sub = self._subscribers[subscriber]
        if sub.end is not None:
            return Pull((), sub.end)
        limit = max_batches or self.config.pull_batches_max
        batches: list[KvBatch] = []
        while sub.chunks and len(batches) < limit:
            batches.append(sub.chunks.popleft())
        end: Ended | None = None
        ranks = list(self.ranks.items())
        sub.turn = (sub.turn + 1) % len(ranks)  # a busy rank does not starve the others
        for rank, r in ranks[sub.turn :] + ranks[: sub.turn]:
            cursor = sub.cursors[rank]
            if cursor.inc != r.inc:
                end = self._loss("restart", f"the KV event publisher of DP rank {rank} restarted")
                break
            if cursor.last is None or r.newest is None or cursor.last >= r.newest:
                continue
            if cursor.last + 1 < r.history.first:
                end = self._loss("behind", f"the subscriber fell behind DP rank {rank}'s KV history window")
                break
            for seq, batch in r.history.entries(cursor.last + 1):
                if len(batches) >= limit:
                    break
                if batch is None:
                    end = self._loss("hole", f"DP rank {rank}'s KV event batch {r.served(seq)} was lost by the publisher")
                    break
                batches.append(batch)
                cursor.last = seq
            if end is not None:
                break
        out = _Out()
        if end is not None:
            self._end(sub, end, out)
        elif sub.state is SubState.CATCHING_UP and not sub.chunks and self._caught_up(sub):
            self._sub_step(sub, SubEvent.CAUGHT_UP, out)
        return Pull(tuple(batches), end, tuple(out.actions))

    def _caught_up(self, sub: _Subscriber) -> bool:
        return all(
            c.last is None or r.newest is None or c.last >= r.newest
            for c, r in ((sub.cursors[rank], r) for rank, r in self.ranks.items())
        )

    def _loss(self, why: str, message: str) -> Ended:
        self.counts[f"data_loss.{why}"] += 1
        return Ended("DATA_LOSS", f"{message}; resubscribe with start_sequence_number 0")

    def _end(self, sub: _Subscriber, end: Ended, out: _Out) -> None:
        sub.end = end
        sub.chunks.clear()
        out.ended.append(sub.id)
        self._sub_step(sub, SubEvent.END, out)

    def _sub_step(self, sub: _Subscriber, event: SubEvent, out: _Out) -> None:
        dest = SubState(SUBSCRIBER_TABLE.next_state(str(sub.id), sub.state, event))
        t = Transition("kv_subscriber", str(sub.id), sub.state.value, dest.value, event.value)
        sub.state = dest
        out.journal(f"kv/sub-{sub.id}", KIND_TRANSITION, t.payload())

    def stalled(self, subscriber: int, now: float) -> Pull:
        """The shell could not send to the subscriber within its stall bound: it ends with DATA_LOSS.

        An end the relay gave it first (behind, restart, ...) stands. Time is
        the shell's: it says when a send has waited too long.
        """
        sub = self._subscribers[subscriber]
        out = _Out()
        if sub.end is None:
            why = "flow control held a message past ENGINELINK_KV_SEND_STALL_SECS"
            self._end(sub, self._loss("stalled", f"the subscriber did not take KV events for too long ({why})"), out)
        return Pull((), sub.end, tuple(out.actions))

    def ended(self, subscriber: int) -> Ended | None:
        """How the subscriber's stream ends, once the relay has decided it."""
        sub = self._subscribers.get(subscriber)
        return None if sub is None else sub.end

    def unsubscribe(self, subscriber: int, now: float) -> list[Action]:
        """The stream is over (client gone, or it ended): forget the subscriber."""
        sub = self._subscribers.pop(subscriber, None)
        out = _Out()
        if sub is not None and sub.end is None:
            self._end(sub, Ended("CANCELLED", "unsubscribed"), out)
        return out.actions

    def cursor(self, subscriber: int, rank: int) -> int | None:
        """The last sequence sent to the subscriber on a rank (what ``load_only`` batches repeat)."""
        cursor, r = self._subscribers[subscriber].cursors[rank], self.ranks[rank]
        if cursor.last is None or cursor.last < 0 or cursor.inc != r.inc:
            return None
        return r.served(cursor.last)

    def close(self, now: float) -> list[Action]:
        """The servicer is stopping: every rank closed, every stream ends UNAVAILABLE."""
        out = _Out()
        for r in self.ranks.values():
            if r.state is not RankState.CLOSED:
                self._step(r, RankEvent.CLOSE, out)
        for sub in self._subscribers.values():
            if sub.end is None:
                self._end(sub, Ended("UNAVAILABLE", "the servicer is stopping"), out)
        out.wake = True
        ids = tuple(self._subscribers)
        return out.actions + ([Wake(ids)] if ids else [])

    # ---- what the shell reads ----------------------------------------------------

    def live_set(self) -> dict[tuple[int, int, int], int]:
        """``{(rank, tier, hash): copies}`` over all ranks."""
        return {(rank, tier, h): c for rank, r in self.ranks.items() for (tier, h), c in r.kv.live_set().items()}

    def counters(self) -> dict[str, int]:
        """Every counter by name (metrics): relay events, drops by rule, forwarded by kind."""
        out = {name: 0 for name in _COUNTERS}
        out.update(self.counts)
        for rule in DROP_RULES:
            out[f"dropped.{rule}"] = self.drops[rule]
        for r in self.ranks.values():
            for kind in ("stored", "removed", "cleared"):
                out[f"forwarded.{kind}"] = out.get(f"forwarded.{kind}", 0) + r.kv.forwarded[kind]
        return out

    def gauges(self) -> dict[int, dict[str, int | str | None]]:
        """Per rank: state, incarnation, window bounds (served numbers) and size, live blocks."""
        return {
            rank: {
                "state": r.state.value, "incarnation": r.inc, "sequence_base": r.base,
                "oldest": r.served(r.history.first) if len(r.history) else None,
                "newest": None if r.newest is None else r.served(r.newest),
                "history_batches": len(r.history), "history_bytes": r.history.bytes,
                "history_holes": r.history.holes, "unknown_before": r.unknown_before,
                "live_blocks": r.kv.block_count(),
            }  # fmt: skip
            for rank, r in self.ranks.items()
        }

    # ---- replay = fold -------------------------------------------------------------

    def apply_record(self, kind: str, payload: dict) -> None:
        """Rebuild from the journal: ``kv.batch`` / ``kv.lost`` / ``kv.incarnation`` in order.

        The window and live set come back as the live relay had them; repairs
        in flight and subscribers are not state worth keeping across a run.
        """
        if kind not in (KIND_KV_BATCH, KIND_KV_LOST, KIND_KV_INCARNATION):
            return
        r = self.ranks[payload["rank"]]
        if kind == KIND_KV_INCARNATION:
            r.new_incarnation()
            r.inc, r.base = payload["inc"], payload["base"]
        elif kind == KIND_KV_LOST:
            self._lose(r, payload["first"], payload["last"], None)
        else:
            data = payload["payload"]
            self._accept(r, payload["seq"], data, hash(data), payload["source"], None)
        r.state = RankState.LIVE if r.newest is not None else RankState.IDLE


_COUNTERS: Final = (
    "live_batches", "relayed", "duplicates", "late", "undecodable", "bad_frames", "gaps", "repairs",
    "recovered", "replay_timeouts", "stale_replies", "bad_replay_frames", "repair_overflows", "holes",
    "unknown_before", "incarnations", "served_history", "served_snapshot", "served_resume", "served_live",
    "out_of_range", "refused_busy", "refused_peer", "data_loss.restart", "data_loss.behind", "data_loss.hole",
    "data_loss.stalled", "data_loss.evicted",
)  # fmt: skip


def _starts_with_clear(payload: bytes) -> bool:
    try:
        events = decode_batch(payload).events
    except WireError:
        return False
    return bool(events) and isinstance(events[0], WireCleared)

"""The KV relay's trio shell: the publisher sockets, the replay fetches, the subscriber streams.

The machine (``machines/kv_relay.py``, read ``docs/kv-events.md``) decides
everything; this file moves frames and time:

- per DP rank a SUB socket on the rank's PUB endpoint (``runtime/kv/kv_config.py``
  says where, and whether the SUB binds or connects), read from the moment it
  exists — a bound SUB sends its subscription to a connecting PUB only when
  the application touches the socket (libzmq #2267), and the receive loop
  does, at every wake-up and at least every 50 ms (``zmq_trio``). Every
  message goes to ``relay.on_live``;
- per rank a replay DEALER, on the machine's ``FetchReplay``: one request,
  replies until the end marker or ``REPLAY_TIMEOUT_S`` (5 s), then
  ``relay.on_replay``; a DEALER that timed out is replaced, so its late
  replies never answer the next fetch;
- the machine's actions: ``Journal`` → the journal, ``Wake`` → the streams'
  wake events, ``FetchReplay`` → the rank's fetcher (one outstanding; a newer
  one replaces an unstarted older one, the machine ignores stale tokens);
- the streams of ``SubscribeKvEvents`` (``runtime/contracts/shared/grpc_kv.py``): each has a
  wake event the handler waits on. It is an ``asyncio.Event`` set from trio
  code here, a plain call on the same thread under trio-asyncio: no
  trio↔asyncio hop per batch. A slow stream costs nothing here: the window
  is its buffer, and the machine refills it from history or ends it with
  DATA_LOSS, at once when the window rolls past it (its ``ended`` event
  stops a send held by flow control); a send held longer than
  ``send_stall_s`` ends it with DATA_LOSS too (``stalled``);
- load records (``runtime/kv/kv_loads.py``): every batch sent carries its
  rank's ``EngineLoad``; a ticker every 100 ms marks ``load_only`` records
  due and wakes those streams (it sleeps while no stream is open);
- start: ``run`` creates the sockets before the engine is launched (the
  server starts it before the link), so the history starts with the engine's
  first batch; ``after_handshake`` connects what only the ready response
  names (a port 0) and waits, up to ``JOIN_GRACE_S``, for every rank's
  publisher to be connected before the warm-up sends its first request;
- stop: ``close`` ends every stream with UNAVAILABLE.

Sequence numbers served start at ``sequence_base`` = wall-clock seconds << 20
(a fresh relay's numbers are above any an earlier run served, so a cursor
from an earlier run is refused with OUT_OF_RANGE, never taken for a position
in this one), journaled at start as incarnation 0 of each rank so a journal
replay rebuilds the same numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, Final, Iterable, NamedTuple

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from enginelink.machines.kv_relay import (
    KIND_KV_GAP,
    KIND_KV_INCARNATION,
    KIND_KV_LOST,
    Action,
    FetchReplay,
    Journal,
    KvRelay,
    Pull,
    Refused,
    Wake,
    kv_stream,
)
from enginelink.runtime.kv.kv_config import KvPlan, loopback
from enginelink.runtime.kv.kv_loads import Beat, LoadRecord, LoadSource
from enginelink.runtime.engine.zmq_trio import make_socket, recv_multipart
from enginelink.wire import kv_events as kv
from enginelink.wire.engine import WireError
from enginelink.wire.kv_batch import KvBatch

log = logging.getLogger("enginelink.kv")

REPLAY_TIMEOUT_S: Final = 5.0
REPLAY_REPLIES_MAX: Final = 200_000  # a publisher's buffer is bounded (vLLM: buffer_steps, 10 000)
JOIN_GRACE_S: Final = 30.0  # the reference's relay join grace before the warm-up
JOIN_SETTLE_S: Final = 0.05  # after the connection, for the subscription to reach the publisher
RECONNECT_IVL_MS: Final = 20  # a SUB dialling an ipc PUB that the engine has not bound yet
MESSAGES_PER_WAKEUP: Final = 64
SEQUENCE_BASE_SHIFT: Final = 20


class Outgoing(NamedTuple):
    """One message of a stream, contract-neutral: the batch and its rank's load record (``kv_messages.py``
    in ``runtime/contracts/shared/`` makes it a ``KvEventBatch``)."""

    batch: KvBatch
    load: LoadRecord


class KvRelayError(Exception):
    """The relay cannot listen where the plan says (operator's fault: exit 2)."""


def wall_sequence_base(wall_s: float | None = None) -> int:
    return int(time.time() if wall_s is None else wall_s) << SEQUENCE_BASE_SHIFT


class KvStream:
    """One SubscribeKvEvents call, as the shell keeps it."""

    __slots__ = ("id", "wake", "ended", "loads_before_first", "sample", "beats", "due", "modes")

    def __init__(self, sid: int, wake: Any, loads_before_first: bool, ranks: Iterable[int],
                 modes: dict[int, str]) -> None:  # fmt: skip
        self.id = sid
        self.wake = wake  # anything with set(): asyncio.Event for gRPC handlers
        # Set when the relay ends the stream (behind the window, restart, ...): a
        # handler whose send is held by flow control stops waiting on it.
        self.ended = asyncio.Event()
        self.loads_before_first = loads_before_first
        self.sample = 0
        self.beats = {rank: Beat() for rank in ranks}
        self.due: set[int] = set()
        self.modes = modes


class KvRelayShell:
    def __init__(self, plan: KvPlan, journal, loads: LoadSource, *, sequence_base: int | None = None,
                 wall_time: Callable[[float], float] | None = None) -> None:  # fmt: skip
        """``wall_time(trio_now)``: wall-clock seconds for ``load_only`` timestamps (the server's run mapping)."""
        self.plan = plan
        self.journal = journal
        self.loads = loads
        self.wall_time = wall_time or (lambda now: time.time())
        self.sequence_base = wall_sequence_base() if sequence_base is None else sequence_base
        self.relay = KvRelay(plan.rank_numbers(), plan.relay, self.sequence_base)
        self.streams: dict[int, KvStream] = {}
        self.closed = False
        self._context = zmq.Context.instance()
        self._sockets: list[zmq.Socket] = []
        self._joined = {rank: trio.Event() for rank in plan.rank_numbers()}
        self._replay_endpoints = {ep.rank: ep.replay for ep in plan.ranks}
        self._fetch_request: dict[int, FetchReplay] = {}
        self._fetch_wake = {rank: trio.Event() for rank in plan.rank_numbers()}
        self._nursery: trio.Nursery | None = None
        self._listener = trio.Event()  # set when a stream opens: the ticker sleeps on it while none is open

    # -- lifetime ------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open every known rank's SUB (raises KvRelayError), then ``started``; run until cancelled."""
        now = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for ep in self.plan.ranks:
                    self.journal.append(now, kv_stream(ep.rank), KIND_KV_INCARNATION,
                                        {"rank": ep.rank, "inc": 0, "base": self.sequence_base,
                                         "reason": "relay start", "seq": 0})  # fmt: skip
                    if ep.pub is not None:
                        self._open_sub(ep.rank, ep.pub, ep.sub_binds)
                    nursery.start_soon(self._fetcher, ep.rank)
                nursery.start_soon(self._ticker)
                log.info("KV event relay for DP rank(s) %s: %s", ",".join(map(str, self.plan.rank_numbers())),
                         "; ".join(f"{'bound' if ep.sub_binds else 'subscribed'} {ep.pub or '(from the ready response)'}"
                                   f", replay {ep.replay or ('(from the ready response)' if ep.replay_late else 'none')}"
                                   for ep in self.plan.ranks))  # fmt: skip
                task_status.started()
        finally:
            for sock in self._sockets:
                sock.close(linger=0)
            for path in self.plan.paths:
                Path(path).unlink(missing_ok=True)

    async def after_handshake(self, ready: dict, grace_s: float = JOIN_GRACE_S) -> bool:
        """Connect what only the ready response names; wait until every publisher is connected."""
        resolved = ready.get("kv_events_config") if isinstance(ready, dict) else None
        for ep in self.plan.ranks:
            if ep.pub is None or ep.replay_late:
                if not isinstance(resolved, dict):
                    log.warning("DP rank %d's KV endpoints were to come from the ready response, which has none: "
                                "no KV events from it", ep.rank)  # fmt: skip
                    continue
                if ep.pub is None and resolved.get("endpoint"):
                    self._open_sub(ep.rank, loopback(str(resolved["endpoint"])), False)
                if ep.replay_late and resolved.get("replay_endpoint"):
                    self._replay_endpoints[ep.rank] = loopback(str(resolved["replay_endpoint"]))
        with trio.move_on_after(grace_s):
            for event in self._joined.values():
                await event.wait()
            await trio.sleep(JOIN_SETTLE_S)
            return True
        missing = [rank for rank, event in self._joined.items() if not event.is_set()]
        log.warning("KV event publisher(s) of DP rank(s) %s not connected after %g s: starting anyway "
                    "(their first batches are fetched from replay when they arrive)", missing, grace_s)  # fmt: skip
        return False

    def close(self) -> None:
        """The servicer is stopping: every stream ends with UNAVAILABLE."""
        if not self.closed:
            self.closed = True
            self._apply(self.relay.close(trio.current_time()))

    # -- streams (called by the SubscribeKvEvents handler) -------------------------

    def open_stream(self, cursor: int, loads_before_first: bool, wake: Any, peer: str = "") -> KvStream | Refused:
        """``peer``: ``runtime/peers.py``'s key of the client (per-peer bounds)."""
        result = self.relay.subscribe(cursor, trio.current_time(), peer)
        if isinstance(result, Refused):
            return result
        stream = KvStream(result.subscriber, wake, loads_before_first, self.relay.ranks, result.modes)
        self.streams[stream.id] = stream
        self._listener.set()
        self._apply(result.actions)
        log.info("KV event subscriber %d from %d: %s", stream.id, cursor,
                 ", ".join(f"rank {r} {m}" for r, m in result.modes.items()))  # fmt: skip
        return stream

    def pull(self, stream: KvStream) -> Pull:
        pull = self.relay.pull(stream.id)
        self._apply(pull.actions)
        return pull

    def message(self, stream: KvStream, batch: KvBatch) -> Outgoing:
        """The batch as sent, with its rank's load record."""
        now = trio.current_time()
        rank = batch.dp_rank if batch.dp_rank is not None else self.plan.ranks[0].rank
        return Outgoing(batch, self._load(stream, rank, now, load_only=False))

    def heartbeats(self, stream: KvStream) -> list[Outgoing]:
        """The ``load_only`` batches due on this stream now: no events, the rank's cursor, its load."""
        if not stream.due:
            return []
        now = trio.current_time()
        out = []
        for rank in sorted(stream.due):
            cursor = self.relay.cursor(stream.id, rank)
            if cursor is None and not stream.loads_before_first:
                continue
            beat = KvBatch(sequence_number=cursor or 0, timestamp=self.wall_time(now), events=(), dp_rank=rank)
            out.append(Outgoing(beat, self._load(stream, rank, now, load_only=True)))
        stream.due.clear()
        return out

    def sending(self, stream: KvStream, window_shut: bool) -> None:
        """A message to the stream starts waiting: for its flow control where ``window_shut`` (it does not
        fit the window the client has given), else only for this servicer (``machines/kv_admission.py``)."""
        self.relay.sending(stream.id, trio.current_time(), window_shut)

    def sent(self, stream: KvStream) -> None:
        """The client took it."""
        self.relay.sent(stream.id)

    @property
    def send_stall_s(self) -> float:
        """How long a handler lets flow control hold one message (``ENGINELINK_KV_SEND_STALL_SECS``)."""
        return self.relay.config.send_stall_s

    def stalled(self, stream: KvStream) -> Pull:
        """The handler could not send within ``send_stall_s``: the stream's end (DATA_LOSS)."""
        pull = self.relay.stalled(stream.id, trio.current_time())
        self._apply(pull.actions)
        return pull

    def close_stream(self, stream: KvStream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._apply(self.relay.unsubscribe(stream.id, trio.current_time()))

    def _load(self, stream: KvStream, rank: int, now: float, *, load_only: bool) -> LoadRecord:
        stream.sample += 1
        beat = stream.beats[rank]
        record = self.loads.record(rank, now, sample=stream.sample, load_only=load_only,
                                   telemetry=load_only or stream.sample == 1)  # fmt: skip
        beat.sent(self.loads.view(rank, now), now, load_only=load_only)
        stream.due.discard(rank)
        return record

    # -- metrics -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return self.relay.counters()

    def gauges(self) -> dict[int, dict[str, Any]]:
        return self.relay.gauges()

    # -- the machine's actions -----------------------------------------------------

    def _apply(self, actions: Iterable[Action]) -> None:
        now = trio.current_time()
        for action in actions:
            match action:
                case Journal(stream=stream, kind=kind, payload=payload):
                    self.journal.append(now, stream, kind, payload)
                    if kind in (KIND_KV_LOST, KIND_KV_INCARNATION, KIND_KV_GAP):
                        _log_event(kind, payload)
                case Wake(subscribers=ids):
                    for sid in ids:
                        stream = self.streams.get(sid)
                        if stream is not None:
                            stream.wake.set()
                            if self.relay.ended(sid) is not None:
                                stream.ended.set()
                case FetchReplay(rank=rank):
                    self._fetch_request[rank] = action
                    self._fetch_wake[rank].set()
                case _:
                    raise AssertionError(f"unknown KV relay action {action!r}")

    # -- sockets -------------------------------------------------------------------

    def _open_sub(self, rank: int, endpoint: str, binds: bool) -> None:
        sock = make_socket(self._context, zmq.SUB)
        self._sockets.append(sock)
        sock.setsockopt(zmq.SUBSCRIBE, self.plan.topic)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sockets.append(monitor)
        try:
            if binds:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as error:
            raise KvRelayError(f"KV event relay cannot {'bind' if binds else 'connect to'} {endpoint} "
                               f"for DP rank {rank}: {error}") from None  # fmt: skip
        assert self._nursery is not None
        self._nursery.start_soon(self._receive, rank, sock)
        self._nursery.start_soon(self._watch, rank, monitor)

    async def _receive(self, rank: int, sock: zmq.Socket) -> None:
        on_live = self.relay.on_live
        while True:
            frames: list[bytes] | None = await recv_multipart(sock)
            handled = 0
            while frames is not None:
                self._apply(on_live(rank, frames, trio.current_time()))
                handled += 1
                if handled >= MESSAGES_PER_WAKEUP:
                    break
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    frames = None
            await trio.lowlevel.checkpoint()

    async def _watch(self, rank: int, monitor: zmq.Socket) -> None:
        while True:
            event = parse_monitor_message(await recv_multipart(monitor))
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self._joined[rank].is_set():
                    log.info("KV event publisher of DP rank %d connected", rank)
                self._joined[rank].set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                log.info("KV event publisher of DP rank %d disconnected", rank)

    async def _fetcher(self, rank: int) -> None:
        dealer: zmq.Socket | None = None
        try:
            while True:
                await self._fetch_wake[rank].wait()
                self._fetch_wake[rank] = trio.Event()
                request = self._fetch_request.pop(rank, None)
                if request is None:
                    continue
                endpoint = self._replay_endpoints.get(rank)
                replies: list[list[bytes]] = []
                complete = False
                if endpoint is not None:
                    if dealer is None:
                        dealer = make_socket(self._context, zmq.DEALER)
                        dealer.connect(endpoint)
                    replies, complete = await _ask_replay(dealer, request.start_seq)
                    if not complete:
                        dealer.close(linger=0)
                        dealer = None
                self._apply(self.relay.on_replay(rank, request.token, replies, complete, trio.current_time()))
        finally:
            if dealer is not None:
                dealer.close(linger=0)

    async def _ticker(self) -> None:
        from enginelink.runtime.kv.kv_loads import CHECK_S

        while True:
            if not self.streams:
                # Nobody listens: no load records are due, so sleep until a stream opens rather
                # than wake ten times a second for no one (a record's age_ms comes from when the
                # stats arrived, which Loads keeps).
                self._listener = trio.Event()
                await self._listener.wait()
            await trio.sleep(CHECK_S)
            now = trio.current_time()
            if not self.streams:
                continue
            views = {rank: self.loads.view(rank, now) for rank in self.relay.ranks}
            for stream in self.streams.values():
                for rank, beat in stream.beats.items():
                    if rank in stream.due or not beat.due(views[rank], now):
                        continue
                    if not stream.loads_before_first and self.relay.cursor(stream.id, rank) is None:
                        continue
                    stream.due.add(rank)
                if stream.due:
                    stream.wake.set()


async def _ask_replay(dealer: zmq.Socket, start_seq: int) -> tuple[list[list[bytes]], bool]:
    """One replay request; (replies, whether the end marker came within the timeout)."""
    try:
        dealer.send_multipart(kv.replay_request(start_seq), zmq.NOBLOCK)
    except zmq.Again:
        return [], False
    replies: list[list[bytes]] = []
    with trio.move_on_after(REPLAY_TIMEOUT_S):
        while len(replies) < REPLAY_REPLIES_MAX:
            frames = await recv_multipart(dealer)
            replies.append(frames)
            try:
                if isinstance(kv.parse_replay_reply(frames), kv.ReplayEnd):
                    return replies, True
            except WireError:
                continue  # the machine counts it
    return replies, False


def _log_event(kind: str, payload: dict) -> None:
    rank = payload.get("rank")
    if kind == KIND_KV_INCARNATION:
        log.warning("KV event publisher of DP rank %s restarted (%s at sequence %s): live subscribers end "
                    "with DATA_LOSS", rank, payload.get("reason"), payload.get("seq"))  # fmt: skip
    elif kind == KIND_KV_LOST:
        log.warning("KV event batches %s..%s of DP rank %s are lost (%s)", payload.get("first"), payload.get("last"),
                    rank, payload.get("why"))  # fmt: skip
    else:
        log.info("KV event gap on DP rank %s: batches %s..%s missing, asking the replay", rank,
                 payload.get("first"), payload.get("last"))  # fmt: skip


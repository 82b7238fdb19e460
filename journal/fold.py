"""Replay = fold: the one function that rebuilds servicer state from records.

Live state (``inspect`` on a running servicer) and post-mortem state
(``enginelink journal replay``) both come from ``fold`` over the latest
snapshot and the records after it, so they cannot disagree.

Rules:
- pure and deterministic: the result depends only on the records and the
  starting state; no clock, no I/O, no randomness, no hashing order;
- ``fold`` advances the state it is given, in place, and returns it (the
  live folder feeds records as they come; copying the whole state per call
  would cost more than the fold). Pass ``FoldState.from_dict(s.to_dict())``
  to keep an old state;
- records with ``seq <= state.last_seq`` are skipped, so overlapping feeds
  (a snapshot, then a ring read that starts before it) fold once;
- bounded: live requests are bounded by the servicer's in-flight cap, and
  only the newest ``terminal_max`` terminal requests are kept (default
  ``TERMINAL_REQUESTS_MAX``);
- unknown machines and kinds that carry no state are skipped; a
  ``client.sent`` for a request the fold does not hold (evicted, or before
  a pruned journal's first record) is counted in ``unmatched``;
- ``engine.frame`` payloads are decoded here (never on the servicer's hot
  path; the live fold may pass the link's own ``OutputBatch`` of the
  frame instead of its bytes, which it then need not decode again), with the codec the run names (``run.start``'s
  ``engine``, default vLLM), and only while some engine request is open: the
  fold attributes each output's tokens to the choice whose engine id it
  carries, from the request's ``engine.request`` until the engine finishes
  that choice, the client aborts the request, or the request ends. Those are
  exactly the frames the hub counted (it journals a frame before handing it
  on), so ``engine_tokens`` equals the hub's ``tokens_engine`` except after a
  stop string, where the hub stops listening at the matching frame while the
  engine runs on until our abort reaches it. Undecodable frames are counted
  in ``frames_undecodable``;
- the request machine starts in ``admitted`` and the link machine in
  ``starting`` without a transition record, so the fold takes the request's
  ``engine.request`` (the last step of admission) as entering ``admitted``,
  and the link's ``engine.handshake`` ``launch`` step as entering
  ``starting``;
- engine restarts (docs/resume.md): ``engine.held`` marks a request held
  (its engine ids stop taking tokens: that engine is gone), ``engine.resume``
  re-opens its choices' engine ids on the new engine, so the tokens keep
  adding up across engines, as the hub's ``tokens_engine`` does; the link
  counts its restarts (``engine.restart``).

``to_dict`` / ``from_dict`` round-trip exactly, key order included (the order
of ``ended`` is the eviction order), which is what ``snapshot`` records hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec

from enginelink.wire import codecs
from enginelink.wire.engine import EngineCodec, EngineDead, OutputBatch, WireError

from . import records as r
from .records import Record
from .states import LINK_INITIAL, REQUEST_INITIAL, REQUEST_TERMINAL

HANDSHAKE_LAUNCH: Final = "launch"
HANDSHAKE_PRIORITY: Final = "priority"
HANDSHAKE_PLACEMENT: Final = "placement"
REQUEST_STREAM_PREFIX: Final = r.request_stream("")
LINK_STREAM_PREFIX: Final = r.link_stream("")
# The wire engine frames are decoded with when run.start names none.
DEFAULT_CODEC: Final = "vllm"
# The request machine's terminal states (``states.py``, the vocabulary its table is built from).
TERMINAL_REQUEST_STATES: Final = frozenset(state.value for state in REQUEST_TERMINAL)
TERMINAL_REQUESTS_MAX: Final = 10_000
# The state of a link or request the fold has seen but no transition for yet.
STATE_UNSEEN: Final = ""


class LinkView(msgspec.Struct):
    state: str
    since: float  # time of the transition into ``state``
    pid: int | None = None
    facts: dict[str, Any] = {}
    # What the launch set: the engine's nice value and autogroup, the servicer's
    # scheduling policy (the ``priority`` handshake step; placement.lower_priority).
    priority: dict[str, Any] = {}
    # Which CPUs the engine binds and where the servicer runs (the ``placement``
    # handshake step; placement.place_front_end).
    placement: dict[str, Any] = {}
    # The engine's DP ranks, one entry each (rank, instance_id, …): the ``engine.facts`` record's ``ranks``.
    ranks: list[dict[str, Any]] = []
    restarts: int = 0  # the engine started again after a crash (``engine.restart``)
    last_crash: str | None = None  # why, the last time


class RequestView(msgspec.Struct):
    state: str
    since: float
    admitted_at: float | None = None
    n: int = 1
    prompt_tokens: int = 0
    tokens_sent: int = 0  # summed over the choices that completed
    finish_reason: str | None = None  # of the last choice that completed
    choices_done: int = 0
    # Per choice (index = choice index), from ``engine.request`` and frames.
    engine_ids: list[str] = []
    engine_tokens: list[int] = []  # tokens the engine produced for the choice
    # Engine restarts (fields last: a snapshot stores a request as the array of its fields).
    held: bool = False  # its engine died; waiting to be re-submitted to the restarted one
    resumes: int = 0
    reprefilled: int = 0  # generated tokens re-sent as prompt, over its resumes and choices

    @property
    def tokens(self) -> int:
        """Tokens the engine produced for this request so far (all choices)."""
        return sum(self.engine_tokens)


class RunView(msgspec.Struct):
    started_at: float | None = None  # trio time of run.start
    wall_time: float | None = None  # wall clock at trio time 0
    pid: int | None = None
    version: str | None = None
    stopped_at: float | None = None
    exit_status: int | None = None
    reason: str | None = None
    engine: str | None = None  # codec name of the engine wire
    media: dict | None = None  # run.start's media settings: the processor, its source, every bound


class FoldState(msgspec.Struct):
    links: dict[str, LinkView] = {}
    requests: dict[str, RequestView] = {}
    # Terminal request ids -> time they ended, oldest first: the eviction order.
    ended: dict[str, float] = {}
    run: RunView = msgspec.field(default_factory=RunView)
    last_seq: int = 0
    unmatched: int = 0
    # Engine ids of open choices -> (request id, choice index): whose tokens
    # a frame output carries. Bounded by the open requests' choices.
    open_engine_ids: dict[str, tuple[str, int]] = {}
    frames: int = 0
    frames_undecodable: int = 0
    # Part of the state (and of snapshots) so a replay evicts exactly as the
    # live fold did; tests set it small.
    terminal_max: int = TERMINAL_REQUESTS_MAX

    def to_dict(self) -> dict[str, Any]:
        # bytes stay bytes: snapshots are msgpack, which carries them as-is.
        return msgspec.to_builtins(self, builtin_types=(bytes,))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FoldState:
        return msgspec.convert(data, cls)

    @classmethod
    def from_snapshot(cls, snapshot: Record) -> FoldState:
        """The state a ``snapshot`` record holds, positioned at its seq."""
        if snapshot.kind != r.KIND_SNAPSHOT:
            raise ValueError(f"record {snapshot.seq} is {snapshot.kind!r}, not a snapshot")
        payload = snapshot.payload
        if payload.get("format") == SNAPSHOT_FORMAT_COMPACT:
            state = _from_compact(payload["state"])
        else:  # written before the compact form
            state = cls.from_dict(payload["state"])
        state.last_seq = snapshot.seq
        return state


# -- snapshots ------------------------------------------------------------------------
#
# A snapshot repeats the whole state every interval, so it is written compact:
# each request id once (``to_dict`` has it up to four times: the requests key,
# ``ended``, its engine ids and ``open_engine_ids``), engine ids as what they
# add to their request id (``""``, ``"#1"``, ``"#1~7"``), a request as the
# array of its fields (no key names), ``ended`` and ``open_engine_ids`` as
# positions in the request list. With request ids capped (256 bytes by
# default) a request costs its id plus ~40 bytes plus ~12 per choice, so a
# snapshot is bounded by the in-flight cap and ``terminal_max``, whatever the
# clients send (docs/limits.md). It round-trips exactly, key order included.

SNAPSHOT_FORMAT_COMPACT: Final = 2
_VIEW_FIELDS: Final = RequestView.__struct_fields__
_ENGINE_IDS_AT: Final = _VIEW_FIELDS.index("engine_ids")
_BULKY: Final = frozenset({"requests", "ended", "open_engine_ids"})


def snapshot_payload(state: FoldState) -> dict[str, Any]:
    """The payload of a ``snapshot`` record holding ``state`` (compact; ``FoldState.from_snapshot`` reads it)."""
    position: dict[str, int] = {}
    requests = []
    for rid, view in state.requests.items():
        position[rid] = len(requests)
        row = list(msgspec.structs.astuple(view))
        # An engine id that does not extend its request id (none of ours) is kept whole, as a 1-list.
        row[_ENGINE_IDS_AT] = [e[len(rid):] if e.startswith(rid) else [e] for e in view.engine_ids]
        requests.append([rid, *row])
    ended = [[position.get(rid, rid), t] for rid, t in state.ended.items()]
    open_ids = []
    for engine_id, (rid, index) in state.open_engine_ids.items():
        at = position.get(rid)
        ids = state.requests[rid].engine_ids if at is not None else ()
        open_ids.append([at, index] if index < len(ids) and ids[index] == engine_id else [engine_id, rid, index])
    compact = {
        name: msgspec.to_builtins(getattr(state, name), builtin_types=(bytes,))
        for name in FoldState.__struct_fields__
        if name not in _BULKY
    }
    compact.update(requests=requests, ended=ended, open_engine_ids=open_ids)
    return {"format": SNAPSHOT_FORMAT_COMPACT, "state": compact}


def _from_compact(data: dict[str, Any]) -> FoldState:
    rest = {name: value for name, value in data.items() if name not in _BULKY}
    state = msgspec.convert(rest, FoldState)
    rids = []
    requests = state.requests = {}
    for rid, *row in data["requests"]:
        row[_ENGINE_IDS_AT] = [rid + e if isinstance(e, str) else e[0] for e in row[_ENGINE_IDS_AT]]
        requests[rid] = RequestView(*row)
        rids.append(rid)
    state.ended = {(rids[at] if isinstance(at, int) else at): t for at, t in data["ended"]}
    opened = state.open_engine_ids = {}
    for entry in data["open_engine_ids"]:
        if len(entry) == 2:
            at, index = entry
            rid = rids[at]
            opened[requests[rid].engine_ids[index]] = (rid, index)
        else:
            engine_id, rid, index = entry
            opened[engine_id] = (rid, index)
    return state


def fold(records: Iterable[Record], state: FoldState | None = None) -> FoldState:
    """Advance ``state`` (a fresh one if None) by ``records``, oldest first."""
    st = FoldState() if state is None else state
    for rec in records:
        if rec.seq <= st.last_seq:
            continue
        _apply(st, rec)
        st.last_seq = rec.seq
    return st


def fold_record(st: FoldState, rec: Record) -> None:
    """Advance ``st`` by one record (the live fold's step, ``Journal.fold_live``); ``fold`` record by record."""
    if rec.seq > st.last_seq:
        _apply(st, rec)
        st.last_seq = rec.seq


def _apply(st: FoldState, rec: Record) -> None:
    p = rec.payload
    match rec.kind:
        case r.KIND_TRANSITION:
            if p["machine"] in (r.MACHINE_LINK, r.MACHINE_ROUTER):  # the router link shows as a link
                link = _link(st, p["id"], rec.time)
                link.state = p["dest"]
                link.since = rec.time
            elif p["machine"] == r.MACHINE_REQUEST:
                _request_transition(st, p["id"], p["dest"], rec.time)
        case r.KIND_CLIENT_GENERATE:
            rid = p["request_id"]
            view = st.requests.get(rid)
            if view is None or view.state in TERMINAL_REQUEST_STATES:
                # A reused id starts over: the old request is done.
                st.ended.pop(rid, None)
                view = st.requests[rid] = RequestView(state=STATE_UNSEEN, since=rec.time)
            view.n = p["n"]
            view.prompt_tokens = p["prompt_tokens"]
        case r.KIND_ENGINE_REQUEST:
            _engine_request(st, rec)
        case r.KIND_ENGINE_HELD:
            view = st.requests.get(p["request_id"])
            if view is not None:
                view.held = True
                _close_engine_ids(st, p["request_id"])
        case r.KIND_ENGINE_RESUME:
            rid = p["request_id"]
            view = st.requests.get(rid)
            if view is not None:
                view.held = False
                view.resumes = p["resumes"]
                view.reprefilled += sum(p["reprefilled"])
                for engine_id, index in zip(p["engine_ids"], p["indexes"]):
                    if index < len(view.engine_tokens):
                        st.open_engine_ids[engine_id] = (rid, index)
        case r.KIND_ENGINE_RESTART:
            link = _link(st, p["link"], rec.time)
            link.restarts += 1
            link.last_crash = p.get("crash")
        case r.KIND_ENGINE_FRAME:
            st.frames += 1
            if st.open_engine_ids:
                _engine_frame(st, rec.payload)
        case r.KIND_CLIENT_ABORT:
            # The hub ends the choices at once; outputs after this are late.
            for rid in p["request_ids"]:
                _close_engine_ids(st, rid)
        case r.KIND_ENGINE_HANDSHAKE if rec.stream.startswith(LINK_STREAM_PREFIX):
            step = p.get("step")
            if step not in (HANDSHAKE_LAUNCH, HANDSHAKE_PRIORITY, HANDSHAKE_PLACEMENT):
                return
            link = _link(st, rec.stream[len(LINK_STREAM_PREFIX):], rec.time)
            if step == HANDSHAKE_LAUNCH and link.state == STATE_UNSEEN:
                link.state = LINK_INITIAL.value
                link.since = rec.time
            elif step == HANDSHAKE_PRIORITY:
                link.priority = p["message"]
            elif step == HANDSHAKE_PLACEMENT:
                link.placement = p["message"]
        case r.KIND_CLIENT_SENT:
            view = st.requests.get(p["request_id"])
            if view is None:
                st.unmatched += 1
            else:
                view.tokens_sent += p["tokens_sent"]
                view.finish_reason = p["finish_reason"]
                view.choices_done += 1
        case r.KIND_ROUTER_HANDSHAKE:
            # The router link's facts: where it dialled, what it registered with (inspect shows them).
            link = _link(st, p["link"], rec.time)
            link.facts = {**link.facts, **{k: v for k, v in p.items() if k not in ("link", "step", "ready_response")},
                          **p.get("ready_response", {})}
        case r.KIND_ENGINE_FACTS:
            link = _link(st, p["link"], rec.time)
            link.pid = p["pid"]
            link.facts = p["facts"]
            link.ranks = p.get("ranks", [])
        case r.KIND_RUN_START:
            st.run.started_at = rec.time
            st.run.wall_time = p["wall_time"]
            st.run.pid = p["pid"]
            st.run.version = p["version"]
            st.run.engine = p.get("engine")
            st.run.media = p.get("media")
        case r.KIND_RUN_STOP:
            st.run.stopped_at = rec.time
            st.run.exit_status = p["exit_status"]
            st.run.reason = p["reason"]
        case _:
            # Kinds that carry no state the fold keeps (errors, snapshots):
            # their effects arrive as transitions.
            pass


def _engine_request(st: FoldState, rec: Record) -> None:
    p = rec.payload
    if not rec.stream.startswith(REQUEST_STREAM_PREFIX):
        return
    rid = rec.stream[len(REQUEST_STREAM_PREFIX):]
    view = st.requests.get(rid)
    if view is None:
        view = st.requests[rid] = RequestView(state=STATE_UNSEEN, since=rec.time)
    if view.state == STATE_UNSEEN:
        view.state = REQUEST_INITIAL.value
        view.since = rec.time
    if view.admitted_at is None:
        view.admitted_at = rec.time
    view.engine_ids = list(p["request_ids"])
    view.engine_tokens = [0] * len(view.engine_ids)
    for index, engine_id in enumerate(view.engine_ids):
        st.open_engine_ids[engine_id] = (rid, index)


_codecs: dict[str, EngineCodec] = {}


def _codec(name: str | None) -> EngineCodec:
    name = name or DEFAULT_CODEC
    codec = _codecs.get(name)
    if codec is None:
        codec = _codecs[name] = codecs.get(name if name in codecs.NAMES else DEFAULT_CODEC)
    return codec


def _engine_frame(st: FoldState, payload: bytes | OutputBatch) -> None:
    if isinstance(payload, OutputBatch):
        # The live fold (runtime/lifetime/snapshots.py): the link's own decode of exactly these
        # bytes, handed over so the frame is not decoded twice. Same outputs, same attribution.
        batch = payload
    else:
        try:
            batch = _codec(st.run.engine).decode_output([payload])
        except WireError:
            st.frames_undecodable += 1
            return
    if isinstance(batch, EngineDead):
        return
    open_ids = st.open_engine_ids
    for out in batch.outputs:
        owner = open_ids.get(out.request_id)
        if owner is None:
            continue  # late output (aborted, stopped) or before this journal
        view = st.requests.get(owner[0])
        if view is None or owner[1] >= len(view.engine_tokens):
            del open_ids[out.request_id]
            continue
        view.engine_tokens[owner[1]] += len(out.new_token_ids)
        if out.finish_reason is not None:
            del open_ids[out.request_id]


def _close_engine_ids(st: FoldState, rid: str) -> None:
    view = st.requests.get(rid)
    if view is not None:
        for engine_id in view.engine_ids:
            if st.open_engine_ids.get(engine_id, (None,))[0] == rid:
                del st.open_engine_ids[engine_id]


def _link(st: FoldState, name: str, now: float) -> LinkView:
    link = st.links.get(name)
    if link is None:
        link = st.links[name] = LinkView(state=STATE_UNSEEN, since=now)
    return link


def _request_transition(st: FoldState, rid: str, dest: str, now: float) -> None:
    view = st.requests.get(rid)
    if view is None:
        view = st.requests[rid] = RequestView(state=STATE_UNSEEN, since=now)
    view.state = dest
    view.since = now
    if dest == REQUEST_INITIAL and view.admitted_at is None:
        view.admitted_at = now
    if dest in TERMINAL_REQUEST_STATES:
        view.held = False
        _close_engine_ids(st, rid)
        st.ended.pop(rid, None)  # re-insert at the newest end
        st.ended[rid] = now
        while len(st.ended) > st.terminal_max:
            oldest = next(iter(st.ended))
            del st.ended[oldest]
            del st.requests[oldest]
    else:
        st.ended.pop(rid, None)

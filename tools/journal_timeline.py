"""A journal as a Chrome/Perfetto trace (``enginelink journal timeline JOURNAL --out FILE.json``).

A post-mortem as a picture: load the file in https://ui.perfetto.dev (or
``chrome://tracing``). The trace-event JSON format (the "JSON Array/Object
Format" of Chrome's Trace Event Format document) has four processes, each
with its tracks:

- **run**: the run's start and stop, snapshots, internal errors (instants);
- **engine links**: a track per link (``vllm-0``, …): one slice per state
  (``starting``, ``warming_up`` = the warm-up, ``serving``, ``draining`` =
  the drain), the handshake steps and the engine's facts as instants, the
  final ``stopped`` / ``failed`` (with its reason) as an instant;
- **engine ranks**: a track per rank (``engine/<rank>``): each output frame
  as counters (outputs and tokens in it; the engine's running and waiting
  requests when it reported them), the KV relay's incarnations, losses and
  gaps of that rank as instants;
- **requests**: a track per request (per admission: an id used again after
  it ended gets a new track), in admission order: one slice for the whole
  request (from ``client.generate``, the admission, to its terminal
  transition, the end; its arguments: n, prompt tokens, link and ranks, the
  end state, its first and last seq), inside it one per phase
  (``admitting``: the call admitted, its ADD not yet sent; ``admitted``: with
  the engine, no output yet; ``running``), and instants for aborts, each
  choice's ``complete`` (its tokens sent and finish reason; it may come
  just after the end) and errors. A request still open at the journal's
  end ends there, marked ``open_at_end``. A call refused before admission
  has no track: its error is an instant on the run track.

Times are seconds since the run started (``run.start``), in microseconds as
the format wants. The writer streams: it keeps only the open requests and
links, so a journal of millions of records becomes a trace of a similar
number of events without holding them all.

Rules: a pure function of the records (``write_timeline``); the caller opens
the journal and decodes frames (``tools/journal_cmd.py``), so this module
imports nothing of the tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import msgspec

from enginelink.journal import records as r
from enginelink.journal.records import Record
from enginelink.journal.states import LINK_TERMINAL, REQUEST_TERMINAL

# The processes of the trace (pid), in the order the viewer shows them.
PID_RUN, PID_LINKS, PID_RANKS, PID_REQUESTS = 1, 2, 3, 4
PROCESS_NAMES = {PID_RUN: "run", PID_LINKS: "engine links", PID_RANKS: "engine ranks", PID_REQUESTS: "requests"}
# The phase of a request between its admission (client.generate) and its ADD frames (engine.request).
ADMITTING = "admitting"
# Ended requests remembered, so a record written after the end (a complete) lands on its track.
ENDED_KEPT = 10_000
# Characters of an error message kept in an event's arguments.
MESSAGE_CHARS_MAX = 300
US = 1_000_000.0


class TimelineStats(msgspec.Struct):
    events: int = 0
    requests: int = 0
    links: int = 0
    ranks: int = 0
    frames: int = 0


class _Request(msgspec.Struct):
    tid: int
    id: str
    start: float  # its admission (client.generate), or its first record when that was pruned
    phase: str
    phase_since: float
    args: dict[str, Any]
    last: float
    last_seq: int


class _Link(msgspec.Struct):
    tid: int
    state: str | None
    since: float


class Timeline:
    """Turns records, in seq order, into trace events written to ``out`` as they are made."""

    def __init__(self, out: TextIO, rel: Callable[[float], float],
                 decode_frame: Callable[[bytes], dict[str, Any]] | None) -> None:
        self.out = out
        self.rel = rel
        self.decode_frame = decode_frame  # None: no frame counters
        self.stats = TimelineStats()
        self.requests: dict[str, _Request] = {}
        self.ended: dict[str, int] = {}  # request id -> its track, the newest ENDED_KEPT
        self.links: dict[str, _Link] = {}
        self.ranks: set[str] = set()
        self.next_request_tid = 1
        self.last_time: float | None = None

    # -- output ---------------------------------------------------------------------

    def begin(self) -> None:
        self.out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        for pid, name in PROCESS_NAMES.items():
            self._meta(pid, 0, "process_name", name)
            self._meta(pid, 0, "process_sort_index", pid, key="sort_index")
        self._meta(PID_RUN, 0, "thread_name", "run")

    def _emit(self, event: dict[str, Any]) -> None:
        if self.stats.events:
            self.out.write(",\n")
        self.out.write(json.dumps(event, default=_jsonable))
        self.stats.events += 1

    def _meta(self, pid: int, tid: int, name: str, value: Any, key: str = "name") -> None:
        self._emit({"ph": "M", "pid": pid, "tid": tid, "name": name, "args": {key: value}})

    def _ts(self, time: float) -> float:
        return round(self.rel(time) * US, 3)

    def _slice(self, pid: int, tid: int, name: str, start: float, end: float, args: dict | None = None,
               cat: str = "") -> None:
        event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": self._ts(start),
                 "dur": round(max(end - start, 0.0) * US, 3)}
        if args:
            event["args"] = args
        self._emit(event)

    def _instant(self, pid: int, tid: int, name: str, time: float, args: dict | None = None, cat: str = "",
                 scope: str = "t") -> None:
        event = {"ph": "i", "s": scope, "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": self._ts(time)}
        if args:
            event["args"] = args
        self._emit(event)

    # -- records --------------------------------------------------------------------

    def add(self, rec: Record) -> None:
        self.last_time = rec.time
        kind, stream, p = rec.kind, rec.stream, rec.payload
        if stream.startswith("req/"):
            self._request_record(stream[4:], rec)
        elif stream.startswith("link/"):
            self._link_record(stream[5:], rec)
        elif kind == r.KIND_ENGINE_FRAME:
            self._frame(stream, rec)
        elif stream.startswith("kv/"):
            self._kv(stream, rec)
        elif kind == r.KIND_RUN_START:
            self._instant(PID_RUN, 0, "run.start", rec.time, {"pid": p.get("pid"), "engine": p.get("engine"),
                                                              "version": p.get("version"), "seq": rec.seq},
                          cat="run", scope="g")
        elif kind == r.KIND_RUN_STOP:
            self._instant(PID_RUN, 0, "run.stop", rec.time, {**p, "seq": rec.seq}, cat="run", scope="g")
        elif kind == r.KIND_INTERNAL_ERROR:
            self._instant(PID_RUN, 0, "internal_error", rec.time,
                          {"rpc": p.get("rpc"), "type": p.get("type"), "message": _clip(p.get("message")),
                           "request_id": p.get("request_id"), "seq": rec.seq}, cat="error")
        elif kind == r.KIND_SNAPSHOT:
            self._instant(PID_RUN, 0, "snapshot", rec.time, {"seq": rec.seq}, cat="run")
        elif kind == r.KIND_ERROR:
            self._instant(PID_RUN, 0, f"error: {p.get('code')}", rec.time, _error_args(rec), cat="error")

    def _request_record(self, rid: str, rec: Record) -> None:
        kind, p = rec.kind, rec.payload
        req = self.requests.get(rid)
        if req is None:
            if kind == r.KIND_CLIENT_GENERATE:
                self.ended.pop(rid, None)  # the id again, after it ended: a new track
                req = self._open_request(rid, rec, ADMITTING)
                req.args.update(n=p.get("n"), prompt_tokens=p.get("prompt_tokens"), stream=p.get("stream"),
                                max_tokens=p.get("max_tokens"))
                return
            if (tid := self.ended.get(rid)) is not None:  # a complete written after the end, say
                self._request_instant(tid, rec)
                return
            if kind == r.KIND_ERROR:  # refused before admission: no track of its own
                self._instant(PID_RUN, 0, f"refused {rid}: {p.get('code')}", rec.time, _error_args(rec), cat="error")
                return
            if kind not in (r.KIND_ENGINE_REQUEST, r.KIND_TRANSITION):
                return
            req = self._open_request(rid, rec, "admitted")  # its admission was pruned
            req.args["admission_not_in_journal"] = True
        req.last, req.last_seq = rec.time, rec.seq
        match kind:
            case r.KIND_ENGINE_REQUEST:
                req.args.update(link=p.get("link"), engine_ids=p.get("request_ids"), ranks=p.get("ranks"))
                self._phase(req, "admitted", rec.time)
            case r.KIND_TRANSITION:
                self._phase(req, p["dest"], rec.time)
                if p["dest"] in REQUEST_TERMINAL:
                    self._close_request(req, rec.time)
            case _:
                self._request_instant(req.tid, rec)

    def _request_instant(self, tid: int, rec: Record) -> None:
        p = rec.payload
        match rec.kind:
            case r.KIND_CLIENT_ABORT:
                self._instant(PID_REQUESTS, tid, "abort", rec.time, {"reason": p.get("reason"), "seq": rec.seq},
                              cat="request")
            case r.KIND_CLIENT_SENT:
                self._instant(PID_REQUESTS, tid, f"complete {p.get('index')}", rec.time,
                              {k: p.get(k) for k in ("index", "tokens_sent", "tokens_engine", "finish_reason")}
                              | {"seq": rec.seq}, cat="request")
            case r.KIND_ERROR:
                self._instant(PID_REQUESTS, tid, f"error: {p.get('code')}", rec.time, _error_args(rec), cat="error")

    def _open_request(self, rid: str, rec: Record, phase: str) -> _Request:
        tid = self.next_request_tid
        self.next_request_tid += 1
        req = _Request(tid=tid, id=rid, start=rec.time, phase=phase, phase_since=rec.time,
                       args={"request_id": rid, "first_seq": rec.seq}, last=rec.time, last_seq=rec.seq)
        self.requests[rid] = req
        self._meta(PID_REQUESTS, tid, "thread_name", rid)
        self._meta(PID_REQUESTS, tid, "thread_sort_index", tid, key="sort_index")
        self.stats.requests += 1
        return req

    def _phase(self, req: _Request, phase: str, time: float) -> None:
        if phase == req.phase:
            return
        if req.phase not in REQUEST_TERMINAL:
            self._slice(PID_REQUESTS, req.tid, req.phase, req.phase_since, time, cat="request phase")
        req.phase, req.phase_since = phase, time

    def _close_request(self, req: _Request, end: float, open_at_end: bool = False) -> None:
        req.args["end_state"] = req.phase
        if open_at_end:
            self._slice(PID_REQUESTS, req.tid, req.phase, req.phase_since, end, cat="request phase")
            req.args["open_at_end"] = True
        req.args["last_seq"] = req.last_seq
        self._slice(PID_REQUESTS, req.tid, req.id, req.start, end, req.args, cat="request")
        del self.requests[req.id]
        self.ended[req.id] = req.tid
        if len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]

    def _link_record(self, name: str, rec: Record) -> None:
        link = self.links.get(name)
        if link is None:
            link = self.links[name] = _Link(tid=len(self.links) + 1, state=None, since=rec.time)
            self._meta(PID_LINKS, link.tid, "thread_name", name)
            self.stats.links += 1
        p = rec.payload
        match rec.kind:
            case r.KIND_ENGINE_HANDSHAKE:
                if link.state is None and p.get("step") == "launch":  # the machine starts here (docs/journal.md)
                    link.state, link.since = "starting", rec.time
                args = {"step": p.get("step"), "seq": rec.seq}
                if p.get("rank") is not None:
                    args["rank"] = p["rank"]
                self._instant(PID_LINKS, link.tid, f"handshake {p.get('step')}", rec.time, args, cat="handshake")
            case r.KIND_ENGINE_FACTS:
                facts = {k: v for k, v in (p.get("facts") or {}).items() if isinstance(v, (int, float, str, bool))}
                self._instant(PID_LINKS, link.tid, "engine facts", rec.time, {"pid": p.get("pid"), **facts},
                              cat="handshake")
            case r.KIND_TRANSITION:
                since = link.since if link.state is not None else rec.time
                self._slice(PID_LINKS, link.tid, p.get("source") or link.state or "?", since, rec.time,
                            {"event_out": p.get("event"), "seq_out": rec.seq}, cat="link state")
                link.state, link.since = p["dest"], rec.time
                if p["dest"] in LINK_TERMINAL:
                    args = {"event": p.get("event"), "seq": rec.seq}
                    if p.get("reason"):
                        args["reason"] = p["reason"]
                    self._instant(PID_LINKS, link.tid, p["dest"], rec.time, args, cat="link state")
            case r.KIND_ERROR:
                self._instant(PID_LINKS, link.tid, f"error: {p.get('code')}", rec.time, _error_args(rec), cat="error")

    def _rank_track(self, rank: str) -> int:
        tid = int(rank) if rank.isdigit() else 10_000 + len(self.ranks)
        if rank not in self.ranks:
            self.ranks.add(rank)
            self._meta(PID_RANKS, tid, "thread_name", f"engine/{rank}")
            self.stats.ranks += 1
        return tid

    def _frame(self, stream: str, rec: Record) -> None:
        self.stats.frames += 1
        if self.decode_frame is None:
            return
        rank = stream.partition("/")[2]
        tid = self._rank_track(rank)
        frame = rec.payload if isinstance(rec.payload, dict) else self.decode_frame(rec.payload)
        outputs = frame.get("outputs") or []
        counters = {"outputs": len(outputs), "tokens": sum(len(o["new_token_ids"]) for o in outputs),
                    "finished": sum(1 for o in outputs if o.get("finish_reason") is not None)}
        self._emit({"ph": "C", "pid": PID_RANKS, "tid": tid, "name": f"engine/{rank} frame", "ts": self._ts(rec.time),
                    "args": counters})
        stats = frame.get("stats")
        if stats:
            self._emit({"ph": "C", "pid": PID_RANKS, "tid": tid, "name": f"engine/{rank} scheduler",
                        "ts": self._ts(rec.time),
                        "args": {"running": stats.get("num_running_reqs"), "waiting": stats.get("num_waiting_reqs")}})
        if frame.get("engine_dead") or frame.get("undecodable"):
            self._instant(PID_RANKS, tid, "ENGINE_CORE_DEAD" if frame.get("engine_dead") else "undecodable frame",
                          rec.time, {"seq": rec.seq}, cat="engine")

    def _kv(self, stream: str, rec: Record) -> None:
        if rec.kind == r.KIND_KV_BATCH:
            return  # one a batch: the frames' counters already show the engine's pace
        p = rec.payload
        tid = self._rank_track(str(p.get("rank", stream.partition("/")[2])))
        self._instant(PID_RANKS, tid, rec.kind, rec.time,
                      {k: v for k, v in p.items() if not isinstance(v, (bytes, bytearray))} | {"seq": rec.seq},
                      cat="kv")

    def end(self) -> TimelineStats:
        end = self.last_time if self.last_time is not None else 0.0
        for req in list(self.requests.values()):
            self._close_request(req, max(end, req.last), open_at_end=True)
        for link in self.links.values():
            if link.state is not None and link.state not in LINK_TERMINAL:
                self._slice(PID_LINKS, link.tid, link.state, link.since, end, {"open_at_end": True}, cat="link state")
        self.out.write("\n]}\n")
        return self.stats


def write_timeline(records: Iterable[Record], out: TextIO, *, rel: Callable[[float], float],
                   decode_frame: Callable[[bytes], dict[str, Any]] | None) -> TimelineStats:
    """Writes ``records`` (in seq order) to ``out`` as one trace-event JSON object; what it wrote, counted."""
    timeline = Timeline(out, rel, decode_frame)
    timeline.begin()
    for rec in records:
        timeline.add(rec)
    return timeline.end()


def _error_args(rec: Record) -> dict[str, Any]:
    p = rec.payload
    return {"whose": p.get("whose"), "code": p.get("code"), "message": _clip(p.get("message")), "seq": rec.seq}


def _clip(text: Any) -> Any:
    if isinstance(text, str) and len(text) > MESSAGE_CHARS_MAX:
        return text[: MESSAGE_CHARS_MAX - 3] + "..."
    return text


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return f"<{len(obj)} bytes>"
    return str(obj)

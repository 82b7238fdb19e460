"""A traced call's life, folded from the records the journal already takes: what its span is built from.

Tracing (``runtime/lifetime/tracing.py``) adds no instrumentation to the
request path. It taps the journal (``Journal.tap``): every record appended
while tracing is on passes through ``TraceTap.record``, and the link's decode
of an engine frame through ``TraceTap.decoded`` (as the live fold takes it,
so a frame is not decoded twice). A traced call's ``CallTrace`` keeps what
its span needs from them:

- ``client.generate``: admitted (n, prompt tokens, max tokens, stream);
- ``engine.request``: the ADDs went out, queued in the engine, to which ranks;
- ``engine.frame``: each engine output with tokens for one of its choices, a
  chunk (its time and token count); the first is the choice's first token;
  the engine's own QUEUED/SCHEDULED times where it reports them (vLLM's
  ``EngineCoreEvent``s, on the first output), moved onto the servicer's clock
  by the frame's own timestamp;
- ``client.sent``: a choice finished (its finish reason and tokens sent);
- ``client.abort``: the abort's reason; ``error``: a refusal before admission;
- ``transition`` of the request machine: its terminal state.

Which call a record is about. The Generate handler sets ``CURRENT`` (a
context variable: each grpclib handler is its own asyncio task) before it
validates; a record appended from that handler's own stack (admission, a
refusal, the abort of a client gone) is that call's, whatever its id. A
record appended elsewhere (the link's frame handler: outputs, a finish, the
direct path's ``client.sent``) is the call's whose request id it names, among
the traced calls open (``open``, ``by_engine_id``). So a refused duplicate id
is traced as its own refused call, not folded into the call holding the id.

Rules: no clocks and no I/O here (times are the records' own trio times; the
tracer turns them into wall time); bounded: ``open`` and ``by_engine_id``
hold traced calls in flight only (each leaves at ``end``, which the handler
calls however it leaves), and a call keeps at most ``chunks_max`` chunks
(the rest are counted). Untraced records cost one context-variable read, and
none when no traced call is open.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any, Callable

from enginelink.journal import records as r
from enginelink.journal.states import REQUEST_TERMINAL
from enginelink.wire.engine import OutputBatch, WireError
from enginelink.wire.vllm import EVENT_QUEUED, EVENT_SCHEDULED

log = logging.getLogger("enginelink.tracing")

REQUEST_PREFIX = r.request_stream("")
TERMINAL = frozenset(state.value for state in REQUEST_TERMINAL)

# The traced call whose handler is running (None: untraced, or not a Generate handler).
CURRENT: ContextVar["CallTrace | None"] = ContextVar("enginelink_trace", default=None)


class CallTrace:
    """What one traced Generate call's records said, in the servicer's (trio) time."""

    __slots__ = (
        "span", "started_at", "rid", "n", "prompt_tokens", "max_tokens", "stream", "admitted_at",
        "queued_at", "ranks", "engine_ids", "engine_queued_at", "engine_scheduled_at", "first_token_at",
        "last_token_at", "tokens_engine", "chunks", "chunks_total", "chunks_max", "finished", "aborted",
        "refused", "ended", "seams",
    )

    def __init__(self, span: Any, started_at: float, chunks_max: int) -> None:
        self.span = span  # the tracer's (an OpenTelemetry span); nothing here reads it
        self.started_at = started_at
        self.rid: str | None = None
        self.n = 1
        self.prompt_tokens = 0
        self.max_tokens = 0
        self.stream = False
        self.admitted_at: float | None = None
        self.queued_at: float | None = None  # the ADDs went out (engine.request)
        self.ranks: list[int] = []
        self.engine_ids: list[str] = []
        self.engine_queued_at: float | None = None  # the engine's own QUEUED / SCHEDULED, where it says
        self.engine_scheduled_at: float | None = None
        self.first_token_at: list[float | None] = []
        self.last_token_at: float | None = None
        self.tokens_engine: list[int] = []
        self.chunks: list[tuple[float, int, int]] = []  # (time, choice, tokens), the first chunks_max
        self.chunks_total = 0
        self.chunks_max = chunks_max
        self.finished: list[tuple[float, int, str, int]] = []  # (time, choice, finish reason, tokens sent)
        self.aborted: tuple[float, str] | None = None  # (time, reason)
        self.refused: tuple[float, str, str, str] | None = None  # (time, code, message, whose)
        self.ended: tuple[float, str] | None = None  # (time, terminal state)
        # An engine restart's seams (docs/resume.md): (event name, time, attributes), held then resumed.
        self.seams: list[tuple[str, float, dict]] = []

    @property
    def tokens_sent(self) -> int:
        return sum(tokens for _, _, _, tokens in self.finished)

    def _admitted(self, now: float, payload: dict) -> None:
        self.admitted_at = now
        self.n = payload["n"]
        self.prompt_tokens = payload["prompt_tokens"]
        self.max_tokens = payload.get("max_tokens", 0)
        self.stream = payload.get("stream", False)
        self.first_token_at = [None] * self.n
        self.tokens_engine = [0] * self.n

    def _output(self, now: float, index: int, tokens: int, out: Any, batch: OutputBatch) -> None:
        if self.engine_scheduled_at is None and batch.timestamp:
            events = getattr(out, "events", None)
            if events:
                # The engine's clock, moved onto ours by this frame's own send time (same host: the
                # frame's transit is the error).
                offset = now - batch.timestamp
                for event in events:
                    if event.type == EVENT_QUEUED:
                        self.engine_queued_at = event.timestamp + offset
                    elif event.type == EVENT_SCHEDULED:
                        self.engine_scheduled_at = event.timestamp + offset
        if not tokens:
            return
        if index < len(self.first_token_at) and self.first_token_at[index] is None:
            self.first_token_at[index] = now
        if index < len(self.tokens_engine):
            self.tokens_engine[index] += tokens
        self.last_token_at = now
        self.chunks_total += 1
        if len(self.chunks) < self.chunks_max:
            self.chunks.append((now, index, tokens))


class TraceTap:
    """The journal's tap while tracing is on: folds traced calls' records into their ``CallTrace``.

    ``decode``: the link's codec's ``decode_output`` for an engine frame the
    link did not hand over decoded (a multi-part frame: its first part, as
    the journal keeps it).
    """

    def __init__(self, decode: Callable[[list[bytes]], Any]) -> None:
        self.decode = decode
        self.open: dict[str, CallTrace] = {}  # request id -> traced call in flight
        self.by_engine_id: dict[str, tuple[CallTrace, int]] = {}  # engine id -> (traced call, choice)
        self._frame: tuple[int, float, bytes] | None = None  # an engine frame waiting for the link's decode
        self.frames_decoded = 0  # frames the tap decoded itself (no decode came from the link)
        self.errors = 0  # records it could not fold (tracing's bug; the first is logged)

    # -- the handler's side ---------------------------------------------------------------

    def begin(self, call: CallTrace) -> Any:
        """``call`` is the running handler's; returns the token ``end`` resets the context with."""
        return CURRENT.set(call)

    def end(self, call: CallTrace, token: Any) -> None:
        """The handler leaves: ``call`` folds nothing more."""
        try:
            self._take_frame()
        except Exception as error:
            self.failed(error)
        CURRENT.reset(token)
        if call.rid is not None and self.open.get(call.rid) is call:
            del self.open[call.rid]
        self._forget_engine_ids(call)

    # -- the journal's side -----------------------------------------------------------------

    def record(self, seq: int, now: float, stream: str, kind: str, payload: Any) -> None:
        """One record, as appended (``Journal.append``). A failure here is tracing's bug: it is counted
        and logged once, never raised into the request path that appended the record."""
        try:
            self._record(seq, now, stream, kind, payload)
        except Exception as error:
            self.failed(error)

    def decoded(self, seq: int, batch: Any) -> None:
        """The link's decode of the engine frame it just journaled as ``seq`` (``Journal.note_decoded``)."""
        frame = self._frame
        if frame is not None and frame[0] == seq:
            self._frame = None
            try:
                self._batch(frame[1], batch)
            except Exception as error:
                self.failed(error)

    def failed(self, error: Exception) -> None:
        """A failure of tracing's own (a bug): counted, the first logged; never raised into the request path."""
        self.errors += 1
        if self.errors == 1:
            log.exception("tracing failed (its span misses what it could not fold or fill): %s", error)

    def _record(self, seq: int, now: float, stream: str, kind: str, payload: Any) -> None:
        if self._frame is not None:
            self._take_frame()
        if kind == r.KIND_ENGINE_FRAME:
            if self.by_engine_id:
                self._frame = (seq, now, payload)
            return
        if not stream.startswith(REQUEST_PREFIX):
            return
        rid = stream[len(REQUEST_PREFIX):]
        call = CURRENT.get()
        if call is None or (call.rid is not None and call.rid != rid):
            if not self.open:
                return
            call = self.open.get(rid)
            if call is None:
                return
        self._fold(call, rid, now, kind, payload)

    # -- folding ------------------------------------------------------------------------------

    def _fold(self, call: CallTrace, rid: str, now: float, kind: str, payload: dict) -> None:
        match kind:
            case r.KIND_CLIENT_GENERATE if call.admitted_at is None:
                call.rid = rid
                call._admitted(now, payload)
                self.open[rid] = call
            case r.KIND_ENGINE_REQUEST:
                call.queued_at = now
                call.ranks = list(payload.get("ranks", ()))
                call.engine_ids = list(payload["request_ids"])
                for index, engine_id in enumerate(call.engine_ids):
                    self.by_engine_id[engine_id] = (call, index)
            case r.KIND_ENGINE_HELD:  # the engine died under the call; the same engine ids carry on after it
                call.seams.append(("engine.held", now, {"enginelink.tokens": list(payload.get("tokens", ()))}))
            case r.KIND_ENGINE_RESUME:
                call.seams.append(("engine.resumed", now, {"enginelink.reprefilled": list(payload.get("reprefilled", ())),
                                                           "enginelink.engine.ranks": list(payload.get("ranks", ()))}))
            case r.KIND_CLIENT_SENT:
                call.finished.append((now, payload["index"], payload["finish_reason"], payload["tokens_sent"]))
            case r.KIND_CLIENT_ABORT:
                if call.aborted is None:
                    call.aborted = (now, payload["reason"])
                self._forget_engine_ids(call)  # outputs after an abort are late: the call no longer hears them
            case r.KIND_ERROR if call.admitted_at is None:  # a refusal before admission
                call.refused = (now, payload.get("code", ""), payload.get("message", ""), payload.get("whose", ""))
            case r.KIND_TRANSITION if payload.get("machine") == r.MACHINE_REQUEST and payload.get("dest") in TERMINAL:
                call.ended = (now, payload["dest"])
                self._forget_engine_ids(call)

    def _batch(self, now: float, batch: Any) -> None:
        if not isinstance(batch, OutputBatch):
            return  # EngineDead: the link fails every call, which their handlers' ends say
        by_engine_id = self.by_engine_id
        for out in batch.outputs:
            entry = by_engine_id.get(out.request_id)
            if entry is None:
                continue
            call, index = entry
            call._output(now, index, len(out.new_token_ids), out, batch)
            if out.finish_reason is not None:
                del by_engine_id[out.request_id]

    def _take_frame(self) -> None:
        """The pending frame, decoded here: no decode of it came from the link."""
        frame = self._frame
        if frame is None:
            return
        self._frame = None
        if not self.by_engine_id:
            return
        try:
            batch = self.decode([frame[2]])
        except WireError:
            return  # the link failed on it too (its error ends the calls)
        self.frames_decoded += 1
        self._batch(frame[1], batch)

    def _forget_engine_ids(self, call: CallTrace) -> None:
        by_engine_id = self.by_engine_id
        for engine_id in call.engine_ids:
            entry = by_engine_id.get(engine_id)
            if entry is not None and entry[0] is call:
                del by_engine_id[engine_id]


"""The journal's invariants, checked in one pass over its records.

``verify(records, tables=...)`` feeds each record to the one ``fold`` and
checks it against the state just before it, so the checks see exactly what
replay sees (no second interpretation of the records):

- **sequence**: seq contiguous. A journal whose first seq is above 1 was
  pruned at the start by the store's budgets (a note, not a violation); a gap
  after the first record is a hole (rows dropped from the disk path, or a
  damaged file) and is a violation;
- **terminals**: every admitted request (``client.generate``) reaches
  exactly one terminal state, or is still open at the end (allowed: the run
  is live, or was killed); never admitted twice while open, never a second
  terminal, never a transition for a request the journal never admitted;
- **tokens**: per completed choice (``client.sent``), ``tokens_sent`` ≤ the
  tokens the engine produced for its engine id (decoded from the frames by
  the fold) and ≤ the hub's own count ``tokens_engine``; all three equal
  unless the choice ended on a stop string (``finish_reason "stop"``: the
  servicer cuts the tokens after the match, and the engine runs on until our
  abort reaches it);
- **transitions**: every transition is legal in its machine's table and
  starts from the state the machine was in (the initial state for the first).

Rules: sans-io (records in, a ``Report`` out); the transition tables are
passed in (``tables={"link": LINK_TABLE, ...}``) because the journal layer
does not import the machines; checks about a request or link whose
beginning was pruned away are skipped, never guessed; memory is bounded like
the fold's (open requests plus the fold's ``terminal_max`` recent ones).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Protocol

import msgspec

from . import records as r
from .fold import STATE_UNSEEN, TERMINAL_REQUEST_STATES, FoldState, fold
from .records import Record

CHECK_SEQUENCE: Final = "sequence"
CHECK_TERMINALS: Final = "terminals"
CHECK_TOKENS: Final = "tokens"
CHECK_TRANSITIONS: Final = "transitions"
CHECKS: Final = (CHECK_SEQUENCE, CHECK_TERMINALS, CHECK_TOKENS, CHECK_TRANSITIONS)
# The finish reason under which the servicer may send fewer tokens than the
# engine made (a stop string matched inside a frame).
STOP: Final = "stop"


class Table(Protocol):
    """What verify needs of a machine's table (``machines.table.Table``)."""

    initial: str
    steps: Mapping[tuple[str, str], str]


class Violation(msgspec.Struct, frozen=True):
    check: str  # one of CHECKS
    seq: int  # the record that broke it
    message: str


class Report(msgspec.Struct):
    records: int = 0
    first_seq: int = 0
    last_seq: int = 0
    pruned_at_start: int = 0  # seqs 1..first_seq-1 are not in the journal
    holes: list[tuple[int, int]] = []  # (first missing, last missing)
    admitted: int = 0
    ended: int = 0
    open_at_end: list[str] = []
    choices_checked: int = 0
    choices_skipped: int = 0  # beginning pruned, or a hole since admission
    tokens_sent: int = 0
    tokens_engine: int = 0
    link_transitions: int = 0
    request_transitions: int = 0
    frames_undecodable: int = 0
    # ``internal_error`` records: the servicer's own bugs, each already logged
    # and answered INTERNAL. Reported, not a violation: the journal is intact.
    internal_errors: int = 0
    run_stopped: bool = False
    violations: list[Violation] = []

    @property
    def ok(self) -> bool:
        return not self.violations

    def violations_of(self, check: str) -> list[Violation]:
        return [v for v in self.violations if v.check == check]


class _Admission:
    """One admission of a request id, as verify follows it."""

    __slots__ = ("seq", "terminal_seq", "sent")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.terminal_seq: int | None = None
        self.sent: set[int] = set()


def verify(records: Iterable[Record], *, tables: Mapping[str, Table], state: FoldState | None = None) -> Report:
    """Check ``records`` (oldest first, one journal) and fold them into ``state``."""
    return _Verifier(tables, FoldState() if state is None else state).run(records)


class _Verifier:
    def __init__(self, tables: Mapping[str, Table], state: FoldState) -> None:
        self.tables = tables
        self.st = state
        self.report = Report()
        self.admissions: dict[str, _Admission] = {}
        self.last_hole_seq = 0  # seq of the first record after the newest hole

    def run(self, records: Iterable[Record]) -> Report:
        rep = self.report
        for rec in records:
            self._sequence(rec)
            match rec.kind:
                case r.KIND_CLIENT_GENERATE:
                    self._generate(rec)
                case r.KIND_TRANSITION:
                    self._transition(rec)
                case r.KIND_CLIENT_SENT:
                    self._sent(rec)
                case r.KIND_RUN_STOP:
                    rep.run_stopped = True
                case r.KIND_INTERNAL_ERROR:
                    rep.internal_errors += 1
            fold((rec,), self.st)
            if len(self.admissions) > 2 * self.st.terminal_max + len(self.st.open_engine_ids) + 1024:
                self._forget_evicted()
        rep.open_at_end = [rid for rid, a in self.admissions.items() if a.terminal_seq is None]
        rep.frames_undecodable = self.st.frames_undecodable
        return rep

    def _fail(self, check: str, rec: Record, message: str) -> None:
        self.report.violations.append(Violation(check, rec.seq, message))

    @property
    def complete(self) -> bool:
        """No record before this one is missing (not pruned at the start, no hole)."""
        return self.report.pruned_at_start == 0 and not self.report.holes

    # -- sequence --------------------------------------------------------------

    def _sequence(self, rec: Record) -> None:
        rep = self.report
        rep.records += 1
        if rep.first_seq == 0:
            rep.first_seq = rep.last_seq = rec.seq
            rep.pruned_at_start = rec.seq - 1
            return
        expected = rep.last_seq + 1
        if rec.seq < expected:
            self._fail(CHECK_SEQUENCE, rec, f"seq {rec.seq} after seq {rep.last_seq} (out of order)")
            return
        if rec.seq > expected:
            rep.holes.append((expected, rec.seq - 1))
            self.last_hole_seq = rec.seq
            self._fail(CHECK_SEQUENCE, rec, f"hole: records {_span(expected, rec.seq - 1)} missing")
        rep.last_seq = rec.seq

    # -- terminals -------------------------------------------------------------

    def _generate(self, rec: Record) -> None:
        rid = rec.payload["request_id"]
        old = self.admissions.get(rid)
        if old is not None and old.terminal_seq is None:
            self._fail(CHECK_TERMINALS, rec, f"request {rid!r} admitted again while open (admitted at seq {old.seq})")
        self.admissions[rid] = _Admission(rec.seq)
        self.report.admitted += 1

    def _transition(self, rec: Record) -> None:
        p = rec.payload
        machine, mid, source, dest, event = p["machine"], p["id"], p["source"], p["dest"], p["event"]
        table = self.tables.get(machine)
        if machine in (r.MACHINE_LINK, r.MACHINE_ROUTER):
            self.report.link_transitions += 1
            view = self.st.links.get(mid)
            current = None if view is None or view.state == STATE_UNSEEN else view.state
        elif machine == r.MACHINE_REQUEST:
            self.report.request_transitions += 1
            current = self._request_state(rec, mid)
        else:
            current = None
        if table is not None:
            if table.steps.get((source, event)) != dest:
                self._fail(CHECK_TRANSITIONS, rec, f"{machine} {mid!r}: {source} -[{event}]-> {dest} is not in the {machine} table")
            if current is None and self.complete and machine != r.MACHINE_REQUEST:
                current = table.initial  # the first transition of a machine the journal saw start
            if current is not None and source != current:
                self._fail(CHECK_TRANSITIONS, rec, f"{machine} {mid!r}: transition from {source!r} but it was in {current!r}")
        if machine == r.MACHINE_REQUEST and dest in TERMINAL_REQUEST_STATES:
            self._terminal(rec, mid, dest)

    def _request_state(self, rec: Record, rid: str) -> str | None:
        admission = self.admissions.get(rid)
        if admission is None:
            if self.complete:
                self._fail(CHECK_TERMINALS, rec, f"transition for request {rid!r}, which this journal never admitted")
            return None
        view = self.st.requests.get(rid)
        if view is None or view.state == STATE_UNSEEN:
            table = self.tables.get(r.MACHINE_REQUEST)
            return None if table is None else table.initial
        return view.state

    def _terminal(self, rec: Record, rid: str, dest: str) -> None:
        admission = self.admissions.get(rid)
        if admission is None:
            return  # reported above, or its admission was pruned away
        if admission.terminal_seq is not None:
            self._fail(CHECK_TERMINALS, rec, f"request {rid!r} ended twice (seq {admission.terminal_seq}, then {dest})")
            return
        admission.terminal_seq = rec.seq
        self.report.ended += 1

    # -- tokens ----------------------------------------------------------------

    def _sent(self, rec: Record) -> None:
        p = rec.payload
        rid, index = p["request_id"], p["index"]
        admission = self.admissions.get(rid)
        view = self.st.requests.get(rid)
        rep = self.report
        if admission is None or view is None:
            if self.complete:
                self._fail(CHECK_TOKENS, rec, f"client.sent for request {rid!r}, which this journal never admitted")
            rep.choices_skipped += 1
            return
        if index in admission.sent:
            self._fail(CHECK_TOKENS, rec, f"request {rid!r} choice {index}: completed twice")
            return
        admission.sent.add(index)
        if index >= len(view.engine_tokens) or self.last_hole_seq > admission.seq:
            rep.choices_skipped += 1
            return
        sent, engine, hub, reason = p["tokens_sent"], view.engine_tokens[index], p.get("tokens_engine"), p["finish_reason"]
        rep.choices_checked += 1
        rep.tokens_sent += sent
        rep.tokens_engine += engine
        where = f"request {rid!r} choice {index} ({view.engine_ids[index]}, finish {reason})"
        if sent > engine:
            self._fail(CHECK_TOKENS, rec, f"{where}: {sent} tokens sent, but the engine produced {engine}")
        if hub is not None:
            if sent > hub:
                self._fail(CHECK_TOKENS, rec, f"{where}: {sent} tokens sent, but the hub received {hub}")
            if hub > engine:
                self._fail(CHECK_TOKENS, rec, f"{where}: the hub counted {hub} tokens, the engine's frames carry {engine}")
            if reason != STOP and (sent != hub or hub != engine):
                self._fail(CHECK_TOKENS, rec, f"{where}: sent {sent}, hub {hub}, engine {engine}: only a stop string may cut")
        elif reason != STOP and sent != engine:
            self._fail(CHECK_TOKENS, rec, f"{where}: sent {sent}, engine {engine}: only a stop string may cut")

    def _forget_evicted(self) -> None:
        """Drop ended admissions the fold has evicted (keeps memory bounded)."""
        requests = self.st.requests
        for rid in [rid for rid, a in self.admissions.items() if a.terminal_seq is not None and rid not in requests]:
            del self.admissions[rid]


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}..{last}"

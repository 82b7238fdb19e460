"""The request machine: one per Generate call (all of its ``n`` choices), writer included.

A call's state is a pair, stepped through ONE table:

- its life (``RequestState``, journaled): ``admitted`` (validated, sent to
  the engine) → ``running`` (the engine's first output) → exactly one end:
  ``finished`` (every choice ended with a finish reason), ``aborted`` (Abort
  RPC, client gone, drain), ``failed`` (the engine died, broke its wire,
  refused the constraint, or could not be reached);
- its writer (``WriterState``, not journaled: it changes per engine frame):
  ``idle`` (the fan-out may write the call's messages itself), ``woken``,
  ``busy`` / ``busy_woken`` (the writer is sending what it took; more came),
  ``backlog`` (the fan-out left messages behind: the writer's first), and
  ``done`` (every complete taken, or the writer left: the id is free).
  ``done`` only follows an ended life.

Life events step the life half and keep the writer half; writer events the
reverse. The table the machine steps (``CALL_TABLE``) is that product,
declared with ``transitions`` from the two lists below and compiled to one
dict lookup per step (``table.py``); an event it does not allow raises
``ProtocolError`` naming the call, its whole state (``life:writer``) and
the event. ``REQUEST_TABLE`` is its journaled half (the life list alone),
what ``verify`` checks transition records against. Sans-io; ``handle``
returns the ``Transition`` for the journal.
"""

from __future__ import annotations

from enum import StrEnum

from enginelink.journal.records import MACHINE_REQUEST, Transition
# The state names are the journal's vocabulary (the fold reads them back); the table is here.
from enginelink.journal.states import (
    REQUEST_INITIAL,
    REQUEST_TERMINAL,
    WRITER_INITIAL,
    RequestState,
    WriterState,
)
from enginelink.machines.table import ProtocolError, build_table


class RequestEvent(StrEnum):
    """Life events: journaled as transitions."""

    FIRST_OUTPUT = "first_output"
    FINISH = "finish"
    ABORT = "abort"
    FAIL = "fail"


class WriterEvent(StrEnum):
    """Writer events: the fan-out and the call's writer."""

    WAKE = "wake"  # new messages for the writer
    LEFT_BEHIND = "left_behind"  # the fan-out wrote some, the rest is the writer's backlog
    TAKE = "take"  # the writer takes what there is
    WRITTEN = "written"  # the writer wrote all it took
    ALL_TAKEN = "all_taken"  # every complete was taken (or the failure handed over): the id is free
    RELEASE = "release"  # the writer left (done, failed, cancelled)


_OPEN = (RequestState.ADMITTED, RequestState.RUNNING)
_LIFE = [
    (RequestEvent.FIRST_OUTPUT, [RequestState.ADMITTED], RequestState.RUNNING),
    # A request can finish on its first output (max_tokens=1, EOS at once),
    # but the core always steps first_output first, so finish needs running.
    (RequestEvent.FINISH, [RequestState.RUNNING], RequestState.FINISHED),
    (RequestEvent.ABORT, list(_OPEN), RequestState.ABORTED),
    (RequestEvent.FAIL, list(_OPEN), RequestState.FAILED),
]
W = WriterState
_WRITER = [
    (WriterEvent.WAKE, [W.IDLE, W.WOKEN], W.WOKEN),
    (WriterEvent.WAKE, [W.BUSY, W.BUSY_WOKEN], W.BUSY_WOKEN),
    (WriterEvent.WAKE, [W.BACKLOG], W.BACKLOG),
    (WriterEvent.WAKE, [W.DONE], W.DONE),  # the writer is woken to return
    (WriterEvent.LEFT_BEHIND, [W.IDLE], W.BACKLOG),
    (WriterEvent.LEFT_BEHIND, [W.DONE], W.DONE),  # the last messages of a call whose id is already free
    (WriterEvent.TAKE, [W.IDLE, W.WOKEN, W.BACKLOG], W.BUSY),
    (WriterEvent.TAKE, [W.DONE], W.DONE),  # a done call's writer takes its backlog, or nothing
    (WriterEvent.WRITTEN, [W.BUSY], W.IDLE),
    (WriterEvent.WRITTEN, [W.BUSY_WOKEN], W.WOKEN),
    (WriterEvent.WRITTEN, [W.DONE], W.DONE),
    (WriterEvent.ALL_TAKEN, [W.IDLE, W.WOKEN, W.BUSY, W.BUSY_WOKEN, W.BACKLOG], W.DONE),
    (WriterEvent.RELEASE, list(W), W.DONE),
]
# ``done`` frees the id: only a call whose life ended may be there.
_WRITER_DONE_NEEDS_END = frozenset({WriterEvent.ALL_TAKEN, WriterEvent.RELEASE})


def state_name(life: RequestState, writer: WriterState) -> str:
    return f"{life.value}:{writer.value}"


def _declare():
    pairs = [(life, writer) for life in RequestState for writer in WriterState
             if not (life in _OPEN and writer is W.DONE)]
    transitions = []
    for event, sources, dest in _LIFE:
        for writer in WriterState:
            for life in sources:
                if (life, writer) in pairs and (dest, writer) in pairs:
                    transitions.append((event, state_name(life, writer), state_name(dest, writer)))
    for event, sources, dest in _WRITER:
        for life in RequestState:
            if event in _WRITER_DONE_NEEDS_END and life in _OPEN:
                continue
            for writer in sources:
                if (life, writer) in pairs and (life, dest) in pairs:
                    transitions.append((event, state_name(life, writer), state_name(life, dest)))
    table = build_table(
        "call",
        states=[state_name(*pair) for pair in pairs],
        transitions=transitions,
        initial=state_name(REQUEST_INITIAL, WRITER_INITIAL),
        # None: a done call's writer may still be woken, take its backlog and report it written
        # (self-loops), which a terminal state may not have. ``done`` after an ended life is the end.
        terminal=set(),
    )
    return table, {state_name(*pair): pair for pair in pairs}


CALL_TABLE, _SPLIT = _declare()
# The journaled half: the life transitions alone (the fold and ``verify`` read these).
REQUEST_TABLE = build_table(
    MACHINE_REQUEST,
    states=[s.value for s in RequestState],
    transitions=[(event, list(sources), dest) for event, sources, dest in _LIFE],
    initial=REQUEST_INITIAL,
    terminal=REQUEST_TERMINAL,
)
TERMINAL_STATES = frozenset(REQUEST_TERMINAL)


class RequestMachine:
    """One call's state: ``state`` (its life, journaled) and ``writer``; one table for both."""

    __slots__ = ("request_id", "state", "writer", "key", "since")

    def __init__(self, request_id: str, now: float) -> None:
        self.request_id = request_id
        self.state = REQUEST_INITIAL
        self.writer = WRITER_INITIAL
        self.key = state_name(self.state, self.writer)
        self.since = now

    def _step(self, event: str) -> None:
        dest = CALL_TABLE.steps.get((self.key, event))
        if dest is None:
            # The life half names the machine's journaled state; the key the whole of it.
            raise ProtocolError(MACHINE_REQUEST, self.request_id, self.key, str(event))
        self.key = dest
        self.state, self.writer = _SPLIT[dest]

    def handle(self, event: RequestEvent, now: float) -> Transition:
        """A life event; the transition to journal."""
        source = self.state
        self._step(event)
        self.since = now
        return Transition(MACHINE_REQUEST, self.request_id, source.value, self.state.value, event.value)

    def writer_step(self, event: WriterEvent) -> None:
        """A writer event: not journaled."""
        self._step(event)

    @property
    def open(self) -> bool:
        return self.state not in TERMINAL_STATES


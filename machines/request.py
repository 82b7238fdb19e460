"""The request machine: one per Generate call (all of its ``n`` choices).

States: ``admitted`` (validated, sent to the engine) → ``running`` (the
engine produced its first token) → exactly one terminal: ``finished`` (every
choice ended with a finish reason), ``aborted`` (Abort RPC, client gone, or
drain), ``failed`` (the engine died or broke its wire, or our bug).

Sans-io and tiny on purpose: it is stepped on the request path, so it is a
dict lookup (see ``table.py``), and it returns the ``Transition`` for the
shell to journal.
"""

from __future__ import annotations

from enum import StrEnum

from enginelink.journal.records import MACHINE_REQUEST, Transition
# The state names are the journal's vocabulary (the fold reads them back); the table is here.
from enginelink.journal.states import REQUEST_INITIAL, REQUEST_TERMINAL, RequestState
from enginelink.machines.table import build_table


class RequestEvent(StrEnum):
    FIRST_OUTPUT = "first_output"
    FINISH = "finish"
    ABORT = "abort"
    FAIL = "fail"


_OPEN = [RequestState.ADMITTED, RequestState.RUNNING]

REQUEST_TABLE = build_table(
    MACHINE_REQUEST,
    states=[s.value for s in RequestState],
    transitions=[
        (RequestEvent.FIRST_OUTPUT, RequestState.ADMITTED, RequestState.RUNNING),
        # A request can finish on its first output (max_tokens=1, EOS at once),
        # but the shell always steps first_output first, so finish needs running.
        (RequestEvent.FINISH, RequestState.RUNNING, RequestState.FINISHED),
        (RequestEvent.ABORT, list(_OPEN), RequestState.ABORTED),
        (RequestEvent.FAIL, list(_OPEN), RequestState.FAILED),
    ],
    initial=REQUEST_INITIAL,
    terminal=REQUEST_TERMINAL,
)

TERMINAL_STATES = frozenset(RequestState(s) for s in REQUEST_TABLE.terminal)


class RequestMachine:
    __slots__ = ("request_id", "state", "since")

    def __init__(self, request_id: str, now: float) -> None:
        self.request_id = request_id
        self.state = RequestState.ADMITTED
        self.since = now

    def handle(self, event: RequestEvent, now: float) -> Transition:
        dest = RequestState(REQUEST_TABLE.next_state(self.request_id, self.state, event))
        transition = Transition(MACHINE_REQUEST, self.request_id, self.state.value, dest.value, event.value)
        self.state = dest
        self.since = now
        return transition

    @property
    def open(self) -> bool:
        return self.state not in TERMINAL_STATES

"""The engine-link machine: one per engine the servicer drives.

States: ``starting`` (sockets bound, engine launching, handshake under way) →
``warming_up`` (handshake done; only warm-up requests admitted) → ``serving``
→ ``draining`` (SIGTERM: admission closed, in-flight requests finishing) →
``stopped``; ``failed`` from any live state (engine died, went silent, or
broke its wire). Exactly one of ``stopped`` / ``failed`` ends a link.

With engine restarts on (``--engine-restarts N``, docs/resume.md), an engine
that dies while the link serves takes it to ``restarting`` instead (``crash``):
admission closed but for the restart's own warm-up, health NOT_SERVING, the
open streams held; the engine is started again and the link goes back to
``serving`` (``restarted``) once the held requests were re-submitted. A crash
while restarting (the new engine died too) stays ``restarting``, counted
against the same budget; when the budget is spent the link fails as before.

Sans-io: ``handle(event, now)`` returns the transition it made (the shell
journals it); the machine never reads a clock. Admission and health are pure
functions of the state, so the gRPC layer and the journal's fold agree on
what a state means.
"""

from __future__ import annotations

from enum import StrEnum

from enginelink.journal.records import MACHINE_LINK, Transition
# The state names are the journal's vocabulary (the fold reads them back); the table is here.
from enginelink.journal.states import LINK_INITIAL, LINK_TERMINAL, LinkState
from enginelink.machines.table import build_table

WARMUP_REQUEST_PREFIX = "smg-warmup-"
# The engine ids of PD early releases (runtime/requests/hub.py ``release_kv``): added and
# aborted at once, never a client's call, so no client id may take the prefix.
KV_RELEASE_REQUEST_PREFIX = "smg-kv-release-"


class LinkEvent(StrEnum):
    HANDSHAKE_DONE = "handshake_done"
    WARMUP_DONE = "warmup_done"
    DRAIN = "drain"
    DRAINED = "drained"
    FAIL = "fail"
    CRASH = "crash"  # the engine died and will be started again (restarts on, budget left)
    RESTARTED = "restarted"  # the engine is back, the held requests re-submitted


_LIVE = [LinkState.STARTING, LinkState.WARMING_UP, LinkState.SERVING, LinkState.RESTARTING, LinkState.DRAINING]


LINK_TABLE = build_table(
    MACHINE_LINK,
    states=[s.value for s in LinkState],
    transitions=[
        (LinkEvent.HANDSHAKE_DONE, LinkState.STARTING, LinkState.WARMING_UP),
        (LinkEvent.WARMUP_DONE, LinkState.WARMING_UP, LinkState.SERVING),
        (LinkEvent.DRAIN, [LinkState.STARTING, LinkState.WARMING_UP, LinkState.SERVING, LinkState.RESTARTING],
         LinkState.DRAINING),
        (LinkEvent.DRAINED, LinkState.DRAINING, LinkState.STOPPED),
        (LinkEvent.FAIL, list(_LIVE), LinkState.FAILED),
        (LinkEvent.CRASH, [LinkState.SERVING, LinkState.RESTARTING], LinkState.RESTARTING),
        (LinkEvent.RESTARTED, LinkState.RESTARTING, LinkState.SERVING),
    ],
    initial=LINK_INITIAL,
    terminal=LINK_TERMINAL,
)

# What HealthCheck says in each state (the Rust servicer's words where it has them).
_HEALTH_MESSAGES = {
    LinkState.STARTING: "Engine is starting",
    LinkState.WARMING_UP: "Engine is warming up",
    LinkState.SERVING: "Health",
    LinkState.RESTARTING: "Engine is restarting",
    LinkState.DRAINING: "Draining",
    LinkState.STOPPED: "Engine is not alive",
    LinkState.FAILED: "Engine is not alive",
}


class LinkMachine:
    """State of one engine link. ``name`` is stable for the run (e.g. ``vllm-0``)."""

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.state = LinkState.STARTING
        self.since = now
        self.failure: str | None = None

    def handle(self, event: LinkEvent, now: float, reason: str | None = None) -> Transition:
        dest = LinkState(LINK_TABLE.next_state(self.name, self.state, event))
        transition = Transition(MACHINE_LINK, self.name, self.state.value, dest.value, event.value)
        self.state = dest
        self.since = now
        if dest is LinkState.FAILED:
            self.failure = reason
        return transition

    def can(self, event: LinkEvent) -> bool:
        return LINK_TABLE.allows(self.state, event)

    @property
    def live(self) -> bool:
        return self.state not in LINK_TABLE.terminal

    def admission_refusal(self, request_id: str) -> str | None:
        """None if a request with this id may be admitted now, else why not."""
        return admission_refusal(self.state, request_id)

    @property
    def healthy(self) -> bool:
        return self.state in (LinkState.SERVING, LinkState.WARMING_UP)

    @property
    def health_message(self) -> str:
        return _HEALTH_MESSAGES[self.state]

    @property
    def ready(self) -> bool:
        """Readiness (grpc.health.v1): SERVING only once warm-up ran."""
        return self.state is LinkState.SERVING


def admission_refusal(state: LinkState, request_id: str) -> str | None:
    if state is LinkState.SERVING:
        return None
    if state is LinkState.WARMING_UP:
        if request_id.startswith(WARMUP_REQUEST_PREFIX):
            return None
        return "engine is warming up; retry on another worker or later"
    if state is LinkState.STARTING:
        return "engine is starting; retry on another worker or later"
    if state is LinkState.RESTARTING:
        # The restart's own warm-up is admitted, as at the first start.
        if request_id.startswith(WARMUP_REQUEST_PREFIX):
            return None
        return "engine is restarting after a crash; retry on another worker or later"
    if state is LinkState.DRAINING:
        return "servicer is draining; retry on another worker"
    return "engine is not alive; retry on another worker"

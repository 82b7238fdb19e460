"""The state names of the link, router-link and request machines: one definition for both layers.

A transition record carries a machine's state names (``source``, ``dest``),
and the fold, ``verify`` and ``inspect`` read them back. The machines
(``machines/link.py``, ``machines/request.py``) build their transition tables
from these enums; the journal sits below the machines and cannot import them,
so the vocabulary lives here and both sides import it. Nothing else: the
events and the transitions themselves stay in the machines' tables.

Rules: a state is never renamed (journals on disk hold the names); a new one
is added here and then to its machine's table.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class LinkState(StrEnum):
    STARTING = "starting"
    WARMING_UP = "warming_up"
    SERVING = "serving"
    # The engine died and is being started again, its open streams held (docs/resume.md).
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


LINK_INITIAL: Final = LinkState.STARTING
LINK_TERMINAL: Final = frozenset({LinkState.STOPPED, LinkState.FAILED})


class RouterLinkState(StrEnum):
    """The router link of ``enginelink headless`` (the router's direct ZMQ lane; machines/router_link.py)."""

    WAITING = "waiting"  # the engine is not serving yet: the router has not been dialled
    DIALING = "dialing"  # HELLO sent; the router's INIT awaited
    REGISTERED = "registered"  # READY and the ready response sent: the router sends requests
    CLOSED = "closed"
    FAILED = "failed"


ROUTER_LINK_INITIAL: Final = RouterLinkState.WAITING
ROUTER_LINK_TERMINAL: Final = frozenset({RouterLinkState.CLOSED, RouterLinkState.FAILED})


class RequestState(StrEnum):
    ADMITTED = "admitted"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


REQUEST_INITIAL: Final = RequestState.ADMITTED
REQUEST_TERMINAL: Final = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})


class WriterState(StrEnum):
    """Where a call's writer (the client side of a call) stands; the second half of a request's state.

    A call's full state is ``(RequestState, WriterState)``, one table
    (``machines/request.py``). Only the ``RequestState`` half is journaled
    (one record per transition, as before): the writer half changes per
    engine frame and would cost a record per token.
    """

    IDLE = "idle"  # nothing for the writer; the fan-out may write the call's messages itself
    WOKEN = "woken"  # the writer was woken and has not taken yet
    BUSY = "busy"  # the writer holds messages it has not written yet
    BUSY_WOKEN = "busy_woken"  # ... and more arrived meanwhile: it takes again after
    BACKLOG = "backlog"  # the fan-out left messages it could not write: the writer's first
    DONE = "done"  # every complete taken (or the failure handed over), or the writer left: the id is free


WRITER_INITIAL: Final = WriterState.IDLE

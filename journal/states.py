"""The state names of the link and request machines: one definition for both layers.

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
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


LINK_INITIAL: Final = LinkState.STARTING
LINK_TERMINAL: Final = frozenset({LinkState.STOPPED, LinkState.FAILED})


class RequestState(StrEnum):
    ADMITTED = "admitted"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


REQUEST_INITIAL: Final = RequestState.ADMITTED
REQUEST_TERMINAL: Final = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})

"""Readiness (grpc.health.v1 SERVING / NOT_SERVING), derived, never set by hand.

What health answers is a function of two things: the engine link's state
(``machines/link.py``: starting, warming_up, serving, draining, stopped,
failed) and whether the servicer's lifetime is closing (its ``finally``: the
link may still say ``serving`` while the server stops). ``serving`` is that
function, the one place the mapping lives. ``Readiness`` follows the link
(``EngineLink.on_transition``, wired by ``runtime/lifetime/compose.py``) and publishes
each change to its sink: grpclib's ``ServiceStatus`` in the server (its
``Watch`` streams the changes), nothing in the simulation, which reads
``value``.

Rules: only ``follow`` (a transition) and ``close`` (the lifetime ends)
change it; once closed it stays NOT_SERVING.
"""

from __future__ import annotations

from typing import Protocol

from enginelink.machines.link import LinkState


class StatusSink(Protocol):
    """grpclib's ``ServiceStatus``, as far as readiness uses it."""

    def set(self, value: bool) -> None: ...


def serving(state: LinkState, closing: bool = False) -> bool:
    """SERVING only while the link serves (warm-up done, not draining) and the servicer is not closing."""
    return state is LinkState.SERVING and not closing


class Readiness:
    def __init__(self, state: LinkState, sink: StatusSink | None = None) -> None:
        self.sink = sink
        self.state = state
        self.closing = False
        self.value: bool | None = None
        self._publish()

    def follow(self, state: LinkState) -> None:
        """The link made a transition: health follows its new state."""
        self.state = state
        self._publish()

    def close(self) -> None:
        """The servicer's lifetime is ending: NOT_SERVING from now on, whatever the link says."""
        self.closing = True
        self._publish()

    def _publish(self) -> None:
        value = serving(self.state, self.closing)
        if value != self.value:
            self.value = value
            if self.sink is not None:
                self.sink.set(value)

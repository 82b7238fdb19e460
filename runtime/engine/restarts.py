"""The link's part in an engine restart: a death while serving becomes a crash, and the next start a fresh one.

Methods of ``EngineLink`` (``engine_link.py`` binds them), kept here beside
the supervision that notices a death (``supervision.py``), so the link's
file holds the link and this one what follows a death when restarts are on.
Their ``link`` is that ``EngineLink``, unannotated: the link imports this
module, and an import back, even for a type, would make the two a circle.

Theory of operation (docs/resume.md). Given a restart budget
(``link.restart_budget``, set by the composition when restarts are on), a
link whose engine dies while it serves does not fail:

- ``crash_or_fail``: the link's ``fail`` asks it first; with budget left
  (``machines/resume.py``) the death is a crash (``crash``), else the
  failure goes on, its message saying why the budget refused;
- ``crash``: journals the crash, steps ``crash`` (``restarting``), tells
  ``on_crash`` (the hub holds the open calls) and ends this ``run``, which
  stops what is left of the engine (at once: ``link_process.stop_engine``);
- ``new_start``: the composition calls ``run`` again, each call one start of
  the engine with the same arguments; this clears the last start's state
  (handshake, process, relay, scopes, times heard) and journals the restart,
  while the link's machine, ranks and counters stay its own.

A failure while restarting is a crash too, against the same budget; once it
is spent the link fails as it always did. Time only from trio.
"""

from __future__ import annotations

import logging

import trio

from enginelink.journal.records import KIND_ENGINE_RESTART, KIND_ERROR, link_stream
from enginelink.machines.link import LinkEvent

log = logging.getLogger("enginelink.link")


def crash_or_fail(link, message: str, now: float) -> str | None:
    """None when the death became a crash (restarts on, budget left), or is one already; else the message to
    fail the link with.

    One death is seen by several of the start's watchers (the output connection closing, the launcher's
    exit, silence), in either order, within the same instant; the first makes it a crash, and the others
    are the same crash, not further ones: counted again, they spent a second restart on one death (CI:
    ``--engine-restarts 1`` failed the held streams with "2 crashes within 600 s" after one SIGKILL).
    A death of the restart's own start is a new crash: that start has its own number."""
    if link.crashed_start == link.starts:
        return None
    budget = link.restart_budget
    if budget is not None and link.machine.can(LinkEvent.CRASH) and not link.stopping:
        why_not = budget.crashed(now)
        if why_not is None:
            crash(link, message, now)
            return None
        message = f"{message}; {why_not}"
    return message


def crash(link, message: str, now: float) -> None:
    """The engine died and will be started again: journal it, hold the calls, end this start."""
    link.last_crash = message
    link.crashed_start = link.starts
    link.journal.append(now, link_stream(link.name), KIND_ERROR,
                        {"whose": "engine", "code": "UNAVAILABLE", "message": message, "restarting": True})
    log.warning("engine died: %s; restarting it (%d of ENGINELINK_ENGINE_RESTARTS=%d in the window)",
                message, len(link.restart_budget.crashes), link.restart_budget.policy.restarts_max)
    link.step(LinkEvent.CRASH, message)
    link.on_crash(message, trio.current_time())  # the calls are held after the link restarts, as journaled
    if link._nursery is not None:
        # Nothing this engine sends matters any more, its start-up included: stop what is
        # left of it (run's finally), and the composition starts it again.
        link._nursery.cancel_scope.cancel()


def new_start(link) -> None:
    """Another start of the engine (a restart): the last one's per-start state goes, the link's stays."""
    now = trio.current_time()
    budget = link.restart_budget
    link.journal.append(now, link_stream(link.name), KIND_ENGINE_RESTART, {
        "link": link.name, "attempt": link.starts, "crash": link.last_crash,
        "restarts_max": budget.policy.restarts_max if budget else 0,
        "window_s": budget.policy.window_s if budget else 0.0})
    log.warning("starting the engine again (restart %d): it died: %s", link.starts, link.last_crash)
    # ``ready`` and ``rank_ready`` stay until the new handshake replaces them (GetServerInfo meanwhile).
    link._handshake_result = None
    link.handshake_done = False
    link.process = None
    link._relay = None
    link._stop_done = None
    link._startup_scope = None
    link._nursery = None
    link.facts_path = None
    link.progress_at = link.last_frame_at = now
    link.rank_heard_at = {}
    link.supervisor.new_start()

"""The engine's process as a link runs it: started in a process group of its own, watched, stopped within a bound.

Methods of ``EngineLink`` (``engine_link.py`` binds them), kept here beside
the supervision that watches the process (``supervision.py``), so the link's
file holds the link and this one the process's life. A transport's ``start``
calls ``launch`` (or, in the simulation, ``adopt`` with its stand-in); the
link's ``run`` places the front end once the engine is up and, as it ends,
stops the engine while its output is still relayed. Their ``link`` is that
``EngineLink``, unannotated: the link imports this module, and an import
back, even for a type, would make the two a circle.

- ``launch``: the engine's argv and environment, its secrets hidden wherever
  they appear (the journal's launch record, its relayed output), both of its
  streams on one pipe relayed to our log (``engine_output.py``), its priority
  lowered and the servicer's scheduling set (``placement.py``), then the
  supervision's process watch and start-up bound;
- ``stop_engine``: once, shielded (later callers wait for that one stop),
  through the transport's ``stop_process`` with the stop grace, or at once
  after a crash with a restart to follow (``restarts.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess

import trio

from enginelink.machines.link import LinkState
from enginelink.runtime.engine.engine_output import RELAY_DRAIN_S, EngineOutputRelay, Redactor
from enginelink.runtime.engine.launchers import launch_secrets
from enginelink.runtime.engine.placement import (
    describe_placement,
    describe_priority,
    lower_priority,
    place_front_end as place_threads,
    run_threads_as_batch,
)

log = logging.getLogger("enginelink.link")


async def launch(link, nursery: trio.Nursery, argv: list[str], env: dict[str, str], details: dict,
                 pass_fds: tuple[int, ...] = ()) -> None:
    """Start the engine's process in a process group of its own (a transport's ``start`` calls this):
    journal the launch (secrets hidden), relay its output, lower its priority, supervise it.

    Its own process group inside the servicer's session, not a session of its own: a terminal's ^C
    reaches the servicer alone (which drains, then stops the engine), and under the kernel's
    autogroups the servicer and its engine are one scheduling group (``engine_processes``). Its
    stdin is /dev/null: a background group that read the terminal would be stopped by it."""
    engine_env = {**os.environ, **env}
    # Secrets of the launch (argv's and the environment's), hidden wherever they appear.
    link.redactor = redactor = Redactor(launch_secrets(argv, engine_env))
    shown_argv = [redactor.line(arg) for arg in link.launcher.redacted(argv)]
    link.journal_handshake("launch", {"argv": shown_argv, **details})
    for warning in getattr(link.launcher, "warnings", ()):
        log.warning("%s", warning)
    # Both of the engine's streams on one pipe, relayed with its secrets hidden.
    link.process = await trio.lowlevel.open_process(
        argv, env=engine_env, process_group=0, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, pass_fds=pass_fds,
    )
    link._relay = EngineOutputRelay(link.process.stdout, redactor)
    nursery.start_soon(link._relay.pump)
    priority = lower_priority(link.process.pid, link.engine_nice)
    if link.servicer_sched == "batch":
        priority["servicer"] = run_threads_as_batch()
    link.journal_handshake("priority", priority)
    log.info("engine process %d started, %s", link.process.pid, describe_priority(priority))
    link.supervisor.process_started(nursery)


def adopt(link, nursery: trio.Nursery, process) -> None:
    """The engine runs as ``process`` (the simulation's stand-in: pid, returncode, wait): supervise it."""
    link.process = process
    link.progress_at = trio.current_time()
    link.supervisor.process_started(nursery)


def place_front_end(link) -> None:
    if link.placement == "auto" and isinstance(link.process, trio.Process):
        # After the handshake: vLLM binds its compute threads while it loads.
        placement = place_threads(link.process.pid)
        link.journal_handshake("placement", placement)
        log.info("placement: %s", describe_placement(placement))


async def stop_engine_relaying(link) -> None:
    """Stop the engine while its last words are still relayed (it must never block on the pipe)."""
    relay = link._relay
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            if relay is not None and not relay.done:
                nursery.start_soon(relay.pump)
            await link.stop_engine()
            nursery.cancel_scope.deadline = trio.current_time() + RELAY_DRAIN_S
        if relay is not None and not relay.done:  # a stray still holds the pipe: stop reading it
            await relay.stream.aclose()


async def stop_engine(link) -> None:
    """Stop the engine once (the transport's ``stop_process``), shielded; later callers wait for that one stop."""
    process = link.process
    if process is None:
        return
    if link._stop_done is not None:
        with trio.CancelScope(shield=True):
            await link._stop_done.wait()
        return
    link._stop_done = trio.Event()
    # After a crash with a restart to follow, what is left of the dead engine (a DP launcher outlives
    # its EngineCore) has nothing to finish: it goes at once, so the restart does not wait the grace.
    grace_s = 0.0 if link.machine.state is LinkState.RESTARTING else link.supervision.stop_grace_s
    with trio.CancelScope(shield=True):
        try:
            await link.transport.stop_process(process, grace_s)
        finally:
            link._stop_done.set()

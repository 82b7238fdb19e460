"""The engine's process session: who is in it, and stopping all of it, bounded.

An engine runs in its own session (``start_new_session``): vLLM's launcher
spawns EngineCore, which spawns a Worker, and none of them may outlive the
servicer. A session is found in ``/proc`` (a process that left its group is
still in its session) and signalled as a group and member by member.

Rules: no trio here but the waits; Linux ``/proc``, with a pid-only fallback.
"""

from __future__ import annotations

import logging
import os
import signal

import trio

from enginelink.runtime.engine.socket_files import pid_alive

log = logging.getLogger("enginelink.link")


def session_members(session: int) -> list[int]:
    """Pids of the live (non-zombie) processes in ``session`` (Linux /proc)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [session] if pid_alive(session) else []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parens.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] != b"Z" and int(fields[3]) == session:
            members.append(int(entry))
    return members


# How often a stop looks in /proc for what is left of the engine's session.
SESSION_POLL_S = 0.05
# After SIGTERM, how long the engine's session gets to exit before SIGKILL
# (ENGINELINK_ENGINE_STOP_GRACE_SECS; vLLM's own process manager gives its
# engine cores 5 s too). The vLLM launch script reads the same knob.
ENGINE_STOP_GRACE_S = 5.0
# After SIGKILL, how long we wait for the session to be gone. SIGKILL cannot be
# refused: only a process stuck in the kernel (uninterruptible I/O) outlasts it.
ENGINE_KILL_WAIT_S = 5.0


def session_alive(process: trio.Process, session: int) -> bool:
    return process.poll() is None or bool(session_members(session))


def signal_session(session: int, sig: int) -> None:
    """Signal every process of the session: its group, and strays that left the group."""
    try:
        os.killpg(session, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(session):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def ask_session_to_stop(process: trio.Process, session: int) -> None:
    """SIGTERM the engine the way its own launcher expects, and wake it if it was stopped.

    The launcher (the session's leader) alone gets SIGTERM, as ``kill`` on a
    ``vllm serve --headless`` does: vLLM's process manager then SIGTERMs each
    EngineCore, which aborts its requests and shuts its executor's workers
    down, and kills (with their children) those that do not exit in time:
    the engine stops top down, in the order vLLM tears itself down. With the
    launcher gone already (the engine died), whatever is left of the session
    gets the SIGTERM itself. Then SIGCONT to the whole session: a stopped
    process (SIGSTOP, a debugger) acts on SIGTERM only once it runs again.
    """
    if process.poll() is None:
        try:
            os.kill(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    else:
        signal_session(session, signal.SIGTERM)
    signal_session(session, signal.SIGCONT)


async def wait_session_stopped(process: trio.Process, session: int) -> None:
    """Wait until no process of the session is left (``ask_session_to_stop`` first; the caller bounds it).

    Once the launcher has exited, whatever it left behind (a child it did not
    stop, an orphan) gets SIGTERM and SIGCONT itself, once: it need not wait
    for the grace to run out.
    """
    told_the_rest = process.poll() is not None  # ask_session_to_stop told them already
    while session_alive(process, session):
        if not told_the_rest and process.poll() is not None:
            signal_session(session, signal.SIGTERM)
            signal_session(session, signal.SIGCONT)
            told_the_rest = True
        await trio.sleep(SESSION_POLL_S)


async def kill_session(process: trio.Process, session: int) -> None:
    """SIGKILL every process of the session until none is left; the caller bounds it.

    Signalled again on every pass: a process forked between two sweeps, or one
    that left the process group, gets it too.
    """
    while session_alive(process, session):
        signal_session(session, signal.SIGKILL)
        await trio.sleep(SESSION_POLL_S)


def describe_members(session: int) -> str:
    """``pid (name)`` of each live process of the session, for the log."""
    names = []
    for pid in session_members(session):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                names.append(f"{pid} ({fh.read().strip()})")
        except OSError:
            names.append(str(pid))
    return ", ".join(names) or "none"


async def stop_session(process: trio.Process, grace_s: float) -> None:
    """Stop the engine's whole session: SIGTERM as its launcher expects, SIGKILL after ``grace_s``.

    Returns only when no process of the session is left, or, for one stuck in
    the kernel, ``ENGINE_KILL_WAIT_S`` after SIGKILL (named in an ERROR line):
    at most ``grace_s`` + ``ENGINE_KILL_WAIT_S``. A vLLM engine that stops as
    it should is gone in well under a second (0.4 s on CPU). The launcher is
    reaped on the way (``session_alive`` polls it).
    """
    session = process.pid
    started = trio.current_time()
    if session_alive(process, session):
        ask_session_to_stop(process, session)
        with trio.move_on_after(grace_s):
            await wait_session_stopped(process, session)
    if session_alive(process, session):
        log.warning("engine session %d still has %s %g s after SIGTERM "
                    "(ENGINELINK_ENGINE_STOP_GRACE_SECS): SIGKILL", session, describe_members(session), grace_s)
        with trio.move_on_after(ENGINE_KILL_WAIT_S):
            await kill_session(process, session)
    if session_alive(process, session):
        log.error("engine session %d: %s still there %g s after SIGKILL (stuck in the kernel?)",
                  session, describe_members(session), ENGINE_KILL_WAIT_S)  # fmt: skip
    else:
        log.info("engine session %d stopped in %.1f s", session, trio.current_time() - started)


def session_of(pid: int) -> int | None:
    """The session id of process ``pid`` (Linux /proc); None when it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat_line = fh.read()
        return int(stat_line[stat_line.rindex(b")") + 2 :].split()[3])  # state ppid pgrp session
    except (OSError, ValueError, IndexError):
        return None

"""The engine's processes: who they are, and stopping all of them, bounded.

An engine runs in a process group of its own inside the servicer's session
(``process_group=0``): vLLM's launcher runs EngineCore (itself for one
engine, a spawned process per DP rank), which spawns a Worker, and none of
them may outlive the servicer. Not a session of its own:
with the kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``,
on by default outside cgroups) a session is a scheduling group, and an
engine whose threads busy-poll every core, in a group of its own, made each
of the servicer's wake-ups wait milliseconds for a core
(docs/benchmarks-history.md, "the kernel's autogroups"). In one session the
kernel weighs the servicer's threads against the engine's one by one.

The engine's processes are its group's members and every descendant of one
(a child may leave the group, never its parent). One that leaves the group
and outlives its parent is adopted by the servicer, a child subreaper
(``become_subreaper``), and found as the servicer's child outside the
servicer's own group. Linux ``/proc``; elsewhere, the group alone.

Rules: no trio here but the waits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import trio

from enginelink.runtime.engine.socket_files import pid_alive

log = logging.getLogger("enginelink.link")

# prctl(2): orphans of our descendants are re-parented to us, not to init.
PR_SET_CHILD_SUBREAPER = 36


_subreaper = False  # set once this process adopts its descendants' orphans (``become_subreaper``)


def become_subreaper() -> None:
    """Make this process a child subreaper (Linux), so that the engine's orphans stay ours to find.

    The servicer calls it before it starts its first engine; any other process
    (a test looking at an engine from outside) sees the group and descendants only.
    """
    global _subreaper
    if _subreaper:
        return
    try:
        _subreaper = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        why = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as error:  # no prctl: not Linux
        why = str(error)
    if not _subreaper:
        log.warning("cannot adopt the engine's orphans (prctl PR_SET_CHILD_SUBREAPER: %s): a process of the "
                    "engine that leaves its process group and outlives its parent will not be stopped with it; "
                    "stop it by hand if one is left", why)


def _stat(pid: int | str) -> tuple[bytes, int, int] | None:
    """The process's (state, ppid, pgrp) from /proc/PID/stat; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parens.
        fields = stat[stat.rindex(b")") + 2 :].split()
        return fields[0], int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R running, S sleeping, D in the kernel, T stopped, Z zombie)."""
    stat = _stat(pid)
    return stat[0].decode() if stat is not None else None


def _processes() -> dict[int, tuple[bytes, int, int]] | None:
    """Every process's (state, ppid, pgrp) from /proc; None where there is no /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for entry in entries:
        if entry.isdigit() and (stat := _stat(entry)) is not None:
            table[int(entry)] = stat
    return table


def engine_members(group: int) -> list[int]:
    """Pids of the engine's live processes: its group ``group``, their descendants, orphans we adopted.

    Adopted orphans (only in a subreaper) are this process's children outside
    its own process group and outside ``group``; their zombies are reaped here
    (nothing else waits for them).
    """
    table = _processes()
    if table is None:
        return [group] if pid_alive(group) else []
    me, my_group = os.getpid(), os.getpgrp()
    children: dict[int, list[int]] = {}
    found = []
    for pid, (state, ppid, pgrp) in table.items():
        children.setdefault(ppid, []).append(pid)
        if pgrp == group or (_subreaper and ppid == me and pgrp != my_group):
            found.append(pid)
    members: set[int] = set()
    while found:
        pid = found.pop()
        if pid in members or pid == me:
            continue
        members.add(pid)
        found.extend(children.get(pid, ()))
    live = []
    for pid in sorted(members):
        state, ppid, _ = table[pid]
        if state != b"Z":
            live.append(pid)
        elif _subreaper and ppid == me and pid != group:
            _reap(pid)  # an adopted orphan's zombie (the launcher, ``group``, is trio's to reap)
    return live


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (its parents read from /proc).

    A process cannot choose its parent, so this, not the process group (which a
    process of the same session may join), says who belongs to the engine.
    """
    for _ in range(64):  # a chain of parents, bounded
        if pid == ancestor:
            return True
        stat = _stat(pid) if pid > 1 else None
        if stat is None:
            return False
        pid = stat[1]
    return False


# How often a stop looks in /proc for what is left of the engine.
MEMBERS_POLL_S = 0.05
# After SIGTERM, how long the engine's processes get to exit before SIGKILL
# (ENGINELINK_ENGINE_STOP_GRACE_SECS; vLLM's own process manager gives its
# engine cores 5 s too). The vLLM launch script reads the same knob.
ENGINE_STOP_GRACE_S = 5.0
# After SIGKILL, how long we wait for the engine to be gone. SIGKILL cannot be
# refused: only a process stuck in the kernel (uninterruptible I/O) outlasts it.
ENGINE_KILL_WAIT_S = 5.0


def engine_alive(process: trio.Process, group: int) -> bool:
    return process.poll() is None or bool(engine_members(group))


def signal_engine(group: int, sig: int) -> None:
    """Signal every process of the engine: its group, and those that left the group."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in engine_members(group):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def ask_engine_to_stop(process: trio.Process, group: int) -> None:
    """SIGTERM the engine the way its own launcher expects, and wake it if it was stopped.

    The launcher (the group's leader) alone gets SIGTERM, as ``kill`` on a
    ``vllm serve --headless`` does: vLLM's process manager then SIGTERMs each
    EngineCore (or the launcher's own EngineCore takes the signal itself),
    which aborts its requests and shuts its executor's workers down, and
    kills (with their children) those that do not exit in time:
    the engine stops top down, in the order vLLM tears itself down. With the
    launcher gone already (the engine died), whatever is left of the engine
    gets the SIGTERM itself. Then SIGCONT to all of it: a stopped process
    (SIGSTOP, a debugger) acts on SIGTERM only once it runs again.
    """
    if process.poll() is None:
        try:
            os.kill(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    else:
        signal_engine(group, signal.SIGTERM)
    signal_engine(group, signal.SIGCONT)


async def wait_engine_stopped(process: trio.Process, group: int) -> None:
    """Wait until no process of the engine is left (``ask_engine_to_stop`` first; the caller bounds it).

    Once the launcher has exited, whatever it left behind (a child it did not
    stop, an orphan) gets SIGTERM and SIGCONT itself, once: it need not wait
    for the grace to run out.
    """
    told_the_rest = process.poll() is not None  # ask_engine_to_stop told them already
    while engine_alive(process, group):
        if not told_the_rest and process.poll() is not None:
            signal_engine(group, signal.SIGTERM)
            signal_engine(group, signal.SIGCONT)
            told_the_rest = True
        await trio.sleep(MEMBERS_POLL_S)


async def kill_engine(process: trio.Process, group: int) -> None:
    """SIGKILL every process of the engine until none is left; the caller bounds it.

    Signalled again on every pass: a process forked between two sweeps, or one
    that left the process group, gets it too.
    """
    while engine_alive(process, group):
        signal_engine(group, signal.SIGKILL)
        await trio.sleep(MEMBERS_POLL_S)


def describe_members(group: int) -> str:
    """``pid (name)`` of each live process of the engine, for the log."""
    names = []
    for pid in engine_members(group):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                names.append(f"{pid} ({fh.read().strip()})")
        except OSError:
            names.append(str(pid))
    return ", ".join(names) or "none"


async def stop_engine_processes(process: trio.Process, grace_s: float) -> None:
    """Stop all of the engine: SIGTERM as its launcher expects, SIGKILL after ``grace_s``.

    Returns only when no process of the engine is left, or, for one stuck in
    the kernel, ``ENGINE_KILL_WAIT_S`` after SIGKILL (named in an ERROR line):
    at most ``grace_s`` + ``ENGINE_KILL_WAIT_S``. A vLLM engine that stops as
    it should is gone in well under a second (0.4 s on CPU). The launcher is
    reaped on the way (``engine_alive`` polls it).
    """
    group = process.pid
    started = trio.current_time()
    if engine_alive(process, group):
        ask_engine_to_stop(process, group)
        with trio.move_on_after(grace_s):
            await wait_engine_stopped(process, group)
    if engine_alive(process, group):
        log.warning("engine %d still has %s %g s after SIGTERM "
                    "(ENGINELINK_ENGINE_STOP_GRACE_SECS): SIGKILL", group, describe_members(group), grace_s)
        with trio.move_on_after(ENGINE_KILL_WAIT_S):
            await kill_engine(process, group)
    if engine_alive(process, group):
        log.error("engine %d: %s still there %g s after SIGKILL (stuck in the kernel?)",
                  group, describe_members(group), ENGINE_KILL_WAIT_S)  # fmt: skip
    else:
        log.info("engine %d stopped in %.1f s", group, trio.current_time() - started)

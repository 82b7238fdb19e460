"""The engine's process session and its files on disk, as the link manages them.

An engine runs in its own session (``start_new_session``): vLLM's launcher
spawns EngineCore, which spawns a Worker, and none of them may outlive the
servicer. A session is found in ``/proc`` (a process that left its group is
still in its session) and signalled as a group and member by member.

The engine runs below the servicer's CPU priority (``lower_priority``): see
that function for why.

Its ipc socket files live in a private 0700 directory (``SMG_ZMQ_SOCKET_DIR``
honoured), named ``enginelink-<pid>-<link>-…``. A file left by a servicer
that died is removed at the next start, but only when its pid is gone *and*
nothing accepts a connection on it: probing a live socket would look, to its
owner, like a client coming and going.

Rules: no trio here but the waits; Linux ``/proc``, with a pid-only fallback.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path

import trio

log = logging.getLogger("enginelink.link")

SOCKET_PREFIX = "enginelink-"
# Nice levels between the servicer and its engine (ENGINELINK_ENGINE_NICE). Opt-in, 0 by default: a
# reniced engine yields to every process on the host, not only to its servicer. In undisturbed pairs
# on 2 cores +10 bought nothing measurable, and with other load on the machine the reniced engine lost
# the most (issue 23; docs/benchmarks.md, "Defaults for production").
ENGINE_NICE_DEFAULT = 0
# The servicer's own scheduling policy once its engine runs (ENGINELINK_SERVICER_SCHED). Opt-in
# `batch`, `normal` (SCHED_OTHER) by default, for the same measurements.
SERVICER_SCHED_CHOICES = ("batch", "normal")
SERVICER_SCHED_DEFAULT = "normal"
# Where the servicer and the engine's unbound threads run once the engine is up (ENGINELINK_PLACEMENT).
PLACEMENT_CHOICES = ("auto", "off")
PLACEMENT_DEFAULT = "off"  # opt-in: no throughput change measured on 2 cores (docs/benchmarks.md)
NICE_MAX = 19
# A socket file younger than this is never judged stale (bind → listen race).
STALE_SOCKET_MIN_AGE_S = 2.0


# sockaddr_un holds 107 bytes of path. The longest name enginelink puts in the
# socket directory ("enginelink-<pid>-<engine>-<rank>-kv-replay.sock" and its
# kin) takes at most SOCKET_NAME_MAX of them, so a longer directory is refused
# at start, with the knob to change, not met later as a bind error.
IPC_PATH_MAX = 107
SOCKET_NAME_MAX = 48


class SocketDirError(Exception):
    """The ipc socket directory is not private to us (operator's fault: exit 2)."""


def socket_dir() -> Path:
    """The private directory for ipc sockets (``SMG_ZMQ_SOCKET_DIR`` honoured).

    Why so strict: the engine's handshake, input and output sockets live
    here, and whoever controls the directory can connect to them or put
    their own in their place. So it must be a real directory (a symlink is
    refused, never followed), owned by this uid, with mode 0700. One we
    create is made so; one found otherwise is refused, never repaired: its
    owner, or whoever could write to it, may already have a file there.
    """
    configured = os.environ.get("SMG_ZMQ_SOCKET_DIR")
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"smg-zmq-{os.getuid()}"
    if configured:
        path.parent.mkdir(parents=True, exist_ok=True)
    created = False
    try:
        os.mkdir(path, 0o700)  # never follows a symlink at ``path``: EEXIST
        created = True
    except FileExistsError:
        pass
    except OSError as error:
        raise SocketDirError(_socket_dir_advice(path, f"cannot be created ({error.strerror})")) from None
    info = os.lstat(path)
    if created and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        os.chmod(path, 0o700, follow_symlinks=False)  # the umask may have taken bits off
        info = os.lstat(path)
    problem = socket_dir_problem(info)
    if problem:
        raise SocketDirError(_socket_dir_advice(path, problem))
    room = IPC_PATH_MAX - 1 - SOCKET_NAME_MAX
    if len(os.fsencode(path)) > room:
        raise SocketDirError(
            f"ipc socket directory {path} is {len(os.fsencode(path))} bytes long: an ipc socket path must fit "
            f"{IPC_PATH_MAX} bytes (sockaddr_un), so the directory may be at most {room} bytes. Set "
            "SMG_ZMQ_SOCKET_DIR (or TMPDIR) to a shorter directory")
    return path


def socket_dir_problem(info: os.stat_result) -> str | None:
    """Why a directory with this ``lstat`` may not hold our sockets; None if it may."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    mode = stat.S_IMODE(info.st_mode)
    if mode != 0o700:
        return f"has mode {mode:04o}, not 0700"
    return None


def _socket_dir_advice(path: Path, problem: str) -> str:
    return (
        f"ipc socket directory {path} {problem}: enginelink keeps its engine sockets only in a private "
        f"directory. Remove it (or fix it: owned by uid {os.getuid()}, mode 0700, not a link), or set "
        "SMG_ZMQ_SOCKET_DIR to a directory that is"
    )


def socket_is_live(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # cannot tell (permissions, a busy listener): leave it
        return True


def remove_stale_files(directory: Path, now_wall: float | None = None) -> list[Path]:
    """Remove enginelink's leftovers in ``directory``: socket files of processes
    that are gone and that nothing live is bound to (a connect is refused), and
    facts files of processes that are gone. Returns them."""
    now_wall = time.time() if now_wall is None else now_wall
    removed = []
    for path in sorted(directory.glob(f"{SOCKET_PREFIX}*")):
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if now_wall - info.st_mtime < STALE_SOCKET_MIN_AGE_S:
            continue
        if path.is_socket():
            # Never probe a socket whose owner lives: a probe is a connection
            # its owner sees come and go.
            stale = not pid_alive(_pid_of(path.name)) and not socket_is_live(path)
        elif path.name.endswith("-facts.json"):
            stale = not pid_alive(_pid_of(path.name))
        else:
            continue
        if stale:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _pid_of(name: str) -> int:
    try:
        return int(name[len(SOCKET_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1


def pid_alive(pid: int | None, *, started_after: float | None = None, started_before: float | None = None) -> bool:
    """The process exists and is not a zombie; where ``/proc`` tells its start
    (wall time), it must lie in the bounds given, so a reused pid is not
    taken for the process the journal names (``enginelink inspect``)."""
    if pid is None or pid <= 0:  # kill(0 or -n, 0) would ask about whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except (FileNotFoundError, PermissionError):
        return True  # no /proc: trust kill(0)
    if fields[0] == b"Z":
        return False
    if started_after is None and started_before is None:
        return True
    started = _boot_wall() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    if started_after is not None and started < started_after:
        return False
    return started_before is None or started <= started_before


def _boot_wall() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    return 0.0


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


def autogroup_nice(pid: int | str) -> int | None:
    """The nice value of the process's autogroup, or None where autogroups do not apply.

    None covers a kernel without them (no file) and a task in a cgroup other
    than the root, which containers and CI runners use: there the kernel
    prints nothing, and nice values rank the tasks of the cgroup directly.
    """
    try:
        with open(f"/proc/{pid}/autogroup") as fh:
            return int(fh.read().split()[-1])  # "/autogroup-123 nice 0"
    except (OSError, ValueError, IndexError):
        return None


def lower_priority(session: int, levels: int) -> dict:
    """Run the engine's new session ``levels`` nice steps below this process.

    Why: vLLM's EngineCore and Worker busy-poll (``sched_yield`` loops) while
    a step runs, so with few cores they are always runnable, and the servicer
    (and the router) wait for a core every time they wake. Each hop they lag
    is time the engine runs under-full: on 2 cores the servicer spent 15.8 s
    of a 21 s load waiting to run, and the engine reached half of the tokens/s
    a bare ZMQ driver gets (docs/benchmarks.md). The front end uses little CPU,
    so letting it go first costs the engine almost nothing.

    Two settings, because with the kernel's autogroups (a session is its own
    scheduling group) a task's nice value only ranks it inside its group: the
    launcher's nice value (EngineCore and the Worker inherit it; they start
    seconds later) and its session's autogroup. Call it right after the launch.
    Returns what it set, for the journal; nothing here may fail a launch.

    The engine also gets the normal scheduling policy explicitly: a servicer
    that already runs ``SCHED_BATCH`` (``run_threads_as_batch``; or started
    under ``chrt -b``, or from a process that did) would hand it down, and
    the engine's step must not wait for others to yield.
    """
    applied: dict = {"levels": levels}
    try:
        os.sched_setscheduler(session, os.SCHED_OTHER, os.sched_param(0))
    except OSError as error:
        applied["policy_error"] = str(error)
    if levels <= 0:
        return applied
    try:
        nice = min(NICE_MAX, os.getpriority(os.PRIO_PROCESS, 0) + levels)
        os.setpriority(os.PRIO_PROCESS, session, nice)
        applied["nice"] = nice
    except OSError as error:
        applied["nice_error"] = str(error)
    own_group = autogroup_nice("self")
    if own_group is not None:
        group_nice = min(NICE_MAX, own_group + levels)
        try:
            with open(f"/proc/{session}/autogroup", "w") as fh:
                fh.write(str(group_nice))
            applied["autogroup_nice"] = group_nice
        except OSError as error:
            applied["autogroup_error"] = str(error)
    return applied


def run_threads_as_batch() -> dict:
    """Put every thread of this process in ``SCHED_BATCH``. Returns what it did, for the journal.

    Why: with the engine filling the cores, the servicer wakes at every
    engine step (the step's outputs arrive) and, at normal policy and a
    higher priority than the engine (``lower_priority``), preempts whatever
    engine task holds the core, often EngineCore in the middle of its part
    of the step. A ``SCHED_BATCH`` task does not preempt on wake-up: it runs
    when the engine's busy-poll yields (``sched_yield``), i.e. while the
    engine waits anyway. Measured on 2 cores with a real vLLM engine at
    concurrency 128, side by side: +7% to +11% engine tokens/s
    (docs/benchmarks.md). Where cores are free it changes nothing: a waking
    task on an idle core runs at once.

    Call it after the engine is launched (``lower_priority`` gives the
    engine the normal policy explicitly, whatever this process runs as);
    threads started later inherit it from the thread that starts them.
    Nothing here may fail a start-up: an error is reported, not raised.
    """
    applied: dict = {"policy": "batch", "threads": 0}
    for tid in own_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            applied["threads"] += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as error:
            applied["error"] = str(error)
            break
    return applied


def describe_priority(applied: dict) -> str:
    """What ``lower_priority`` (and ``run_threads_as_batch``, under "servicer") did, in words.

    For the start-up log and ``enginelink inspect``, from the journal's
    ``engine.handshake`` ``priority`` step.
    """
    if applied.get("levels", 0) <= 0:
        text = "at the servicer's priority (ENGINELINK_ENGINE_NICE=0)"
    else:
        parts = [f"nice {applied['nice']}" if "nice" in applied else f"nice unchanged ({applied.get('nice_error')})"]
        if "autogroup_nice" in applied:
            parts.append(f"its session's autogroup nice {applied['autogroup_nice']}")
        elif "autogroup_error" in applied:
            parts.append(f"autogroup unchanged ({applied['autogroup_error']})")
        text = f"{applied['levels']} levels below the servicer: " + ", ".join(parts)
    if "policy_error" in applied:
        text += f"; engine's scheduling policy unchanged ({applied['policy_error']})"
    servicer = applied.get("servicer")
    if servicer is not None:
        if "error" in servicer:
            text += f"; servicer threads not SCHED_BATCH ({servicer['error']})"
        else:
            text += f"; the servicer's {servicer['threads']} threads run SCHED_BATCH, so they wait for the engine to yield"
    return text


def place_front_end(session: int) -> dict:
    """Keep the servicer and the engine's unbound threads off the CPUs the engine binds its compute to.

    Why: vLLM's CPU backend binds its Worker's OpenMP threads one per CPU and
    leaves the rest "for the front end", but nothing else is bound: EngineCore,
    the servicer and the router float. With the engine ``lower_priority``,
    whatever the kernel's balancer moves onto a bound CPU preempts the Worker
    mid-step: on 2 cores (/proc schedstat) the Worker waited for its own core
    up to 18% of a load behind enginelink; placed, 2–6%. But on 2 cores the
    front end then shares the one other core with EngineCore, which waits
    instead, and tokens/s did not change in side-by-side runs. So it is
    opt-in (``ENGINELINK_PLACEMENT=auto``), for machines with cores to spare
    (docs/benchmarks.md).

    Bound CPUs are those of the engine's threads whose affinity is narrower
    than the servicer's (the engine inherited the servicer's at launch). The
    engine's threads that still have the servicer's affinity, and every
    servicer thread, are moved to the others. Nothing changes when the engine
    binds nothing (a GPU engine, the sim engine) or when it binds every CPU.
    Call it once the handshake is done (vLLM binds while it loads); threads
    started later inherit from their creator. Returns what it did, for the
    journal; nothing here may fail a start-up.
    """
    allowed = os.sched_getaffinity(0)
    engine_threads: dict[int, set[int]] = {}
    for pid in session_members(session):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process ended meanwhile
        for name in tids:
            try:
                engine_threads[int(name)] = os.sched_getaffinity(int(name))
            except OSError:
                continue
    bound = set().union(*(cpus for cpus in engine_threads.values() if cpus < allowed))
    applied: dict = {"bound_cpus": sorted(bound), "servicer_cpus": sorted(allowed)}
    front_end = allowed - bound
    if not bound:
        applied["skipped"] = "the engine binds no thread to particular CPUs"
        return applied
    if not front_end:
        applied["skipped"] = "the engine binds every CPU the servicer may use"
        return applied
    applied["front_end_cpus"] = sorted(front_end)
    for key, tids in (("engine", [tid for tid, cpus in engine_threads.items() if cpus == allowed]),
                      ("servicer", own_threads())):
        applied[f"{key}_threads"], error = set_affinity(tids, front_end)
        if error is not None:
            applied[f"{key}_error"] = error
    return applied


def own_threads() -> list[int]:
    """This process's thread ids."""
    return [int(name) for name in os.listdir("/proc/self/task")]


def set_affinity(tids, cpus: set[int]) -> tuple[int, str | None]:
    """Give each thread ``cpus``; returns how many moved and the last error, if any.
    A thread that ended meanwhile is skipped."""
    done, error = 0, None
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except ProcessLookupError:
            continue
        except OSError as exc:
            error = str(exc)
    return done, error


def cpu_list(cpus) -> str:
    """``[0, 1, 2, 5]`` as ``CPUs 0-2,5`` (the kernel's list format), ``[1]`` as ``CPU 1``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    listed = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    return f"CPU {listed}" if len(cpus) == 1 else f"CPUs {listed}"


def describe_placement(applied: dict, front_end: str = "the servicer") -> str:
    """What ``place_front_end`` did, in words (the start-up log and ``enginelink inspect``).

    ``front_end``: who called it (the bench's raw driver places itself as the servicer would).
    """
    if "skipped" in applied:
        return f"unchanged: {applied['skipped']}"
    text = (f"the engine binds {cpu_list(applied['bound_cpus'])}; {front_end}'s {applied['servicer_threads']} "
            f"threads and the engine's {applied['engine_threads']} unbound threads run on "
            f"{cpu_list(applied['front_end_cpus'])}")
    for key, whose in (("engine_error", "the engine's"), ("servicer_error", f"{front_end}'s")):
        if key in applied:
            text += f"; some of {whose} threads did not move ({applied[key]})"
    return text


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

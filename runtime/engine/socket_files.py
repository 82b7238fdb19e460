"""The engine's ipc socket files: the private directory they live in, and the stale ones removed.

Its ipc socket files live in a private 0700 directory (``SMG_ZMQ_SOCKET_DIR``
honoured), named ``enginelink-<pid>-<link>-…``. A file left by a servicer
that died is removed at the next start, but only when its pid is gone *and*
nothing accepts a connection on it: probing a live socket would look, to its
owner, like a client coming and going.

Rules: no trio here; Linux ``/proc``, with a pid-only fallback.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import time
from pathlib import Path

SOCKET_PREFIX = "enginelink-"
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

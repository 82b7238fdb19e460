"""A journal's files: who owns one, the previous runs' files, and where a port's journal is.

Theory of operation: one journal file holds one run (seq restarts at 1), and
belongs to one live process at a time. A servicer takes an exclusive
``flock`` on ``<journal>.lock`` (a small file beside the journal that holds
the owner's pid) before anything touches the journal; only the lock's holder
may set the last run's file aside (``rotate``) and open the path for writing.
A second process that wants the same journal gets ``JournalBusy`` naming the
holder's pid and leaves every file alone. The kernel drops the lock when its
holder exits, however it exits (SIGKILL included), so a lock never outlives
its process and needs no clean-up.

``rotate`` keeps the previous runs as ``<stem>.prev<suffix>`` (the newest),
``<stem>.prev2<suffix>``, … ``<stem>.prev<keep><suffix>`` (the oldest):
a crash loop does not erase the crashed run's journal on its second restart.
The count is ``ENGINELINK_JOURNAL_KEEP`` (``JOURNAL_KEEP_DEFAULT``).

A servicer also writes a run file, ``serve-<port>.json`` in the state
directory, once it holds the lock and its port: it names the journal it
writes (which ``--journal`` may have put anywhere), so ``inspect --port N``
and ``journal … --port N`` find it. It is removed when the servicer exits
(so run files do not pile up, one per port ever used); one that a killed
servicer left names its journal for the post-mortem until the next servicer
on that port replaces it.

Rules:
- the lock file is never unlinked: removing it would let two processes hold
  "the" lock on two different inodes;
- readers (``inspect``, ``journal``) never take the lock; SQLite's WAL lets
  them read a live journal;
- the WAL moves with its database (it may hold a killed writer's last
  batches); the shared-memory index is rebuilt by SQLite, so it is removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Final

import platformdirs

__all__ = [
    "JOURNAL_KEEP_DEFAULT",
    "JOURNAL_KEEP_ENV",
    "JOURNAL_KEEP_MAX",
    "JournalBusy",
    "JournalLock",
    "default_journal_path",
    "journal_keep",
    "previous_path",
    "read_run_file",
    "remove_run_file",
    "rotate",
    "run_file_path",
    "state_dir",
    "write_run_file",
]

# Previous runs' journals kept beside the live one; each is bounded by the
# store's own budgets (STORE_BYTES_MAX), so this bounds the disk they take.
JOURNAL_KEEP_DEFAULT: Final = 5
JOURNAL_KEEP_MAX: Final = 1000
JOURNAL_KEEP_ENV: Final = "ENGINELINK_JOURNAL_KEEP"
_SIDE_FILES: Final = ("-wal", "-shm")


class JournalBusy(Exception):
    """Another live process owns the journal; the message names its pid."""

    def __init__(self, path: Path, pid: int | None) -> None:
        owner = f"process {pid}" if pid else "another process"
        super().__init__(f"journal {path} is in use by {owner} (a servicer already runs with it); "
                         "stop that one first, or give this one another --port or --journal")
        self.path = path
        self.pid = pid


def state_dir() -> Path:
    """enginelink's state directory (``$XDG_STATE_HOME/enginelink`` on Linux)."""
    return Path(platformdirs.user_state_dir("enginelink"))


def default_journal_path(port: int) -> Path:
    """Where the servicer on ``port`` keeps its journal unless told otherwise."""
    return state_dir() / f"journal-{port}.sqlite"


def journal_keep(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """``ENGINELINK_JOURNAL_KEEP``: previous journals kept; ValueError with the reason when bad."""
    value = environ.get(JOURNAL_KEEP_ENV, "").strip()
    if not value:
        return JOURNAL_KEEP_DEFAULT
    try:
        keep = int(value)
    except ValueError:
        raise ValueError(f"{JOURNAL_KEEP_ENV}={value!r}: expected a whole number of previous journals") from None
    if not 0 <= keep <= JOURNAL_KEEP_MAX:
        raise ValueError(f"{JOURNAL_KEEP_ENV}={value!r}: must be 0 to {JOURNAL_KEEP_MAX}")
    return keep


class JournalLock:
    """An exclusive, process-lifetime claim on one journal path (``flock`` on ``<path>.lock``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = Path(f"{self.path}.lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "JournalLock":
        """Take the lock or raise ``JournalBusy``; touches nothing but the lock file."""
        if self._fd is not None:
            return self
        self.lock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds prompts' token ids
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_pid(fd)
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JournalBusy(self.path, holder) from None
            raise
        # Ours now: say who holds it, for the next one who asks.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # the file stays (see the module's rules)

    def __enter__(self) -> "JournalLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None


def previous_path(path: str | os.PathLike[str], n: int = 1) -> Path:
    """The ``n``-th previous run's journal of ``path`` (1: the newest previous)."""
    path = Path(path)
    if n < 1:
        raise ValueError(f"previous journal number {n}: expected 1 or more")
    return path.with_name(f"{path.stem}.prev{'' if n == 1 else n}{path.suffix}")


def _move(src: Path, dst: Path) -> None:
    for suffix in _SIDE_FILES:
        Path(f"{dst}{suffix}").unlink(missing_ok=True)
    os.replace(src, dst)
    wal = Path(f"{src}-wal")
    if wal.exists():
        os.replace(wal, f"{dst}-wal")
    Path(f"{src}-shm").unlink(missing_ok=True)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    for suffix in _SIDE_FILES:
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def rotate(lock: JournalLock, keep: int = JOURNAL_KEEP_DEFAULT) -> Path | None:
    """Set the last run's journal aside as ``.prev``, shifting older ones up to ``keep``.

    Only the lock's holder may call it. Returns where the last run's file
    went (None when there was none, or ``keep`` is 0 and it was removed).
    """
    if not lock.held:
        raise RuntimeError(f"rotating {lock.path} without holding its lock")
    path = lock.path
    if not path.exists():
        return None
    if keep < 1:
        _remove(path)
        return None
    _remove(previous_path(path, keep))
    for n in range(keep - 1, 0, -1):
        older = previous_path(path, n)
        if older.exists():
            _move(older, previous_path(path, n + 1))
    prev = previous_path(path)
    _move(path, prev)
    return prev


# -- the run file: which journal the servicer on a port writes --------------------


def run_file_path(port: int) -> Path:
    return state_dir() / f"serve-{port}.json"


def write_run_file(port: int, journal: Path, *, host: str) -> Path:
    """Record (atomically) that this process serves ``port`` with ``journal``."""
    path = run_file_path(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    body = {"pid": os.getpid(), "host": host, "port": port, "journal": str(Path(journal).resolve())}
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(body) + "\n")
    os.replace(staging, path)
    return path


def remove_run_file(port: int) -> None:
    """Remove this process's run file for ``port`` (not one another process wrote since)."""
    recorded = read_run_file(port)
    if recorded is not None and recorded.get("pid") == os.getpid():
        run_file_path(port).unlink(missing_ok=True)


def read_run_file(port: int) -> dict[str, Any] | None:
    """What the latest servicer on ``port`` recorded; None when nothing (or nothing readable)."""
    try:
        body = json.loads(run_file_path(port).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("journal"), str) else None

"""Whether the journal reaches its file, said where an operator looks: the log, /metrics, ``inspect``.

A journal that cannot write (disk full, I/O error, the file's filesystem
gone read-only) must not stop the servicer: the flusher counts and drops the
batch, and the ring still holds the newest records. But it must not be
silent either. ``StoreHealth`` turns the flusher's per-batch outcome into an
episode:

- the first failed batch: one ERROR line with the cause in words (the disk
  is full, an I/O error, a read-only filesystem: ``describe_error``), the
  SQLite or OS error itself, the free space on the journal's filesystem and
  what is lost (that batch's records, by seq, and every record after them
  until writing recovers);
- while it lasts: one WARNING summary every ``summary_interval_s`` (records
  dropped since the last line, and in all), never a line per batch;
- the first batch written again: one WARNING line saying it recovered, for
  how long it failed and how many records the file lacks (a gap in seq).

``inspect`` reads the journal file, which is exactly what cannot say this
when the disk is full. So the state also goes to a small status file next to
the journal (``<journal>.health``, 0600), allocated in full at start-up and
rewritten in place: an overwrite of blocks a file already has needs no free
space, so it still lands on a full disk. It holds one JSON object padded with
spaces (``HEALTH_FILE_BYTES``). If even that fails the log and /metrics
still say it.

Rules: no trio; the caller passes nothing but outcomes; clock reads only here
(``time.monotonic`` for the summary interval, ``time.time`` for the wall
times an operator reads).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("enginelink.journal")

HEALTH_FILE_BYTES = 4096
HEALTH_SUFFIX = ".health"
# Seconds between "still failing" summaries of one episode.
SUMMARY_INTERVAL_S = 60.0
# The error as the status file keeps it (the file has a fixed size).
ERROR_CHARS_MAX = 512


# The cause, in an operator's words, by SQLite's result code (``sqlite3.Error.sqlite_errorname``, its
# primary code: SQLITE_IOERR_WRITE is an SQLITE_IOERR) or the OS's errno. SQLite's own message for
# SQLITE_FULL, "database or disk is full", is also what a database at its max_page_count says: the
# free space printed beside it tells the two apart.
SQLITE_CAUSES = {
    "SQLITE_FULL": "the disk (or the journal's database) is full",
    "SQLITE_IOERR": "an I/O error on the journal's disk",
    "SQLITE_READONLY": "the journal's file or its filesystem is read-only",
    "SQLITE_CORRUPT": "the journal's file is corrupt",
    "SQLITE_NOTADB": "the journal's file is not a database",
    "SQLITE_BUSY": "another process holds the journal's database",
}
ERRNO_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EIO: "an I/O error on the journal's disk",
    errno.EROFS: "the journal's filesystem is read-only",
}


def describe_error(error: BaseException) -> str:
    """A failed write's error as the log and the status file say it: the cause first, then the error."""
    name = getattr(error, "sqlite_errorname", None)
    code = "_".join(name.split("_")[:2]) if isinstance(name, str) else None
    cause = SQLITE_CAUSES.get(code) if code else ERRNO_CAUSES.get(getattr(error, "errno", None))
    text = f"{type(error).__name__}: {error}" + (f" ({name})" if name else "")
    return f"{cause}: {text}" if cause else text


def free_space(path: Path | None) -> str:
    """The free space on ``path``'s filesystem, for the log line; ``?`` where it cannot be read."""
    try:
        st = os.statvfs(path.parent if path is not None else ".")
    except OSError:
        return "? bytes"
    free = st.f_bavail * st.f_frsize
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"


def health_path(journal_path: str | os.PathLike[str]) -> Path:
    return Path(f"{journal_path}{HEALTH_SUFFIX}")


def read_health(journal_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The status a servicer last wrote next to ``journal_path``; None when there is none."""
    try:
        with open(health_path(journal_path), "rb") as fh:
            data = fh.read(HEALTH_FILE_BYTES)
        value = json.loads(data.decode("utf-8").strip() or "null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class StoreHealth:
    def __init__(self, journal_path: Path | None, summary_interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.journal_path = journal_path
        self.summary_interval_s = summary_interval_s
        self.failing = False
        self.episodes = 0
        self.since_wall: float | None = None
        self.error: str | None = None
        self.dropped_in_episode = 0
        self._since_mono = 0.0
        self._summary_at = 0.0
        self._dropped_at_summary = 0
        self._fd: int | None = None
        if journal_path is not None:
            self._open()
            self._publish()

    # -- outcomes -----------------------------------------------------------------

    def failed(self, error: BaseException, rows: int, seqs: tuple[int, int] | None = None) -> None:
        """A batch of ``rows`` (seq ``seqs[0]..seqs[1]``) did not reach the file."""
        now = time.monotonic()
        text = describe_error(error)[:ERROR_CHARS_MAX]
        if not self.failing:
            self.failing = True
            self.episodes += 1
            self.since_wall = time.time()
            self._since_mono = self._summary_at = now
            self.dropped_in_episode = self._dropped_at_summary = 0
            self.dropped_in_episode += rows
            self.error = text
            batch = f"records seq {seqs[0]}..{seqs[1]} ({rows})" if seqs else f"this batch's {rows} records"
            log.error("journal: cannot write to %s: %s; %s free on its filesystem. The servicer keeps serving, "
                      "but %s and every record after them are dropped from the file until writing recovers "
                      "(a gap in seq; the newest stay in memory for inspection)",
                      self.journal_path, text, free_space(self.journal_path), batch)
            self._publish()
            return
        self.dropped_in_episode += rows
        self.error = text
        self._publish()  # one 4 KiB pwrite per failed flush (at most 20/s): inspect's count stays current
        if now - self._summary_at >= self.summary_interval_s:
            log.warning("journal: still cannot write to %s (%s): %d records dropped in the last %.0f s, "
                        "%d since it began %.0f s ago", self.journal_path, text,
                        self.dropped_in_episode - self._dropped_at_summary, now - self._summary_at,
                        self.dropped_in_episode, now - self._since_mono)
            self._summary_at = now
            self._dropped_at_summary = self.dropped_in_episode

    def written(self) -> None:
        """A batch reached the file."""
        if not self.failing:
            return
        took = time.monotonic() - self._since_mono
        log.warning("journal: writing to %s recovered after %.0f s; %d records were dropped and are "
                    "missing from the file (a gap in seq)", self.journal_path, took, self.dropped_in_episode)
        self.failing = False
        self._publish()

    # -- the status file ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "writing": not self.failing, "since": self.since_wall if self.failing else None,
                "error": self.error, "dropped_in_episode": self.dropped_in_episode, "episodes": self.episodes,
                "updated": time.time()}

    def _open(self) -> None:
        path = health_path(self.journal_path)
        try:
            path.unlink(missing_ok=True)  # a link or a file someone else left: never written through
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as error:
            log.warning("journal: no status file %s (%s): inspect will not see a failing disk", path, error)
            return
        try:
            os.posix_fallocate(fd, 0, HEALTH_FILE_BYTES)
        except OSError:
            try:  # a filesystem without fallocate: write the blocks instead
                os.pwrite(fd, b" " * HEALTH_FILE_BYTES, 0)
            except OSError as error:
                log.warning("journal: cannot allocate status file %s (%s)", path, error)
        self._fd = fd

    def _publish(self) -> None:
        if self._fd is None:
            return
        data = json.dumps(self.state(), separators=(",", ":")).encode()[: HEALTH_FILE_BYTES - 1]
        try:
            os.pwrite(self._fd, data.ljust(HEALTH_FILE_BYTES), 0)
        except OSError:
            pass  # the log and /metrics still say it

    def close(self) -> None:
        if self._fd is not None:
            self._publish()
            os.close(self._fd)
            self._fd = None

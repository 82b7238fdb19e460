"""Reading a file a client named (a ``file:`` media ref, a ``/dev/shm`` tensor handle) without letting it hang us.

A client picks the path, so the path may name anything a local user can
make: a FIFO (any user can ``mkfifo`` in ``/dev/shm``), a symlink, a device,
a directory. Opening a FIFO for reading blocks until a writer comes, in a
worker thread that no timeout can stop, and about forty of them stopped all
media work and the servicer's own SIGTERM (issue 38, item 3). The rules here:

- the path is looked at first without being opened (``lstat``): anything but
  a regular file is refused untouched, so opening it has no side effects;
- it is then opened without following a symlink and without blocking
  (``O_NOFOLLOW | O_NONBLOCK``) and checked again on the descriptor, so a
  file swapped in between the two looks is refused as well;
- what was read carries the file's identity (device, inode), so a caller
  that later removes the file (a consumed shared-memory segment) removes
  the one it read and nothing put in its place.

Raises ``LocalFileRefused`` (the caller's fault, with words to show) or
``OSError`` (cannot be opened or read: the caller decides whose fault).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class LocalFileRefused(Exception):
    """The path names something that is not one regular file (its words say what it is)."""


@dataclass(frozen=True)
class ReadFile:
    data: bytes
    size: int  # the file's size when it was read
    device: int
    inode: int


def _kind(mode: int) -> str:
    for check, words in _KINDS:
        if check(mode):
            return words
    return "not a regular file"


def read_regular(path: str, *, offset: int = 0, nbytes: int | None = None, cap: int | None = None) -> ReadFile:
    """``nbytes`` at ``offset`` of the regular file ``path`` (``nbytes`` None: up to ``cap + 1`` bytes
    from ``offset``, so the caller sees that it is over ``cap``). ``nbytes`` past the file's end is
    refused before anything is read."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise LocalFileRefused(f"is {_kind(mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped between the two looks
            raise LocalFileRefused(f"is {_kind(info.st_mode)}, not a regular file")
        if nbytes is not None:
            if offset + nbytes > info.st_size:
                raise LocalFileRefused(f"holds {info.st_size} bytes, fewer than the {nbytes} claimed at offset {offset}")
            data = os.pread(fd, nbytes, offset)
        else:
            data = os.pread(fd, (cap if cap is not None else info.st_size) + 1, offset)
    finally:
        os.close(fd)
    return ReadFile(data, info.st_size, info.st_dev, info.st_ino)


def remove_if_same(path: str, read: ReadFile) -> bool:
    """Remove ``path`` only while it is still the file that was read (same device and inode); True if removed."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    if (now.st_dev, now.st_ino) != (read.device, read.inode) or not stat.S_ISREG(now.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True

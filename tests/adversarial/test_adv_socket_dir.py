"""Attacks on the ipc socket directory: someone else's, a symlink, too open, not a directory.

The directory holds the engine's handshake, input and output sockets, so
whoever controls it could talk to the engine or stand in for it. enginelink
must refuse (``enginelink serve`` exits 2 with one line saying what to do)
unless it is a real directory owned by this uid with mode 0700, and must
never follow a symlink there. The tests run as root, so a directory "of
another user" is made with ``os.chown``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from enginelink.runtime.engine.socket_files import IPC_PATH_MAX, SOCKET_NAME_MAX, SocketDirError, socket_dir
from tests.harness import VENV_BIN, free_port

OTHER_UID = 54321


def _refused(monkeypatch, path: Path) -> str:
    monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(path))
    with pytest.raises(SocketDirError) as caught:
        socket_dir()
    message = str(caught.value)
    assert str(path) in message and "SMG_ZMQ_SOCKET_DIR" in message
    return message


def test_a_directory_owned_by_another_user_is_refused_not_used(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    message = _refused(monkeypatch, theirs)
    assert f"owned by uid {OTHER_UID}" in message
    assert os.lstat(theirs).st_uid == OTHER_UID  # not taken over either


def test_the_default_directory_squatted_by_another_user_is_refused(tmp_path, monkeypatch):
    # The attack of the issue: another user creates $TMPDIR/smg-zmq-<our uid> first.
    monkeypatch.delenv("SMG_ZMQ_SOCKET_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squat = tmp_path / f"smg-zmq-{os.getuid()}"
    squat.mkdir(mode=0o777)
    os.chown(squat, OTHER_UID, OTHER_UID)
    with pytest.raises(SocketDirError, match=f"owned by uid {OTHER_UID}"):
        socket_dir()


def test_a_symlink_is_refused_and_not_followed(tmp_path, monkeypatch):
    # Even a link to a perfectly private directory of ours: the link's target can change.
    target = tmp_path / "private"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "symbolic link" in _refused(monkeypatch, link)
    # A link to somewhere that does not exist yet is not created through either.
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "not-there")
    assert "symbolic link" in _refused(monkeypatch, dangling)
    assert not (tmp_path / "not-there").exists()


def test_an_open_mode_is_refused_not_repaired(tmp_path, monkeypatch):
    for mode in (0o755, 0o770, 0o1777):
        open_dir = tmp_path / f"open-{mode:o}"
        open_dir.mkdir()
        os.chmod(open_dir, mode)
        assert f"mode {mode & 0o7777:04o}" in _refused(monkeypatch, open_dir)
        assert stat.S_IMODE(os.lstat(open_dir).st_mode) == mode


def test_a_file_in_its_place_is_refused(tmp_path, monkeypatch):
    squat = tmp_path / "file"
    squat.write_text("")
    assert "not a directory" in _refused(monkeypatch, squat)


def test_a_directory_it_creates_is_private_whatever_the_umask(monkeypatch):
    short = Path(tempfile.mkdtemp(prefix="el-"))  # pytest's tmp_path can be too long for an ipc path
    for umask in (0o022, 0o077, 0o000):
        fresh = short / f"fresh-{umask:o}" / "sockets"
        monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(fresh))
        old = os.umask(umask)
        try:
            assert socket_dir() == fresh
        finally:
            os.umask(old)
        info = os.lstat(fresh)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert socket_dir() == fresh  # and it is accepted the next time
    shutil.rmtree(short, ignore_errors=True)


@pytest.mark.process
def test_a_directory_too_long_for_an_ipc_path_is_refused_before_any_bind(monkeypatch, test_model_dir):
    """sockaddr_un holds 107 bytes: a directory that leaves no room for the socket names is the
    operator's to change (exit 2, one line naming the knob), not a bind error and a traceback."""
    short = Path(tempfile.mkdtemp(prefix="el-"))
    long_dir = short / ("d" * (IPC_PATH_MAX - SOCKET_NAME_MAX - len(str(short))))
    at_limit = short / ("d" * (IPC_PATH_MAX - SOCKET_NAME_MAX - 2 - len(str(short))))
    try:
        assert len(str(at_limit)) == IPC_PATH_MAX - 1 - SOCKET_NAME_MAX
        monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(at_limit))
        assert socket_dir() == at_limit  # the longest accepted
        message = _refused(monkeypatch, long_dir)
        assert f"{IPC_PATH_MAX} bytes" in message
        done = subprocess.run(
            [str(VENV_BIN / "enginelink"), "serve", "--model", str(test_model_dir), "--port", str(free_port())],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "SMG_ZMQ_SOCKET_DIR": str(long_dir), "XDG_STATE_HOME": str(short / "state")},
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert "SMG_ZMQ_SOCKET_DIR" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.process
@pytest.mark.parametrize("attack", ["other-owner", "symlink", "mode-0755"])
def test_serve_exits_2_with_one_line_saying_what_to_do(tmp_path, test_model_dir, attack):
    target = tmp_path / "sockets"
    target.mkdir(mode=0o700)
    if attack == "other-owner":
        os.chown(target, OTHER_UID, OTHER_UID)
    elif attack == "mode-0755":
        os.chmod(target, 0o755)
    else:
        link = tmp_path / "link"
        link.symlink_to(target)
        target = link
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--model", str(test_model_dir), "--port", str(free_port()),
         "--journal", str(tmp_path / "j.sqlite")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "SMG_ZMQ_SOCKET_DIR": str(target)},
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert lines[0].startswith(f"enginelink serve: ipc socket directory {target}")
    assert "SMG_ZMQ_SOCKET_DIR" in lines[0]
    assert not any(tmp_path.glob("sockets/enginelink-*"))  # nothing was put there

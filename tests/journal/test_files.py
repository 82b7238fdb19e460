"""A journal's files: the owner's lock, the previous runs kept, the run file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enginelink.journal.files import (
    JOURNAL_KEEP_DEFAULT,
    JournalBusy,
    JournalLock,
    journal_keep,
    previous_path,
    read_run_file,
    remove_run_file,
    run_file_path,
    write_run_file,
)
from enginelink.journal.journal import Journal
from enginelink.journal.records import KIND_ENGINE_FRAME
from enginelink.journal.store import open_reader


def one_run(path, records: int, keep: int = JOURNAL_KEEP_DEFAULT) -> None:
    journal = Journal(path, keep=keep)
    for i in range(records):
        journal.append(float(i), "engine/0", KIND_ENGINE_FRAME, b"x")
    journal.flush_sync()
    journal.close()


def stored_count(path) -> int:
    with open_reader(path) as reader:
        return reader.counts().records


def test_a_crash_loop_keeps_the_last_keep_runs(tmp_path):
    """Runs of 1..6 records with keep=3: the live file has run 6, .prev run 5, .prev2 run 4, .prev3 run 3."""
    path = tmp_path / "journal-9.sqlite"
    for run in range(1, 7):
        one_run(path, run, keep=3)
    assert stored_count(path) == 6
    assert [stored_count(previous_path(path, n)) for n in (1, 2, 3)] == [5, 4, 3]
    assert previous_path(path, 1).name == "journal-9.prev.sqlite"
    assert previous_path(path, 3).name == "journal-9.prev3.sqlite"
    assert not previous_path(path, 4).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "prev" in p.name and p.suffix == ".sqlite") == [
        "journal-9.prev.sqlite", "journal-9.prev2.sqlite", "journal-9.prev3.sqlite"]


def test_keep_zero_keeps_no_previous_run(tmp_path):
    path = tmp_path / "journal-9.sqlite"
    one_run(path, 2, keep=0)
    one_run(path, 1, keep=0)
    assert stored_count(path) == 1
    assert not previous_path(path).exists()


def test_a_held_journal_is_not_moved_or_opened_by_another_journal(tmp_path):
    path = tmp_path / "journal-9.sqlite"
    live = Journal(path)
    live.append(0.0, "engine/0", KIND_ENGINE_FRAME, b"x")
    live.flush_sync()
    inode = os.stat(path).st_ino
    with pytest.raises(JournalBusy) as refused:
        Journal(path)
    assert f"in use by process {os.getpid()}" in str(refused.value)
    assert os.stat(path).st_ino == inode and not previous_path(path).exists()
    live.append(1.0, "engine/0", KIND_ENGINE_FRAME, b"y")  # still writes where it did
    live.flush_sync()
    live.close()
    assert stored_count(path) == 2
    # Released at close: the next run takes it and sets this one aside.
    one_run(path, 1)
    assert stored_count(previous_path(path)) == 2


@pytest.mark.process
def test_the_lock_is_per_process_and_names_its_holder(tmp_path):
    """Another process is refused while the holder lives, and gets the lock once it is gone (however it ends)."""
    path = tmp_path / "journal-9.sqlite"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from enginelink.journal.files import JournalLock\n"
        f"JournalLock({str(path)!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JournalBusy) as refused:
            JournalLock(path).acquire()
        assert refused.value.pid == holder.pid
        assert f"process {holder.pid}" in str(refused.value)
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait()
        with JournalLock(path) as lock:
            assert lock.held
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_journal_keep_knob():
    assert journal_keep({}) == JOURNAL_KEEP_DEFAULT == 5
    assert journal_keep({"ENGINELINK_JOURNAL_KEEP": "2"}) == 2
    for bad in ("-1", "two", "100000"):
        with pytest.raises(ValueError, match="ENGINELINK_JOURNAL_KEEP"):
            journal_keep({"ENGINELINK_JOURNAL_KEEP": bad})


def test_run_file_names_the_journal(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert read_run_file(50999) is None
    written = write_run_file(50999, tmp_path / "elsewhere.sqlite", host="127.0.0.1")
    assert written == tmp_path / "state" / "enginelink" / "serve-50999.json"
    recorded = read_run_file(50999)
    assert recorded["journal"] == str(tmp_path / "elsewhere.sqlite") and recorded["pid"] == os.getpid()
    remove_run_file(50999)
    assert not run_file_path(50999).exists()
    # Another process's run file is not ours to remove.
    run_file_path(50999).write_text('{"pid": 1, "journal": "/x"}')
    remove_run_file(50999)
    assert read_run_file(50999) == {"pid": 1, "journal": "/x"}

"""Attacks on the journal's disk: full, failing, and files others could read.

A full disk must not stop the servicer, and must not be silent: one ERROR
line with the OS error, a summary while it lasts, a line when it recovers;
``journal_store_failing`` in /metrics; ``enginelink inspect`` says the file
is not being written (from the status file next to the journal, since the
journal itself cannot say it). The journal holds prompts' token ids, so the
file, its -wal and -shm, and the status file are 0600, in a 0700 directory
when enginelink makes it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import stat
import subprocess
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginelink.journal import store as store_module
from enginelink.journal.journal import Journal
from enginelink.journal.store import StoreError, open_reader, open_store
from enginelink.journal.store_health import health_path, read_health
from enginelink.tools.inspect import render_health
from tests.harness import VENV_BIN, VLLM_SERVICE, Servicer, free_port, generate_request, scrape, wait_until

PROMPT = [318, 283, 1552, 10, 90, 305]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _failing_writes(monkeypatch, failing: list[bool]) -> None:
    real = store_module.Store.write_batch

    def write_batch(self, rows):
        if failing[0]:
            raise ENOSPC
        return real(self, rows)

    monkeypatch.setattr(store_module.Store, "write_batch", write_batch)


def test_a_failing_disk_is_said_once_then_summarised_then_recovered(tmp_path, monkeypatch, caplog):
    failing = [False]
    _failing_writes(monkeypatch, failing)
    journal = Journal(tmp_path / "j.sqlite")
    caplog.set_level(logging.INFO, logger="enginelink.journal")
    journal.append(0.0, "run", "run.start", {"n": 0})
    journal.flush_sync()
    assert journal.stats().store_failing == 0 and read_health(journal.path)["writing"] is True

    failing[0] = True
    for n in range(50):  # fifty failed batches...
        journal.append(float(n), "run", "run.start", {"n": n})
        journal.flush_sync()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # ...one line, with the OS error
    assert "No space left on device" in errors[0].getMessage() and "keeps serving" in errors[0].getMessage()
    stats = journal.stats()
    assert stats.store_failing == 1 and stats.store_errors == 50 and stats.store_dropped == 50
    health = read_health(journal.path)  # what inspect reads while the journal cannot say it
    assert health["writing"] is False and "No space left on device" in health["error"]
    assert health["dropped_in_episode"] == 50 and health["pid"] == os.getpid()
    line = render_health(health, os.getpid())[0]
    assert line.startswith("  NOT WRITING to this file since") and "50 records dropped" in line
    assert render_health(health, os.getpid() + 1) == []  # another run's status is not shown

    journal.health.summary_interval_s = 0.0  # the periodic summary, without waiting a minute
    journal.append(99.0, "run", "run.start", {"n": 99})
    journal.flush_sync()
    summaries = [r.getMessage() for r in caplog.records if "still cannot write" in r.getMessage()]
    assert len(summaries) == 1 and "1 records dropped in the last" in summaries[0] and "51 since" in summaries[0]

    failing[0] = False
    journal.append(100.0, "run", "run.start", {"n": 100})
    journal.flush_sync()
    recovered = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert len(recovered) == 1 and "51 records were dropped" in recovered[0]
    assert journal.stats().store_failing == 0 and journal.stats().store_failing_episodes == 1
    health = read_health(journal.path)
    assert health["writing"] is True and health["episodes"] == 1
    assert "failed 1 time(s) before" in render_health(health, os.getpid())[0]
    journal.close()


def test_the_status_file_is_written_in_place_on_a_full_disk(tmp_path, monkeypatch):
    # Allocated at start-up, so a later rewrite needs no free block: simulate "no new blocks".
    journal = Journal(tmp_path / "j.sqlite")
    path = health_path(journal.path)
    size = path.stat().st_size
    blocks = os.stat(path).st_blocks
    assert size == 4096 and blocks > 0
    journal.health.failed(ENOSPC, 3)
    assert path.stat().st_size == size and os.stat(path).st_blocks == blocks
    assert read_health(journal.path)["writing"] is False
    journal.close()


def test_journal_files_are_private(tmp_path):
    state = tmp_path / "state" / "enginelink"
    journal = Journal(state / "journal-1.sqlite")
    journal.append(0.0, "run", "run.start", {"prompt": [1, 2, 3]})
    journal.flush_sync()
    assert _mode(state) == 0o700
    for name in ("journal-1.sqlite", "journal-1.sqlite-wal", "journal-1.sqlite-shm", "journal-1.sqlite.health"):
        assert _mode(state / name) == 0o600, name
    journal.close()


def test_an_existing_journal_file_is_made_private_and_a_symlink_is_refused(tmp_path):
    old = tmp_path / "old.sqlite"
    open_store(old).close()
    os.chmod(old, 0o644)  # as an older enginelink left it, with an (empty) WAL beside it
    Path(f"{old}-wal").write_bytes(b"")
    os.chmod(f"{old}-wal", 0o644)
    store = open_store(old)
    store.write_batch([(1, 0.0, "run", "run.start", b"\x80")])
    for name in ("old.sqlite", "old.sqlite-wal", "old.sqlite-shm"):
        assert _mode(tmp_path / name) == 0o600, name
    store.close()
    elsewhere = tmp_path / "elsewhere.sqlite"
    link = tmp_path / "link.sqlite"
    link.symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(link)
    assert not elsewhere.exists()
    # The status file is never written through a link either: the link is replaced.
    planted = tmp_path / "victim"
    planted.write_text("keep")
    health_path(tmp_path / "h.sqlite").symlink_to(planted)
    journal = Journal(tmp_path / "h.sqlite")
    assert planted.read_text() == "keep" and not health_path(journal.path).is_symlink()
    journal.close()


def _metric(port: int, family: str) -> float:
    for name, value in scrape(port).items():
        if name.startswith(family + "{") or name == family:
            return value
    raise AssertionError(f"{family} not exported")


def _inspect(journal: Path) -> str:
    done = subprocess.run([str(VENV_BIN / "enginelink"), "inspect", "--journal", str(journal)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
MNT_DETACH = 2


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem (a tmpfs), mounted with mount(2) itself: no `mount` process, so the
    in-process tests below stay in the fast loop (tests/fast_loop.py). Needs root, as the suite has."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if _libc.mount(b"tmpfs", os.fsencode(mount), b"tmpfs", 0, b"size=4m,mode=0700") != 0:
        code = ctypes.get_errno()
        pytest.fail(f"cannot mount a tmpfs here (the tests run as root): {os.strerror(code)}")
    yield mount
    _libc.umount2(os.fsencode(mount), MNT_DETACH)


def _fill(path: Path) -> None:
    """Writes zeros to ``path`` until its filesystem is full (ENOSPC)."""
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_a_full_disk_is_named_in_the_error_line_with_what_is_lost(small_disk, caplog):
    # SQLite rolls a transaction back itself when the disk is full (SQLITE_FULL); the store's own
    # ROLLBACK then failed with "cannot rollback - no transaction is active", and that error, not the
    # full disk, was what the log, /metrics' last error and the status file said.
    journal = Journal(small_disk / "j.sqlite")
    caplog.set_level(logging.INFO, logger="enginelink.journal")
    journal.append(0.0, "run", "run.start", {"n": 0})
    journal.flush_sync()
    _fill(small_disk / "filler")
    prompt = list(range(20_000))  # ~60 KiB a record: the WAL must grow, a full disk has no block for it
    for n in range(1, 4):
        journal.append(float(n), "req/r", "client.generate", {"request_id": "r", "prompt": prompt})
        journal.flush_sync()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    line = errors[0]
    assert "cannot rollback" not in line, line
    assert "database or disk is full" in line and "SQLITE_FULL" in line, line  # SQLite's own error
    assert "the disk (or the journal's database) is full" in line, line  # the cause, in words
    assert "0 bytes free on its filesystem" in line, line  # which of the two: the disk
    assert "records seq 2..2" in line and "every record after them" in line, line  # what is being lost
    assert "keeps serving" in line, line
    stats = journal.stats()
    assert stats.store_failing == 1 and stats.store_errors == 3 and stats.store_dropped == 3
    health = read_health(journal.path)
    assert health["writing"] is False and "database or disk is full" in health["error"], health
    assert "cannot rollback" not in health["error"], health

    (small_disk / "filler").unlink()  # room again: the next batch is written, the gap stays
    journal.append(4.0, "run", "run.start", {"n": 4})
    journal.flush_sync()
    assert journal.stats().store_failing == 0
    journal.close()
    with open_reader(small_disk / "j.sqlite") as reader:
        assert [rec.seq for rec in reader.iter_records()] == [1, 5]


@pytest.mark.process
@pytest.mark.slow
def test_serve_on_a_full_disk_keeps_serving_and_says_so(tmp_path, test_model_dir, small_disk):
    metrics_port = free_port()
    journal = small_disk / "journal.sqlite"
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env={"SMG_VLLM_SERVICER_WARMUP": "off"},
                        extra=["--metrics-port", str(metrics_port), "--journal", str(journal)])
    filler = small_disk / "filler"
    count = 0

    def generate() -> None:
        nonlocal count
        count += 1
        replies = list(servicer.stub.Generate(generate_request(f"r{count}", PROMPT, max_tokens=32), timeout=30))
        assert replies[-1].HasField("complete")

    try:
        servicer.start()
        assert _metric(metrics_port, "smg_servicer_journal_store_failing") == 0
        with open(filler, "wb") as fh:  # fill the disk
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError as error:
                assert error.errno == errno.ENOSPC

        def said() -> bool:
            generate()
            return "journal: cannot write to" in servicer.log()

        wait_until(said, 60, "the journal's failure logged", interval_s=0.05)
        wait_until(lambda: _metric(metrics_port, "smg_servicer_journal_store_errors") >= 3 or generate(), 60,
                   "more failed writes", interval_s=0.05)
        assert servicer.log().count("journal: cannot write to") == 1  # once, not once per batch
        line = next(line for line in servicer.log().splitlines() if "journal: cannot write to" in line)
        assert "cannot rollback" not in line and "is full" in line and "dropped from the file" in line, line
        assert _metric(metrics_port, "smg_servicer_journal_store_failing") == 1
        assert _metric(metrics_port, "smg_servicer_journal_store_dropped") > 0
        shown = _inspect(journal)
        assert "NOT WRITING to this file since" in shown and "records dropped from it" in shown, shown
        # Still serving.
        health = health_pb2_grpc.HealthStub(servicer.channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        generate()

        filler.unlink()  # room again

        def recovered() -> bool:
            generate()
            return "journal: writing to" in servicer.log() and "recovered" in servicer.log()

        wait_until(recovered, 60, "the journal's recovery logged", interval_s=0.05)
        assert _metric(metrics_port, "smg_servicer_journal_store_failing") == 0
        assert "failed 1 time(s) before" in _inspect(journal)
    finally:
        servicer.stop()

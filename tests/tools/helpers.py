"""Helpers for the tool tests: run the CLI as a user would, and drive traffic."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import grpc

from enginelink.journal.store import open_reader
from tests.harness import VENV_BIN, Servicer, alive, engine_pid, generate_request, wait_until  # noqa: F401 (re-exported)

PROMPT = [318, 283, 1552, 10, 90, 305]
CLI_TIMEOUT_S = 30


def enginelink(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``.venv/bin/enginelink ARGS``; the result keeps stdout, stderr and the exit status."""
    return subprocess.run([str(VENV_BIN / "enginelink"), *map(str, args)], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env={**os.environ, **(env or {})})


def inspect_json(journal: Path) -> dict:
    done = enginelink("inspect", "--journal", journal, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class Stream(threading.Thread):
    """One streaming Generate read to its end in a thread, keeping what arrived."""

    def __init__(self, servicer: Servicer, request_id: str, **sampling) -> None:
        super().__init__(daemon=True)
        self.request = generate_request(request_id, PROMPT, stream=True, **sampling)
        self.stub = servicer.stub
        self.messages: list = []
        self.error: grpc.RpcError | None = None
        self.streaming = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            for message in self.stub.Generate(self.request):
                self.messages.append(message)
                self.streaming.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.streaming.set()


def journal_has(journal: Path, predicate) -> bool:
    with open_reader(journal) as reader:
        return predicate(reader.records())


def copy_journal(source: Path, dest: Path) -> Path:
    """A consistent copy of a (possibly live) journal, WAL content included, via SQLite's backup."""
    import sqlite3

    src = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return dest


WARMUP_PREFIX = "smg-warmup-"


def warmup_admitted(journal: Path) -> int:
    """Warm-up requests the servicer itself admitted (they count in verify's totals)."""
    with open_reader(journal) as reader:
        return sum(rec.payload["request_id"].startswith(WARMUP_PREFIX)
                   for rec in reader.records(kinds=["client.generate"]))


def verify_report(journal: Path) -> dict:
    done = enginelink("journal", "verify", "--journal", journal, "--json")
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)

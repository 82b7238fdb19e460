"""A real, private redis-server for the tests of ``--mm-processor redis`` (Debian's, ``tools/setup-redis``).

No TCP port at all (``--port 0``): one unix socket in the test's own 0700
folder, and a password, so nothing else on the machine reaches it. Nothing
is saved to disk. ``kill()`` is SIGKILL (Redis gone mid-job), ``pause()``
SIGSTOP (Redis silent: the socket open, nothing answering); ``start()`` again
brings it back on the same socket, as a restarted Redis comes back. Every
server stops with its test (``stop()``), or when this process exits.

Without redis-server the tests that need one skip, unless
``ENGINELINK_REQUIRE_REDIS=1`` (``tools/run-tests`` sets it), where they fail.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def redis_server_or_skip() -> str:
    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("ENGINELINK_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required here: run tools/setup-redis")
        pytest.skip("no redis-server (run tools/setup-redis)")
    return found


class RedisServer:
    def __init__(self, folder: Path, binary: str | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self.binary = binary or redis_server_or_skip()
        self.socket_path = self.folder / "redis.sock"
        self.password = secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self.log_path = self.folder / "redis.log"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?password={self.password}"

    def start(self) -> "RedisServer":
        self.socket_path.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
             "--requirepass", self.password, "--save", "", "--appendonly", "no", "--dir", str(self.folder),
             "--logfile", str(self.log_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.process.returncode}: {self.log()[-2000:]}")
            if self.answers():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S} s: {self.log()[-2000:]}")

    def answers(self) -> bool:
        import redis

        try:
            return bool(self.client().ping())
        except (redis.RedisError, OSError):
            return False

    def client(self):
        """A plain synchronous client: the test's own look at the server, apart from the code under test."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

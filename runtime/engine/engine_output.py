"""The engine's own output (stdout and stderr), relayed to the servicer's stderr with secrets hidden.

The engine is launched with both streams on one pipe; ``EngineOutputRelay``
reads it line by line and writes each line, redacted, to this process's
stderr, where the engine's lines went before. Why relay at all: an engine
echoes its arguments (an argument error prints ``--hf-token X``), and what
reaches the servicer's log must not hold a credential the journal and
``GetServerInfo`` already hide.

Redaction (``Redactor``), in this order:
- every secret value the launch knows (credential flags' values, secret keys
  inside JSON configs, URL passwords, secret-named environment variables),
  wherever it appears in a line;
- by pattern: ``--<secret flag> V`` / ``--<secret flag>=V`` (also as a Python
  list prints it), ``name=V`` / ``name: V`` where the name's last word is a
  secret word (``hf_token=``, ``api_key:``), ``Bearer V``, URL passwords.

Bounds: a line longer than ``ENGINE_LINE_MAX_BYTES`` is cut there (the rest
of it is dropped, and the cut said); a read takes at most
``ENGINE_READ_BYTES``. The pipe is read for the engine's whole life, and
while it stops (the link's ``run``), so the engine never blocks on it.
"""

from __future__ import annotations

import re
import sys
from typing import Iterable

import trio

from enginelink.runtime.engine.launchers import REDACTED, SECRET_WORDS, URL_CREDENTIALS

ENGINE_LINE_MAX_BYTES = 16 * 1024
ENGINE_READ_BYTES = 64 * 1024
# After the engine is stopped, how long the relay may still read what it wrote last.
RELAY_DRAIN_S = 1.0
# Known secret values shorter than this are not searched for (they would hide common words).
SECRET_VALUE_MIN_CHARS = 4

_WORDS = "|".join(sorted(SECRET_WORDS, key=len, reverse=True))
# A flag with a secret word as one of its words, then its value: "--hf-token X", "--api-key=Y", "'--hf-token', 'X'".
_FLAG = re.compile(
    rf"(--(?:[A-Za-z0-9]+[-_.])*(?:{_WORDS})(?:[-_.][A-Za-z0-9]+)*)"
    r"(=|\s+|['\"],\s*['\"])(?!--)([^\s'\",\]]+)",
    re.IGNORECASE,
)
# name=V / name: V / "name": "V", where the name ends in a secret word (hf_token, api_key, password).
_ASSIGN = re.compile(
    rf"(?<![A-Za-z0-9_-])((?:[A-Za-z0-9]+[-_.])*(?:{_WORDS})['\"]?\s*[=:]\s*['\"]?)([^\s'\",}}\]]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(Bearer\s+)[^\s'\"]+", re.IGNORECASE)


class Redactor:
    """Hides known secret values and credential-shaped text in a line."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = sorted({s for s in secrets if len(s) >= SECRET_VALUE_MIN_CHARS}, key=len, reverse=True)
        self._known = re.compile("|".join(re.escape(v) for v in values)) if values else None

    def line(self, text: str) -> str:
        if self._known is not None:
            text = self._known.sub(REDACTED, text)
        text = _FLAG.sub(rf"\1\2{REDACTED}", text)
        text = _ASSIGN.sub(rf"\1{REDACTED}", text)
        text = _BEARER.sub(rf"\1{REDACTED}", text)
        return URL_CREDENTIALS.sub(rf"\1{REDACTED}@", text)


class EngineOutputRelay:
    """Reads the engine's output pipe and writes it, redacted, line by line."""

    def __init__(self, stream: trio.abc.ReceiveStream, redactor: Redactor, sink=None) -> None:
        self.stream = stream
        self.redactor = redactor
        self.sink = sink if sink is not None else sys.stderr
        self.lines = 0
        self.cut = 0
        self._buffer = bytearray()
        self._cutting = False  # inside a line already cut: drop until its end
        self.done = False

    async def pump(self) -> None:
        """Relay until the pipe ends; cancel-safe (call again to go on where it stopped)."""
        while not self.done:
            try:
                chunk = await self.stream.receive_some(ENGINE_READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                if self._buffer and not self._cutting:
                    self._emit(bytes(self._buffer))
                self._buffer.clear()
                self.done = True
                await self.stream.aclose()
                return
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > ENGINE_LINE_MAX_BYTES and not self._cutting:
                    self._emit(bytes(self._buffer[:ENGINE_LINE_MAX_BYTES]), cut=True)
                    self._cutting = True
                if self._cutting:
                    self._buffer.clear()
                return
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            if self._cutting:
                self._cutting = False
                continue
            if len(line) > ENGINE_LINE_MAX_BYTES:
                self._emit(line[:ENGINE_LINE_MAX_BYTES], cut=True)
            else:
                self._emit(line)

    def _emit(self, raw: bytes, cut: bool = False) -> None:
        text = self.redactor.line(raw.decode("utf-8", errors="replace").rstrip("\r"))
        if cut:
            self.cut += 1
            text += f" [… line cut at {ENGINE_LINE_MAX_BYTES} bytes by enginelink]"
        self.lines += 1
        try:
            self.sink.write(text + "\n")
            self.sink.flush()
        except (OSError, ValueError):
            pass  # our own stderr is gone: nothing to tell, and the engine must not block on us

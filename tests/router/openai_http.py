"""A tiny OpenAI-style HTTP client for the router tests: standard library only.

``post`` sends one JSON request and returns the status and decoded body.
``SSEStream`` opens a streaming request with ``http.client`` and yields the
``data:`` payloads one at a time, so a test can stop reading (and hang up)
whenever it likes. Every call has a timeout: a hung router fails the test,
never the run.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

TIMEOUT_S = 30.0
DONE = "[DONE]"


def get(base_url: str, path: str, timeout_s: float = TIMEOUT_S) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(base_url + path, timeout=timeout_s) as reply:
            return reply.status, _json_or_text(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, _json_or_text(error.read())


def post(base_url: str, path: str, body: dict, timeout_s: float = TIMEOUT_S) -> tuple[int, object]:
    request = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, _json_or_text(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, _json_or_text(error.read())


def _json_or_text(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class SSEStream:
    """One streaming POST; iterate ``data()`` for the payloads (dicts, or ``DONE``)."""

    def __init__(self, base_url: str, path: str, body: dict, timeout_s: float = TIMEOUT_S) -> None:
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        self.conn.request("POST", path, json.dumps({**body, "stream": True}),
                          {"content-type": "application/json", "accept": "text/event-stream"})
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.headers = {k.lower(): v for k, v in self.response.getheaders()}

    def data(self):
        """The ``data:`` payloads in order; ends after ``[DONE]`` or at end of stream."""
        while True:
            line = self.response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            payload = line[len(b"data:"):].strip().decode()
            if payload == DONE:
                yield DONE
                return
            yield json.loads(payload)

    def read_all(self) -> list:
        events = list(self.data())
        self.close()
        return events

    def hang_up(self) -> None:
        """Close the socket under the response, as a client that goes away does."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.response.close()
        self.conn.close()

    def __enter__(self) -> "SSEStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream(base_url: str, path: str, body: dict) -> tuple[int, list]:
    """The whole stream: its status and every payload, ``DONE`` included."""
    s = SSEStream(base_url, path, body)
    return s.status, s.read_all()

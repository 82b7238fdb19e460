"""Who may speak on the engine's handshake socket, and what a stranger costs.

The handshake ROUTER is the one socket the engine dials before it knows
anything else, so it is the one an intruder on the host would aim at. The
rules it keeps:

- reachable only from this host's owner: it is an ipc socket in the private
  0700 socket directory (``socket_files.socket_dir``), never tcp; vLLM's
  headless engine and the sim engine dial any ZeroMQ address, ipc included;
- open only while the engine starts: the link closes it, and removes its
  file, as soon as the handshake is done (the engine closes its side too);
- bounded while open: a message over ``HANDSHAKE_MESSAGE_MAX_BYTES``
  makes libzmq drop that peer before buffering it (``ZMQ_MAXMSGSIZE``), and
  each peer may queue at most ``HANDSHAKE_QUEUE_MAX`` messages;
- a stranger's frame is ignored, journaled and logged, never fatal: a frame
  is the engine's only when it comes from one of the engine's processes,
  its launcher or a descendant (for ipc, libzmq tells the sender's pid: the
  ``Peer-Address`` property reads ``host:uid:gid:pid``; no process can
  choose its parent) and,
  from the identity of one of the engine's DP ranks (the rank, 2 bytes
  little-endian; each rank sends its own HELLO first), and, once HELLO was
  accepted, from the identity that sent it. A stranger's
  frame is never decoded. Where the pid is unknown (not Linux), the first
  frame that decodes as HELLO is taken, and others are strangers.

The gate says who sent a frame, never what it means: the engine's own frames
go to the handshake machine (``machines/handshake.py``), and one that breaks
the handshake still fails the link: that is the engine's fault, and waiting
would not mend it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import zmq

from enginelink.runtime.engine.engine_processes import descends_from
from enginelink.runtime.engine.zmq_trio import has_message, wait_fd

log = logging.getLogger("enginelink.link")

# vLLM's HELLO and READY are about 40 bytes; the init we send is ours. 64 KiB
# leaves room for a future field or two and costs nothing.
HANDSHAKE_MESSAGE_MAX_BYTES = 64 * 1024
# vLLM 0.32's ready response is about 1 KiB (25 keys; the KV-event config the largest).
READY_RESPONSE_MAX_BYTES = 1024 * 1024
# Messages one peer may have queued on the handshake (or input) socket.
HANDSHAKE_QUEUE_MAX = 16
# Strangers' frames journaled one by one (then only counted), so a flood cannot fill the journal.
STRANGER_RECORDS_MAX = 16


def bound_handshake_socket(sock: zmq.Socket) -> None:
    """Bounds of the handshake socket; call before ``bind`` (they apply to each new peer).

    ROUTER_HANDOVER: the engine's identity is known (its rank, 2 bytes), so a
    stranger who connected first with it would otherwise lock the engine out;
    with handover the newest connection takes the identity, and the older
    one keeps a random identity nobody answers.
    """
    sock.setsockopt(zmq.MAXMSGSIZE, HANDSHAKE_MESSAGE_MAX_BYTES)
    sock.setsockopt(zmq.RCVHWM, HANDSHAKE_QUEUE_MAX)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)


def bound_input_socket(sock: zmq.Socket) -> None:
    """Bounds of the input ROUTER; call before ``bind``.

    The engine sends one message on it, its ready response, and the link
    reads it only during start-up; whatever else arrives stays queued for
    the link's lifetime. So at most ``READY_RESPONSE_MAX_BYTES`` a message
    and ``HANDSHAKE_QUEUE_MAX`` messages a peer.
    """
    sock.setsockopt(zmq.MAXMSGSIZE, READY_RESPONSE_MAX_BYTES)
    sock.setsockopt(zmq.RCVHWM, HANDSHAKE_QUEUE_MAX)


def peer_of(frame: zmq.Frame) -> tuple[str, int | None]:
    """The sender as libzmq tells it (``Peer-Address``), and its pid where that says one."""
    try:
        address = frame.get("Peer-Address") or ""
    except (zmq.ZMQError, UnicodeDecodeError):
        return "", None
    parts = address.rsplit(":", 3)  # ipc: "host:uid:gid:pid"
    if len(parts) == 4 and parts[3].isdigit():
        return address, int(parts[3])
    return address, None


@dataclass
class Stranger:
    """One frame the gate refused, for the journal."""

    reason: str
    identity: str
    peer: str
    size: int

    def record(self) -> dict:
        return {"reason": self.reason, "identity": self.identity, "peer": self.peer, "bytes": self.size}


class HandshakeGate:
    """Sorts handshake frames into the engine's messages and strangers' (no I/O but reads).

    It decides who sent a frame, never what the frame says: the engine's own
    messages go to the handshake machine (``machines/handshake.py``), which
    refuses a broken handshake.
    """

    def __init__(self, engine_pid: int, journal_step, identities: frozenset[bytes],
                 is_hello: Callable[[bytes], bool]) -> None:  # fmt: skip
        self.engine_pid = engine_pid  # the launcher's: the engine's processes are it and its descendants
        self.allowed = identities  # the identities the engine's ranks speak from
        self._is_hello = is_hello
        self.hello_from: set[bytes] = set()  # where the pid is unknown: the ranks that sent HELLO
        self.strangers = 0
        self._journal_step = journal_step

    def judge(self, frames: list[zmq.Frame]) -> tuple[bytes, bytes] | None:
        """The engine's (identity, payload), or None for a stranger's frame (journaled)."""
        identity = frames[0].bytes if frames else b""
        peer, pid = peer_of(frames[-1]) if frames else ("", None)
        size = sum(len(frame) for frame in frames[1:])  # what the sender sent (the identity is the ROUTER's)
        if len(frames) != 2:
            return self._stranger("not one frame", identity, peer, size)
        if pid is not None and not descends_from(pid, self.engine_pid):
            return self._stranger(f"pid {pid} is not one of the engine's processes", identity, peer, size)
        if identity not in self.allowed:
            return self._stranger("not the identity of one of the engine's DP ranks", identity, peer, size)
        payload = frames[1].bytes
        if pid is None and identity not in self.hello_from:
            # Nothing tells the engine apart but what it says: its first frame must be a HELLO.
            if not self._is_hello(payload):
                return self._stranger("not HELLO", identity, peer, size)
            self.hello_from.add(identity)
        return identity, payload

    def _stranger(self, reason: str, identity: bytes, peer: str, size: int) -> None:
        self.strangers += 1
        stranger = Stranger(reason, identity[:32].hex(), peer, size)
        if self.strangers <= STRANGER_RECORDS_MAX:
            self._journal_step("stranger", stranger.record())
            log.warning("ignored a frame on the engine handshake socket from %s (%d bytes): %s",
                        peer or "an unknown peer", size, reason)
        return None

    def summary(self) -> dict | None:
        """What to journal when the handshake closes, if strangers were more than journaled."""
        if self.strangers > STRANGER_RECORDS_MAX:
            log.warning("ignored %d frames from strangers on the engine handshake socket "
                        "(the first %d are journaled)", self.strangers, STRANGER_RECORDS_MAX)
            return {"strangers": self.strangers, "journaled": STRANGER_RECORDS_MAX}
        return None


def read_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """One whole message without copying (so its ``Peer-Address`` can be read), or None."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


async def receive_from_engine(sock: zmq.Socket, gate: HandshakeGate) -> tuple[bytes, bytes]:
    """Wait for the engine's next handshake message, passing over strangers'."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        while has_message(sock):
            frames = read_frames(sock)
            if frames is None:
                break
            judged = gate.judge(frames)
            if judged is not None:
                return judged
        await wait_fd(fd)


def poll_engine_from(sock: zmq.Socket, gate: HandshakeGate) -> tuple[bytes, bytes] | None:
    """The engine's (identity, payload) waiting on the socket, if any; strangers' are passed over."""
    while True:
        frames = read_frames(sock)
        if frames is None:
            return None
        judged = gate.judge(frames)
        if judged is not None:
            return judged

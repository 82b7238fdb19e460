"""pyzmq under trio: non-blocking sockets, woken by trio's fd readiness.

ZeroMQ's ``FD`` is edge-triggered and only says "socket state may have
changed", so every wait is followed by draining with ``NOBLOCK`` until
``Again``; a short fallback timeout on the wait covers the rare lost edge
(pyzmq's own asyncio integration re-checks for the same reason).

Sends never wait: every socket is made with SNDHWM = 0 (as vLLM does), and a
ROUTER with ROUTER_MANDATORY raises at once when the peer is not connected.
"""

from __future__ import annotations

import trio
import zmq

# Bound on a lost edge of ZMQ_FD: a missed wake-up costs at most this. Every wait reads EVENTS
# first (which re-arms the edge), so a lost edge needs another reader of the socket's EVENTS; none
# is known here. Each recheck is a timer wake-up of a parked wait, several sockets' worth per
# interval: at 50 ms they were most of an idle servicer's 2.7% of a core (docs/benchmarks-history.md).
LOST_EDGE_RECHECK_S = 0.5


def make_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


# Plain ints: ``zmq.POLLIN`` is an ``IntFlag``, and ``&`` on one builds a flag through
# enum's machinery, about as dear as the getsockopt itself; this runs once per engine frame.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def has_message(sock: zmq.Socket) -> bool:
    """A whole message is waiting. Reading ``EVENTS`` also re-arms ``FD``'s edge."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


async def wait_fd(fd: int) -> None:
    """Park until ``fd`` (a socket's ``FD``) signals, or the lost-edge bound passes."""
    with trio.move_on_after(LOST_EDGE_RECHECK_S):
        await trio.lowlevel.wait_readable(fd)


async def wait_readable(sock: zmq.Socket) -> None:
    if not has_message(sock):
        await wait_fd(sock.getsockopt(zmq.FD))


async def recv_multipart(sock: zmq.Socket) -> list[bytes]:
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await wait_readable(sock)

"""The asyncio loop grpclib runs on (trio-asyncio), running its ready callbacks together.

Why. trio-asyncio runs each asyncio callback in a trio scheduling round of its
own: ``_main_loop_one`` opens a cancel scope with the next timer's deadline,
receives one callback from a memory channel (a checkpoint: the loop task is
rescheduled) and runs it. A gRPC call is several callbacks (the socket read,
the handler task's steps, its wake-ups), so every call paid that round several
times. Measured side by side with the sim engine (concurrency 128, 8 tokens
per call, alternating; docs/benchmarks.md): 89.1/97.5/103.4 servicer µs per
token with one round per callback, 80.9/77.5/93.4 with this.

What. After trio-asyncio's own ``_main_loop_one`` (one callback, with its
timers and its round), the callbacks already queued run too, in order, up to
``READY_CALLBACKS_MAX``; then the loop task yields to trio as before. This is
what asyncio's own loop does each iteration (it runs every ready callback
before it polls for I/O). The bound keeps trio's tasks (the engine link's
receive loop) from waiting behind a flood. Each callback is dispatched
exactly as trio-asyncio dispatches it (timers to the heap, trio-flavoured
handles started in the loop's nursery, the rest run with sniffio saying
"asyncio"); a callback that stops the loop ends the pass as it ends
trio-asyncio's.

Private trio-asyncio API (``_main_loop_one``, ``_q_recv``, ``_timers``,
``_nursery``, ``_stopped``, ``AsyncHandle``): trio-asyncio is pinned below
0.17 in pyproject.toml for that reason. ``_main_loop`` looks
``_main_loop_one`` up on the loop at every turn, so setting it on the
instance is enough.
"""

from __future__ import annotations

import asyncio
import heapq

import trio
from sniffio import thread_local as sniffio_library
from trio_asyncio._handles import AsyncHandle

# Callbacks run per trio round beyond trio-asyncio's own one. A gRPC call is a
# handful; 64 is dozens of calls' worth, about a millisecond of work.
READY_CALLBACKS_MAX = 64


def run_ready_callbacks_together(loop) -> None:
    """Make ``loop`` (a running ``trio_asyncio`` loop) run its queued callbacks per trio round."""
    one = loop._main_loop_one
    queue = loop._q_recv

    async def main_loop_one(no_wait: bool = False) -> None:
        await one(no_wait)
        for _ in range(READY_CALLBACKS_MAX):
            if loop._stopped.is_set():
                return
            try:
                handle = queue.receive_nowait()
            except trio.WouldBlock:
                return
            if isinstance(handle, asyncio.TimerHandle):
                heapq.heappush(loop._timers, handle)
            elif isinstance(handle, AsyncHandle):
                handle._context.run(loop._nursery.start_soon, handle._run, name=handle._callback)
                await handle._started.wait()
            elif not handle._cancelled:
                previous, sniffio_library.name = sniffio_library.name, "asyncio"
                try:
                    handle._run()
                finally:
                    sniffio_library.name = previous

    loop._main_loop_one = main_loop_one

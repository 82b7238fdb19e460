"""The asyncio loop grpclib runs on (trio-asyncio), running its ready callbacks together.

Why. trio-asyncio runs each asyncio callback in a trio scheduling round of its
own: ``_main_loop_one`` opens a cancel scope with the next timer's deadline,
receives one callback from a memory channel (a checkpoint: the loop task is
rescheduled) and runs it. A gRPC call is several callbacks (the socket read,
the handler task's steps, its wake-ups), so every call paid that round several
times; running them together cut the servicer's CPU per token, side by side
with the sim engine (the figures: docs/benchmarks.md, "The end of a call").

What. After trio-asyncio's own ``_main_loop_one`` (one callback, with its
timers and its round), the loop calls it again with ``no_wait=True`` while
callbacks are queued, up to ``READY_CALLBACKS_MAX``: that is trio-asyncio's
own dispatch (expired timers first, trio-flavoured handles, sniffio), only
without the wait and so without a trio round; trio-asyncio itself drains the
queue that way when the loop closes. Then the loop task yields to trio as
before. This is what asyncio's own loop does each iteration (it runs every
ready callback before it polls for I/O). The bound keeps trio's tasks (the
engine link's receive loop) from waiting behind a flood; a callback that
stops the loop ends the pass as it ends trio-asyncio's.

Private trio-asyncio API (``_main_loop_one`` and its ``no_wait``,
``_stopped``): trio-asyncio is pinned below 0.17 in pyproject.toml for that
reason. ``_main_loop`` looks ``_main_loop_one`` up on the loop at every
turn, so setting it on the instance is enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

# Callbacks run per trio round beyond trio-asyncio's own one. A gRPC call is a
# handful; 64 is dozens of calls' worth, about a millisecond of work.
READY_CALLBACKS_MAX = 64


@dataclass
class ReadyCallbackStats:
    """The bound and how often a pass reached it (``/metrics``: ``smg_servicer_asyncio_*``)."""

    ready_callbacks_max: int = READY_CALLBACKS_MAX
    # Passes that ran the bound's worth: trio's tasks ran before any callbacks still queued.
    full_passes: int = 0


def run_ready_callbacks_together(loop) -> ReadyCallbackStats:
    """Make ``loop`` (a running ``trio_asyncio`` loop) run its queued callbacks per trio round."""
    one = loop._main_loop_one
    stats = ReadyCallbackStats()

    async def main_loop_one(no_wait: bool = False) -> None:
        await one(no_wait)
        for _ in range(READY_CALLBACKS_MAX):
            if loop._stopped.is_set():
                return
            try:
                await one(True)  # no wait: nothing here yields to trio unless a trio-flavoured handle starts
            except trio.WouldBlock:
                return
        stats.full_passes += 1

    loop._main_loop_one = main_loop_one
    return stats

"""How many call writers are still at work: what a drain's last wait ends on.

A Generate (or Embed) handler's writer sends what the hub handed it after the
hub is done with the call: the abort completes a drain produces, the last
chunks of a call that just finished. ``runtime/lifetime/core.drain`` gives
those writers up to ``DRAIN_FLUSH_S`` before the engine stops and the front
closes (grpclib cancels every handler still running); with this count it ends
that wait as soon as none is left, instead of always sleeping it out.

``app.open_writers`` counts the calls of ``generate``/``embed`` that have not
returned (decorated with ``counted``); it works the same under grpclib's
asyncio handlers and the simulation's trio clients (both run in trio's thread).
"""

from __future__ import annotations

import functools


def counted(serve):
    """``serve(app, ...)`` counted in ``app.open_writers`` while it runs, however it ends."""

    @functools.wraps(serve)
    async def counted_serve(app, *args, **kwargs):
        app.open_writers += 1
        try:
            return await serve(app, *args, **kwargs)
        finally:
            app.open_writers -= 1

    return counted_serve

"""Trio code called from either side of trio-asyncio: grpclib's handlers run in asyncio, the simulation in trio.

The Generate writer's sliced serialization (``generate.py``) and the media
service's fetches and processing (``runtime/contracts/shared/media.py``)
are trio code; their callers are a gRPC handler (asyncio under
trio-asyncio) or a simulation client (trio). Here, below both, so the
request shell need not reach up into a contract's media service for it.
"""

from __future__ import annotations

import sniffio


async def in_trio(fn, *args):
    """``fn(*args)`` in trio: grpclib's handlers run in asyncio (trio-asyncio), the simulation in trio."""
    if sniffio.current_async_library() == "asyncio":
        import trio_asyncio

        return await trio_asyncio.trio_as_aio(fn)(*args)
    return await fn(*args)

"""A real grpclib server in this process, on loopback, in front of the in-memory sim engine.

``grpc_pair(fast_path=...)`` is ``runtime/lifetime/server.py``'s gRPC side (the same
``GrpcServer``, ``VllmEngineService``, ``FrameWrites``, ``RequestHub`` and
trio-asyncio loop with its ready-callback batching) over a ``MemoryLink``
(the sim engine's core in a trio task, as ``tests/sim`` runs it), with no
journal file, no warm-up and no signals. Clients reach it over a real TCP
socket on 127.0.0.1, so every byte goes through h2, grpclib and, when on,
the fast path; the test can read the server's h2 state (``fastpath.flow_states``).
Real time (asyncio sockets do not run on trio's MockClock): the engine has
no cost model unless the caller gives one.
"""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
import trio_asyncio

from enginelink.journal.journal import Journal
from enginelink.machines.link import LinkEvent
from enginelink.machines.sim_core import SimConfig
from enginelink.runtime.context.app import App
from enginelink.runtime.lifetime.core import connect
from enginelink.runtime.rpc.fastpath import FrameWrites, GrpcServer, flow_states, run_ready_callbacks_together
from enginelink.runtime.contracts.vllm.service import VllmEngineService
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.engine.memory_link import MemoryLink

WALL_START = 1_700_000_000.0


class _Readiness:
    def __init__(self) -> None:
        self.value = False

    def set(self, value: bool) -> None:
        self.value = bool(value)


@dataclass
class Pair:
    port: int
    server: GrpcServer
    hub: RequestHub
    link: MemoryLink
    frame_writes: FrameWrites
    app: App

    def flow_states(self):
        return flow_states(self.server)


@asynccontextmanager
async def grpc_pair(model, tokenizer, *, fast_path: bool, sim: SimConfig | None = None, service=VllmEngineService):
    """``service``: the contract served over the sim's vLLM wire (vLLM's; MLX's speaks it too)."""
    journal = Journal(None, ring_records_max=200_000, ring_bytes_max=256 << 20)
    sim = sim or SimConfig(vocab_size=4096, max_model_len=2048, eos_token_id=2, instance_id="pair")
    link = MemoryLink(name="vllm-0", config=sim, journal=journal)
    hub = RequestHub(link=link.machine, codec=link.codec, send_frames=link.send, ranks=link.ranks, journal=journal,
                     edge=service.edge, tokenizer=tokenizer, cached_tokens=link.codec.cached_tokens)  # fmt: skip
    async with trio_asyncio.open_loop() as loop:
        run_ready_callbacks_together(loop)
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            app = App(link=link, hub=hub, journal=journal, model=model, served_model_name="test-model",
                      run_start_wall=WALL_START, run_start_trio=trio.current_time())  # fmt: skip
            frame_writes = FrameWrites(fast_path)
            hub.end_of_batch = frame_writes.flush
            server = GrpcServer([service(app, frame_writes)], fast_path=fast_path)
            connect(link, hub, app, _Readiness(), trio.Event())
            await nursery.start(link.run)
            link.step(LinkEvent.WARMUP_DONE)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            await trio_asyncio.aio_as_trio(server.start)(sock=sock)
            try:
                yield Pair(port, server, hub, link, frame_writes, app)
            finally:
                with trio.CancelScope(shield=True):
                    server.close()
                    with trio.move_on_after(5):
                        await trio_asyncio.aio_as_trio(server.wait_closed)()
                    await link.stop_engine()
                nursery.cancel_scope.cancel()

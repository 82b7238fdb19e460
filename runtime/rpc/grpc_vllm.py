"""``vllm.grpc.engine.VllmEngine`` served with grpclib (asyncio, under trio-asyncio).

Handlers are thin: validate, ask the hub, write what it produced. Every
exception leaves through ``to_grpc_error`` (the one status map). RPCs this
servicer does not offer raise UNIMPLEMENTED, as do all other engine services
(grpclib answers unknown paths with UNIMPLEMENTED), which the router's backend
detection relies on.
"""

from __future__ import annotations

import asyncio
import datetime

import trio
import trio_asyncio
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.proto.vllm_engine_grpc import VllmEngineBase
from enginelink.runtime.requests.contract_vllm import VLLM_EDGE
from enginelink.runtime.requests.embed import embed
from enginelink.runtime.errors import current_request_id, grpc_errors
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.rpc.fastpath import DirectSender, FrameWrites
from enginelink.runtime.lifetime.profiling import check_start_options, profile
from enginelink.runtime.kv.grpc_kv import FlushError, flush_cache, subscribe_kv_events
from enginelink.runtime.requests.inputs import input_limits, validate_abort_ids


class VllmEngineService(VllmEngineBase):
    # The contract's edge (runtime/requests/contract.py): its requests validated, the hub's messages encoded.
    # server.py builds the hub with it.
    edge = VLLM_EDGE

    def __init__(self, app, frame_writes: FrameWrites, kv_relay=None) -> None:
        self.app = app
        # The direct path's writes of one engine frame; the hub flushes them (server.py wires it).
        self.frame_writes = frame_writes
        self.kv_relay = kv_relay  # runtime.kv_relay.KvRelayShell; None: KV events are off

    # Where ``errors.grpc_errors`` reports a bug a handler hit.
    @property
    def journal(self):
        return self.app.journal

    @property
    def metrics(self):
        return self.app.hub.metrics

    # -- Generate / Abort -----------------------------------------------------------

    @grpc_errors
    async def Generate(self, stream) -> None:
        request = await stream.recv_message()
        current_request_id.set(request.request_id[: input_limits().request_id_bytes])  # for a bug report, if any
        # runtime/requests/generate.py: the one Generate loop (the simulation runs it too).
        # ENGINELINK_FAST_PATH off: no DirectSender; grpclib sends the headers once admitted, as the fast path does.
        direct = DirectSender(stream, self.frame_writes) if self.frame_writes.fast_path else None
        await generate(self.app, request, wake=asyncio.Event(), send=stream.send_message, direct=direct,
                       send_headers=stream.send_initial_metadata, edge=self.edge)

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        # The same id rules as Generate: no client may abort the servicer's own (warm-up) requests.
        request_ids = validate_abort_ids(request.request_ids, input_limits())
        self.app.hub.abort(request_ids, "abort_rpc", trio.current_time())
        await stream.send_message(pb.AbortResponse())

    # -- health and facts -----------------------------------------------------------

    @grpc_errors
    async def HealthCheck(self, stream) -> None:
        await stream.recv_message()
        link = self.app.link.machine
        await stream.send_message(pb.HealthCheckResponse(healthy=link.healthy, message=link.health_message))

    @grpc_errors
    async def GetModelInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(self.app.model_info())

    @grpc_errors
    async def GetServerInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(self.app.server_info())

    @grpc_errors
    async def GetLoads(self, stream) -> None:
        await stream.recv_message()
        app = self.app
        loads = app.loads.scheduler_loads(app.max_num_seqs, app.kv_capacity_tokens)
        await stream.send_message(
            pb.GetLoadsResponse(
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                version=str(app.link.ready.get("vllm_version", "")),
                dp_rank_count=len(loads),
                loads=loads,
            )
        )

    @grpc_errors
    async def GetTokenizer(self, stream) -> None:
        await stream.recv_message()
        chunks = self.app.tokenizer_chunks()
        for data, sha256 in chunks:
            await stream.send_message(common_pb2.GetTokenizerChunk(data=data, sha256=sha256))

    # -- KV cache (runtime/kv/grpc_kv.py) ----------------------------------------------

    @grpc_errors
    async def SubscribeKvEvents(self, stream) -> None:
        await subscribe_kv_events(self.kv_relay, stream)

    @grpc_errors
    async def FlushCache(self, stream) -> None:
        request = await stream.recv_message()
        try:
            reply = await trio_asyncio.trio_as_aio(flush_cache)(self.app.link, request.timeout_s)
        except FlushError as error:
            raise GRPCError(error.status, str(error)) from None
        await stream.send_message(reply)

    # -- Embed (runtime/requests/embed.py; UNIMPLEMENTED unless the engine is a pooling model) --

    @grpc_errors
    async def Embed(self, stream) -> None:
        request = await stream.recv_message()
        current_request_id.set(request.request_id[: input_limits().request_id_bytes])  # for a bug report, if any
        await stream.send_message(await embed(self.app, request, wake=asyncio.Event()))

    # -- profiling ------------------------------------------------------------------

    @grpc_errors
    async def StartProfile(self, stream) -> None:
        request = await stream.recv_message()
        check_start_options(request)
        await stream.send_message(await trio_asyncio.trio_as_aio(profile)(self.app.link, True))

    @grpc_errors
    async def StopProfile(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(await trio_asyncio.trio_as_aio(profile)(self.app.link, False))


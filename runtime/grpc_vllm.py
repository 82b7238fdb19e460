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
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.proto.vllm_engine_grpc import VllmEngineBase
from enginelink.runtime.errors import ServicerError, grpc_errors, to_grpc_error
from enginelink.runtime.validate import validate_generate


class VllmEngineService(VllmEngineBase):
    def __init__(self, app) -> None:
        self.app = app

    # -- Generate / Abort -----------------------------------------------------------

    @grpc_errors
    async def Generate(self, stream) -> None:
        request = await stream.recv_message()
        app = self.app
        hub = app.hub
        now = trio.current_time()
        try:
            spec = validate_generate(request, app.limits, app.wall_time(now))
            call = hub.admit(spec, now)
        except ServicerError as error:
            app.refused(request.request_id, error, now)
            raise to_grpc_error(error) from None
        try:
            wake = call.wake
            while True:
                await wake.wait()
                wake.clear()
                if call.error is not None:
                    raise to_grpc_error(call.error)
                for message in hub.take(call, trio.current_time()):
                    await stream.send_message(message)
                if call.done:
                    return
        except asyncio.CancelledError:
            # The client went away (or the router cancelled a non-streaming call):
            # that is an abort, and the engine must stop working on it.
            hub.abort([call.spec.request_id], "client_gone", trio.current_time())
            raise

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        self.app.hub.abort(list(request.request_ids), "abort_rpc", trio.current_time())
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

    # -- not offered (yet) ----------------------------------------------------------

    @grpc_errors
    async def Embed(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "Embed: this worker serves a generation model")

    @grpc_errors
    async def SubscribeKvEvents(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "SubscribeKvEvents is not offered by this enginelink build")

    @grpc_errors
    async def FlushCache(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "FlushCache is not offered by this enginelink build")

    @grpc_errors
    async def StartProfile(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "StartProfile is not offered by this enginelink build")

    @grpc_errors
    async def StopProfile(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "StopProfile is not offered by this enginelink build")


"""``vllm.grpc.engine.VllmEngine`` served with grpclib (asyncio, under trio-asyncio).

Handlers are thin: validate, ask the hub, write what it produced. Every
exception leaves through ``to_grpc_error`` (the one status map). RPCs this
servicer does not offer raise UNIMPLEMENTED, as do all other engine services
(grpclib answers unknown paths with UNIMPLEMENTED), which the router's backend
detection relies on.
"""

from __future__ import annotations

import asyncio

import trio
import trio_asyncio
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.proto.vllm_engine_grpc import VllmEngineBase
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.contracts.vllm import facts
from enginelink.runtime.requests.embed import EmbedInput, embed
from enginelink.runtime.errors import current_request_id, grpc_errors
from enginelink.runtime.contracts.shared.service_common import ContractService
from enginelink.runtime.contracts.vllm.profiling import check_start_options, profile
from enginelink.runtime.contracts.shared.grpc_kv import FlushError, flush_cache
from enginelink.runtime.requests.inputs import input_limits, validate_abort_ids


class VllmEngineService(ContractService, VllmEngineBase):
    # The contract's edge (runtime/requests/contract.py): its requests validated, the hub's messages encoded.
    # server.py builds the hub with it.
    edge = VLLM_EDGE
    health_reply = pb.HealthCheckResponse
    # Generate, HealthCheck, GetTokenizer, SubscribeKvEvents: ContractService's (runtime/contracts/shared/service_common.py).

    # -- Abort ------------------------------------------------------------------------

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        # The same id rules as Generate: no client may abort the servicer's own (warm-up) requests.
        request_ids = validate_abort_ids(request.request_ids, input_limits())
        self.app.hub.abort(request_ids, "abort_rpc", trio.current_time())
        await stream.send_message(pb.AbortResponse())

    # -- facts ------------------------------------------------------------------------

    @grpc_errors
    async def GetModelInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(facts.model_info(self.app))

    @grpc_errors
    async def GetServerInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(facts.server_info(self.app))

    @grpc_errors
    async def GetLoads(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(facts.loads(self.app))

    # -- KV cache (runtime/contracts/shared/grpc_kv.py) ----------------------------------------------

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
        # Not copied: Embed judges their number first (runtime/requests/embed.py).
        tokens = request.tokenized.input_ids if request.HasField("tokenized") else None
        reply = await embed(self.app, EmbedInput(request.request_id, tokens), wake=asyncio.Event())
        await stream.send_message(pb.EmbedResponse(embedding=reply.embedding, prompt_tokens=reply.prompt_tokens,
                                                   embedding_dim=reply.embedding_dim))

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


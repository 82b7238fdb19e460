"""``mlx.grpc.engine.MlxEngine`` served with grpclib: what ``enginelink serve --engine mlx`` offers.

Six RPCs (reference/mlx.md §1): Generate, Abort, HealthCheck, GetModelInfo,
GetServerInfo, GetTokenizer. The MLX engine process speaks vLLM's headless
wire (``tools/mlx_engine.py``), so everything under the contract, the link,
request core, hub, journal, drain and death handling, is the vLLM contract's
own; the edge (``runtime/requests/contract_mlx.py``) is what differs.
Handlers are thin, and every exception leaves through ``errors.grpc_errors``
(the one status map). ``VllmEngine`` and every other engine service answer
UNIMPLEMENTED (grpclib does for paths it does not serve): the router tells
backends apart by that.
"""

from __future__ import annotations

import asyncio

import trio
from smg_grpc_proto.generated import common_pb2, mlx_engine_pb2 as pb

from enginelink.proto.mlx_engine_grpc import MlxEngineBase
from enginelink.runtime.errors import current_request_id, grpc_errors
from enginelink.runtime.requests.contract_mlx import MLX_EDGE, SERVER_TYPE
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.requests.inputs import input_limits, validate_abort_ids
from enginelink.runtime.rpc.fastpath import DirectSender, FrameWrites


class MlxEngineService(MlxEngineBase):
    # The contract's edge: server.py builds the hub with it.
    edge = MLX_EDGE

    def __init__(self, app, frame_writes: FrameWrites, kv_relay=None) -> None:
        self.app = app
        self.frame_writes = frame_writes  # the hub flushes the direct path's writes once per engine frame
        # MLX has no SubscribeKvEvents (the router disables KV events for MLX workers); serve
        # builds no relay for it, and the argument is only the services' common signature.
        del kv_relay

    # Where ``errors.grpc_errors`` reports a bug a handler hit.
    @property
    def journal(self):
        return self.app.journal

    @property
    def metrics(self):
        return self.app.hub.metrics

    @grpc_errors
    async def Generate(self, stream) -> None:
        request = await stream.recv_message()
        current_request_id.set(request.request_id[: input_limits().request_id_bytes])  # for a bug report, if any
        direct = DirectSender(stream, self.frame_writes) if self.frame_writes.fast_path else None
        await generate(self.app, request, wake=asyncio.Event(), send=stream.send_message, direct=direct,
                       send_headers=stream.send_initial_metadata, edge=self.edge)

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        # A list of ids, unlike SGLang's one; the same id rules as Generate (no client aborts a warm-up call).
        request_ids = validate_abort_ids(request.request_ids, input_limits())
        self.app.hub.abort(request_ids, "abort_rpc", trio.current_time())
        await stream.send_message(pb.AbortResponse())

    @grpc_errors
    async def HealthCheck(self, stream) -> None:
        await stream.recv_message()
        # The link's view (starting, serving, draining, failed), not the reference's "the thread is alive".
        link = self.app.link.machine
        # "OK" once serving, as the reference MLX servicer says; otherwise the state (warming up, draining, ...).
        message = "OK" if link.ready else link.health_message
        await stream.send_message(pb.HealthCheckResponse(healthy=link.healthy, message=message))

    @grpc_errors
    async def GetModelInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(model_info(self.app))

    @grpc_errors
    async def GetServerInfo(self, stream) -> None:
        await stream.recv_message()
        app = self.app
        await stream.send_message(pb.GetServerInfoResponse(
            server_type=SERVER_TYPE, active_requests=app.hub.active_requests, uptime_seconds=app.uptime_s()))

    @grpc_errors
    async def GetTokenizer(self, stream) -> None:
        await stream.recv_message()
        for data, sha256 in self.app.tokenizer_chunks():
            await stream.send_message(common_pb2.GetTokenizerChunk(data=data, sha256=sha256))


def model_info(app) -> pb.GetModelInfoResponse:
    """The model directory's facts in MLX's shape (reference/mlx.md §5); the context is the engine's once it is up."""
    model = app.model
    max_len = int(app.ready.get("max_model_len") or model.max_position_embeddings or 0)
    return pb.GetModelInfoResponse(
        model_path=str(model.model_path),
        is_generation=True,
        max_context_length=max_len,
        vocab_size=model.vocab_size,
        served_model_name=app.served_model_name,
        model_type=model.model_type or "",
        architectures=list(model.architectures),
        eos_token_ids=list(model.eos_token_ids),
        pad_token_id=model.pad_token_id or 0,
        bos_token_id=model.bos_token_id or 0,
        max_req_input_len=max_len,
    )

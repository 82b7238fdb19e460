"""``mlx.grpc.engine.MlxEngine`` served with grpclib: what ``enginelink serve --engine mlx`` offers.

Six RPCs (reference/mlx.md §1): Generate, Abort, HealthCheck, GetModelInfo,
GetServerInfo, GetTokenizer. The MLX engine process speaks vLLM's headless
wire (``tools/mlx_engine.py``), so everything under the contract, the link,
request core, hub, journal, drain and death handling, is the vLLM contract's
own; the edge (``runtime/contracts/mlx/edge.py``) is what differs.
Handlers are thin, and every exception leaves through ``errors.grpc_errors``
(the one status map). ``VllmEngine`` and every other engine service answer
UNIMPLEMENTED (grpclib does for paths it does not serve): the router tells
backends apart by that.
"""

from __future__ import annotations

import trio
from smg_grpc_proto.generated import mlx_engine_pb2 as pb

from enginelink.proto.mlx_engine_grpc import MlxEngineBase
from enginelink.runtime.errors import grpc_errors
from enginelink.runtime.contracts.mlx.edge import MLX_EDGE, SERVER_TYPE
from enginelink.runtime.context.facts import context_len
from enginelink.runtime.contracts.shared.facts import model_fields
from enginelink.runtime.requests.inputs import input_limits, validate_abort_ids
from enginelink.runtime.rpc.fastpath import FrameWrites
from enginelink.runtime.contracts.shared.service_common import ContractService


class MlxEngineService(ContractService, MlxEngineBase):
    # The contract's edge: server.py builds the hub with it.
    edge = MLX_EDGE

    # Generate, GetTokenizer: ContractService's (runtime/contracts/shared/service_common.py).

    def __init__(self, app, frame_writes: FrameWrites, kv_relay=None) -> None:
        # MLX has no SubscribeKvEvents (the router disables KV events for MLX workers); serve
        # builds no relay for it, and the argument is only the services' common signature.
        super().__init__(app, frame_writes, None)

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


def model_info(app) -> pb.GetModelInfoResponse:
    """The model directory's facts in MLX's shape (reference/mlx.md §5); the context is the engine's once it is up."""
    max_len = context_len(app)
    return pb.GetModelInfoResponse(**model_fields(app), is_generation=True, max_context_length=max_len,
                                   max_req_input_len=max_len)

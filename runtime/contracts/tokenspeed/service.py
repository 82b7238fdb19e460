"""``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` served with grpclib, beside vLLM's (``contracts/vllm/service.py``).

The same shape as the vLLM service: thin handlers, every exception through
``errors.grpc_errors``, the one Generate loop (``runtime/requests/generate.py``)
with this contract's edge (``runtime/contracts/tokenspeed/edge.py``). What
is TokenSpeed's own (``reference/tokenspeed.md`` §1, §4):

- Abort is ``{request_id, reason}`` → ``{success, message}``; aborting an id
  ends the call and with it every child ``<id>-n<i>``; nothing open →
  ``success=false``, "Request X not found";
- GetModelInfo / GetServerInfo / GetLoads have TokenSpeed's messages
  (``server_args`` a Struct, credentials redacted; ``tokenspeed_version``;
  per-rank loads plus an aggregate; UNAVAILABLE until the engine's KV
  geometry is known);
- FlushCache / StartProfile / StopProfile: TokenSpeed 0.1.1's handshake
  declares no control replies (its wire drops them), so they answer
  UNIMPLEMENTED after checking the request, as the reference's Rust path does;
- no Embed (the contract has none), no LoRA.
"""

from __future__ import annotations

import math

import trio
from google.protobuf import struct_pb2
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from enginelink.proto.tokenspeed_scheduler_grpc import TokenSpeedSchedulerBase
from enginelink.runtime.engine.grammar_labels import CONSTRAINED_DECODING_START_KEY, FIRST_TOKEN, tokenspeed_labels
from enginelink.runtime.errors import Unavailable, grpc_errors
from enginelink.runtime.contracts.shared.grpc_kv import FLUSH_BAD_TIMEOUT, KV_OFF_MESSAGE_TOKENSPEED
from enginelink.runtime.contracts.tokenspeed.edge import TOKENSPEED_EDGE, TokenSpeedEdge
from enginelink.runtime.context.facts import context_len
from enginelink.runtime.contracts.shared.facts import model_fields, scheduler_load
from enginelink.runtime.requests.inputs import check_request_id, input_limits
from enginelink.runtime.requests.pd_bootstrap import PdLeg
from enginelink.runtime.rpc.fastpath import FrameWrites
from enginelink.runtime.contracts.shared.service_common import ContractService, aggregate, now_iso, start_time
from enginelink.wire.tokenspeed import ENGINE_VERSION_PREFIX, TOKENSPEED_VERSION

SERVICE = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
NO_CONTROL = (f"TokenSpeed {TOKENSPEED_VERSION}'s headless wire carries no control replies "
              "(its handshake declares none), so {rpc} has no path to the engine")


class TokenSpeedSchedulerService(ContractService, TokenSpeedSchedulerBase):
    edge = TOKENSPEED_EDGE
    health_reply = pb.HealthCheckResponse
    name = SERVICE
    stamped = True  # every response carries request_id (ContractService.Generate stamps them)
    kv_off_message = KV_OFF_MESSAGE_TOKENSPEED
    # HealthCheck, GetTokenizer, SubscribeKvEvents: ContractService's (runtime/contracts/shared/service_common.py).

    def __init__(self, app, frame_writes: FrameWrites, kv_relay=None) -> None:
        super().__init__(app, frame_writes, kv_relay)
        # GetServerInfo's launch facts (the engine's arguments, redacted); ``configure`` sets them.
        self.server_args: dict = {}
        self.constrained_decoding = ""  # the engine's declared policy (always / requested), when it declares one

    def configure(self, launcher) -> None:
        """What this service learns from the engine's launch (server.py calls it once, before serving)."""
        labels, self.constrained_decoding = tokenspeed_labels(list(launcher.extra_args))
        self.server_args = {"engine_args": launcher.redacted(list(launcher.extra_args)), **labels}
        # Without --enable-output-logprobs TokenSpeed pre-aborts a request for logprobs: refused here instead.
        self.edge = TokenSpeedEdge(output_logprobs=getattr(launcher, "output_logprobs", True))

    # -- Generate / Abort -----------------------------------------------------------

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        # The same id rules as Generate: no client may abort the servicer's own (warm-up) requests.
        check_request_id("request_id", request.request_id, input_limits())
        # The call is the unit: its children <id>-n<i> end with it (RequestCore.abort).
        aborted = self.app.hub.abort([request.request_id], "abort_rpc", trio.current_time())
        if aborted:
            reply = pb.AbortResponse(success=True, message=f"Aborted request {request.request_id}")
        else:
            reply = pb.AbortResponse(success=False, message=f"Request {request.request_id} not found")
        await stream.send_message(reply)

    # -- health and facts -----------------------------------------------------------

    @grpc_errors
    async def GetModelInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(model_info(self.app))

    @grpc_errors
    async def GetServerInfo(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(server_info(self.app, self.server_args, self.constrained_decoding))

    @grpc_errors
    async def GetLoads(self, stream) -> None:
        request = await stream.recv_message()
        await stream.send_message(loads(self.app, request))

    # -- control calls: none on TokenSpeed 0.1.1's wire -----------------------------

    @grpc_errors
    async def FlushCache(self, stream) -> None:
        request = await stream.recv_message()
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            raise GRPCError(Status.INVALID_ARGUMENT, FLUSH_BAD_TIMEOUT)
        raise GRPCError(Status.UNIMPLEMENTED, NO_CONTROL.format(rpc="FlushCache"))

    @grpc_errors
    async def StartProfile(self, stream) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, NO_CONTROL.format(rpc="StartProfile"))

    @grpc_errors
    async def StopProfile(self, stream) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, NO_CONTROL.format(rpc="StopProfile"))


# -- the facts, in TokenSpeed's messages --------------------------------------------------


def _ready(app) -> dict:
    ready = app.ready
    if not ready:
        raise Unavailable("engine is starting; retry on another worker or later")
    return ready


def model_info(app) -> pb.GetModelInfoResponse:
    model, ready = app.model, _ready(app)
    max_len = context_len(app)
    return pb.GetModelInfoResponse(
        **model_fields(app),
        tokenizer_path=model.tokenizer_path,
        max_context_length=max_len,
        max_req_input_len=max_len - 1,  # at least one token of room to generate (the edge's check)
        default_sampling_params_json=model.default_sampling_params_json,
        supports_vision=False,
        supports_multimodal=False,
        model_dtype=str(ready.get("dtype") or model.dtype or ""),
        multimodal_encoder_dtype=str(ready.get("multimodal_encoder_dtype") or ""),
    )


def engine_version(ready: dict) -> str:
    """The release from the ready response's ``tokenspeed-<release>``."""
    version = str(ready.get("vllm_version") or "")
    return version.removeprefix(ENGINE_VERSION_PREFIX)


def server_info(app, server_args: dict, constrained_decoding: str = "") -> pb.GetServerInfoResponse:
    ready = _ready(app)
    args = struct_pb2.Struct()
    args.update({
        "model_path": str(app.model.model_path),
        "served_model_name": app.served_model_name,
        "context_length": int(ready.get("max_model_len") or 0),
        "dp_size": app.link.ranks.size,
        CONSTRAINED_DECODING_START_KEY: FIRST_TOKEN,  # TokenSpeed's grammar runs from the first token
        **server_args,  # the engine's arguments and the labels resolved from them (``configure``)
        # The PD role the router pairs legs by, and the operator's pairing protocol (pd_bootstrap.py).
        **PdLeg.of(ready).server_fields(),
    })
    scheduler = struct_pb2.Struct()
    scheduler.update({
        "max_total_num_tokens": app.kv_capacity_tokens,
        "max_running_requests": app.max_num_seqs,
        "max_num_batched_tokens": int(ready.get("max_num_batched_tokens") or 0),
        "page_size": int(ready.get("prefix_granularity") or ready.get("block_size") or 0),
    })
    return pb.GetServerInfoResponse(
        server_args=args,
        scheduler_info=scheduler,
        active_requests=app.hub.active_requests,
        is_paused=False,
        uptime_seconds=app.uptime_s(),
        max_total_num_tokens=app.kv_capacity_tokens,
        tokenspeed_version=engine_version(ready),
        start_time=start_time(app),
        # The engine's declared policy (a grammar on every turn, or when asked), only when it declares one.
        **({"constrained_decoding": constrained_decoding} if constrained_decoding else {}),
    )


def loads(app, request: pb.GetLoadsRequest) -> pb.GetLoadsResponse:
    ready = _ready(app)
    capacity = app.kv_capacity_tokens
    if capacity <= 0:
        raise Unavailable("KV page geometry is unavailable", reason="no_kv_geometry")
    ranks = [scheduler_load(pb.SchedulerLoad, load) for load in app.loads.rank_loads(app.max_num_seqs, capacity)]
    if request.HasField("dp_rank"):
        ranks = [load for load in ranks if load.dp_rank == request.dp_rank]
    return pb.GetLoadsResponse(
        timestamp=now_iso(),
        version=engine_version(ready),
        dp_rank_count=len(ranks),
        loads=ranks,
        aggregate=aggregate(pb, ranks),
    )

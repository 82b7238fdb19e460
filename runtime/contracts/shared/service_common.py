"""What the four contracts' gRPC services (vLLM, MLX, SGLang, TokenSpeed) share, written once.

Each service (its wing's ``service.py``) is a grpclib base for its proto with this mixin
before it: the mixin's handlers fill the base's abstract methods, and a
service overrides one where its contract answers differently (SGLang's
HealthCheck probes the engine, MLX's says "OK", TokenSpeed's Generate stamps
its messages). The facts' shared pieces (the scheduler aggregate, the start
time) are plain functions over the contract's proto module.
"""

from __future__ import annotations

import datetime

from google.protobuf import timestamp_pb2
from smg_grpc_proto.generated import common_pb2

from enginelink.runtime.errors import current_request_id, grpc_errors
from enginelink.runtime.contracts.shared.grpc_kv import KV_OFF_MESSAGE, subscribe_kv_events
from enginelink.runtime.contracts.shared.call_stamp import CallStamp
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.requests.inputs import input_limits
from enginelink.runtime.rpc.fastpath import DirectSender, FrameWrites
from enginelink.runtime.rpc.stream_memory import WakeEvent


class ContractService:
    """The handlers that are the same in every contract, and the attributes ``errors.grpc_errors`` reads.

    A subclass sets ``edge`` (its wing's ``edge.py``; server.py builds the hub
    with it) and ``health_reply`` (its proto's ``HealthCheckResponse``).
    """

    edge = None
    health_reply = None
    # Every response repeats the call's request_id (SGLang's and TokenSpeed's protos, as their references do).
    stamped = False
    # SubscribeKvEvents' UNIMPLEMENTED when KV events are off: the reference's words for the contract's engine.
    kv_off_message = KV_OFF_MESSAGE

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

    @grpc_errors
    async def Generate(self, stream) -> None:
        tracing = self.app.tracing
        if tracing is None:
            return await self._generate(stream)
        # runtime/lifetime/tracing.py: this call's span, in the trace its metadata carries (the router's
        # traceparent); the records its call journals are folded into it until it ends here.
        with tracing.call(stream.metadata):
            await self._generate(stream)

    async def _generate(self, stream) -> None:
        request = await stream.recv_message()
        current_request_id.set(request.request_id[: input_limits().request_id_bytes])  # for a bug report, if any
        # runtime/requests/generate.py: the one Generate loop (the simulation runs it too).
        # ENGINELINK_FAST_PATH off: no DirectSender; grpclib sends the headers once admitted, as the fast path does.
        if not self.stamped:
            direct = DirectSender(stream, self.frame_writes) if self.frame_writes.fast_path else None
            await generate(self.app, request, wake=WakeEvent(), send=stream.send_message, direct=direct,
                           send_headers=stream.send_initial_metadata, edge=self.edge)
            return
        stamp = CallStamp(request.request_id, request.stream)  # runtime/contracts/shared/call_stamp.py

        async def send(message) -> None:
            await stream.send_message(stamp.stamp(message))

        direct = StampedSender(stream, self.frame_writes, stamp) if self.frame_writes.fast_path else None
        await generate(self.app, request, wake=WakeEvent(), send=send, direct=direct,
                       send_headers=stream.send_initial_metadata, edge=self.edge)

    @grpc_errors
    async def HealthCheck(self, stream) -> None:
        await stream.recv_message()
        link = self.app.link.machine  # the link's view: starting, serving, draining, failed
        await stream.send_message(self.health_reply(healthy=link.healthy, message=link.health_message))

    @grpc_errors
    async def GetTokenizer(self, stream) -> None:
        await stream.recv_message()
        for data, sha256 in self.app.tokenizer_chunks():
            await stream.send_message(common_pb2.GetTokenizerChunk(data=data, sha256=sha256))

    @grpc_errors
    async def SubscribeKvEvents(self, stream) -> None:
        # runtime/contracts/shared/grpc_kv.py; a contract whose proto has no such RPC (MLX) never routes here.
        await subscribe_kv_events(self.kv_relay, stream, self.kv_off_message)


class StampedSender(DirectSender):
    """The fast path's sender for a stamped contract: each message gets its call's ``request_id`` first."""

    __slots__ = ("_stamp",)

    def __init__(self, stream, writes: FrameWrites, stamp: CallStamp) -> None:
        super().__init__(stream, writes)
        self._stamp = stamp

    def send(self, messages) -> int:
        stamp = self._stamp.stamp
        return self.send_bodies([stamp(message).SerializeToString() for message in messages])


def now_iso() -> str:
    """A loads reply's timestamp: now, UTC, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def start_time(app) -> timestamp_pb2.Timestamp:
    """When this run started (wall clock, whole seconds), as a server info's ``start_time``."""
    start = timestamp_pb2.Timestamp()
    start.FromSeconds(int(app.run_start_wall))
    return start


def aggregate(pb, loads):
    """The contract's ``AggregateMetrics`` over its per-rank ``SchedulerLoad``s (SGLang's and TokenSpeed's)."""
    count = len(loads) or 1
    return pb.AggregateMetrics(
        total_running_reqs=sum(load.num_running_reqs for load in loads),
        total_waiting_reqs=sum(load.num_waiting_reqs for load in loads),
        total_reqs=sum(load.num_total_reqs for load in loads),
        avg_token_usage=sum(load.token_usage for load in loads) / count,
        avg_throughput=sum(load.gen_throughput for load in loads) / count,
        avg_utilization=sum(load.utilization for load in loads) / count,
    )

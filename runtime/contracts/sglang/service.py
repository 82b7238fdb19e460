"""``sglang.grpc.scheduler.SglangScheduler`` served with grpclib, over the same hub as vLLM's contract.

The router detects an SGLang worker by this service answering (every other
engine service is UNIMPLEMENTED: grpclib answers unknown paths so). Handlers
are thin, as in vLLM's (``contracts/vllm/service.py``): Generate goes through the one Generate loop
with SGLang's edge (``runtime/contracts/sglang/edge.py``); Embed through the
one Embed path; every exception leaves through ``errors.grpc_errors``.

SGLang's semantics where they differ from vLLM's (``reference/sglang-contract.md`` §1):
- ``Abort`` answers ``{success, message}`` and never a gRPC error;
- ``HealthCheck`` is a real one-token greedy generation through the hub
  (a reserved id, so no client can take or abort it), bounded by
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); concurrent checks share one probe;
- ``GetLoads`` checks ``include`` (``core memory spec lora disagg queues all``);
  SGLang's wire carries no load, so a rank's running count is the hub's;
- ``FlushCache`` / profiling forward the scheduler's own ``success`` and message;
- the three LoRA RPCs answer UNIMPLEMENTED with a message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

import trio
import trio_asyncio
from google.protobuf import struct_pb2
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2 as pb

from enginelink.machines.link import WARMUP_REQUEST_PREFIX
from enginelink.runtime.engine.grammar_labels import sglang_labels
from enginelink.runtime.engine.mm_item_limits import MM_ITEM_LIMITS_KEY, format_item_limits, item_limits
from enginelink.machines.warmup import WarmupRequest
from enginelink.proto.sglang_scheduler_grpc import SglangSchedulerBase
from enginelink.runtime.errors import ClientError, current_request_id, grpc_errors
from enginelink.runtime.errors import ServicerError
from enginelink.runtime.contracts.shared.grpc_kv import KV_OFF_MESSAGE_SGLANG, retrieve_outcome
from enginelink.runtime.context.submit import Outcome, TrioWake, hub_submit
from enginelink.runtime.contracts.sglang.edge import SGLANG_EDGE
from enginelink.runtime.requests.embed import RUNNER_POOLING, EmbedCall, EmbedInput, embed, runner_type
from enginelink.wire.engine import GenerateSpec, PoolingSpec, SamplingSpec
from enginelink.runtime.context.facts import context_len
from enginelink.runtime.context.loads import RankLoad
from enginelink.runtime.contracts.shared.facts import model_fields, scheduler_load
from enginelink.runtime.requests.inputs import input_limits, validate_abort_ids
from enginelink.runtime.requests.pd_bootstrap import PdLeg
from enginelink.runtime.rpc.fastpath import FrameWrites
from enginelink.runtime.contracts.shared.service_common import ContractService, aggregate, now_iso, start_time
from enginelink.wire.sglang import SGLANG_VERSION

# The reference's probe bound (SGLANG_HEALTH_CHECK_TIMEOUT, seconds).
HEALTH_CHECK_TIMEOUT_S_DEFAULT = 20.0
HEALTH_PROBE_PREFIX = f"{WARMUP_REQUEST_PREFIX}health-"
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
# Entries of one GetLoads ``include``: every section several times over; a list of millions would
# hold the event loop while it is walked.
LOAD_INCLUDE_MAX = 64
# A control call's own bound: the reference's communicator waits max(30, timeout_s + 10).
CONTROL_TIMEOUT_S_MIN = 30.0


HEALTH_CHECK_TIMEOUT_KNOBS = ("SGLANG_HEALTH_CHECK_TIMEOUT", "ENGINELINK_HEALTH_CHECK_TIMEOUT_SECS")


def health_check_timeout_s(environ=os.environ) -> float:
    """The probe's bound; ``ValueError`` naming the knob for a value that is not a positive number
    (``serve`` checks it before anything starts: exit 2)."""
    for name in HEALTH_CHECK_TIMEOUT_KNOBS:
        value = environ.get(name)
        if value:
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: expected a number of seconds") from None
            if not (seconds > 0 and seconds != float("inf")):
                raise ValueError(f"{name}={value!r}: must be a positive number of seconds")
            return seconds
    return HEALTH_CHECK_TIMEOUT_S_DEFAULT


class SglangSchedulerService(ContractService, SglangSchedulerBase):
    edge = SGLANG_EDGE
    stamped = True  # every response carries request_id, as the reference's do
    kv_off_message = KV_OFF_MESSAGE_SGLANG
    # Generate, GetTokenizer, SubscribeKvEvents: ContractService's (runtime/contracts/shared/service_common.py).

    def __init__(self, app, frame_writes: FrameWrites, kv_relay=None) -> None:
        super().__init__(app, frame_writes, kv_relay)
        self.health_timeout_s = health_check_timeout_s()
        self._probe: asyncio.Future | None = None  # the health probe in flight, shared by concurrent checks
        self._probe_ids = itertools.count(1)

    # -- Abort ------------------------------------------------------------------------

    @grpc_errors
    async def Abort(self, stream) -> None:
        request = await stream.recv_message()
        try:
            # The Generate id rules: no client aborts the servicer's own (warm-up, health) requests.
            ids = validate_abort_ids([request.request_id], input_limits())
        except ClientError as error:
            await stream.send_message(pb.AbortResponse(success=False, message=str(error)))
            return
        aborted = self.app.hub.abort(ids, "abort_rpc", trio.current_time())
        message = f"aborted {request.request_id}" if aborted else f"{request.request_id} is not running"
        await stream.send_message(pb.AbortResponse(success=True, message=message))

    # -- health ---------------------------------------------------------------------

    @grpc_errors
    async def HealthCheck(self, stream) -> None:
        await stream.recv_message()
        link = self.app.link.machine
        if not link.healthy:
            await stream.send_message(pb.HealthCheckResponse(healthy=False, message=link.health_message))
            return
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(trio_asyncio.trio_as_aio(self._run_probe)())
            # Shared by concurrent checks, all of which may be cancelled before it ends: an error
            # nobody awaited would end the servicer (trio-asyncio raises unretrieved task errors).
            self._probe.add_done_callback(retrieve_outcome)
        healthy, message = await asyncio.shield(self._probe)
        await stream.send_message(pb.HealthCheckResponse(healthy=healthy, message=message))

    async def _run_probe(self) -> tuple[bool, str]:
        """One greedy token through the hub and the engine, within the health timeout (trio)."""
        app = self.app
        request = WarmupRequest(request_id=f"{HEALTH_PROBE_PREFIX}{next(self._probe_ids)}", ordinal=0, prompt_len=1,
                                max_tokens=1, vocab=app.model.vocab_size)
        outcome = None
        with trio.move_on_after(self.health_timeout_s):
            if runner_type(app.ready) == RUNNER_POOLING:  # an embedding model: the probe is an embedding
                outcome = await self._embed_probe(request)
            else:
                outcome = await hub_submit(app.hub, app.limits)(request, self.health_timeout_s)
        if outcome is None:
            return False, f"the engine did not generate a token within {self.health_timeout_s:g} s"
        if outcome == Outcome.OK:
            return True, "OK"
        return False, f"the engine did not serve the health probe ({outcome}); {app.link.machine.health_message}"

    async def _embed_probe(self, request: WarmupRequest) -> str:
        """One embedding of the probe's prompt through the hub (trio); an ``Outcome``."""
        hub, now = self.app.hub, trio.current_time()
        prompt = request.prompt_token_ids
        spec = GenerateSpec(request_id=request.request_id, prompt_token_ids=prompt,
                            sampling=SamplingSpec(max_tokens=1), arrival_time=now, pooling=PoolingSpec(task="embed"))
        wake = TrioWake()
        try:
            call = hub.admit(EmbedCall(request.request_id, False, prompt, [spec], max_tokens=0,
                                       engine_ids=[request.request_id]), now, wake=wake)
        except ServicerError:
            return Outcome.REFUSED
        choice = call.choices[0]
        try:
            while call.error is None and not choice.finished:
                await wake.wait()
                wake.clear()
            if call.error is None:
                hub.take(call, trio.current_time())
        finally:
            if call.machine.open:
                hub.abort([request.request_id], "warmup_cancelled", trio.current_time())
            hub.release(call)
        return Outcome.OK if call.error is None and choice.pooled is not None else Outcome.FAILED

    # -- facts ----------------------------------------------------------------------

    @grpc_errors
    async def GetModelInfo(self, stream) -> None:
        await stream.recv_message()
        app, model = self.app, self.app.model
        ready = app.ready
        max_len = context_len(app)
        await stream.send_message(pb.GetModelInfoResponse(
            **model_fields(app), tokenizer_path=model.tokenizer_path,
            is_generation=ready.get("runner_type") != "pooling", max_context_length=max_len,
            # The engine's own answer (its ready report: SGLang's ModelConfig, runtime/contracts/sglang/sglang_headless.py);
            # router tensors are taken only then (runtime/contracts/sglang/mm_inputs.py).
            supports_vision=bool(ready.get("supports_vision", model.supports_vision)),
            max_req_input_len=int(ready.get("max_req_input_len") or max(max_len - 1, 0)),
            default_sampling_params_json=model.default_sampling_params_json,
        ))

    @grpc_errors
    async def GetServerInfo(self, stream) -> None:
        await stream.recv_message()
        app = self.app
        ready = app.ready
        # The scheduler's arguments as it resolved them (its ready report), with the labels derived from them.
        resolved = dict(ready.get("server_args") or {})
        server_args = struct_pb2.Struct()
        server_args.update({
            **resolved,
            "model_path": str(app.model.model_path), "served_model_name": app.served_model_name,
            "skip_tokenizer_init": bool(resolved.get("skip_tokenizer_init")), "dp_size": app.link.ranks.size,
            "max_running_requests": int(ready.get("max_running_requests") or 0),
            **sglang_labels(resolved),
            # The PD role the router pairs legs by, and the operator's pairing protocol (pd_bootstrap.py).
            **PdLeg.of(ready).server_fields(),
        })
        # The engine's own per-request media counts, flat, for the router's media pipeline (its precomputed
        # inputs bypass the engine's front end, which checks them): the reference adds them only when set.
        limits = format_item_limits(item_limits(resolved.get("limit_mm_data_per_request")))
        if limits:
            server_args.update({MM_ITEM_LIMITS_KEY: limits})
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(json.loads(json.dumps({k: v for k, v in ready.items() if k != "server_args"},
                                                    default=str)))
        await stream.send_message(pb.GetServerInfoResponse(
            server_args=server_args, scheduler_info=scheduler_info, active_requests=app.hub.active_requests,
            is_paused=False, last_receive_timestamp=app.hub.last_receive_wall, uptime_seconds=app.uptime_s(),
            sglang_version=SGLANG_VERSION, server_type="grpc", start_time=start_time(app),
            max_total_num_tokens=int(ready.get("max_total_num_tokens") or 0),
        ))

    @grpc_errors
    async def GetLoads(self, stream) -> None:
        request = await stream.recv_message()
        if len(request.include) > LOAD_INCLUDE_MAX:  # by its length, before it is walked (issue 38)
            raise GRPCError(Status.INVALID_ARGUMENT, f"include: {len(request.include)} sections; at most "
                            f"{LOAD_INCLUDE_MAX} (there are {len(LOAD_SECTIONS)})")
        for section in request.include:
            if section not in LOAD_SECTIONS:
                raise GRPCError(Status.INVALID_ARGUMENT,
                                f"include: unknown section {section!r}; known: {', '.join(LOAD_SECTIONS)}")
        app = self.app
        ready = app.ready
        capacity = int(ready.get("max_total_num_tokens") or 0)
        loads = [_sglang_load(load, app.hub.active_requests)
                 for load in app.loads.rank_loads(app.max_num_seqs, capacity)]
        if request.HasField("dp_rank"):
            if not any(load.dp_rank == request.dp_rank for load in loads):
                raise GRPCError(Status.INVALID_ARGUMENT, f"dp_rank {request.dp_rank}: this worker has ranks "
                                f"{[load.dp_rank for load in loads]}")
            loads = [load for load in loads if load.dp_rank == request.dp_rank]
        await stream.send_message(pb.GetLoadsResponse(
            timestamp=now_iso(), version=SGLANG_VERSION,
            dp_rank_count=app.link.ranks.size, loads=loads, aggregate=aggregate(pb, loads)))

    # -- KV cache, control ----------------------------------------------------------------

    @grpc_errors
    async def FlushCache(self, stream) -> None:
        request = await stream.recv_message()
        timeout_s = request.timeout_s
        if not (timeout_s >= 0 and timeout_s != float("inf")):
            raise GRPCError(Status.INVALID_ARGUMENT, f"timeout_s must be a finite number >= 0, got {timeout_s}")
        success, message = await self._control("flush_cache", [timeout_s] if timeout_s else [],
                                                max(CONTROL_TIMEOUT_S_MIN, timeout_s + 10))
        await stream.send_message(common_pb2.FlushCacheResponse(success=success, message=message))

    @grpc_errors
    async def StartProfile(self, stream) -> None:
        request = await stream.recv_message()
        fields = {name: getattr(request, name) for name in ("output_dir", "start_step", "num_steps", "with_stack",
                                                            "record_shapes") if request.HasField(name)}
        if request.activities:
            fields["activities"] = list(request.activities)
        if request.profile_by_stage:
            fields["profile_by_stage"] = True
        success, message = await self._control("start_profile", [fields], CONTROL_TIMEOUT_S_MIN)
        await stream.send_message(common_pb2.ProfileResponse(success=success, message=message))

    @grpc_errors
    async def StopProfile(self, stream) -> None:
        await stream.recv_message()
        success, message = await self._control("stop_profile", [], CONTROL_TIMEOUT_S_MIN)
        await stream.send_message(common_pb2.ProfileResponse(success=success, message=message))

    async def _control(self, method: str, args: list, timeout_s: float) -> tuple[bool, str]:
        """The scheduler's (success, message) for a control call; UNAVAILABLE / DEADLINE_EXCEEDED otherwise."""
        from enginelink.runtime.engine.engine_link import LinkFailed

        link = self.app.link
        if not link.machine.live or not link.ready:
            raise GRPCError(Status.UNAVAILABLE, "engine is not up; retry later")
        try:
            result = await trio_asyncio.trio_as_aio(link.utility)(method, args, timeout_s)
        except LinkFailed as error:
            text = str(error)
            if "did not answer" in text:
                raise GRPCError(Status.DEADLINE_EXCEEDED, text) from None
            if text.startswith("engine refused"):  # the scheduler's own failure reply, in its words
                return False, text.split(": ", 1)[-1]
            raise GRPCError(Status.UNAVAILABLE, f"{text}; retry later") from None
        result = result if isinstance(result, dict) else {}
        return bool(result.get("success", True)), str(result.get("message") or "")

    # -- Embed, LoRA ------------------------------------------------------------------

    @grpc_errors
    async def Embed(self, stream) -> None:
        request = await stream.recv_message()
        current_request_id.set(request.request_id[: input_limits().request_id_bytes])
        for name, present in (("mm_inputs", request.HasField("mm_inputs")), ("is_cross_encoder", request.is_cross_encoder),
                              ("texts", len(request.texts)), ("token_type_ids", len(request.token_type_ids))):
            if present:
                raise ClientError(name, "is not supported by this worker (token ids only)")
        # Not copied: Embed judges their number first (runtime/requests/embed.py).
        tokens = request.tokenized.input_ids if request.HasField("tokenized") else None
        reply = await embed(self.app, EmbedInput(request.request_id, tokens), wake=asyncio.Event())
        await stream.send_message(pb.EmbedResponse(embedding=reply.embedding, prompt_tokens=reply.prompt_tokens,
                                                   embedding_dim=reply.embedding_dim))

    async def LoadLoRAAdapter(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "LoRA adapters are not served by this worker (enginelink)")

    async def UnloadLoRAAdapter(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "LoRA adapters are not served by this worker (enginelink)")

    async def ListLoadedLoRAAdapters(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "LoRA adapters are not served by this worker (enginelink)")


def _sglang_load(load: RankLoad, in_flight: int) -> pb.SchedulerLoad:
    """A rank's load (``runtime/context/loads.py``) as SGLang's; no stats on this wire: the hub's count."""
    running = load.num_running_reqs or in_flight
    return scheduler_load(pb.SchedulerLoad, load, num_running_reqs=running,
                          num_total_reqs=running + load.num_waiting_reqs)

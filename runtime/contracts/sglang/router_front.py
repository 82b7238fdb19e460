"""The front of ``enginelink headless``: the router's direct ZMQ lane instead of a gRPC port.

``smg serve --backend sglang --connection-mode zmq`` starts the reference's
``python -m smg_grpc_servicer.sglang.headless``, whose scheduler dials the
router. ``enginelink headless`` takes that place: the servicer runs as it
always does (engine link, hub, warm-up, journal, metrics) and, once its
engine serves, dials the router as the engine (``machines/router_link.py``;
the lane's messages in ``wire/sglang_router.py``):

- HELLO, INIT, READY and the ready response, each journaled
  (``router.handshake``) with the router link's transitions;
- every request message the router sends is journaled as received
  (``router.frame``); an ADD runs the one Generate loop with the lane's edge
  (``runtime/contracts/sglang/lane_edge.py``): admission, the engine, the
  journal's request records, exactly as a gRPC call's; each of its messages
  goes back as one ``BatchTokenIDSlimOutput`` with the load tail. A request
  refused or failed ends with a terminal ``abort`` carrying the message and
  an HTTP status, never by silence (the router's stream would hang); an
  ABORT aborts the calls; a CONTROL is the engine's flush or profile call,
  answered ``ControlReplySlim``;
- when the servicer stops (drained, or the engine gone) the router link
  closes and the router is told ``ENGINE_CORE_DEAD``, so it marks the worker
  dead rather than idle.

One nursery (the servicer's); every request task is bounded by the hub's
in-flight cap (a request beyond it ends at once, refused). Time is trio's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
import zmq

from enginelink.journal.records import KIND_ERROR, KIND_ROUTER_FRAME, KIND_ROUTER_HANDSHAKE, KIND_TRANSITION, link_stream
from enginelink.machines.router_link import RouterLink
from enginelink.runtime.engine.zmq_trio import make_socket, recv_multipart
from enginelink.runtime.errors import ServicerError
from enginelink.runtime.context.facts import context_len
from enginelink.runtime.context.submit import TrioWake
from enginelink.runtime.contracts.sglang.lane_edge import LANE_EDGE, abort_row, rows
from enginelink.runtime.requests.generate import generate
from enginelink.wire import sglang_router as lane
from enginelink.wire.engine import WireError
from enginelink.wire.sglang import SGLANG_VERSION

log = logging.getLogger("enginelink.router")

# How long the router may take to answer HELLO (the reference's scheduler waits as long: its INIT_TIMEOUT_MS).
INIT_TIMEOUT_S = 600.0
CONTROL_TIMEOUT_S = 60.0
# The dtypes the router's ready response takes (its enum); anything else is reported as bfloat16.
WIRE_DTYPES = ("bfloat16", "float16", "float32")
# The field order of what this side decodes, declared at registration (``positional_layouts``).
LANE_LAYOUTS = {
    "TokenizedGenerateReqInput": [name for name in lane.GenerateRequest.__struct_fields__],
    "SamplingParams": [name for name in lane.SamplingParams.__struct_fields__],
}


@dataclass(frozen=True)
class LaneConfig:
    """Where the router listens, and the engine index this servicer registers as."""

    handshake_address: str  # tcp://HOST:PORT, what SMG derives from the worker's ipc:// URL
    engine_index: int = 0


def ready_response(app, engine_index: int) -> lane.ReadyResponse:
    """The registration facts, from the engine's own (its ready report) and the model's."""
    ready = app.ready
    block = int(ready.get("block_size") or ready.get("page_size") or 1)
    total = int(ready.get("max_total_num_tokens") or app.kv_capacity_tokens or 0)
    dtype = str(ready.get("dtype") or app.model.dtype or "bfloat16")
    return lane.ReadyResponse(
        max_model_len=context_len(app), num_gpu_blocks=total // block, block_size=block,
        dtype=dtype if dtype in WIRE_DTYPES else "bfloat16", vllm_version=f"sglang-{SGLANG_VERSION}",
        data_parallel_size=1, data_parallel_rank=engine_index, max_num_seqs=app.max_num_seqs,
        max_num_batched_tokens=int(ready.get("max_num_batched_tokens") or 0), instance_id=app.served_model_name,
        kv_cache_size_tokens=total, positional_layouts=LANE_LAYOUTS)


class RouterFront:
    """The front a ``Servicer`` runs (``start`` / ``close`` / ``wait_closed``) on the router's lane."""

    def __init__(self, config: LaneConfig) -> None:
        self.config = config
        self.serving = trio.Event()  # set by the servicer once its engine serves (``on_serving``)
        self.link: RouterLink | None = None
        self._context = zmq.Context.instance()
        self._sockets: list[zmq.Socket] = []
        self._outputs: zmq.Socket | None = None
        self._servicer = None
        self.requests_received = 0

    def on_serving(self) -> None:
        self.serving.set()

    async def start(self, servicer, nursery: trio.Nursery) -> None:
        self._servicer = servicer
        nursery.start_soon(self._run, nursery)
        log.info("the router's ZMQ lane: dialling %s (engine index %d) once the engine serves",
                 self.config.handshake_address, self.config.engine_index)

    # -- journal -----------------------------------------------------------------------

    def _journal(self, kind: str, payload) -> None:
        self._servicer.journal.append(trio.current_time(), link_stream(self.link.name), kind, payload)

    def _transition(self, transition) -> None:
        if transition is not None:
            self._journal(KIND_TRANSITION, transition.payload())

    # -- lifetime ------------------------------------------------------------------------

    async def _run(self, nursery: trio.Nursery) -> None:
        await self.serving.wait()
        app = self._servicer.app
        self.link = RouterLink(self.config.engine_index, ready_response(app, self.config.engine_index))
        inputs = await self._register()
        if inputs is None:
            return
        while True:
            frames = await recv_multipart(inputs)
            self.requests_received += 1
            self._journal(KIND_ROUTER_FRAME, b"".join(bytes(f) for f in frames[:2]))
            self._dispatch(frames, nursery)

    async def _register(self) -> zmq.Socket | None:
        """HELLO, INIT, READY, the ready response; the input socket, or None when the router refused."""
        link = self.link
        hello, transition = link.dial()
        handshake = make_socket(self._context, zmq.DEALER)
        handshake.setsockopt(zmq.IDENTITY, link.identity)
        self._sockets.append(handshake)
        handshake.connect(self.config.handshake_address)
        self._transition(transition)
        self._journal(KIND_ROUTER_HANDSHAKE, {"link": link.name, "step": "hello",
                                              "address": self.config.handshake_address})
        handshake.send(hello)
        init = None
        with trio.move_on_after(INIT_TIMEOUT_S):
            init = await recv_multipart(handshake)
        if init is None:
            return self._refused(f"the router at {self.config.handshake_address} sent no INIT in {INIT_TIMEOUT_S:g} s")
        try:
            registration, transition = link.on_init(init[-1])
        except WireError as error:
            return self._refused(f"the router's INIT cannot be read: {error}")
        self._transition(transition)
        if registration is None:
            return self._refused(link.failure or "the router's INIT was refused")
        self._journal(KIND_ROUTER_HANDSHAKE, {"link": link.name, "step": "init", "inputs": registration.inputs,
                                              "outputs": registration.outputs})
        handshake.send(registration.ready)
        inputs = make_socket(self._context, zmq.DEALER)
        inputs.setsockopt(zmq.IDENTITY, link.identity)
        self._sockets.append(inputs)
        inputs.connect(registration.inputs)
        inputs.send(registration.ready_response)
        outputs = make_socket(self._context, zmq.PUSH)
        self._sockets.append(outputs)
        outputs.connect(registration.outputs)
        self._outputs = outputs
        self._journal(KIND_ROUTER_HANDSHAKE, {"link": link.name, "step": "ready",
                                              "ready_response": _ready_facts(link)})
        log.info("registered with the router at %s as engine index %d", self.config.handshake_address,
                 self.config.engine_index)
        return inputs

    def _refused(self, reason: str) -> None:
        self._transition(self.link.fail(reason))
        self._journal(KIND_ERROR, {"whose": "router", "code": "UNAVAILABLE", "message": reason})
        log.error("the router's ZMQ lane: %s", reason)
        return None

    # -- requests ------------------------------------------------------------------------

    def _dispatch(self, frames: list[bytes], nursery: trio.Nursery) -> None:
        try:
            message = lane.decode_request(frames)
        except WireError as error:
            rid = lane.request_id_of(frames)
            self._journal(KIND_ERROR, {"whose": "router", "code": "INVALID_ARGUMENT", "message": str(error)})
            if rid is not None:  # still the router's request: answered, or its stream would hang
                self._send([lane.Row(rid, [], finish="abort", message=f"undecodable request: {error}", status=400)])
            else:
                log.warning("the router sent a message that cannot be read: %s", error)
            return
        match message:
            case lane.GenerateRequest():
                nursery.start_soon(self._generate, message)
            case lane.AbortRequest(request_ids=ids):
                self._servicer.hub.abort(ids, "abort_rpc", trio.current_time())
            case lane.ControlRequest():
                nursery.start_soon(self._control, message)

    async def _generate(self, request: lane.GenerateRequest) -> None:
        rid = request.rid or ""

        async def send(message) -> None:
            self._send(rows(rid, [message]))

        try:
            await generate(self._servicer.app, request, wake=TrioWake(), send=send, edge=LANE_EDGE)
        except ServicerError as error:  # refused, or the engine failed the call: the router hears it
            self._send([abort_row(rid, error)])

    async def _control(self, request: lane.ControlRequest) -> None:
        method = {"flush_cache": "flush_cache", "start_profile": "start_profile",
                  "stop_profile": "stop_profile"}.get(request.method)
        success, text = False, f"unknown control method {request.method!r}"
        if method is not None:
            try:
                result = await self._servicer.link.utility(method, list(request.args), CONTROL_TIMEOUT_S)
                success = bool(result.get("success", True)) if isinstance(result, dict) else bool(result)
                text = result.get("message") if isinstance(result, dict) else None
            except Exception as error:  # the engine refused or did not answer: the router hears why
                success, text = False, str(error)
        if self._outputs is not None:
            self._outputs.send(lane.encode_control_reply(request.call_id, success, text, self.config.engine_index),
                               zmq.NOBLOCK)

    def _send(self, out: list[lane.Row]) -> None:
        if self._outputs is None or not out:
            return
        app = self._servicer.app
        load = lane.Load(engine_index=self.config.engine_index, num_running=app.hub.active_requests,
                         kv_total_tokens=int(app.ready.get("max_total_num_tokens") or app.kv_capacity_tokens or 0))
        self._outputs.send(lane.encode_rows(out, load), zmq.NOBLOCK)

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """The servicer is stopping: the router hears the engine is gone, then the sockets close."""
        if self.link is not None:
            if self.link.registered and self._outputs is not None:
                try:
                    self._outputs.send(lane.ENGINE_CORE_DEAD, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._transition(self.link.close())
        self._outputs = None
        for sock in self._sockets:
            sock.close(linger=200)  # ENGINE_CORE_DEAD is on its way out
        self._sockets = []

    async def wait_closed(self) -> None:
        return None


def _ready_facts(link: RouterLink) -> dict:
    response = link.ready_response
    return {name: getattr(response, name) for name in ("max_model_len", "num_gpu_blocks", "block_size", "dtype",
                                                        "vllm_version", "max_num_seqs", "kv_cache_size_tokens",
                                                        "instance_id")}

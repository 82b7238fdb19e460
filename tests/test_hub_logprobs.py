"""The hub with logprobs: which write path a call takes, and what an unreadable array costs.

A one-choice streaming call without logprobs keeps the hand-encoded chunk
(``stream_chunk_body``, written with ``send_bodies``); a call with logprobs
takes the protobuf path from the same fan-out. Logprobs the engine sent
unreadable fail that call alone (UNAVAILABLE, an ABORT to the engine), and
every other call in the frame goes on.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec
import trio
from grpclib.const import Status
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE, stream_chunk_body
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import vllm
from enginelink.wire.engine import OutputBatch
from tests.harness import ListJournal, generate_request

LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
EXT = msgspec.msgpack.Ext


class Wire:
    """A direct sender recording which of its two ways each write took."""

    def __init__(self) -> None:
        self.ways: list[str] = []
        self.bodies: list[bytes] = []

    def send(self, messages) -> int:
        self.ways.append("protobuf")
        self.bodies += [m.SerializeToString() for m in messages]
        return len(messages)

    def send_body(self, body: bytes) -> bool:
        return self.send_bodies([body]) >= 1

    def send_bodies(self, bodies) -> int:
        self.ways.append("bytes")
        self.bodies += list(bodies)
        return len(self.bodies)

    def end_ok(self) -> bool:
        return True


def make_hub():
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    sent: list[list[bytes]] = []
    hub = RequestHub(link=link, codec=vllm.VllmCodec(), send_frames=lambda frames, rank=0: sent.append(frames), journal=ListJournal(), edge=VLLM_EDGE)
    return hub, sent


def admit(hub, rid: str, **sampling):
    request = generate_request(rid, [5, 6, 7], stream=True, max_tokens=4, **sampling)
    call = hub.admit(validate_generate(request, LIMITS, 0.0), 0.0, wake=asyncio.Event())
    call.direct = Wire()
    return call


def sample(token: int, top: list[tuple[int, float]], value: float, ids_bytes: bytes | None = None) -> list:
    ids = [token] + [t for t, _ in top]
    values = [value] + [v for _, v in top]
    raw_ids = struct.pack(f"<{len(ids)}i", *ids) if ids_bytes is None else ids_bytes
    raw_values = struct.pack(f"<{len(values)}f", *values)
    return [["<i4", [1, len(ids)], EXT(3, raw_ids)], ["<f4", [1, len(ids)], EXT(3, raw_values)],
            ["<i8", [1], EXT(3, struct.pack("<q", 1))], None]


def test_plain_calls_keep_the_hand_encoded_chunk_and_logprob_calls_take_protobuf():
    hub, _ = make_hub()
    plain = admit(hub, "plain")
    with_lp = admit(hub, "with-lp", logprobs=2)
    hub.on_batch(OutputBatch(0, [
        vllm.EngineCoreOutput("plain", [11]),
        vllm.EngineCoreOutput("with-lp", [12], new_logprobs=sample(12, [(12, -0.5), (40, -1.0)], -0.5)),
    ]), 1.0)
    assert plain.direct.ways == ["bytes"]
    assert plain.direct.bodies == [stream_chunk_body([11], 3, 0, 0)]
    assert with_lp.direct.ways == ["protobuf"]
    (body,) = with_lp.direct.bodies
    chunk = pb.GenerateResponse.FromString(body).chunk
    assert list(chunk.token_ids) == [12]
    assert list(chunk.output_logprobs.token_ids) == [12]
    assert list(chunk.output_logprobs.token_logprobs) == [-0.5]
    (top,) = chunk.output_logprobs.top_logprobs
    assert list(top.token_ids) == [12, 40] and list(top.values) == [-0.5, -1.0]


def test_unreadable_logprobs_fail_only_their_call():
    hub, sent = make_hub()
    bystander = admit(hub, "bystander", logprobs=1)
    broken = admit(hub, "broken", logprobs=1)
    hub.on_batch(OutputBatch(0, [
        vllm.EngineCoreOutput("broken", [13], new_logprobs=sample(13, [(13, -0.1)], -0.1, ids_bytes=b"\x00" * 3)),
        vllm.EngineCoreOutput("bystander", [14], new_logprobs=sample(14, [(14, -0.2)], -0.2)),
    ]), 1.0)
    assert broken.error is not None and broken.error.status is Status.UNAVAILABLE
    assert "logprobs" in str(broken.error)
    assert sent[-1] == [vllm.REQ_ABORT, msgspec.msgpack.encode(["broken"])]
    assert hub.logprob_errors == 1
    assert bystander.error is None and bystander.direct.ways == ["protobuf"]
    # The rows must be the tokens': a row for another token is the engine's fault too.
    liar = admit(hub, "liar", logprobs=0)
    hub.on_batch(OutputBatch(0, [vllm.EngineCoreOutput("liar", [15], new_logprobs=sample(16, [], -0.3))]), 2.0)
    assert liar.error is not None and "is for token 16" in str(liar.error)


def test_a_chunk_with_more_logprobs_than_one_step_is_left_to_the_writer():
    """Prompt logprobs of 300 positions x top-20 ride on the first chunk: more than the fan-out fills at
    once (``SLICE_ENTRIES``), so it writes nothing for the call and its writer gets the chunk, to
    serialize in slices (``generate.serialize_in_slices``); what the client gets is the same chunk."""
    from enginelink.runtime.requests.generate import serialize_in_slices
    from enginelink.runtime.requests.logprob_bytes import SlicedResponse

    hub, _ = make_hub()
    prompt = [10 + i for i in range(301)]
    request = generate_request("big", prompt, stream=True, max_tokens=4, logprobs=20, prompt_logprobs=20)
    call = hub.admit(validate_generate(request, LIMITS, 0.0), 0.0, wake=asyncio.Event())
    call.direct = Wire()
    ids = [11 + r if c == 0 else 500 + c for r in range(300) for c in range(21)]
    values = [-0.25 - c for r in range(300) for c in range(21)]
    rows = [["<i4", [300, 21], EXT(3, struct.pack(f"<{len(ids)}i", *ids))],
            ["<f4", [300, 21], EXT(3, struct.pack(f"<{len(values)}f", *values))],
            ["<i8", [300], EXT(3, struct.pack("<300q", *[0] * 300))]]
    hub.on_batch(OutputBatch(0, [vllm.EngineCoreOutput(
        "big", [12], new_logprobs=sample(12, [(12, -0.5)] * 20, -0.5), new_prompt_logprobs_tensors=rows)]), 1.0)
    assert call.direct.ways == [] and call.wake.is_set()
    (message,) = hub.take(call, 1.0)
    assert type(message) is SlicedResponse
    body = trio.run(serialize_in_slices, message)
    chunk = pb.GenerateResponse.FromString(body).chunk
    assert list(chunk.token_ids) == [12]
    assert len(chunk.input_logprobs.token_logprobs) == 301 and len(chunk.input_logprobs.top_logprobs) == 301
    assert list(chunk.input_logprobs.token_ids) == prompt
    assert list(chunk.input_logprobs.top_logprobs[1].token_ids) == [500 + c for c in range(1, 21)]

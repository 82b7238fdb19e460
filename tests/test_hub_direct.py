"""The hub's direct write path: what a streaming call's client gets from the engine frame's fan-out itself.

The writer task (the call's gRPC handler) wakes later than the fan-out, behind
the rest of the frame and a core. A call whose last token arrives must get its
chunk, its complete and its trailers from the fan-out, so that a client which
starts its next call on the trailers does not wait for that wake-up.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.records import KIND_CLIENT_SENT
from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE, stream_chunk_body
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import FinishReason, OutputBatch
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal, generate_request

LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))


class Wire:
    """A stream's direct sender as the hub sees it: what it wrote, in order; ``room`` messages fit."""

    def __init__(self, room: int = 1000, can_end: bool = True) -> None:
        self.written: list[object] = []
        self.room = room
        self.can_end = can_end

    def send(self, messages) -> int:
        return self.send_bodies([message.SerializeToString() for message in messages])

    def send_body(self, body: bytes) -> bool:
        return self.send_bodies([body]) >= 1

    def send_bodies(self, bodies) -> int:
        taken = [pb.GenerateResponse.FromString(body) for body in list(bodies)[: self.room]]
        self.room -= len(taken)
        self.written += taken
        return len(taken)

    def end_ok(self) -> bool:
        if self.can_end:
            self.written.append("trailers")
        return self.can_end


def output(request_id: str, tokens: list[int], finish: FinishReason | None = None):
    return SimpleNamespace(request_id=request_id, new_token_ids=tokens,
                           finish_reason=None if finish is None else int(finish), stop_reason=None,
                           kv_transfer_params=None)


def hub_with_call(wire: Wire, n: int = 1):
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    journal = ListJournal()
    hub = RequestHub(link=link, codec=VllmCodec(), send_frames=lambda frames, rank=0: None, journal=journal, edge=VLLM_EDGE)
    request = generate_request("r1", [5, 6, 7], stream=True, max_tokens=2, n=n, seed=1)
    call = hub.admit(validate_generate(request, LIMITS, 0.0), 0.0, wake=asyncio.Event())
    call.direct = wire
    return hub, call, journal


def kinds(written) -> list[str]:
    return [m if isinstance(m, str) else m.WhichOneof("response") for m in written]


def test_a_finishing_call_gets_chunk_complete_and_trailers_from_the_fan_out():
    wire = Wire()
    hub, call, journal = hub_with_call(wire)
    engine_id = call.choices[0].engine_id

    hub.on_batch(OutputBatch(0, [output(engine_id, [11])]), 1.0)
    assert kinds(wire.written) == ["chunk"]
    assert not call.wake.is_set()  # nothing for the writer

    hub.on_batch(OutputBatch(0, [output(engine_id, [12], FinishReason.LENGTH)]), 2.0)
    assert kinds(wire.written) == ["chunk", "chunk", "complete", "trailers"]
    last_chunk, complete = wire.written[1], wire.written[2]
    assert list(last_chunk.chunk.token_ids) == [12]
    assert complete.complete.finish_reason == "length"
    assert list(complete.complete.output_ids) == [12]  # as the reference: the last delta
    # Journaled as the writer would have, and the id is free again at once.
    sent = [p for _, _, kind, p in journal.records if kind == KIND_CLIENT_SENT]
    assert sent == [{"request_id": "r1", "index": 0, "tokens_sent": 2, "tokens_engine": 2, "finish_reason": "length"}]
    assert "r1" not in hub.calls and "r1" not in hub.writing
    # The writer still wakes, to return; it finds nothing more to send.
    assert call.wake.is_set()
    assert hub.take(call, 3.0) == [] and call.done


def test_trailers_the_fan_out_cannot_send_are_left_to_the_writer():
    wire = Wire(can_end=False)
    hub, call, _ = hub_with_call(wire)
    engine_id = call.choices[0].engine_id
    hub.on_batch(OutputBatch(0, [output(engine_id, [11, 12], FinishReason.LENGTH)]), 1.0)
    assert kinds(wire.written) == ["chunk", "complete"]
    assert call.wake.is_set() and call.done  # the writer returns and grpclib sends the trailers


def test_a_complete_that_does_not_fit_waits_for_the_writer_with_no_trailers_before_it():
    wire = Wire(room=1)
    hub, call, journal = hub_with_call(wire)
    engine_id = call.choices[0].engine_id
    hub.on_batch(OutputBatch(0, [output(engine_id, [11, 12], FinishReason.LENGTH)]), 1.0)
    assert kinds(wire.written) == ["chunk"]
    assert call.wake.is_set()
    backlog = hub.take(call, 2.0)
    assert [m.WhichOneof("response") for m in backlog] == ["complete"]
    assert len([1 for _, _, kind, _ in journal.records if kind == KIND_CLIENT_SENT]) == 1


def test_with_two_choices_the_trailers_wait_for_both_completes():
    wire = Wire()
    hub, call, _ = hub_with_call(wire, n=2)
    first, second = (choice.engine_id for choice in call.choices)
    hub.on_batch(OutputBatch(0, [output(first, [11, 12], FinishReason.LENGTH), output(second, [21])]), 1.0)
    assert kinds(wire.written) == ["chunk", "complete", "chunk"]
    assert not call.done and "r1" in hub.calls
    hub.on_batch(OutputBatch(0, [output(second, [22], FinishReason.LENGTH)]), 2.0)
    assert kinds(wire.written) == ["chunk", "complete", "chunk", "chunk", "complete", "trailers"]
    assert [m.complete.index for m in wire.written if not isinstance(m, str) and m.HasField("complete")] == [0, 1]


def test_a_chunk_encoded_by_hand_is_the_bytes_upb_writes():
    rng = random.Random(7)
    for _ in range(5000):
        # Varint widths 1-5 bytes and each width's edges (the encoder writes up to 3 bytes without a loop).
        edges = [127, 128, 16383, 16384, 2097151, 2097152, (1 << 32) - 1]
        tokens = [rng.choice([rng.randrange(128), rng.randrange(1 << 14), rng.randrange(1 << 21),
                              rng.randrange(1 << 32), rng.choice(edges)])
                  for _ in range(rng.choice([1, 1, 1, 2, 5, 40]))]
        prompt = rng.choice([0, 1, 127, 128, rng.randrange(1 << 20)])
        cached = rng.choice([0, 0, rng.randrange(1 << 16)])
        index = rng.choice([0, 0, rng.randrange(1, 8)])
        message = pb.GenerateResponse()
        chunk = message.chunk
        chunk.token_ids.extend(tokens)
        chunk.prompt_tokens = prompt
        chunk.completion_tokens = len(tokens)
        chunk.cached_tokens = cached
        chunk.index = index
        assert stream_chunk_body(tokens, prompt, cached, index) == message.SerializeToString(), (tokens, prompt, cached, index)


def test_a_chunk_that_does_not_fit_stays_pending_for_the_writer():
    wire = Wire(room=0)
    hub, call, _ = hub_with_call(wire)
    engine_id = call.choices[0].engine_id
    hub.on_batch(OutputBatch(0, [output(engine_id, [11])]), 1.0)
    assert wire.written == [] and call.wake.is_set()
    backlog_or_pending = call.backlog or hub.take(call, 2.0)
    assert [list(m.chunk.token_ids) for m in backlog_or_pending] == [[11]]

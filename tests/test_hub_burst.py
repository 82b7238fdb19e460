"""The frames of one wake-up, written once: one message per call, one socket write per wake-up.

A servicer behind its engine finds many frames waiting when its receive task
wakes. With the hub holding writes (``RequestHub.hold_writes``, what
``runtime/lifetime/core.connect`` turns on), the calls those frames touched
are written after the last of them (``write_held``): each call's client gets
every token of the burst in one chunk, in order, with its complete and
trailers where it finished, and the connections' writes go out once.
"""

from __future__ import annotations

import asyncio

from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.wire.engine import FinishReason, OutputBatch
from tests.harness import generate_request
from tests.test_hub_direct import LIMITS, Wire, hub_with_call, kinds, output


def held_hub(calls: int = 2, max_tokens: int = 8):
    """A hub holding writes, with ``calls`` streaming calls, each writing to its own ``Wire``."""
    hub, first, _ = hub_with_call(Wire())
    wires = [first.direct]
    calls_ = [first]
    for i in range(1, calls):
        request = generate_request(f"r{i + 1}", [5, 6, 7], stream=True, max_tokens=max_tokens, seed=1)
        call = hub.admit(validate_generate(request, LIMITS, 0.0), 0.0, wake=asyncio.Event())
        call.direct = Wire()
        wires.append(call.direct)
        calls_.append(call)
    flushes = []
    hub.end_of_batch = lambda: flushes.append(1)
    hub.hold_writes()
    return hub, calls_, wires, flushes


def engine_id(call) -> str:
    return call.choices[0].engine_id


def test_the_frames_of_one_wake_up_give_each_call_one_chunk_with_all_their_tokens():
    hub, (a, b), (wa, wb), flushes = held_hub()
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [11]), output(engine_id(b), [21])]), 1.0)
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [12]), output(engine_id(b), [22])]), 1.0)
    hub.on_batch(OutputBatch(0, [output(engine_id(b), [23])]), 1.0)
    assert wa.written == [] and wb.written == [] and flushes == []  # nothing before the wake-up's end
    hub.write_held(1.0)
    assert [list(m.chunk.token_ids) for m in wa.written] == [[11, 12]]
    assert [list(m.chunk.token_ids) for m in wb.written] == [[21, 22, 23]]
    assert flushes == [1]  # one flush of the connections' writes per wake-up, not per frame
    assert (hub.held_frames, hub.held_bursts) == (2, 1)
    assert not a.wake.is_set() and not b.wake.is_set()  # written from the fan-out, no writer woken


def test_a_call_that_finishes_inside_the_burst_gets_its_chunk_complete_and_trailers_at_its_end():
    hub, (a, b), (wa, wb), _ = held_hub()
    # ``a`` (max_tokens 2) finishes on the burst's first frame, ``b`` only goes on.
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [11, 12], FinishReason.LENGTH), output(engine_id(b), [21])]), 1.0)
    hub.on_batch(OutputBatch(0, [output(engine_id(b), [22])]), 1.0)
    hub.write_held(1.0)
    assert kinds(wa.written) == ["chunk", "complete", "trailers"]
    assert list(wa.written[1].complete.output_ids) == [11, 12]
    assert [list(m.chunk.token_ids) for m in wb.written] == [[21, 22]]
    assert "r1" not in hub.calls and "r2" in hub.calls


def test_a_frame_alone_in_its_wake_up_is_written_as_before_and_bursts_do_not_leak_into_the_next():
    hub, (a, b), (wa, wb), flushes = held_hub()
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [11])]), 1.0)
    hub.write_held(1.0)
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [12])]), 2.0)
    hub.write_held(2.0)
    assert [list(m.chunk.token_ids) for m in wa.written] == [[11], [12]]
    assert wb.written == [] and flushes == [1, 1]
    assert (hub.held_frames, hub.held_bursts) == (0, 0)
    hub.write_held(3.0)  # a wake-up with no frame: nothing written, the flush runs (it writes nothing)
    assert [list(m.chunk.token_ids) for m in wa.written] == [[11], [12]]


def test_a_call_whose_window_fills_inside_the_burst_hands_the_rest_to_its_writer_in_order():
    hub, (a, b), (wa, wb), _ = held_hub()
    wa.room = 0  # a's client stopped reading: nothing of a's goes from the fan-out
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [11]), output(engine_id(b), [21])]), 1.0)
    hub.on_batch(OutputBatch(0, [output(engine_id(a), [12], FinishReason.LENGTH)]), 1.0)
    hub.write_held(1.0)
    assert wa.written == [] and a.wake.is_set()
    taken = hub.take(a, 2.0)  # its backlog first, then what is pending
    assert [m.WhichOneof("response") for m in taken] == ["chunk", "complete"]
    assert list(taken[0].chunk.token_ids) == [11, 12]
    assert [list(m.chunk.token_ids) for m in wb.written] == [[21]]


def test_without_holding_each_frame_is_written_at_once():
    hub, call, _ = hub_with_call(Wire())
    assert isinstance(hub, RequestHub)
    hub.on_batch(OutputBatch(0, [output(engine_id(call), [11])]), 1.0)
    assert [list(m.chunk.token_ids) for m in call.direct.written] == [[11]]
    hub.write_held(1.0)  # not holding: a no-op
    assert [list(m.chunk.token_ids) for m in call.direct.written] == [[11]]


class TimedWire(Wire):
    """A ``Wire`` that also notes, on a timeline shared with the connection's flushes, what it wrote."""

    def __init__(self, name: str, timeline: list) -> None:
        super().__init__()
        self.name, self.timeline = name, timeline

    def send_bodies(self, bodies) -> int:
        before = len(self.written)
        taken = super().send_bodies(bodies)
        self.timeline += [(self.name, kinds([m])[0]) for m in self.written[before:]]
        return taken

    def end_ok(self) -> bool:
        self.timeline.append((self.name, "trailers"))
        return super().end_ok()


def test_a_call_that_ends_does_not_hold_the_other_calls_tokens_of_its_frame():
    """The first call in the engine's frame ends; the other two only get a token. Every call's token goes
    out in the connection's first write; the ending call's complete and trailers (a take, the journal's
    records, protobuf encoding) follow in a second one. Written in frame order, every token of the
    frame waited for the ending call's work and went out in one write behind it."""
    for holding in (True, False):
        timeline: list = []
        hub, calls, _, _ = held_hub(calls=3, max_tokens=8)
        if not holding:
            hub._held = None  # each on_batch writes its own calls (the hub's other mode)
        for number, call in enumerate(calls, start=1):
            call.direct = TimedWire(f"r{number}", timeline)
        hub.end_of_batch = lambda: timeline.append("flush")
        first, second, third = calls
        hub.on_batch(OutputBatch(0, [output(engine_id(first), [11], FinishReason.STOP),
                                     output(engine_id(second), [21]), output(engine_id(third), [31])]), 1.0)
        hub.write_held(1.0)
        assert timeline == [("r1", "chunk"), ("r2", "chunk"), ("r3", "chunk"), "flush",
                            ("r1", "complete"), ("r1", "trailers"), "flush"], holding
        assert "r1" not in hub.calls and {"r2", "r3"} <= set(hub.calls)
        ending = calls[0].direct.written
        assert list(ending[0].chunk.token_ids) == [11] and list(ending[1].complete.output_ids) == [11]
        assert ending[1].complete.finish_reason == "stop"


def test_a_call_that_ends_with_the_others_and_one_that_cannot_take_its_chunk_now_keep_their_order():
    """The ending call's client window is full: nothing of it goes from the fan-out, its writer gets
    chunk and complete in order; the others' tokens are not held for it."""
    timeline: list = []
    hub, calls, _, _ = held_hub(calls=2, max_tokens=8)
    for number, call in enumerate(calls, start=1):
        call.direct = TimedWire(f"r{number}", timeline)
    calls[0].direct.room = 0
    hub.end_of_batch = lambda: timeline.append("flush")
    hub.on_batch(OutputBatch(0, [output(engine_id(calls[0]), [11], FinishReason.STOP),
                                 output(engine_id(calls[1]), [21])]), 1.0)
    hub.write_held(1.0)
    assert timeline == [("r2", "chunk"), "flush", "flush"] and calls[0].wake.is_set()
    assert kinds(hub.take(calls[0], 2.0)) == ["chunk", "complete"]


def test_a_frame_of_plain_chunks_is_still_one_write():
    timeline: list = []
    hub, calls, _, _ = held_hub(calls=3, max_tokens=8)
    for number, call in enumerate(calls, start=1):
        call.direct = TimedWire(f"r{number}", timeline)
    hub.end_of_batch = lambda: timeline.append("flush")
    hub.on_batch(OutputBatch(0, [output(engine_id(call), [number]) for number, call in enumerate(calls)]), 1.0)
    hub.write_held(1.0)
    assert timeline == [("r1", "chunk"), ("r2", "chunk"), ("r3", "chunk"), "flush"]

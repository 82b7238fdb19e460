"""The engine link's receive loop on real ZeroMQ sockets: frames in order, a lost edge, a bad frame.

The loop parks on the output socket's ZMQ_FD for at most LOST_EDGE_RECHECK_S
(``zmq_trio.wait_fd``), so that a lost edge costs at most that long. One
test loses an edge on purpose: reading ZMQ_EVENTS after a message has
arrived, before trio looks at the fd, clears the fd's readiness and leaves
the message waiting with nothing to wake the loop.
"""

from __future__ import annotations

import time

import pytest
import trio
import zmq

from enginelink.machines.link import LinkState
from enginelink.runtime.engine import engine_link as el
from enginelink.runtime.engine.zmq_transport import OUTPUTS_PER_WAKEUP, receive_frames
from enginelink.runtime.engine.zmq_trio import LOST_EDGE_RECHECK_S, make_socket
from enginelink.wire.vllm import EngineCoreOutput, EngineCoreOutputs, VllmCodec, encode_outputs
from tests.harness import ListJournal


def frame(request_id: str, token: int) -> list[bytes]:
    return encode_outputs(EngineCoreOutputs(0, [EngineCoreOutput(request_id, [token])]))


@pytest.fixture
def pair(tmp_path):
    """(push, pull): the engine's end and the link's end of an output socket."""
    context = zmq.Context.instance()
    pull = make_socket(context, zmq.PULL)
    push = make_socket(context, zmq.PUSH)
    address = f"ipc://{tmp_path}/out"
    pull.bind(address)
    push.connect(address)
    yield push, pull
    push.close()
    pull.close()


def make_link() -> tuple[el.EngineLink, list[tuple[str, int]]]:
    link = el.EngineLink(name="vllm-0", launcher=None, codec=VllmCodec(), journal=ListJournal(), servicer_sched="normal")
    seen: list[tuple[str, int]] = []
    link.on_batch = lambda batch, now: seen.extend((o.request_id, o.new_token_ids[0]) for o in batch.outputs)
    return link, seen


async def wait_for(seen: list, count: int) -> None:
    while len(seen) < count:
        await trio.sleep(0.001)


async def test_frames_reach_the_hub_in_order(pair):
    push, pull = pair
    link, seen = make_link()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_frames, pull, link)
        for token in range(200):
            push.send_multipart(frame("a", token))
            if token % 50 == 0:
                await trio.sleep(0.005)  # some frames find the loop parked, some find it busy
        with trio.fail_after(2):
            await wait_for(seen, 200)
        nursery.cancel_scope.cancel()
    assert seen == [("a", token) for token in range(200)]
    assert link.frames_received == 200


async def test_a_lost_edge_costs_at_most_the_recheck_interval(pair):
    push, pull = pair
    link, seen = make_link()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_frames, pull, link)
        await trio.sleep(0.05)  # the loop is parked on the fd
        push.send_multipart(frame("a", 7))
        time.sleep(0.05)  # blocking: ZeroMQ's I/O thread delivers while trio does not look
        assert pull.getsockopt(zmq.EVENTS) & zmq.POLLIN  # the edge is consumed here, the message stays
        started = trio.current_time()
        with trio.fail_after(2):
            await wait_for(seen, 1)
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert seen == [("a", 7)]
    assert waited <= LOST_EDGE_RECHECK_S + 0.5


async def test_a_frame_it_cannot_read_ends_the_loop_and_says_so(pair):
    push, pull = pair
    link, seen = make_link()
    failures: list[str] = []
    link.on_failure = lambda message, now: failures.append(message)
    push.send_multipart(frame("a", 1))
    push.send_multipart([b"\xc1 not msgpack"])
    push.send_multipart(frame("a", 2))
    with trio.fail_after(2):
        await receive_frames(pull, link)  # returns by itself: the link failed
    assert seen == [("a", 1)]
    assert len(failures) == 1 and "engine sent a frame enginelink cannot read" in failures[0]
    assert link.machine.state is LinkState.FAILED


async def test_each_wake_up_ends_with_one_frames_done_after_its_last_frame():
    # inproc: a frame sent is in the pipe at once, so every frame below waits when the loop starts.
    context = zmq.Context.instance()
    pull = make_socket(context, zmq.PULL)
    push = make_socket(context, zmq.PUSH)
    pull.bind("inproc://frames-done")
    push.connect("inproc://frames-done")
    try:
        link, seen = make_link()
        done: list[int] = []  # frames seen by each frames-done call
        link.on_frames_done = lambda now: done.append(len(seen))
        queued = 2 * el.FRAMES_PER_WAKEUP + 3
        for token in range(queued):
            push.send_multipart(frame("a", token))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_frames, pull, link)
            with trio.fail_after(2):
                await wait_for(done, 3)
            nursery.cancel_scope.cancel()
        # At most FRAMES_PER_WAKEUP frames per wake-up, each wake-up's writes once after its last.
        assert done == [el.FRAMES_PER_WAKEUP, 2 * el.FRAMES_PER_WAKEUP, queued]
        assert seen == [("a", token) for token in range(queued)]
    finally:
        push.close()
        pull.close()


async def test_a_frame_that_fails_the_link_still_ends_the_wake_up_with_frames_done(pair):
    push, pull = pair
    link, seen = make_link()
    done: list[int] = []
    link.on_frames_done = lambda now: done.append(len(seen))
    link.on_failure = lambda message, now: None
    push.send_multipart(frame("a", 1))
    push.send_multipart([b"\xc1 not msgpack"])
    with trio.fail_after(2):
        await receive_frames(pull, link)
    # Frame 1's writes were held for the wake-up's end: they still go out.
    assert seen == [("a", 1)] and done and done[-1] == 1


async def test_a_wake_up_ends_once_its_frames_carried_enough_outputs():
    """Frames of 256 outputs each: a wake-up takes frames until they carried OUTPUTS_PER_WAKEUP outputs
    (never part of a frame), then yields, so a burst of big frames (sequences asking for logprobs, whose
    fan-out costs microseconds an output) does not hold the event loop for all 64 (issue 38)."""
    context = zmq.Context.instance()
    pull = make_socket(context, zmq.PULL)
    push = make_socket(context, zmq.PUSH)
    pull.bind("inproc://outputs-per-wake-up")
    push.connect("inproc://outputs-per-wake-up")
    try:
        link, seen = make_link()
        done: list[int] = []
        link.on_frames_done = lambda now: done.append(len(seen))
        per_frame, outputs_max = 128, 256  # the latter is OUTPUTS_PER_WAKEUP, written out
        frames = 2 * outputs_max // per_frame + 1
        for index in range(frames):
            push.send_multipart(encode_outputs(EngineCoreOutputs(
                0, [EngineCoreOutput(f"r{i}", [index]) for i in range(per_frame)])))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_frames, pull, link)
            with trio.fail_after(5):
                await wait_for(seen, frames * per_frame)
                while not done or done[-1] < len(seen):
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert done == [outputs_max, 2 * outputs_max, frames * per_frame]
        assert OUTPUTS_PER_WAKEUP == outputs_max
    finally:
        push.close()
        pull.close()

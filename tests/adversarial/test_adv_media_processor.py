"""The media processor helper's shell against a scripted child: death, silence, bad frames, each fault's code.

The real child (``media_processor_child.py``) needs vLLM; its behaviour on a
real model is ``tests/vllm/test_vllm_vision.py``. Here a child script speaks
the same frames and misbehaves on cue (the prompt's first id says how), so
each property is attacked more than one way, fast and without vLLM:

- its death fails only the request in hand, UNAVAILABLE, and the next
  request gets a fresh child: exit mid-request, an oversized frame, an
  undecodable frame, a reply out of turn;
- time is bounded: a child that never says ready, one that hangs on a
  request, a request queued behind a hung one;
- whose fault: the processor's "cannot decode this item" is the client's
  (INVALID_ARGUMENT naming the item); its exception on good input INTERNAL;
- the prompt the placeholders grow is judged again against the context
  (``media_refit.py``): no room left, or a ``max_tokens`` that no longer fits.
"""

from __future__ import annotations

import sys
import textwrap

import msgspec
import pytest
import trio
from grpclib.const import Status

from enginelink.runtime.errors import ClientError, Unavailable
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.contracts.shared.media import MediaService, MediaSettings
from enginelink.runtime.requests.media_processor import MediaProcessor
from enginelink.runtime.contracts.shared.media_refit import with_processed_media
from enginelink.runtime.requests.validate import EngineLimits
from tests.harness import generate_request

OK, EXIT, HANG, CLIENT, INTERNAL, HUGE, GARBAGE, WRONG_ID = range(1, 9)

CHILD = textwrap.dedent(r'''
    import os, struct, sys, time, msgspec
    H = struct.Struct(">I")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    def send(obj):
        body = msgspec.msgpack.encode(obj)
        out.write(H.pack(len(body)) + body); out.flush()
    mode = os.environ.get("FAKE_START", "ok")
    if mode == "exit":
        sys.exit(7)
    if mode == "silent":
        time.sleep(3600)
    send({"ready": True, "version": "fake"})
    while True:
        head = inp.read(4)
        if len(head) < 4:
            sys.exit(0)
        req = msgspec.msgpack.decode(inp.read(H.unpack(head)[0]))
        cue = req["prompt"][0]
        if cue == 2:
            os._exit(3)
        if cue == 3:
            time.sleep(3600)
        if cue == 4:
            send({"id": req["id"], "error": "not a decodable image: broken", "fault": "client", "item": 1})
        elif cue == 5:
            send({"id": req["id"], "error": "RuntimeError: boom", "fault": "internal", "item": None})
        elif cue == 6:
            out.write(H.pack(0xFFFFFFF0)); out.flush(); time.sleep(3600)
        elif cue == 7:
            out.write(H.pack(3) + b"\xc1\xc1\xc1"); out.flush()
        elif cue == 8:
            send({"id": req["id"] + 100, "prompt": [], "features": []})
        else:
            size = sum(len(item["data"]) for item in req["items"])
            send({"id": req["id"], "prompt": [9, 9] + req["prompt"], "pid": os.getpid(),
                  "features": [{"mm_hash": str(size), "data": msgspec.msgpack.Ext(3, b"px")}]})
''')


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "fake_child.py"
    path.write_text(CHILD)
    return path


def _processor(child, *, process_timeout_s: float = 30.0, start_timeout_s: float = 30.0, starts=None):
    return MediaProcessor("/nowhere", lambda: sys.executable, start_timeout_s=start_timeout_s,
                          process_timeout_s=process_timeout_s, reply_bytes_max=1 << 20,
                          on_start=(lambda: starts.append(1)) if starts is not None else (lambda: None),
                          script=child)  # fmt: skip


ITEMS = [("image", b"abc"), ("image", b"defg")]


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.process
async def test_a_good_reply_is_the_expanded_prompt_and_the_features_with_their_tensors_as_sent(child):
    processor = _processor(child)
    try:
        prompt, features, embeds, identity = await processor.process([OK, 5], ITEMS)
        assert prompt == [9, 9, OK, 5]
        assert features == [{"mm_hash": "7", "data": msgspec.msgpack.Ext(3, b"px")}]
        assert processor.version == "fake"
    finally:
        await processor.aclose()
    assert not processor.running


@pytest.mark.process
@pytest.mark.parametrize("cue, words", [
    (EXIT, "died during this request"),
    (HUGE, "over the"),
    (GARBAGE, "undecodable reply frame"),
    (WRONG_ID, "out of turn"),
])  # fmt: skip
async def test_a_child_that_breaks_fails_that_request_unavailable_and_the_next_gets_a_fresh_one(child, cue, words):
    starts: list[int] = []
    processor = _processor(child, starts=starts)
    try:
        assert (await processor.process([OK], ITEMS))[0] == [9, 9, OK]
        with pytest.raises(Unavailable) as error:
            await processor.process([cue], ITEMS)
        assert error.value.status == Status.UNAVAILABLE and words in str(error.value), str(error.value)
        assert not processor.running  # killed, not left with a half-read frame
        assert (await processor.process([OK, 1], ITEMS))[0] == [9, 9, OK, 1]
        assert len(starts) == 2
    finally:
        await processor.aclose()


@pytest.mark.process
async def test_a_hung_request_is_cut_at_the_bound_and_the_child_replaced(child):
    starts: list[int] = []
    processor = _processor(child, process_timeout_s=1.0, starts=starts)
    try:
        await processor.process([OK], ITEMS)  # started: the bound below is the request's alone
        with pytest.raises(Unavailable) as error:
            await processor.process([HANG], ITEMS)
        assert "ENGINELINK_MM_PROCESS_TIMEOUT_S=1" in str(error.value) and error.value.reason == "media_processor_timeout"
        assert (await processor.process([OK], ITEMS))[0] == [9, 9, OK]
        assert len(starts) == 2
    finally:
        await processor.aclose()


@pytest.mark.process
async def test_requests_queued_behind_a_hung_one_end_unavailable_too_never_waiting_unbounded(child):
    processor = _processor(child, process_timeout_s=1.0)
    await processor.process([OK], ITEMS)
    outcomes: dict[int, str] = {}

    async def one(cue: int) -> None:
        try:
            await processor.process([cue], ITEMS)
            outcomes[cue] = "ok"
        except Unavailable as error:
            outcomes[cue] = error.reason

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, HANG)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, OK)
        # The hung one is cut at its bound; the queued one either ran after it or ran out of time waiting.
        assert outcomes[HANG] == "media_processor_timeout"
        assert outcomes[OK] in ("ok", "media_processor_busy", "media_processor_timeout")
    finally:
        await processor.aclose()


@pytest.mark.process
@pytest.mark.parametrize("start, words", [("exit", "did not start"), ("silent", "START_TIMEOUT_S=1")])
async def test_a_child_that_never_gets_ready_is_unavailable_and_tried_again_next_time(child, monkeypatch, start, words):
    monkeypatch.setenv("FAKE_START", start)
    starts: list[int] = []
    processor = _processor(child, start_timeout_s=1.0, starts=starts)
    try:
        for _ in range(2):
            with pytest.raises(Unavailable) as error:
                await processor.process([OK], ITEMS)
            assert words in str(error.value) and error.value.reason == "media_processor_down"
            assert not processor.running
        assert len(starts) == 2
    finally:
        await processor.aclose()


@pytest.mark.process
async def test_the_processors_faults_say_whose(child):
    processor = _processor(child)
    try:
        with pytest.raises(ClientError) as client:
            await processor.process([CLIENT], ITEMS)
        assert str(client.value) == "media_refs.items[1]: not a decodable image: broken"
        assert client.value.status == Status.INVALID_ARGUMENT
        with pytest.raises(Exception) as internal:
            await processor.process([INTERNAL], ITEMS)
        assert internal.value.status == Status.INTERNAL and "boom" in str(internal.value)
        assert processor.running  # neither fault is the child's death
        assert (await processor.process([OK], ITEMS))[0] == [9, 9, OK]
    finally:
        await processor.aclose()


@pytest.mark.process
async def test_a_caller_that_leaves_mid_request_does_not_leave_its_reply_for_the_next(child):
    processor = _processor(child)
    try:
        await processor.process([OK], ITEMS)
        with trio.move_on_after(0.5):
            await processor.process([HANG], ITEMS)
        assert not processor.running  # replaced: a late reply could otherwise answer the next caller
        assert (await processor.process([OK, 2], ITEMS))[0] == [9, 9, OK, 2]
    finally:
        await processor.aclose()


async def test_a_worker_without_a_processor_refuses_fetched_refs_failed_precondition():
    settings = MediaSettings(processor="inprocess")
    service = MediaService(settings)  # the sim engine's case: no model processor to run
    assert service.processor is None
    service_with = MediaService(settings, model_dir="/m", processor_python=lambda: sys.executable)
    assert service_with.processor is not None and not service_with.processor.running  # lazy: nothing started yet
    off = MediaService(MediaSettings(), model_dir="/m", processor_python=lambda: sys.executable)
    assert off.processor is None  # media refs off: no helper, ever


@pytest.mark.process
async def test_a_child_killed_between_requests_is_noticed_before_the_next_is_sent(child):
    starts: list[int] = []
    processor = _processor(child, starts=starts)
    try:
        await processor.process([OK], ITEMS)
        first = processor._process
        first.kill()
        with trio.fail_after(10):
            while not _zombie(first.pid):  # dead, not yet reaped: only a poll() can tell
                await trio.sleep(0.01)
        assert (await processor.process([OK, 3], ITEMS))[0] == [9, 9, OK, 3]  # a fresh child, not a failed request
        assert len(starts) == 2 and processor._process is not first
    finally:
        await processor.aclose()


# -- the call refitted to the processed prompt (runtime/contracts/shared/media_refit.py) ---------------------------------

def _validated(max_model_len: int, prompt_len: int, **sampling):
    limits = EngineLimits(max_model_len=max_model_len, vocab_size=4096, eos_token_ids=(2,))
    request = generate_request("refit", list(range(5, 5 + prompt_len)), **sampling)
    if "max_tokens" not in sampling:
        request.sampling_params.ClearField("max_tokens")
    return request, limits, validate_generate(request, limits, 0.0)


def test_an_unset_max_tokens_is_the_room_left_beside_the_expanded_prompt():
    request, limits, call = _validated(64, 10)
    assert call.max_tokens == 54  # judged on the router's prompt, before the image's tokens
    expanded = [4096] * 32 + call.prompt_token_ids
    call = with_processed_media(call, request.sampling_params, expanded, [{"mm_hash": "h"}], limits)
    assert call.max_tokens == 22 and call.prompt_token_ids == expanded
    assert all(spec.sampling.max_tokens == 22 and spec.prompt_token_ids == expanded for spec in call.specs)
    assert all(spec.mm_features == [{"mm_hash": "h"}] for spec in call.specs)


@pytest.mark.parametrize("image_tokens, sampling, field, words", [
    (54, {}, "media_refs", "the prompt with its media placeholders has 64 tokens"),  # no room at all
    (60, {}, "media_refs", "has 70 tokens; the context is 64"),
    (40, {"max_tokens": 20}, "sampling_params.max_tokens", "20 does not fit"),  # fit before, not after
])  # fmt: skip
def test_a_prompt_the_placeholders_grow_past_the_context_is_the_clients_error(image_tokens, sampling, field, words):
    request, limits, call = _validated(64, 10, **sampling)
    with pytest.raises(ClientError) as error:
        with_processed_media(call, request.sampling_params, [4096] * image_tokens + call.prompt_token_ids, [], limits)
    assert str(error.value).startswith(field) and words in str(error.value), str(error.value)

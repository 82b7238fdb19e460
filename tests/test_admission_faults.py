"""Any failure between admission and the engine frees the call: its id, its engine ids, its slots (issue 38, item 1).

A request that passed validation and was admitted, then failed while it was
encoded for the engine, used to stay in flight forever: its id answered
ALREADY_EXISTS even after Abort, and about 4,100 of them made every request
UNAVAILABLE ("4096 requests in flight") while health said SERVING. Here a
fault is injected at every step from admission to the engine (the rank pick,
the admission metric, the admission record, each ADD's encoding, each ADD's
hand-off, the "sent" record), on each engine wire's codec (vLLM, SGLang,
TokenSpeed), through the real ``generate`` loop a gRPC handler runs; after
each, nothing of the call is left and the same id is served again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from enginelink.journal.records import KIND_CLIENT_GENERATE, KIND_ENGINE_REQUEST
from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.runtime.errors import EngineFailure
from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
from enginelink.runtime.requests.generate import generate
from enginelink.runtime.context.submit import TrioWake
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import FinishReason, OutputBatch
from enginelink.wire.sglang import SglangCodec
from enginelink.wire.tokenspeed import TokenSpeedCodec
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal, generate_request

LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
CODECS = {"vllm": VllmCodec, "sglang": SglangCodec, "tokenspeed": TokenSpeedCodec}


class Injected(Exception):
    """The injected fault (stands for an encoder's error, a broken journal, a bug)."""


class FaultyJournal(ListJournal):
    def __init__(self) -> None:
        super().__init__()
        self.fail_kind: str | None = None

    def append(self, now, stream, kind, payload) -> None:
        if kind == self.fail_kind:
            self.fail_kind = None
            raise Injected(f"journal refused {kind}")
        super().append(now, stream, kind, payload)


class Servicer:
    """A hub on a serving link with two DP ranks, the frames it sent per rank, and ``generate`` as gRPC runs it."""

    def __init__(self, wire: str) -> None:
        link = LinkMachine("faults-0", 0.0)
        link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
        link.handle(LinkEvent.WARMUP_DONE, 0.0)
        self.codec = CODECS[wire]()
        # What each frame list the servicer sends is: an ADD's engine id, or the engine ids an ABORT names.
        self.added: dict[int, str] = {}
        self.aborted: dict[int, tuple[str, ...]] = {}
        encode_add, encode_abort = self.codec.encode_add, self.codec.encode_abort

        def add(spec):
            frames = encode_add(spec)
            self.added[id(frames)] = spec.request_id
            return frames

        def abort(engine_ids):
            frames = encode_abort(engine_ids)
            self.aborted[id(frames)] = tuple(engine_ids)
            return frames

        self.codec.encode_add, self.codec.encode_abort = add, abort
        if hasattr(self.codec, "encode_aborts"):  # SGLang: one AbortReq a request, several for one rank
            encode_aborts = self.codec.encode_aborts

            def aborts(engine_ids):
                frame_lists = encode_aborts(engine_ids)
                for engine_id, frames in zip(engine_ids, frame_lists, strict=True):
                    self.aborted[id(frames)] = (engine_id,)
                return frame_lists

            self.codec.encode_aborts = aborts
        self.journal = FaultyJournal()
        self.sent: list[tuple[int, list[bytes]]] = []
        self.fail_send_at: int | None = None
        self.hub = RequestHub(link=link, codec=self.codec, send_frames=self._send, journal=self.journal,
                              ranks=RankTable((0, 1)))  # fmt: skip
        self.app = SimpleNamespace(hub=self.hub, limits=LIMITS, ready={}, open_writers=0,
                                   wall_time=lambda now: now, refused=lambda *args: None)  # fmt: skip

    def _send(self, frames: list[bytes], rank: int) -> None:
        if self.fail_send_at is not None and len(self.sent) == self.fail_send_at:
            self.fail_send_at = None
            raise Injected("the transport broke")
        self.sent.append((rank, frames))

    async def generate(self, request_id: str, n: int):
        """One non-streaming Generate; returns the error it ended with, or the messages it sent."""
        got = []

        async def send(message):
            got.append(message)

        request = generate_request(request_id, [5, 6, 7], max_tokens=2, n=n, seed=3)
        try:
            with trio.fail_after(5):
                await generate(self.app, request, wake=TrioWake(), send=send, edge=VLLM_EDGE)
        except Exception as error:  # what the gRPC handler maps to a status
            return error
        return got

    def finish_all(self) -> None:
        """The engine ends every open engine request with one token (so a good call completes)."""
        outputs = [SimpleNamespace(request_id=engine_id, new_token_ids=[9], finish_reason=int(FinishReason.LENGTH),
                                   stop_reason=None, kv_transfer_params=None, num_cached_tokens=0,
                                   new_logprobs=None, new_prompt_logprobs_tensors=None)
                   for engine_id in list(self.hub.by_engine_id)]  # fmt: skip
        self.hub.on_batch(OutputBatch(outputs=outputs, engine_index=0, timestamp=0.0), 0.0)

    def assert_nothing_held(self) -> None:
        hub = self.hub
        assert hub.calls == {}, f"calls still in flight: {list(hub.calls)}"
        assert hub.writing == {}, f"ids still held by a writer: {list(hub.writing)}"
        assert hub.by_engine_id == {}, f"engine ids still routed: {list(hub.by_engine_id)}"
        assert hub.ranks.in_flight == {0: 0, 1: 0}, f"rank slots still taken: {hub.ranks.in_flight}"
        assert self.app.open_writers == 0


def _inject(servicer: Servicer, step: str, monkeypatch) -> None:
    hub = servicer.hub
    if step == "rank_pick":
        original = hub.ranks.pick
        calls = []

        def pick(pinned=None):
            calls.append(pinned)
            if len(calls) == 2:  # the second choice's rank: the first already holds a slot
                raise Injected("rank table")
            return original(pinned)

        monkeypatch.setattr(hub.ranks, "pick", pick)
    elif step == "admitted_metric":
        metrics = hub.core.metrics
        original = metrics.admitted

        def admitted(*args):
            monkeypatch.setattr(metrics, "admitted", original)  # once
            raise Injected("metrics")

        monkeypatch.setattr(metrics, "admitted", admitted, raising=False)
    elif step == "admission_record":
        servicer.journal.fail_kind = KIND_CLIENT_GENERATE
    elif step in ("encode_first", "encode_second"):
        original = servicer.codec.encode_add
        calls = []

        def encode_add(spec):
            calls.append(spec)
            if len(calls) == (1 if step == "encode_first" else 2):
                raise Injected("the codec cannot encode this request")
            return original(spec)

        monkeypatch.setattr(servicer.codec, "encode_add", encode_add)
    elif step == "sent_record":
        servicer.journal.fail_kind = KIND_ENGINE_REQUEST
    elif step in ("send_first", "send_second"):
        servicer.fail_send_at = 0 if step == "send_first" else 1
    else:
        raise AssertionError(step)


STEPS = ["rank_pick", "admitted_metric", "admission_record", "encode_first", "encode_second", "sent_record",
         "send_first", "send_second"]  # fmt: skip


@pytest.mark.parametrize("wire", sorted(CODECS))
@pytest.mark.parametrize("step", STEPS)
async def test_a_failure_at_any_step_to_the_engine_frees_the_call(wire, step, monkeypatch):
    servicer = Servicer(wire)
    _inject(servicer, step, monkeypatch)
    error = await servicer.generate("victim", n=2)
    if step.startswith("send_"):
        # The link could not take the frame: the engine's side, retryable (the writer freed it).
        assert isinstance(error, EngineFailure), error
    else:
        # Our own failure: it goes on as our bug (the gRPC handler answers INTERNAL and logs it).
        assert isinstance(error, Injected), error
    servicer.assert_nothing_held()
    # Whatever of the call reached the engine was aborted there, on the rank that has it.
    added = {(rank, servicer.added[id(frames)]) for rank, frames in servicer.sent if id(frames) in servicer.added}
    aborted = {(rank, engine_id) for rank, frames in servicer.sent for engine_id in servicer.aborted.get(id(frames), ())}
    assert added == aborted, (added, aborted)
    if step in ("encode_second", "sent_record", "send_second"):
        assert added, "the fault came after an ADD went out: the case must abort one"
    # The same id is served again, and completes.
    servicer.sent.clear()

    async def engine():
        while not servicer.hub.by_engine_id:
            await trio.sleep(0.001)
        servicer.finish_all()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine)
            again = await servicer.generate("victim", n=2)
    assert isinstance(again, list), again
    assert [m.index for m in again] == [0, 1]
    servicer.assert_nothing_held()


async def test_thousands_of_failing_requests_leave_the_servicer_serving(monkeypatch):
    """The issue's numbers: past 4,096 failed requests the next good one is still admitted."""
    servicer = Servicer("vllm")
    original = servicer.codec.encode_add
    monkeypatch.setattr(servicer.codec, "encode_add", lambda spec: (_ for _ in ()).throw(Injected("encode")))
    for i in range(servicer.hub.in_flight_max + 10):
        assert isinstance(await servicer.generate(f"bad-{i}", n=1), Injected)
    servicer.assert_nothing_held()
    monkeypatch.setattr(servicer.codec, "encode_add", original)

    async def engine():
        while not servicer.hub.by_engine_id:
            await trio.sleep(0.001)
        servicer.finish_all()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine)
            assert isinstance(await servicer.generate("good", n=1), list)

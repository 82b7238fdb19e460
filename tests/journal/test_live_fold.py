"""The live fold (the snapshot task) takes the link's decode of each engine frame instead of decoding
the journaled bytes again, and its snapshots are still exactly what replay folds from the bytes."""

from __future__ import annotations

import functools

import msgspec
import pytest
import trio

from enginelink.journal import fold as fold_module
from enginelink.journal import journal as journal_module
from enginelink.journal import records as r
from enginelink.journal.fold import FoldState, fold
from enginelink.journal.journal import Journal
from enginelink.runtime.lifetime.snapshots import run_snapshots
from enginelink.wire.vllm import EngineCoreOutput, EngineCoreOutputs, VllmCodec

CODEC = VllmCodec()


def frame(*outputs: tuple[str, list[int], int | None]) -> bytes:
    return msgspec.msgpack.encode(EngineCoreOutputs(0, [EngineCoreOutput(rid, tokens, finish_reason=finish)
                                                        for rid, tokens, finish in outputs]))


class CountingCodec:
    """The fold's codec, counting the frames the fold decodes itself."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode_output(self, frames):
        self.decoded += 1
        return CODEC.decode_output(frames)


@pytest.fixture
def counting(monkeypatch) -> CountingCodec:
    codec = CountingCodec()
    monkeypatch.setattr(fold_module, "_codec", lambda name: codec)
    return codec


def scenario() -> list[tuple[str, str, object]]:
    """Two calls (one of n=2), their frames, a late output, a finish, and one frame nobody can read."""
    events: list[tuple[str, str, object]] = [
        ("run", r.KIND_RUN_START, {"wall_time": 0.0, "pid": 1, "version": "v", "engine": "vllm"}),
        (r.request_stream("a"), r.KIND_CLIENT_GENERATE, {"request_id": "a", "n": 1, "prompt_tokens": 3}),
        (r.request_stream("a"), r.KIND_ENGINE_REQUEST, {"link": "vllm-0", "request_ids": ["a"], "prompt_tokens": 3}),
        (r.request_stream("b"), r.KIND_CLIENT_GENERATE, {"request_id": "b", "n": 2, "prompt_tokens": 2}),
        (r.request_stream("b"), r.KIND_ENGINE_REQUEST,
         {"link": "vllm-0", "request_ids": ["b#0", "b#1"], "prompt_tokens": 2}),
    ]
    for step in range(6):
        outputs = [("a", [100 + step], None), ("b#0", [200 + step, 300], None)]
        if step < 3:
            outputs.append(("b#1", [7], 0 if step == 2 else None))  # b#1 finishes (stop) at step 2
        if step == 4:
            outputs.append(("gone", [1, 2, 3], None))  # an engine id no call holds: a late output
        events.append(("engine", r.KIND_ENGINE_FRAME, frame(*outputs)))
    events.append(("engine", r.KIND_ENGINE_FRAME, b"\xc1 not msgpack"))  # undecodable: never noted
    return events


async def live_run(events, journal: Journal) -> tuple[Journal, r.Record]:
    """The events through a journal while the snapshot task runs, each readable frame noted as the link does."""
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_snapshots, journal, interval_s=1.0, fold_every_s=0.25))
        for index, (stream, kind, payload) in enumerate(events):
            seq = journal.append(trio.current_time(), stream, kind, payload)
            if kind == r.KIND_ENGINE_FRAME and payload[:1] != b"\xc1":
                journal.note_decoded(seq, CODEC.decode_output([payload]))
            if index % 4 == 3:
                await trio.sleep(0.25)  # a fold period: the task folds what came so far
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    snapshots = [rec for rec in journal.records() if rec.kind == r.KIND_SNAPSHOT]
    assert snapshots, "the snapshot task wrote no snapshot"
    return journal, snapshots[-1]


def replayed(journal: Journal, through_seq: int) -> FoldState:
    return fold(rec for rec in journal.records() if rec.seq < through_seq)


def same_state(snapshot: r.Record, state: FoldState) -> bool:
    back = FoldState.from_snapshot(snapshot)
    expected = {**state.to_dict(), "last_seq": snapshot.seq}
    return msgspec.msgpack.encode(back.to_dict()) == msgspec.msgpack.encode(expected)


async def test_the_live_fold_decodes_no_frame_the_link_decoded_and_snapshots_what_replay_folds(
        autojump_clock, counting):
    events = scenario()
    journal, snapshot = await live_run(events, Journal(None))
    frames = sum(1 for _, kind, _ in events if kind == r.KIND_ENGINE_FRAME)
    assert counting.decoded == 1, "the live fold decoded frames the link had decoded already"
    counting.decoded = 0
    state = replayed(journal, snapshot.seq)
    assert counting.decoded == frames  # replay decodes every frame from its bytes
    assert same_state(snapshot, state)
    assert state.requests["a"].engine_tokens == [6] and state.requests["b"].engine_tokens == [12, 3]
    assert state.frames_undecodable == 1 and state.frames == frames
    # The task is gone: nothing takes decodes any more, so none is kept.
    seq = journal.append(9.0, "engine", r.KIND_ENGINE_FRAME, events[5][2])
    journal.note_decoded(seq, CODEC.decode_output([events[5][2]]))
    assert journal.take_decoded(seq) == {} and journal.stats().decoded_outputs == 0


async def test_decodes_past_the_bound_are_dropped_and_the_fold_decodes_those_frames_itself(
        autojump_clock, counting):
    events = scenario()
    # Every frame noted before the task's first fold: the last two frames hold 3 + 2 outputs, all
    # the bound keeps; every older decode is dropped.
    journal = Journal(None, decoded_outputs_max=5)
    journal.keep_decoded()
    seqs = []
    for stream, kind, payload in events:
        seq = journal.append(0.0, stream, kind, payload)
        if kind == r.KIND_ENGINE_FRAME and payload[:1] != b"\xc1":
            journal.note_decoded(seq, CODEC.decode_output([payload]))
            seqs.append(seq)
    stats = journal.stats()
    assert (stats.decoded_dropped, stats.decoded_outputs, stats.decoded_outputs_max) == (len(seqs) - 2, 5, 5)
    assert sorted(journal.take_decoded(seqs[-1])) == seqs[-2:]
    assert journal.take_decoded(seqs[-1]) == {}  # taken once
    assert journal.stats().decoded_outputs == 0

    # Through the snapshot task, with the bound that small: the snapshot is still replay's state.
    journal, snapshot = await live_run(events, Journal(None, decoded_outputs_max=5))
    assert counting.decoded > 1  # the frames whose decodes were dropped, decoded by the fold
    assert same_state(snapshot, replayed(journal, snapshot.seq))


def test_without_a_live_fold_no_decode_is_kept():
    journal = Journal(None)
    assert journal.stats().decoded_outputs_max == journal_module.DECODED_OUTPUTS_MAX
    seq = journal.append(0.0, "engine", r.KIND_ENGINE_FRAME, frame(("a", [1], None)))
    journal.note_decoded(seq, CODEC.decode_output([frame(("a", [1], None))]))
    assert journal.take_decoded(seq) == {}
    assert journal.stats().decoded_dropped == 0

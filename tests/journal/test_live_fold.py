"""The journal's live fold (started by the snapshot task) folds each record at the end of the receive
wake-up that appended it (after that wake-up's writes), takes the link's decode of each engine frame
instead of decoding the journaled bytes again, and its state and snapshots are exactly what replay folds
from the bytes."""

from __future__ import annotations

import functools

import msgspec
import pytest
import trio

from enginelink.journal import fold as fold_module
from enginelink.journal import records as r
from enginelink.journal.fold import FoldState, fold
from enginelink.journal.journal import UNFOLDED_MAX, Journal
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


async def live_run(events, journal: Journal, *, late: frozenset[int] = frozenset()) -> tuple[Journal, r.Record]:
    """The events through a journal while the snapshot task runs, each readable frame's decode
    noted right after it as the link does; for the frames at the indexes in ``late``, only after
    the next record (the decode then comes too late to be taken)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_snapshots, journal, interval_s=1.0))
        owed = None
        for index, (stream, kind, payload) in enumerate(events):
            seq = journal.append(trio.current_time(), stream, kind, payload)
            if owed is not None:
                journal.note_decoded(*owed)
                owed = None
            if kind == r.KIND_ENGINE_FRAME and payload[:1] != b"\xc1":
                if index in late:
                    owed = (seq, CODEC.decode_output([payload]))
                else:
                    journal.note_decoded(seq, CODEC.decode_output([payload]))
            if index % 4 == 3:
                await trio.sleep(0.25)
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


def encoded(state: FoldState) -> bytes:
    return msgspec.msgpack.encode(state.to_dict())


async def test_the_live_fold_decodes_no_frame_the_link_decoded_and_snapshots_what_replay_folds(
        autojump_clock, counting):
    events = scenario()
    journal, snapshot = await live_run(events, Journal(None))
    frames = sum(1 for _, kind, _ in events if kind == r.KIND_ENGINE_FRAME)
    assert counting.decoded == 1, "the live fold decoded frames the link had decoded already"
    assert journal.stats().live_fold_frames_decoded == 1  # the unreadable one, which has no decode
    counting.decoded = 0
    state = replayed(journal, snapshot.seq)
    assert counting.decoded == frames  # replay decodes every frame from its bytes
    assert same_state(snapshot, state)
    assert state.requests["a"].engine_tokens == [6] and state.requests["b"].engine_tokens == [12, 3]
    assert state.frames_undecodable == 1 and state.frames == frames


async def test_a_frame_whose_decode_comes_after_another_record_is_decoded_by_the_fold(autojump_clock, counting):
    events = scenario()
    late = frozenset(index for index, (_, kind, _) in enumerate(events) if kind == r.KIND_ENGINE_FRAME)
    late = frozenset(sorted(late)[1::2])  # every other readable frame's decode comes one record late
    journal, snapshot = await live_run(events, Journal(None), late=late)
    assert counting.decoded == 1 + len(late)  # the unreadable frame, and each late one, from its bytes
    assert journal.stats().live_fold_frames_decoded == 1 + len(late)
    assert same_state(snapshot, replayed(journal, snapshot.seq))


def test_the_live_state_is_replays_after_every_record():
    journal = Journal(None)
    state = journal.fold_live()
    for stream, kind, payload in scenario():
        seq = journal.append(1.0, stream, kind, payload)
        if kind == r.KIND_ENGINE_FRAME and payload[:1] != b"\xc1":
            journal.note_decoded(seq, CODEC.decode_output([payload]))
        assert journal.live_state() is state
        assert encoded(state) == encoded(fold(journal.records()))
    with pytest.raises(RuntimeError, match="already running"):
        journal.fold_live()


def test_the_live_fold_takes_a_wake_ups_records_at_its_end_and_never_more_than_its_bound():
    """Folded at each append, a frame and the records its calls made sat between the frame's arrival
    and its tokens' write; the fold now waits for the wake-up's end (``catch_up``, which
    ``runtime/lifetime/core.connect`` calls after the writes), and a reader of the state gets it whole."""
    journal = Journal(None)
    state = journal.fold_live()
    events = scenario()
    for stream, kind, payload in events:
        seq = journal.append(1.0, stream, kind, payload)
        if kind == r.KIND_ENGINE_FRAME and payload[:1] != b"\xc1":
            journal.note_decoded(seq, CODEC.decode_output([payload]))
    assert state.last_seq == 0 and state.frames == 0  # nothing folded on the frames' way
    journal.catch_up()
    assert state.last_seq == len(events) and encoded(state) == encoded(fold(journal.records()))
    assert journal.stats().live_fold_frames_decoded == 1  # only the unreadable frame, from its bytes
    for _ in range(UNFOLDED_MAX):  # appends no wake-up ends (admissions to an engine that sends nothing)
        journal.append(2.0, "run", r.KIND_RUN_STOP, {"exit_status": 0, "reason": "test"})
    assert state.last_seq == len(events) + UNFOLDED_MAX  # the bound folded them itself
    journal.append(3.0, "run", r.KIND_RUN_STOP, {"exit_status": 0, "reason": "test"})
    assert journal.live_state() is state and state.last_seq == len(events) + UNFOLDED_MAX + 1


def test_a_live_fold_started_late_folds_what_came_before_it():
    events = scenario()
    journal = Journal(None)
    for stream, kind, payload in events[:6]:
        journal.append(0.0, stream, kind, payload)
    journal.fold_live()
    for stream, kind, payload in events[6:]:
        journal.append(0.0, stream, kind, payload)
    assert encoded(journal.live_state()) == encoded(fold(journal.records()))


async def test_without_a_live_fold_appends_fold_nothing_and_decodes_are_ignored(autojump_clock):
    journal = Journal(None)
    seq = journal.append(0.0, "engine", r.KIND_ENGINE_FRAME, frame(("a", [1], None)))
    journal.note_decoded(seq, CODEC.decode_output([frame(("a", [1], None))]))
    with pytest.raises(RuntimeError, match="no live fold"):
        journal.live_state()
    # The snapshot task's end ends the live fold: later appends fold nothing.
    async with trio.open_nursery() as nursery:
        state = await nursery.start(functools.partial(run_snapshots, journal, interval_s=1.0))
        nursery.cancel_scope.cancel()
    assert state.last_seq == seq
    journal.append(1.0, "run", r.KIND_RUN_STOP, {"exit_status": 0, "reason": "test"})
    assert state.last_seq == seq
    with pytest.raises(RuntimeError, match="no live fold"):
        journal.live_state()


async def test_a_ring_that_pruned_its_start_means_no_snapshots_not_a_crash(autojump_clock, caplog):
    journal = Journal(None, ring_records_max=3)
    for stream, kind, payload in scenario()[:5]:
        journal.append(0.0, stream, kind, payload)
    async with trio.open_nursery() as nursery:
        assert await nursery.start(functools.partial(run_snapshots, journal, interval_s=1.0)) is None
        await trio.sleep(5.0)  # the task has ended; the nursery (the servicer) lives on
    assert "no longer holds records 1..2" in caplog.text and "no snapshots this run" in caplog.text
    assert not any(rec.kind == r.KIND_SNAPSHOT for rec in journal.records())

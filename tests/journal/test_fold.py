"""The fold: what it rebuilds, its bounds, and snapshot resume == full replay."""

from __future__ import annotations

import msgspec
import pytest

from enginelink.journal import records as r
from enginelink.journal.fold import (
    STATE_UNSEEN,
    FoldState,
    LinkView,
    RequestView,
    fold,
    snapshot_payload,
)
from enginelink.journal.journal import Journal
from enginelink.journal.store import open_reader


def exact(state: FoldState) -> bytes:
    """Byte-exact form: equality that also sees dict order (eviction order)."""
    return msgspec.msgpack.encode(state.to_dict())


def journaled(events) -> list[r.Record]:
    """Records as a reader gets them: payloads through msgpack and back."""
    journal = Journal(None)
    for t, stream, kind, payload in events:
        journal.append(t, stream, kind, payload)
    return journal.records()


def trans(seq: int, t: float, machine: str, id_: str, source: str, dest: str) -> r.Record:
    payload = r.Transition(machine, id_, source, dest, "ev").payload()
    return r.Record(seq, t, f"{machine}/{id_}", r.KIND_TRANSITION, payload)


def generate(seq: int, t: float, rid: str, n: int, prompt_tokens: int) -> r.Record:
    payload = {"request_id": rid, "n": n, "prompt_tokens": prompt_tokens, "stream": True, "max_tokens": 9}
    return r.Record(seq, t, r.request_stream(rid), r.KIND_CLIENT_GENERATE, payload)


def sent(seq: int, t: float, rid: str, index: int, tokens: int, reason: str) -> r.Record:
    payload = {"request_id": rid, "index": index, "tokens_sent": tokens, "finish_reason": reason}
    return r.Record(seq, t, r.request_stream(rid), r.KIND_CLIENT_SENT, payload)


def test_fold_rebuilds_links_requests_and_run():
    start = {"wall_time": 100.0, "trio_time": 0.0, "pid": 9, "argv": [], "version": "v", "budgets": {}}
    facts = {"link": "0", "pid": 77, "facts": {"max_model_len": 8}}
    recs = [
        r.Record(1, 0.0, "run", r.KIND_RUN_START, start),
        trans(2, 0.1, "link", "0", "new", "starting"),
        r.Record(3, 0.2, "engine/0", r.KIND_ENGINE_FACTS, facts),
        trans(4, 0.3, "link", "0", "starting", "serving"),
        generate(5, 1.0, "a", n=2, prompt_tokens=5),
        trans(6, 1.0, "request", "a", "new", "admitted"),
        r.Record(7, 1.5, "engine/0", r.KIND_ENGINE_FRAME, b"\x00\x01"),
        sent(8, 2.0, "a", 0, 4, "stop"),
        sent(9, 2.5, "a", 1, 9, "length"),
        trans(10, 2.5, "request", "a", "admitted", "finished"),
        sent(11, 3.0, "zz", 0, 1, "stop"),  # a request the fold never saw
        r.Record(12, 4.0, "run", r.KIND_RUN_STOP, {"exit_status": 0, "reason": "sigterm"}),
    ]
    st = fold(recs)
    assert st.links == {"0": LinkView(state="serving", since=0.3, pid=77, facts={"max_model_len": 8})}
    assert st.requests == {
        "a": RequestView(
            state="finished", since=2.5, admitted_at=1.0, n=2, prompt_tokens=5,
            tokens_sent=13, finish_reason="length", choices_done=2,
        )
    }
    assert st.ended == {"a": 2.5}
    run = st.run
    assert (run.started_at, run.wall_time, run.pid, run.stopped_at, run.exit_status) == (0.0, 100.0, 9, 4.0, 0)
    assert (st.last_seq, st.unmatched) == (12, 1)


def test_the_launch_priority_is_part_of_the_link_and_of_snapshots():
    """What ``lower_priority`` set is kept as the handshake's ``priority`` step said it, and survives a snapshot."""
    priority = {"levels": 10, "nice": 10, "autogroup_nice": 10, "servicer": {"policy": "batch", "threads": 4}}
    recs = journaled([
        (0.0, r.link_stream("vllm-0"), r.KIND_ENGINE_HANDSHAKE, {"step": "launch", "message": {"argv": ["vllm"]}}),
        (0.1, r.link_stream("vllm-0"), r.KIND_ENGINE_HANDSHAKE, {"step": "priority", "message": priority}),
        (0.2, r.link_stream("vllm-0"), r.KIND_ENGINE_HANDSHAKE, {"step": "init", "message": {"inputs": []}}),
    ])
    st = fold(recs)
    assert st.links["vllm-0"].priority == priority
    assert st.links["vllm-0"].state == "starting"
    assert FoldState.from_dict(st.to_dict()).links["vllm-0"].priority == priority
    # A snapshot written before the field existed still loads, with no priority.
    old = st.to_dict()
    del old["links"]["vllm-0"]["priority"]
    assert FoldState.from_dict(old).links["vllm-0"].priority == {}


def test_the_placement_is_part_of_the_link_and_of_snapshots():
    """What ``place_front_end`` did is kept as the handshake's ``placement`` step said it, and survives a snapshot."""
    placement = {"bound_cpus": [0], "servicer_cpus": [0, 1], "front_end_cpus": [1], "engine_threads": 50,
                 "servicer_threads": 4}
    recs = journaled([
        (0.0, r.link_stream("vllm-0"), r.KIND_ENGINE_HANDSHAKE, {"step": "launch", "message": {"argv": ["vllm"]}}),
        (0.3, r.link_stream("vllm-0"), r.KIND_ENGINE_HANDSHAKE, {"step": "placement", "message": placement}),
    ])
    st = fold(recs)
    assert st.links["vllm-0"].placement == placement
    assert FoldState.from_dict(st.to_dict()).links["vllm-0"].placement == placement
    old = st.to_dict()
    del old["links"]["vllm-0"]["placement"]
    assert FoldState.from_dict(old).links["vllm-0"].placement == {}


def test_generate_before_any_transition_is_unseen():
    st = fold([generate(1, 1.0, "a", n=1, prompt_tokens=3)])
    assert st.requests["a"] == RequestView(state=STATE_UNSEEN, since=1.0, admitted_at=None, n=1, prompt_tokens=3)


def test_reused_request_id_starts_over():
    st = fold([
        generate(1, 1.0, "a", n=1, prompt_tokens=3),
        trans(2, 1.0, "request", "a", "new", "admitted"),
        trans(3, 2.0, "request", "a", "admitted", "failed"),
        generate(4, 5.0, "a", n=2, prompt_tokens=4),
    ])
    assert st.requests["a"] == RequestView(state=STATE_UNSEEN, since=5.0, n=2, prompt_tokens=4)
    assert st.ended == {}


def test_terminal_requests_are_bounded_oldest_first():
    st = FoldState(terminal_max=3)
    recs = [trans(1 + i, float(i), "request", str(i), "new", "admitted") for i in range(6)]
    recs += [trans(7 + i, 10.0 + i, "request", str(i), "admitted", "aborted") for i in range(6)]
    fold(recs, st)
    assert list(st.ended) == ["3", "4", "5"]
    assert sorted(st.requests) == ["3", "4", "5"]


def test_records_already_folded_are_skipped(scenario):
    recs = journaled(scenario(seed=5))
    once = fold(recs)
    again = fold(recs, FoldState.from_dict(once.to_dict()))
    assert exact(again) == exact(once)


def test_to_dict_round_trips_through_msgpack(scenario):
    st = fold(journaled(scenario(seed=6)), FoldState(terminal_max=7))
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(st.to_dict()))
    assert FoldState.from_dict(data) == st
    assert exact(FoldState.from_dict(data)) == exact(st)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fold_from_any_snapshot_equals_fold_from_start(seed, scenario, tmp_path):
    """The live servicer folds as it goes and writes snapshots; a replay
    from any snapshot plus the records after it gives the same state as a
    replay from the first record. Checked on the ring and on the file."""
    path = tmp_path / "j.sqlite"
    journal = Journal(path)
    live = FoldState(terminal_max=5)  # small, so eviction happens across snapshots
    for i, (t, stream, kind, payload) in enumerate(scenario(seed=seed, requests=80)):
        seq = journal.append(t, stream, kind, payload)
        fold(journal.records(after_seq=seq - 1), live)
        if i % 37 == 36:
            seq = journal.append(t, r.RUN_STREAM, r.KIND_SNAPSHOT, snapshot_payload(live))
            fold(journal.records(after_seq=seq - 1), live)
    journal.flush_sync()
    journal.close()

    recs = journal.records()
    full = fold(recs, FoldState(terminal_max=5))
    assert exact(full) == exact(live)
    assert full.ended and full.links["0"].state == "draining"
    snapshots = [x for x in recs if x.kind == r.KIND_SNAPSHOT]
    assert len(snapshots) >= 3
    for snap in snapshots:
        resumed = fold([x for x in recs if x.seq > snap.seq], FoldState.from_snapshot(snap))
        assert exact(resumed) == exact(full), f"resume from snapshot at seq {snap.seq}"

    with open_reader(path) as reader:
        snap = reader.last_snapshot()
        resumed = fold(reader.iter_records(after_seq=snap.seq), FoldState.from_snapshot(snap))
        assert exact(resumed) == exact(full)
        assert exact(fold(reader.iter_records(), FoldState(terminal_max=5))) == exact(full)


def test_from_snapshot_refuses_other_kinds():
    with pytest.raises(ValueError, match="not a snapshot"):
        FoldState.from_snapshot(r.Record(1, 0.0, "run", r.KIND_RUN_STOP, {}))

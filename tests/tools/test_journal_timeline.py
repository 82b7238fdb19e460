"""``enginelink journal timeline``: a journal as a Chrome/Perfetto trace, checked against the journal.

A real servicer on the sim engine (warm-up on) serves a mix: a short call,
n = 2, a stream aborted by the client, a stream still running when SIGTERM
drains it. The timeline of its journal, written by the CLI as a user would,
must hold a track per request with its admission and its end at the
journal's times, its phases in order, the link's states in the order of its
transitions (warm-up and drain among them), a counter per engine frame on
the rank's track and an instant per complete. Synthetic journals check what
a real run rarely shows (a request open at the end, an id used twice, a call
refused before admission, a pruned start).
"""

from __future__ import annotations

import io
import json
import signal
from collections import defaultdict

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal import records as r
from enginelink.journal.records import Record
from enginelink.journal.store import open_reader
from enginelink.tools.journal_timeline import PID_LINKS, PID_RANKS, PID_REQUESTS, PID_RUN, write_timeline
from tests.harness import Servicer, generate_request
from tests.tools.helpers import PROMPT, WARMUP_PREFIX, Stream, enginelink


@pytest.fixture(scope="module")
def journal(tmp_path_factory, test_model_dir):
    servicer = Servicer(tmp_path_factory.mktemp("timeline"), model_dir=test_model_dir,
                        engine_args=["--step-us", "10000"], env={"ENGINELINK_DRAIN_SECS": "0.2"})
    try:
        servicer.start()
        stub = servicer.stub
        drained = Stream(servicer, "drained", max_tokens=1500, ignore_eos=True)
        cut = Stream(servicer, "cut", max_tokens=1500, ignore_eos=True)
        list(stub.Generate(generate_request("short", PROMPT, stream=True, max_tokens=5, ignore_eos=True)))
        list(stub.Generate(generate_request("pair", PROMPT, n=2, temperature=1.0, max_tokens=4, ignore_eos=True)))
        assert cut.streaming.wait(5) and drained.streaming.wait(5)
        stub.Abort(pb.AbortRequest(request_ids=["cut"]))
        cut.join(5)
        servicer.signal(signal.SIGTERM)
        assert servicer.wait(15) == 0, servicer.log()
        drained.join(5)
    finally:
        servicer.stop()
    return servicer.journal


def _timeline(journal, tmp_path) -> dict:
    out = tmp_path / "timeline.json"
    done = enginelink("journal", "timeline", "--journal", journal, "--out", out)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}:" in done.stderr
    return json.loads(out.read_text())


def _us(seconds: float) -> float:
    return round(seconds * 1_000_000, 3)


def _tracks(events: list[dict], pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


@pytest.mark.process
def test_the_timeline_of_a_real_run_matches_its_journal(journal, tmp_path):
    with open_reader(journal) as reader:
        records = list(reader.iter_records())
    start = next(rec.time for rec in records if rec.kind == r.KIND_RUN_START)
    trace = _timeline(journal, tmp_path)
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {PID_RUN: "run", PID_LINKS: "engine links", PID_RANKS: "engine ranks",
                         PID_REQUESTS: "requests"}

    # Every request: a track of its own, one slice from its admission to its end, at the journal's times.
    admitted = [rec for rec in records if rec.kind == r.KIND_CLIENT_GENERATE]
    ids = [rec.payload["request_id"] for rec in admitted]
    assert {"short", "pair", "cut", "drained"} <= set(ids) and any(i.startswith(WARMUP_PREFIX) for i in ids)
    tracks = _tracks(events, PID_REQUESTS)
    assert sorted(tracks.values()) == sorted(ids)
    tid_of = {name: tid for tid, name in tracks.items()}
    ends = {rec.payload["id"]: rec for rec in records
            if rec.kind == r.KIND_TRANSITION and rec.payload["machine"] == "request"
            and rec.payload["dest"] in ("finished", "aborted", "failed")}
    for rec in admitted:
        rid = rec.payload["request_id"]
        whole = [e for e in events if e["ph"] == "X" and e["pid"] == PID_REQUESTS and e["tid"] == tid_of[rid]
                 and e["cat"] == "request"]
        assert len(whole) == 1, (rid, whole)
        whole = whole[0]
        end = ends[rid]
        assert whole["name"] == rid and whole["ts"] == _us(rec.time - start), rid
        assert whole["ts"] + whole["dur"] == pytest.approx(_us(end.time - start), abs=0.01), rid
        assert whole["args"]["end_state"] == end.payload["dest"] and whole["args"]["n"] == rec.payload["n"]
        # Its phases, in order, inside it: admitting until the ADD, admitted until the first output, running.
        phases = sorted((e for e in events if e["ph"] == "X" and e["tid"] == tid_of[rid] and e["pid"] == PID_REQUESTS
                         and e["cat"] == "request phase"), key=lambda e: e["ts"])
        names = [e["name"] for e in phases]
        assert names in (["admitting", "admitted", "running"], ["admitting", "admitted"]), (rid, names)
        assert phases[0]["ts"] == whole["ts"]
        for before, after in zip(phases, phases[1:]):
            assert before["ts"] + before["dur"] == pytest.approx(after["ts"], abs=0.01)
        assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(whole["ts"] + whole["dur"], abs=0.01)
    assert {rid: e for rid, e in ((tracks[e["tid"]], e) for e in events if e["ph"] == "X" and e["cat"] == "request")
            if rid in ("cut", "drained")}.keys() == {"cut", "drained"}
    end_state = {tracks[e["tid"]]: e["args"]["end_state"] for e in events if e["ph"] == "X" and e["cat"] == "request"}
    assert end_state["short"] == end_state["pair"] == "finished"
    assert end_state["cut"] == end_state["drained"] == "aborted"
    # An instant per complete on its request's track, and the abort (by the client, then by the drain).
    completes = defaultdict(int)
    for e in events:
        if e["ph"] == "i" and e["pid"] == PID_REQUESTS and e["name"].startswith("complete "):
            completes[tracks[e["tid"]]] += 1
    sent = defaultdict(int)
    for rec in records:
        if rec.kind == r.KIND_CLIENT_SENT:
            sent[rec.payload["request_id"]] += 1
    assert completes == sent and completes["pair"] == 2
    aborts = {tracks[e["tid"]]: e["args"]["reason"] for e in events if e["ph"] == "i" and e["name"] == "abort"}
    assert aborts["cut"] == "abort_rpc" and aborts["drained"] == "drain"

    # The link: a slice per state, in the order of its transitions: the warm-up and the drain among them.
    links = _tracks(events, PID_LINKS)
    assert list(links.values()) == ["vllm-0"]
    states = sorted((e for e in events if e["ph"] == "X" and e["pid"] == PID_LINKS), key=lambda e: e["ts"])
    moves = [rec for rec in records if rec.kind == r.KIND_TRANSITION and rec.payload["machine"] == "link"]
    assert [e["name"] for e in states] == [m.payload["source"] for m in moves]
    assert [e["name"] for e in states] == ["starting", "warming_up", "serving", "draining"]
    assert [e["ts"] + e["dur"] for e in states] == pytest.approx([_us(m.time - start) for m in moves], abs=0.01)
    launch = next(rec for rec in records if rec.kind == r.KIND_ENGINE_HANDSHAKE and rec.payload["step"] == "launch")
    assert states[0]["ts"] == _us(launch.time - start)
    final = [e for e in events if e["ph"] == "i" and e["pid"] == PID_LINKS and e["cat"] == "link state"]
    assert [e["name"] for e in final] == ["stopped"]
    steps = [e["args"]["step"] for e in events if e["ph"] == "i" and e["pid"] == PID_LINKS and e["cat"] == "handshake"
             and "step" in e["args"]]
    assert steps == [rec.payload["step"] for rec in records if rec.kind == r.KIND_ENGINE_HANDSHAKE]

    # The engine's rank: a counter per frame, its tokens the frames' tokens.
    assert list(_tracks(events, PID_RANKS).values()) == ["engine/0"]
    frames = [e for e in events if e["ph"] == "C" and e["name"] == "engine/0 frame"]
    assert len(frames) == sum(1 for rec in records if rec.kind == r.KIND_ENGINE_FRAME) > 0
    assert sum(e["args"]["tokens"] for e in frames) > 0
    # The run's start and stop.
    assert [e["name"] for e in events if e["ph"] == "i" and e["pid"] == PID_RUN and e["cat"] == "run"
            and e["name"].startswith("run.")] == ["run.start", "run.stop"]


@pytest.mark.process
def test_the_timeline_takes_the_filters_of_show(journal, tmp_path):
    out = tmp_path / "one.json"
    done = enginelink("journal", "timeline", "--journal", journal, "--request", "pair", "--out", out)
    assert done.returncode == 0, done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert list(_tracks(events, PID_REQUESTS).values()) == ["pair"]
    bad = enginelink("journal", "timeline", "--journal", journal, "--out", tmp_path / "no" / "such" / "dir.json")
    assert bad.returncode == 1 and "cannot write" in bad.stderr


# -- synthetic journals: in-process ------------------------------------------------------------


def _write(records: list[Record]) -> list[dict]:
    out = io.StringIO()
    write_timeline(records, out, rel=lambda t: t, decode_frame=None)
    return json.loads(out.getvalue())["traceEvents"]


def _rec(seq: int, time: float, stream: str, kind: str, payload) -> Record:
    return Record(seq, time, stream, kind, payload)


def _move(seq, time, rid, source, dest, event):
    return _rec(seq, time, f"req/{rid}", r.KIND_TRANSITION,
                {"machine": "request", "id": rid, "source": source, "dest": dest, "event": event})


def test_an_open_request_ends_at_the_journals_end_and_a_reused_id_gets_a_new_track():
    events = _write([
        _rec(1, 0.0, "run", r.KIND_RUN_START, {"pid": 1}),
        _rec(2, 1.0, "req/a", r.KIND_CLIENT_GENERATE, {"request_id": "a", "n": 1}),
        _rec(3, 1.5, "req/a", r.KIND_ENGINE_REQUEST, {"link": "vllm-0", "request_ids": ["a"], "ranks": [0]}),
        _move(4, 2.0, "a", "admitted", "running", "first_output"),
        _move(5, 3.0, "a", "running", "finished", "finish"),
        _rec(6, 3.25, "req/a", r.KIND_CLIENT_SENT, {"request_id": "a", "index": 0, "tokens_sent": 4,
                                                     "finish_reason": "length"}),
        _rec(7, 4.0, "req/a", r.KIND_CLIENT_GENERATE, {"request_id": "a", "n": 2}),
        _rec(8, 5.0, "req/bad", r.KIND_ERROR, {"whose": "client", "code": "INVALID_ARGUMENT", "message": "no"}),
        _move(9, 6.0, "pruned", "admitted", "running", "first_output"),
        _rec(10, 7.0, "run", r.KIND_SNAPSHOT, {"state": {}}),
    ])
    tracks = _tracks(events, PID_REQUESTS)
    assert sorted(tracks.items()) == [(1, "a"), (2, "a"), (3, "pruned")]
    whole = {e["tid"]: e for e in events if e["ph"] == "X" and e["cat"] == "request"}
    assert (whole[1]["ts"], whole[1]["dur"], whole[1]["args"]["end_state"]) == (1e6, 2e6, "finished")
    assert (whole[2]["ts"], whole[2]["dur"], whole[2]["args"]["open_at_end"]) == (4e6, 3e6, True)
    assert whole[2]["args"]["end_state"] == "admitting" and whole[2]["args"]["n"] == 2
    assert whole[3]["args"]["admission_not_in_journal"] is True and whole[3]["args"]["open_at_end"] is True
    # The complete written after the end lands on the first track, not on the second.
    completes = [e for e in events if e["ph"] == "i" and e["name"] == "complete 0"]
    assert [(e["tid"], e["ts"], e["args"]["tokens_sent"]) for e in completes] == [(1, 3.25e6, 4)]
    # A call refused before admission: an instant on the run's track, no request track.
    refused = [e for e in events if e["ph"] == "i" and e["pid"] == PID_RUN and e["name"].startswith("refused")]
    assert [e["name"] for e in refused] == ["refused bad: INVALID_ARGUMENT"]


def test_a_failed_link_ends_with_its_reason():
    events = _write([
        _rec(1, 0.0, "link/vllm-0", r.KIND_ENGINE_HANDSHAKE, {"step": "launch", "message": {}}),
        _rec(2, 1.0, "link/vllm-0", r.KIND_TRANSITION, {"machine": "link", "id": "vllm-0", "source": "starting",
                                                        "dest": "warming_up", "event": "handshake_done"}),
        _rec(3, 2.0, "link/vllm-0", r.KIND_TRANSITION, {"machine": "link", "id": "vllm-0", "source": "warming_up",
                                                        "dest": "failed", "event": "fail", "reason": "engine died"}),
    ])
    slices = [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["pid"] == PID_LINKS]
    assert slices == [("starting", 0.0, 1e6), ("warming_up", 1e6, 1e6)]
    failed = [e for e in events if e["ph"] == "i" and e["pid"] == PID_LINKS and e["name"] == "failed"]
    assert len(failed) == 1 and failed[0]["args"]["reason"] == "engine died"

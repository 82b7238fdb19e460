"""``journal/verify.py`` on hand-made records: the token rules the live tests cannot force.

A live run rarely lands a stop string mid-frame or an engine output after an
abort; these cases pin what verify accepts and refuses there, with frames
encoded by the real vLLM wire structs.
"""

from __future__ import annotations

import msgspec

from enginelink.journal import records as r
from enginelink.journal.fold import fold
from enginelink.journal.journal import Journal
from enginelink.journal.verify import verify
from enginelink.machines.link import LINK_TABLE
from enginelink.machines.request import REQUEST_TABLE
from enginelink.wire.vllm import EngineCoreOutput, EngineCoreOutputs

TABLES = {"link": LINK_TABLE, "request": REQUEST_TABLE}


def frame(*outputs: tuple[str, int, int | None]) -> bytes:
    return msgspec.msgpack.encode(EngineCoreOutputs(
        engine_index=0,
        outputs=[EngineCoreOutput(rid, list(range(tokens)), finish_reason=finish) for rid, tokens, finish in outputs]))


def run_of(*events) -> list[r.Record]:
    journal = Journal(None)
    t = 0.0
    base = [
        ("run", r.KIND_RUN_START, {"wall_time": 1.0, "trio_time": 0.0, "pid": 1, "argv": [], "version": "x",
                                   "engine": "vllm"}),
        ("link/vllm-0", r.KIND_ENGINE_HANDSHAKE, {"step": "launch", "message": {}}),
        ("link/vllm-0", r.KIND_TRANSITION, r.Transition("link", "vllm-0", "starting", "warming_up", "handshake_done").payload()),
        ("link/vllm-0", r.KIND_TRANSITION, r.Transition("link", "vllm-0", "warming_up", "serving", "warmup_done").payload()),
    ]
    for stream, kind, payload in [*base, *events]:
        t += 0.01
        journal.append(t, stream, kind, payload)
    return journal.records()


def admit(rid: str, n: int = 1):
    ids = [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]
    return [
        (f"req/{rid}", r.KIND_CLIENT_GENERATE, {"request_id": rid, "n": n, "prompt_tokens": 3, "stream": True, "max_tokens": 9}),
        (f"req/{rid}", r.KIND_ENGINE_REQUEST, {"link": "vllm-0", "request_ids": ids, "prompt_tokens": 3}),
    ]


def step(rid: str, source: str, dest: str, event: str):
    return (f"req/{rid}", r.KIND_TRANSITION, r.Transition("request", rid, source, dest, event).payload())


def sent(rid: str, index: int, tokens_sent: int, tokens_engine: int, reason: str):
    return (f"req/{rid}", r.KIND_CLIENT_SENT, {"request_id": rid, "index": index, "tokens_sent": tokens_sent,
                                              "tokens_engine": tokens_engine, "finish_reason": reason})


def engine(*outputs):
    return ("engine/0", r.KIND_ENGINE_FRAME, frame(*outputs))


def test_a_stop_string_may_cut_and_late_frames_are_allowed_then():
    recs = run_of(
        *admit("a"),
        engine(("a", 2, None)),
        step("a", "admitted", "running", "first_output"),
        engine(("a", 3, None)),  # the stop string matched in here: 4 of 5 kept
        step("a", "running", "finished", "finish"),
        engine(("a", 1, None)),  # late: the engine had not seen our abort yet
        sent("a", 0, 4, 5, "stop"),
    )
    report = verify(recs, tables=TABLES)
    assert report.ok, report.violations
    assert (report.choices_checked, report.tokens_sent, report.tokens_engine) == (1, 4, 5)


def test_fewer_tokens_sent_than_received_is_only_allowed_for_stop():
    recs = run_of(
        *admit("a", n=2),
        engine(("a#0", 2, None), ("a#1", 2, None)),
        step("a", "admitted", "running", "first_output"),
        engine(("a#0", 1, 1), ("a#1", 1, 1)),
        step("a", "running", "finished", "finish"),
        sent("a", 0, 3, 3, "length"),
        sent("a", 1, 2, 3, "length"),
    )
    report = verify(recs, tables=TABLES)
    [violation] = report.violations
    assert violation.check == "tokens" and violation.seq == recs[-1].seq
    assert violation.message == "request 'a' choice 1 (a#1, finish length): sent 2, hub 3, engine 3: only a stop string may cut"


def test_outputs_after_an_abort_are_not_counted_for_the_request():
    recs = run_of(
        *admit("a"),
        engine(("a", 1, None)),
        step("a", "admitted", "running", "first_output"),
        ("req/a", r.KIND_CLIENT_ABORT, {"request_ids": ["a"], "reason": "abort_rpc"}),
        step("a", "running", "aborted", "abort"),
        engine(("a", 1, None)),
        sent("a", 0, 1, 1, "abort"),
    )
    assert verify(recs, tables=TABLES).ok
    state = fold(recs)
    assert state.requests["a"].engine_tokens == [1] and state.open_engine_ids == {}


def test_admission_and_link_start_need_no_transition_record():
    recs = run_of(*admit("a"))
    state = fold(recs)
    assert state.requests["a"].state == "admitted" and state.requests["a"].admitted_at == recs[-1].time
    assert state.links["vllm-0"].state == "serving"
    assert fold(recs[:2]).links["vllm-0"].state == "starting"
    report = verify(recs, tables=TABLES)
    assert report.ok and report.open_at_end == ["a"]


def test_a_request_transition_must_start_where_the_machine_is():
    recs = run_of(*admit("a"), step("a", "running", "finished", "finish"))
    [violation] = verify(recs, tables=TABLES).violations
    assert violation.message == "request 'a': transition from 'running' but it was in 'admitted'"

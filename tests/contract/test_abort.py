"""Abort by id and client cancellation, on a sim engine slow enough to catch requests mid-flight.

What a client must see: the aborted stream ends OK with one
``complete{finish_reason: "abort"}`` per open choice; the call leaves
``active_requests``; the engine stops working on it (GetLoads shows no running
request once a later request has finished); a client that goes away is
journaled as ``client_gone`` and its request ends ``aborted``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    Outcome,
    active_requests,
    call,
    generate,
    journal_rows,
    new_id,
    prompt,
    wait_idle,
    wait_journal,
)
from tests.harness import generate_request, wait_until

# Long enough (20 ms a step) that nothing finishes by itself during a test.
LONG = 500


@pytest.fixture(autouse=True)
def _starts_idle(slow_servicer):
    """Each test counts requests from zero; a request left by an earlier failure must not cascade."""
    wait_idle(slow_servicer.stub, timeout_s=CALL_TIMEOUT_S + 2)


def _abort(stub, *request_ids: str) -> None:
    reply = stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=CALL_TIMEOUT_S)
    assert isinstance(reply, pb.AbortResponse)


def _engine_is_idle(stub) -> None:
    """Finish a short request, then the engine's own stats must show nothing running.

    The sim reports scheduler stats on every output frame, the last one after
    retiring the finished request; a request the engine was never told to
    abort would still be counted there.
    """
    out = generate(stub, new_id("probe"), prompt(77), temperature=0.0, max_tokens=3, ignore_eos=True)
    assert out.complete(0).finish_reason == "length"
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=CALL_TIMEOUT_S)
    assert loads.loads[0].num_running_reqs == 0, "the engine is still running an aborted request"
    assert loads.loads[0].num_waiting_reqs == 0


def _journal_outcome(journal, rid: str, reason: str) -> None:
    def ended(rows) -> bool:
        return any(r.kind == "transition" and r.payload["id"] == rid and r.payload["dest"] == "aborted"
                   for r in rows)

    wait_journal(journal, ended, f"{rid} aborted in the journal")
    rows = [r for r in journal_rows(journal) if r.stream == f"req/{rid}"]
    aborts = [r.payload for r in rows if r.kind == "client.abort"]
    assert aborts == [{"request_ids": [rid], "reason": reason}]
    terminal = [r.payload["dest"] for r in rows if r.kind == "transition"
                and r.payload["dest"] in ("finished", "aborted", "failed")]
    assert terminal == ["aborted"]


@pytest.mark.parametrize("n", [1, 2])
def test_abort_mid_stream_ends_each_choice_with_abort(slow_servicer, n):
    stub = slow_servicer.stub
    rid = new_id(f"abort-n{n}")
    stream = stub.Generate(generate_request(rid, prompt(60 + n), stream=True, n=n, temperature=1.0,
                                            max_tokens=LONG, ignore_eos=True), timeout=CALL_TIMEOUT_S)
    messages = [next(stream)]
    assert messages[0].HasField("chunk")
    assert active_requests(stub) == 1
    _abort(stub, rid)
    messages += list(stream)  # ends OK: an error would raise here
    out = Outcome(messages)
    assert sorted(out.completes) == list(range(n))
    for index in range(n):
        complete = out.complete(index)
        assert complete.finish_reason == "abort"
        assert len(out.streamed(index)) < LONG
    # Nothing after a choice's complete.
    for position, message in enumerate(messages):
        if message.HasField("complete"):
            index = message.complete.index
            assert not any(m.HasField("chunk") and m.chunk.index == index for m in messages[position + 1:])
    wait_idle(stub)
    _journal_outcome(slow_servicer.journal, rid, "abort_rpc")
    _engine_is_idle(stub)


def test_abort_of_a_non_streaming_call(slow_servicer):
    stub = slow_servicer.stub
    rid = new_id("abort-full")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call, stub, generate_request(rid, prompt(63), temperature=0.0, max_tokens=LONG,
                                                          ignore_eos=True))
        wait_until(lambda: active_requests(stub) == 1, 5, "the call in flight", interval_s=0.02)
        _abort(stub, rid)
        out = future.result(CALL_TIMEOUT_S)
    complete = out.complete(0)
    assert complete.finish_reason == "abort"
    assert complete.completion_tokens == len(complete.output_ids) < LONG
    wait_idle(stub)
    _engine_is_idle(stub)


def test_client_cancel_is_an_abort(slow_servicer):
    stub = slow_servicer.stub
    rid = new_id("gone")
    stream = stub.Generate(generate_request(rid, prompt(64), stream=True, temperature=0.0, max_tokens=LONG,
                                            ignore_eos=True), timeout=CALL_TIMEOUT_S)
    assert next(stream).HasField("chunk")
    assert active_requests(stub) == 1
    stream.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(stream)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(stub)
    _journal_outcome(slow_servicer.journal, rid, "client_gone")
    _engine_is_idle(stub)


def test_client_deadline_on_a_non_streaming_call_is_an_abort(slow_servicer):
    stub = slow_servicer.stub
    rid = new_id("deadline")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(generate_request(rid, prompt(65), temperature=0.0, max_tokens=LONG, ignore_eos=True),
                           timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stub)
    _journal_outcome(slow_servicer.journal, rid, "client_gone")
    _engine_is_idle(stub)


def test_abort_of_unknown_or_finished_ids_is_a_no_op(slow_servicer):
    stub = slow_servicer.stub
    done = new_id("done")
    generate(stub, done, prompt(66), temperature=0.0, max_tokens=2, ignore_eos=True)
    rid = new_id("keeps-running")
    started = threading.Event()

    def run() -> Outcome:
        messages = []
        request = generate_request(rid, prompt(67), stream=True, temperature=0.0, max_tokens=40, ignore_eos=True)
        for message in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            messages.append(message)
            started.set()
        return Outcome(messages)

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run)
        assert started.wait(CALL_TIMEOUT_S)
        _abort(stub, new_id("never-sent"), done, "")
        _abort(stub)
        out = future.result(CALL_TIMEOUT_S)
    assert out.complete(0).finish_reason == "length"
    assert len(out.streamed(0)) == 40
    rows = journal_rows(slow_servicer.journal, ("client.abort",))
    assert not [r for r in rows if r.stream in (f"req/{done}", f"req/{rid}")]
    wait_idle(stub)


def test_active_requests_counts_calls_in_flight(slow_servicer):
    stub = slow_servicer.stub
    rids = [new_id("busy") for _ in range(3)]
    streams = [stub.Generate(generate_request(r, prompt(70 + i), stream=True, temperature=0.0, max_tokens=LONG,
                                              ignore_eos=True), timeout=CALL_TIMEOUT_S)
               for i, r in enumerate(rids)]
    for stream in streams:
        assert next(stream).HasField("chunk")
    assert active_requests(stub) == 3
    _abort(stub, *rids)
    for stream in streams:
        assert Outcome(list(stream)).complete(0).finish_reason == "abort"
    wait_idle(stub)
    _engine_is_idle(stub)

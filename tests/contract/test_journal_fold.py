"""Replay = fold: after a run, the journal folds to exactly what the clients observed.

One servicer of its own (it is stopped with SIGTERM as part of the test), a
mix of finished, aborted, cancelled and refused requests, then the journal is
read the way ``enginelink journal`` reads it: ``open_reader(...).records()``
folded with ``fold``. Snapshots are written every 0.5 s here, so the fold from
the latest snapshot is checked against the fold from the start.
"""

from __future__ import annotations

import math
import signal

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.fold import FoldState, fold
from enginelink.journal.store import open_reader
from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    SLOW_ENGINE_ARGS,
    Outcome,
    call,
    new_id,
    prompt,
    refusal,
    wait_idle,
)
from tests.harness import Servicer, generate_request, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)


@pytest.fixture(scope="module")
def run_journal(tmp_path_factory, test_model_dir):
    """Drive one servicer through a mixed run, stop it; yields (journal path, observed, refused ids)."""
    servicer = Servicer(tmp_path_factory.mktemp("fold"), model_dir=test_model_dir, engine_args=SLOW_ENGINE_ARGS,
                        env={"ENGINELINK_SNAPSHOT_INTERVAL_SECS": "0.5"})
    observed: dict[str, tuple[str, Outcome | None]] = {}
    refused: list[str] = []
    try:
        servicer.start()
        stub = servicer.stub
        # Finished: non-streaming, streaming, n = 2, and one stopped by a stop token.
        for rid, request in [
            (new_id("fin"), dict(max_tokens=3)),
            (new_id("fin-stream"), dict(max_tokens=4, stream=True)),
            (new_id("fin-n2"), dict(max_tokens=3, n=2, temperature=1.0)),
        ]:
            stream = request.pop("stream", False)
            out = call(stub, generate_request(rid, prompt(len(observed) + 90), stream=stream, ignore_eos=True,
                                              **request))
            observed[rid] = ("finished", out)
        # Aborted by id, mid-stream, n = 2.
        rid = new_id("aborted")
        stream = stub.Generate(generate_request(rid, prompt(95), stream=True, n=2, temperature=1.0,
                                                max_tokens=500, ignore_eos=True), timeout=CALL_TIMEOUT_S)
        messages = [next(stream)]
        # Refused while it runs: a duplicate id, and a bad request.
        assert refusal(stub, generate_request(rid, [5, 6], max_tokens=2)).code() == grpc.StatusCode.ALREADY_EXISTS
        bad = new_id("bad")
        error = refusal(stub, generate_request(bad, [5, 6], max_tokens=2, temperature=math.nan))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        refused.append(bad)
        stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=CALL_TIMEOUT_S)
        observed[rid] = ("aborted", Outcome(messages + list(stream)))
        # Gone: the client cancels mid-stream.
        gone = new_id("gone")
        stream = stub.Generate(generate_request(gone, prompt(96), stream=True, max_tokens=500, ignore_eos=True),
                               timeout=CALL_TIMEOUT_S)
        next(stream)
        stream.cancel()
        observed[gone] = ("aborted", None)
        wait_idle(stub)
        # Long enough for the snapshot task to write at least one snapshot after the requests.
        wait_until(lambda: _snapshot_after_requests(servicer.journal, gone), 5, "a snapshot after the requests")
        servicer.signal(signal.SIGTERM)
        assert servicer.wait(15) == 0, servicer.log()
    finally:
        servicer.stop()
    yield servicer.journal, observed, refused


def _snapshot_after_requests(path, last_id: str) -> bool:
    with open_reader(path) as reader:
        snapshot = reader.last_snapshot()
        if snapshot is None:
            return False
        return last_id in FoldState.from_snapshot(snapshot).requests


def test_fold_equals_what_clients_observed(run_journal):
    path, observed, refused = run_journal
    with open_reader(path) as reader:
        state = fold(reader.records())
    for rid, (expected, outcome) in observed.items():
        view = state.requests.get(rid)
        assert view is not None, f"{rid} missing from the fold"
        assert view.state == expected, f"{rid}: fold says {view.state}, the client saw {expected}"
        if outcome is None:
            continue
        assert view.n == len(outcome.completes)
        assert view.choices_done == len(outcome.completes)
        reasons = {outcome.complete(i).finish_reason for i in outcome.completes}
        assert view.finish_reason in reasons
        tokens = sum(len(outcome.streamed(i)) or len(outcome.complete(i).output_ids) for i in outcome.completes)
        assert view.tokens_sent == tokens
    for rid in refused:
        assert rid not in state.requests, f"refused {rid} was folded as a request"
    assert [link.state for link in state.links.values()] == ["stopped"]
    assert state.run.exit_status == 0
    assert state.unmatched == 0


def test_fold_from_the_latest_snapshot_equals_the_full_fold(run_journal):
    path, observed, _ = run_journal
    with open_reader(path) as reader:
        records = reader.records()
        snapshot = reader.last_snapshot()
    assert snapshot is not None, "no snapshot was written (ENGINELINK_SNAPSHOT_INTERVAL_SECS=0.5)"
    full = fold(records)
    replayed = fold([r for r in records if r.seq > snapshot.seq], FoldState.from_snapshot(snapshot))
    assert replayed.to_dict() == full.to_dict()
    # And every snapshot holds the fold of the records before it.
    snapshots = [r for r in records if r.kind == "snapshot"]
    for snap in snapshots:
        upto = fold([r for r in records if r.seq < snap.seq])
        upto.last_seq = snap.seq
        assert FoldState.from_snapshot(snap).to_dict() == upto.to_dict(), f"snapshot at seq {snap.seq}"

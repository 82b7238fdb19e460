"""Crash safety: SIGKILL the servicer under load, then read what it left.

The servicer (not the engine) is killed while streams run. What it had
flushed must be a readable journal on which ``verify`` passes (requests
still open at the end are allowed: they were in flight), and ``inspect``
must show those requests in flight, the run dead and the engine gone (the
sim engine exits by itself when its parent dies).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.store import open_reader

from tests.harness import Servicer, generate_request, wait_until
from tests.tools.helpers import (PROMPT, Stream, alive, engine_pid, enginelink, verify_report,
                                 warmup_admitted)

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

LONG = dict(max_tokens=1500, ignore_eos=True)
LONG_IDS = ["long-0", "long-1", "long-2", "long-n2"]


def frames_after_sent(journal, request_ids: set[str]) -> int | None:
    """Engine frames on disk after every ``request_ids`` choice completed (None: not yet)."""
    with open_reader(journal) as reader:
        records = reader.records(kinds=["client.sent", "engine.frame"])
    done = [i for i, rec in enumerate(records) if rec.kind == "client.sent" and rec.payload["request_id"] in request_ids]
    if {records[i].payload["request_id"] for i in done} != request_ids:
        return None
    return sum(rec.kind == "engine.frame" for rec in records[done[-1]:]) or 0


def test_sigkill_under_load_leaves_a_journal_that_verifies_and_inspects(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--step-us", "20000"]).start()
    streams = []
    engine = None
    try:
        engine = engine_pid(servicer.journal)
        streams = [Stream(servicer, rid, **LONG) for rid in LONG_IDS[:3]]
        streams.append(Stream(servicer, "long-n2", n=2, temperature=1.0, **LONG))
        streams.append(Stream(servicer, "aborted", **LONG))
        finished = [list(servicer.stub.Generate(generate_request(f"done-{i}", PROMPT, stream=i == 0, n=1 + i,
                                                                 temperature=1.0, max_tokens=6, ignore_eos=True)))
                    for i in range(2)]
        assert all(messages for messages in finished)
        for stream in streams:
            assert stream.streaming.wait(5)
        servicer.stub.Abort(pb.AbortRequest(request_ids=["aborted"]))
        # Once the ended requests are on disk, let the streams run on for ten more
        # frames; then the kill lands mid-flight, whatever the flusher is doing.
        ended = wait_until(lambda: frames_after_sent(servicer.journal, {"done-0", "done-1", "aborted"}), 5,
                           "the ended requests on disk")
        wait_until(lambda: frames_after_sent(servicer.journal, {"aborted"}) >= ended + 10, 5, "ten more frames")
        os.kill(servicer.process.pid, signal.SIGKILL)
        assert servicer.wait(5) == -signal.SIGKILL
        killed_at = time.monotonic()
        wait_until(lambda: not alive(engine), 5, "the orphaned sim engine to exit by itself")
        engine_gone_s = time.monotonic() - killed_at
        for stream in streams:
            stream.join(5)
        assert all(stream.error is not None for stream in streams if stream.request.request_id != "aborted")
    finally:
        servicer.stop()
        if engine is not None and alive(engine):
            os.kill(engine, signal.SIGKILL)
    assert engine_gone_s < 5

    verified = enginelink("journal", "verify", "--journal", servicer.journal)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = verified.stdout
    assert "no run.stop (the servicer is running, or died)" in out
    assert [line.split()[:2] for line in out.splitlines()[1:5]] == [
        ["ok", "sequence"], ["ok", "terminals"], ["ok", "tokens"], ["ok", "transitions"]]
    assert out.splitlines()[-1] == "all invariants hold"
    report, warm = verify_report(servicer.journal), warmup_admitted(servicer.journal)
    assert (report["admitted"], report["ended"]) == (7 + warm, 3 + warm)
    assert sorted(report["open_at_end"]) == LONG_IDS
    assert report["choices_checked"] >= 4  # done-0, done-1 (n = 2), aborted
    assert report["run_stopped"] is False and report["holes"] == [] and report["pruned_at_start"] == 0

    inspected = enginelink("inspect", "--journal", servicer.journal, "--json")
    assert inspected.returncode == 0, inspected.stderr
    view = json.loads(inspected.stdout)
    assert view["run"]["status"] == "dead" and view["run"]["pid_alive"] is False
    assert view["run"]["pid"] == servicer.process.pid and view["as_of"]["basis"] == "journal end"
    [link] = view["links"]
    assert (link["state"], link["engine_pid"], link["engine_alive"]) == ("serving", engine, False)
    requests = {q["id"]: q for q in view["requests"]}
    assert sorted(requests) == LONG_IDS  # warm-up requests, if any, all ended before serving
    assert all(q["state"] == "running" and q["tokens"] > 0 for q in requests.values())
    assert requests["long-n2"]["n"] == 2
    assert view["ended_recently"] == {"aborted": 1, "finished": 2}

    human = enginelink("inspect", "--journal", servicer.journal)
    assert "DEAD: pid" in human.stdout and "requests in flight (4)" in human.stdout

    # What the engine last said to one of them is there too.
    last = enginelink("journal", "show", "--journal", servicer.journal, "--request", "long-0").stdout.splitlines()
    assert last[0].split()[3] == "client.generate" and "long-0: 1 tokens [" in last[-1]

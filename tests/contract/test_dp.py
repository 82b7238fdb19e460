"""Data parallelism: one servicer in front of a sim engine launched with ``--data-parallel-size 2``.

The sim engine does what ``vllm serve --headless --data-parallel-size 2``
does: one launch, two engine-core processes, each its own handshake and
identity. What a client must see:
- GetLoads names both ranks, and GetServerInfo says 2;
- unpinned requests spread over the ranks (the least-loaded one, ties round-robin);
- ``data_parallel_rank`` pins a rank; a pin outside [0, 2) is INVALID_ARGUMENT
  in vLLM's words and never reaches the engine;
- an Abort reaches the rank holding the request (that rank stops running it);
- ``/metrics`` has per-rank families labelled ``rank``;
- the journal says which rank each engine request went to, and each rank's handshake.

Which rank runs what is read from the engine's own scheduler stats per rank
(GetLoads, from each rank's output frames): the sim runs a request only on
the rank it was sent to. A rank's stats ride on its output frames, so after
an abort they are current once a later request on that rank has finished
(``_settle``).
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    SLOW_ENGINE_ARGS,
    call,
    generate,
    journal_rows,
    new_id,
    prompt,
    refusal,
    wait_idle,
    wait_journal,
)
from tests.harness import Servicer, free_port, generate_request, shared, wait_until

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

# 20 ms a step: 2000 tokens is 40 s, far longer than any test here waits.
LONG = 2000


@pytest.fixture(scope="module")
def dp_servicer(tmp_path_factory, test_model_dir):
    metrics_port = free_port()
    with shared(Servicer(tmp_path_factory.mktemp("dp-servicer"), model_dir=test_model_dir,
                         extra=["--metrics-port", str(metrics_port)],
                         engine_args=[*SLOW_ENGINE_ARGS, "--data-parallel-size", "2"])) as running:
        running.metrics_port = metrics_port
        yield running


@pytest.fixture(autouse=True)
def _starts_idle(dp_servicer):
    wait_idle(dp_servicer.stub, timeout_s=CALL_TIMEOUT_S + 2)
    _settle(dp_servicer.stub, 0, 1)
    assert _running(dp_servicer.stub) == {0: 0, 1: 0}


def _settle(stub, *ranks: int) -> None:
    """Finish a short request pinned to each rank: its last frame carries the rank's current stats."""
    for rank in ranks:
        request = generate_request(new_id(f"settle{rank}"), prompt(3), temperature=0.0, max_tokens=1,
                                   ignore_eos=True)
        request.data_parallel_rank = rank
        out = call(stub, request)
        assert out.complete(0).finish_reason == "length"


def _loads(stub) -> dict[int, pb.SchedulerLoad]:
    reply = stub.GetLoads(pb.GetLoadsRequest(), timeout=CALL_TIMEOUT_S)
    return {load.dp_rank: load for load in reply.loads}


def _running(stub) -> dict[int, int]:
    return {rank: load.num_running_reqs + load.num_waiting_reqs for rank, load in _loads(stub).items()}


def _start_long(stub, rid: str, seed: int, **fields):
    request = generate_request(rid, prompt(seed), stream=True, temperature=0.0, max_tokens=LONG, ignore_eos=True)
    for name, value in fields.items():
        setattr(request, name, value)
    stream = stub.Generate(request, timeout=60)
    first = next(stream)  # the engine is running it once a chunk came back
    assert first.WhichOneof("response") == "chunk"
    return stream


def _abort(stub, *rids: str) -> None:
    stub.Abort(pb.AbortRequest(request_ids=list(rids)), timeout=CALL_TIMEOUT_S)


def _engine_ranks(journal, rid: str) -> list[int]:
    """The ranks the call's engine requests went to, from its ``engine.request`` record."""
    def mine(rows):
        return [r for r in rows if r.kind == "engine.request" and r.stream == f"req/{rid}"]

    rows = wait_journal(journal, mine, f"{rid}'s engine.request in the journal")
    assert len(rows) == 1, rows
    return rows[0].payload["ranks"]


def test_both_ranks_are_served_and_named(dp_servicer):
    stub = dp_servicer.stub
    assert sorted(_loads(stub)) == [0, 1]
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.data_parallel_size == 2
    # Each rank ran its own handshake: HELLO and READY per identity, both journaled by rank.
    rows = journal_rows(dp_servicer.journal, ("engine.handshake",))
    for step in ("hello", "ready", "READY"):
        assert sorted(r.payload.get("rank") for r in rows if r.payload["step"] == step) == [0, 1], step
    ready = {r.payload["rank"]: r.payload["message"] for r in rows if r.payload["step"] == "ready"}
    assert [ready[0]["data_parallel_rank"], ready[1]["data_parallel_rank"]] == [0, 1]
    assert ready[0]["instance_id"] != ready[1]["instance_id"]  # two engine cores, not one twice
    facts = wait_journal(dp_servicer.journal, lambda rows: [r for r in rows if r.kind == "engine.facts"],
                         "engine.facts")[-1].payload
    assert [r["rank"] for r in facts["ranks"]] == [0, 1]


def test_unpinned_requests_spread_over_the_ranks(dp_servicer):
    stub = dp_servicer.stub
    rids = [new_id("spread") for _ in range(4)]
    streams = [_start_long(stub, rid, 10 + i) for i, rid in enumerate(rids)]
    try:
        wait_until(lambda: _running(stub) == {0: 2, 1: 2}, CALL_TIMEOUT_S, "two requests on each rank")
        ranks = [_engine_ranks(dp_servicer.journal, rid)[0] for rid in rids]
        assert sorted(ranks) == [0, 0, 1, 1]
    finally:
        _abort(stub, *rids)
        for stream in streams:
            stream.cancel()


def test_sequential_requests_alternate_between_idle_ranks(dp_servicer):
    """Ties (both ranks idle) go round-robin, as vLLM's DP client's rotating scan does."""
    stub = dp_servicer.stub
    rids = [new_id("seq") for _ in range(4)]
    for i, rid in enumerate(rids):
        out = generate(stub, rid, prompt(30 + i), temperature=0.0, max_tokens=2, ignore_eos=True)
        assert out.complete(0).finish_reason == "length"
    ranks = [_engine_ranks(dp_servicer.journal, rid)[0] for rid in rids]
    assert sorted(ranks) == [0, 0, 1, 1]
    assert ranks[0] != ranks[1] and ranks[2] != ranks[3]


def test_n_choices_spread_like_separate_requests(dp_servicer):
    stub = dp_servicer.stub
    rid = new_id("n2")
    out = generate(stub, rid, prompt(41), temperature=1.0, seed=7, max_tokens=3, n=2, ignore_eos=True)
    assert [out.complete(i).finish_reason for i in (0, 1)] == ["length", "length"]
    assert sorted(_engine_ranks(dp_servicer.journal, rid)) == [0, 1]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pin_sends_every_request_to_that_rank(dp_servicer, rank):
    stub = dp_servicer.stub
    rids = [new_id(f"pin{rank}") for _ in range(2)]
    streams = [_start_long(stub, rid, 50 + i, data_parallel_rank=rank) for i, rid in enumerate(rids)]
    try:
        wait_until(lambda: _running(stub)[rank] == 2, CALL_TIMEOUT_S, f"both requests on rank {rank}")
        assert _running(stub)[1 - rank] == 0
        assert [_engine_ranks(dp_servicer.journal, rid) for rid in rids] == [[rank], [rank]]
    finally:
        _abort(stub, *rids)
        for stream in streams:
            stream.cancel()


@pytest.mark.parametrize("rank", [2, 7, -1])
def test_a_pin_out_of_range_is_refused_in_vllms_words(dp_servicer, rank):
    stub = dp_servicer.stub
    rid = new_id("pin-out")
    request = generate_request(rid, prompt(5), temperature=0.0, max_tokens=2)
    request.data_parallel_rank = rank
    error = refusal(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"data_parallel_rank {rank} is out of range [0, 2)."
    assert not [r for r in journal_rows(dp_servicer.journal, ("engine.request",)) if r.stream == f"req/{rid}"]


@pytest.mark.parametrize("rank", [0, 1])
def test_abort_reaches_the_rank_that_holds_the_request(dp_servicer, rank):
    stub = dp_servicer.stub
    rid, other = new_id(f"abort-pin{rank}"), new_id("abort-other")
    stream = _start_long(stub, rid, 70, data_parallel_rank=rank)
    keep = _start_long(stub, other, 71, data_parallel_rank=1 - rank)
    try:
        wait_until(lambda: _running(stub) == {0: 1, 1: 1}, CALL_TIMEOUT_S, "one request on each rank")
        _abort(stub, rid)
        rest = list(stream)
        assert rest[-1].complete.finish_reason == "abort"
        # The rank holding it stops running it (its stats say so); the other rank keeps its own.
        _settle(stub, rank)
        assert _running(stub) == {rank: 0, 1 - rank: 1}
    finally:
        _abort(stub, other)
        keep.cancel()


def test_loads_and_metrics_per_rank(dp_servicer):
    stub = dp_servicer.stub
    rid = new_id("metrics")
    stream = _start_long(stub, rid, 90, data_parallel_rank=1)
    try:
        wait_until(lambda: _running(stub) == {0: 0, 1: 1}, CALL_TIMEOUT_S, "the pinned request on rank 1")
        loads = _loads(stub)
        assert loads[1].num_running_reqs == 1 and loads[0].num_running_reqs == 0
        assert loads[1].gen_throughput > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{dp_servicer.metrics_port}/metrics", timeout=5).read().decode()
        lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                 if line.startswith("smg_servicer_dp_rank_")}
        name = 'smg_servicer_dp_rank_{}{{model="{}",rank="{}"}}'
        model = next(k for k in lines if k.startswith("smg_servicer_dp_rank_in_flight_requests")).split('"')[1]
        assert lines[name.format("in_flight_requests", model, 1)] == 1
        assert lines[name.format("in_flight_requests", model, 0)] == 0
        assert lines[name.format("running_requests", model, 1)] == 1
        assert lines[name.format("running_requests", model, 0)] == 0
        assert lines[name.format("requests_total", model, 1)] >= 1
    finally:
        _abort(stub, rid)
        stream.cancel()


def test_many_concurrent_calls_all_finish_across_ranks(dp_servicer):
    stub = dp_servicer.stub

    def one(i: int) -> str:
        return generate(stub, new_id("many"), prompt(100 + i), temperature=0.0, max_tokens=3,
                        ignore_eos=True).complete(0).finish_reason

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == ["length"] * 16


def test_inspect_shows_the_ranks(dp_servicer):
    from tests.tools.helpers import enginelink, inspect_json

    view = inspect_json(dp_servicer.journal)
    (link,) = view["links"]
    assert [r["rank"] for r in link["ranks"]] == [0, 1]
    assert [r["data_parallel_rank"] for r in link["ranks"]] == [0, 1]
    done = enginelink("inspect", "--journal", dp_servicer.journal)
    assert done.returncode == 0, done.stderr
    assert "DP ranks (2): 0 (sim-" in done.stdout


def test_kv_events_come_from_each_rank_with_its_rank(dp_servicer):
    """KV events are on by default: each rank publishes its own, relayed with ``dp_rank`` and its own load."""
    from tests.kv.kv_client import KvSubscription

    stub = dp_servicer.stub
    with KvSubscription(dp_servicer) as sub:
        sub.caught_up()
        seen = len(sub.kv_batches())
        for rank in (0, 1):
            request = generate_request(new_id(f"kv{rank}"), prompt(200 + rank, length=40), temperature=0.0,
                                       max_tokens=2, ignore_eos=True)
            request.data_parallel_rank = rank
            assert call(stub, request).complete(0).finish_reason == "length"

        def stored_by_rank(s):
            ranks = {b.dp_rank for b in s.kv_batches()[seen:]
                     if any(e.WhichOneof("data") == "stored" for e in b.events)}
            return ranks == {0, 1}

        sub.wait(stored_by_rank, CALL_TIMEOUT_S, "stored blocks from rank 0 and from rank 1")
        # Heartbeats (load records) name both ranks too.
        sub.wait(lambda s: {b.dp_rank for b in s.snapshot() if b.load.load_only} == {0, 1}, CALL_TIMEOUT_S,
                 "load records of both ranks")


def test_one_rank_takes_pin_0_and_refuses_any_other(slow_servicer):
    """Without --data-parallel-size the engine is one rank: pin 0 is served, pin 1 is vLLM's refusal."""
    stub = slow_servicer.stub
    request = generate_request(new_id("one-pin0"), prompt(6), temperature=0.0, max_tokens=2, ignore_eos=True)
    request.data_parallel_rank = 0
    assert call(stub, request).complete(0).finish_reason == "length"
    request = generate_request(new_id("one-pin1"), prompt(6), temperature=0.0, max_tokens=2)
    request.data_parallel_rank = 1
    error = refusal(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "data_parallel_rank 1 is out of range [0, 1)."
    assert [load.dp_rank for load in stub.GetLoads(pb.GetLoadsRequest(), timeout=CALL_TIMEOUT_S).loads] == [0]


def test_flush_cache_clears_every_rank(dp_servicer):
    """FlushCache goes to every rank, as vLLM's DP client sends utility calls to all engines."""
    from smg_grpc_proto.generated import common_pb2

    from tests.kv.kv_client import KvSubscription

    stub = dp_servicer.stub
    with KvSubscription(dp_servicer) as sub:
        sub.caught_up()
        seen = len(sub.kv_batches())
        reply = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=CALL_TIMEOUT_S)
        assert reply.success and reply.message == "Local KV prefix cache flushed successfully"
        _settle(stub, 0, 1)  # a rank publishes its clear with its next step

        def cleared_by_rank(s):
            return {b.dp_rank for b in s.kv_batches()[seen:]
                    if any(e.WhichOneof("data") == "cleared" for e in b.events)} == {0, 1}

        sub.wait(cleared_by_rank, CALL_TIMEOUT_S, "a cleared event from rank 0 and from rank 1")

"""Request ids: bounded, never the servicer's own, and snapshots bounded whatever clients send
(issue 21, items 4 and 5).

Attacked several ways each: ids over the byte cap (ASCII, multi-byte, the
report's 8 MB), the warm-up's reserved prefix through Generate and Abort
(while serving, and from the first moment the port answers through the
whole warm-up), ids with control characters; then what lands in the journal:
a refused id's record is clipped, a snapshot of 4,096 in-flight calls with
ids of the maximum size stays under its stated bound (and a full state of
the fold's 10,000 ended ones too), an idle servicer writes no snapshots, and
the compact snapshot form round-trips ids it cannot shorten.
"""

from __future__ import annotations

import functools

import grpc
import msgspec
import pytest
import trio
import trio.testing
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal import records as r
from enginelink.journal.fold import TERMINAL_REQUESTS_MAX, FoldState, fold, snapshot_payload
from enginelink.journal.journal import Journal
from enginelink.journal.store import open_reader
from enginelink.machines.link import WARMUP_REQUEST_PREFIX
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.hub import IN_FLIGHT_MAX
from enginelink.runtime.lifetime.snapshots import run_snapshots
from enginelink.runtime.requests.inputs import InputKnobError, InputLimits, input_limits_from, validate_abort_ids
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from tests.harness import Servicer, generate_request, wait_until

LIMITS = InputLimits()
ID_MAX = LIMITS.request_id_bytes
ENGINE = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
# What one request may cost in a snapshot beyond its id (docs/limits.md, "Request input"):
# its fields as an array (state, times, counts) and, per choice, an engine-id suffix,
# a token count and an open-choice entry.
SNAPSHOT_REQUEST_BYTES = 64
SNAPSHOT_CHOICE_BYTES = 16


def _refusal(request_id: str) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate_generate(generate_request(request_id, [5, 6, 7], max_tokens=4), ENGINE, 0.0)
    return error.value


@pytest.mark.parametrize("request_id", ["x" * (ID_MAX + 1), "é" * (ID_MAX // 2 + 1), "y" * (8 << 20)])
def test_ids_over_the_cap_are_refused_naming_the_field(request_id):
    error = _refusal(request_id)
    assert error.field == "request_id"
    assert "ENGINELINK_MAX_REQUEST_ID_BYTES" in str(error)
    assert len(str(error)) < 200, "the refusal must not echo the id"


def test_ids_at_the_cap_are_taken():
    for request_id in ("x" * ID_MAX, "é" * (ID_MAX // 2), "a-uuid-" + "0" * 36):
        assert validate_generate(generate_request(request_id, [5, 6], max_tokens=2), ENGINE, 0.0).request_id == request_id


@pytest.mark.parametrize("request_id", [WARMUP_REQUEST_PREFIX + "0", WARMUP_REQUEST_PREFIX, WARMUP_REQUEST_PREFIX + "x#1"])
def test_the_warmup_prefix_is_refused_in_generate_and_abort(request_id):
    assert "reserved" in str(_refusal(request_id))
    with pytest.raises(ClientError, match="reserved"):
        validate_abort_ids(["fine", request_id], LIMITS)


@pytest.mark.parametrize("request_id", ["a\nb", "\x1b[31mred", "nul\x00", "c1\x85"])
def test_ids_with_control_characters_are_refused(request_id):
    """They land in the journal and in ``inspect``'s output, which a terminal would interpret."""
    assert "control characters" in str(_refusal(request_id))


def test_the_cap_is_a_knob_and_a_bad_value_is_refused():
    assert input_limits_from({"ENGINELINK_MAX_REQUEST_ID_BYTES": "16"}).request_id_bytes == 16
    assert input_limits_from({}) == InputLimits()
    for bad in ("x", "0", "-3", "1.5"):
        with pytest.raises(InputKnobError, match="ENGINELINK_MAX_REQUEST_ID_BYTES"):
            input_limits_from({"ENGINELINK_MAX_REQUEST_ID_BYTES": bad})


# -- snapshots ---------------------------------------------------------------------------


def _admit(events: list, rid: str, n: int, t: float) -> None:
    engine_ids = [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]
    stream = r.request_stream(rid)
    events.append((t, stream, r.KIND_CLIENT_GENERATE,
                   {"request_id": rid, "n": n, "prompt_tokens": 4000, "stream": True, "max_tokens": 100000}))
    events.append((t, stream, r.KIND_ENGINE_REQUEST, {"link": "vllm-0", "request_ids": engine_ids, "prompt_tokens": 4000}))
    events.append((t, stream, r.KIND_TRANSITION, r.Transition("request", rid, "admitted", "running", "first_output").payload()))


def _end(events: list, rid: str, t: float) -> None:
    stream = r.request_stream(rid)
    events.append((t, stream, r.KIND_TRANSITION, r.Transition("request", rid, "running", "finished", "finish").payload()))
    events.append((t, stream, r.KIND_CLIENT_SENT,
                   {"request_id": rid, "index": 0, "tokens_sent": 99999, "tokens_engine": 99999, "finish_reason": "length"}))


def _max_id(i: int) -> str:
    return f"{i:08d}".ljust(ID_MAX, "z")


def _snapshot_bytes(state: FoldState) -> int:
    return len(r.encode_payload(r.KIND_SNAPSHOT, snapshot_payload(state)))


def _state(events: list) -> FoldState:
    journal = Journal(None, ring_records_max=len(events) + 10, ring_bytes_max=1 << 34)
    for event in events:
        journal.append(*event)
    return fold(journal.records())


def test_a_snapshot_of_4096_in_flight_calls_with_maximal_ids_stays_under_its_bound():
    events: list = []
    for i in range(IN_FLIGHT_MAX):
        _admit(events, _max_id(i), 1, float(i))
    state = _state(events)
    assert len(state.requests) == IN_FLIGHT_MAX
    size = _snapshot_bytes(state)
    bound = IN_FLIGHT_MAX * (ID_MAX + SNAPSHOT_REQUEST_BYTES + SNAPSHOT_CHOICE_BYTES)
    assert size <= bound, f"{size} bytes > {bound}"
    assert bound < 1.5 * 2**20  # what docs/limits.md states
    # The form the journal used to write held each id four times (requests, engine ids, open ids, the key).
    assert len(msgspec.msgpack.encode(state.to_dict())) > 2.5 * size
    # ... and the compact one holds everything: a replay from it is the same state.
    snap = r.Record(len(events) + 1, 9e9, r.RUN_STREAM, r.KIND_SNAPSHOT,
                    r.decode_payload(r.KIND_SNAPSHOT, r.encode_payload(r.KIND_SNAPSHOT, snapshot_payload(state))))
    assert msgspec.msgpack.encode(FoldState.from_snapshot(snap).to_dict()) == msgspec.msgpack.encode(
        {**state.to_dict(), "last_seq": snap.seq})


@pytest.mark.slow
def test_a_full_snapshot_with_maximal_ids_and_n_64_stays_under_its_bound():
    """The fold's largest state: 4,096 open calls of n = 64 and 10,000 ended ones, every id at the cap."""
    events: list = []
    for i in range(TERMINAL_REQUESTS_MAX):
        _admit(events, _max_id(i), 1, float(i))
        _end(events, _max_id(i), float(i))
    for i in range(IN_FLIGHT_MAX):
        _admit(events, _max_id(TERMINAL_REQUESTS_MAX + i), 64, 1e5 + i)
    state = _state(events)
    size = _snapshot_bytes(state)
    bound = (TERMINAL_REQUESTS_MAX * (ID_MAX + SNAPSHOT_REQUEST_BYTES + SNAPSHOT_CHOICE_BYTES)
             + IN_FLIGHT_MAX * (ID_MAX + SNAPSHOT_REQUEST_BYTES + 64 * SNAPSHOT_CHOICE_BYTES))
    assert size <= bound, f"{size} bytes > {bound}"
    assert bound < 10 * 2**20  # what docs/limits.md states


def test_compact_snapshots_round_trip_ids_they_cannot_shorten():
    """Engine ids that do not extend their request id, an open id whose request was replaced: kept exactly."""
    events: list = []
    _admit(events, "a", 2, 1.0)
    events.append((2.0, r.request_stream("b"), r.KIND_ENGINE_REQUEST,
                   {"link": "vllm-0", "request_ids": ["elsewhere", "b#1~3"], "prompt_tokens": 3}))
    _admit(events, "a", 3, 3.0)  # a second engine.request for "a" while its first choices are open
    state = _state(events)
    payload = r.decode_payload(r.KIND_SNAPSHOT, r.encode_payload(r.KIND_SNAPSHOT, snapshot_payload(state)))
    back = FoldState.from_snapshot(r.Record(99, 9.0, r.RUN_STREAM, r.KIND_SNAPSHOT, payload))
    assert msgspec.msgpack.encode(back.to_dict()) == msgspec.msgpack.encode({**state.to_dict(), "last_seq": 99})
    assert back.open_engine_ids["elsewhere"] == ("b", 0)


async def test_an_idle_servicer_writes_no_snapshots(autojump_clock):
    journal = Journal(None)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_snapshots, journal, interval_s=30.0))
        journal.append(trio.current_time(), "run", r.KIND_RUN_START, {"wall_time": 0.0, "pid": 1, "version": "v"})
        await trio.sleep(3600)  # an hour idle after one record
        snapshots = [rec for rec in journal.records() if rec.kind == r.KIND_SNAPSHOT]
        assert len(snapshots) == 1
        _admit_rows = []
        _admit(_admit_rows, "late", 1, trio.current_time())
        for event in _admit_rows:
            journal.append(*event)
        await trio.sleep(3600)
        snapshots = [rec for rec in journal.records() if rec.kind == r.KIND_SNAPSHOT]
        assert len(snapshots) == 2
        assert "late" in FoldState.from_snapshot(snapshots[-1]).requests
        nursery.cancel_scope.cancel()


# -- through a servicer ------------------------------------------------------------------


def _grpc_refusal(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        fn()
    return error.value


@pytest.mark.slow
def test_a_huge_id_is_refused_and_its_journal_record_is_clipped(servicer):
    big = "q" * (512 << 10)  # 512 KiB: under any gRPC message limit, 2,048 times the cap
    error = _grpc_refusal(lambda: list(servicer.stub.Generate(generate_request(big, [5, 6], max_tokens=2), timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in error.details() and len(error.details()) < 300
    with open_reader(servicer.journal) as reader:
        def refused():
            return [rec for rec in reader.records(kinds=[r.KIND_ERROR]) if rec.payload["id"].startswith("qqqq")]
        records = wait_until(refused, 5, "the refusal's journal record")
        assert records[-1].stream == r.request_stream("<refused id>")
        assert len(r.encode_payload(r.KIND_ERROR, records[-1].payload)) < 1024
        assert all(len(rec.stream) < 1024 for rec in reader.records())


@pytest.mark.slow
def test_reserved_ids_are_refused_while_serving(servicer):
    stub = servicer.stub
    for rid in (WARMUP_REQUEST_PREFIX + "0", WARMUP_REQUEST_PREFIX + "999"):
        error = _grpc_refusal(lambda: list(stub.Generate(generate_request(rid, [5, 6], max_tokens=2), timeout=10)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in error.details()
        error = _grpc_refusal(lambda: stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in error.details()
    out = list(stub.Generate(generate_request("plain-after", [5, 6], max_tokens=2, ignore_eos=True), timeout=10))
    assert out[-1].complete.finish_reason == "length"


@pytest.mark.process
@pytest.mark.slow
def test_reserved_ids_are_refused_from_start_up_through_warm_up(tmp_path, test_model_dir):
    """Every attempt from the first moment the port answers until SERVING is INVALID_ARGUMENT,
    and some of them land while the servicer is warming up (when such ids used to be admitted)."""
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--step-us", "20000"],
                        env={"ENGINELINK_WARMUP": "full"})
    try:
        servicer.start(wait_serving=False)
        stub = servicer.stub
        states: dict[str, int] = {}
        ordinal = 0
        while True:
            try:
                health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).message
            except grpc.RpcError:
                assert servicer.process.poll() is None, servicer.log()
                continue  # the port is not bound yet
            if health == "Health":
                break
            rid = f"{WARMUP_REQUEST_PREFIX}{ordinal}"
            ordinal += 1
            error = _grpc_refusal(lambda: list(stub.Generate(generate_request(rid, [5, 6], max_tokens=2), timeout=10)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (health, error.details())
            states[health] = states.get(health, 0) + 1
        assert states.get("Engine is warming up", 0) > 0, states
        # Each was journaled as a refusal, apart from the warm-up's own requests' streams.
        def journaled():
            with open_reader(servicer.journal) as reader:
                found = [rec for rec in reader.records(kinds=[r.KIND_ERROR])
                         if rec.payload["id"].startswith(WARMUP_REQUEST_PREFIX)]
            return found if len(found) >= ordinal else None

        refused = wait_until(journaled, 5, "every refusal journaled")
        assert len(refused) == ordinal
        assert {rec.stream for rec in refused} == {r.request_stream("<refused id>")}
    finally:
        servicer.stop()


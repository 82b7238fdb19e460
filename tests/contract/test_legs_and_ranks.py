"""Data parallelism and PD legs on the SGLang and TokenSpeed contracts, on the sim's personalities.

``enginelink serve --engine sim --wire sglang -- --dp-size 2`` runs two
scheduler ranks behind SGLang's DP controller (the sim's, ``machines/sim_legs.py``);
``--disaggregation-mode prefill|decode`` makes the engine a PD leg. What a
client must see (``runtime/requests/pd_bootstrap.py``, ``docs/pd.md``):

- DP: ``dp_size`` 2 in GetServerInfo, two ranks in GetLoads, a pin runs on
  its rank (the scheduler's own ``dp_ranks`` column in the journal's engine
  frames says which), unpinned requests spread, a control call reaches both;
- PD: the leg's role in GetServerInfo; the bootstrap reaches the engine (the
  sim logs each room a leg took); a leg refuses a request without one, a
  whole engine one with one; a prefill leg under DP runs a request on its
  room's residue whatever the pin (the engine fails one elsewhere, as
  SGLang's KV sender does); the planned warm-up and the health probe run on
  an SGLang leg (SGLang's stand-in bootstrap), and are skipped on a
  TokenSpeed leg, as the reference's are.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg, sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts, tokenspeed_scheduler_pb2_grpc as ts_grpc

from enginelink.wire import sglang
from tests.contract.helpers import CALL_TIMEOUT_S, new_id, prompt
from tests.harness import Servicer, free_port, shared, wait_until
from tests.router.test_router_e2e import journal

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

SGLANG = "sglang.grpc.scheduler.SglangScheduler"
TOKENSPEED = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
SLOW = ["--step-us", "5000"]  # a 400-token request is still running while others arrive


def _servicer(tmp_path_factory, model_dir, wire: str, *engine_args: str) -> Servicer:
    service = SGLANG if wire == "sglang" else TOKENSPEED
    return Servicer(tmp_path_factory.mktemp(f"{wire}-legs"), model_dir=model_dir, extra=["--engine", "sim", "--wire", wire],
                    engine_args=[*SLOW, *engine_args], health_service=service)


@pytest.fixture(scope="module")
def sgl_dp(tmp_path_factory, test_model_dir):
    with shared(_servicer(tmp_path_factory, test_model_dir, "sglang", "--dp-size", "2")) as running:
        running.sgl = sg_grpc.SglangSchedulerStub(running.channel)
        yield running


@pytest.fixture(scope="module")
def sgl_prefill(tmp_path_factory, test_model_dir):
    port = free_port()
    with shared(_servicer(tmp_path_factory, test_model_dir, "sglang", "--dp-size", "2", "--disaggregation-mode",
                          "prefill", "--disaggregation-bootstrap-port", str(port))) as running:
        running.sgl, running.bootstrap_port = sg_grpc.SglangSchedulerStub(running.channel), port
        yield running


@pytest.fixture(scope="module")
def sgl_decode(tmp_path_factory, test_model_dir):
    with shared(_servicer(tmp_path_factory, test_model_dir, "sglang", "--disaggregation-mode", "decode")) as running:
        running.sgl = sg_grpc.SglangSchedulerStub(running.channel)
        yield running


@pytest.fixture(scope="module")
def ts_prefill(tmp_path_factory, test_model_dir):
    port = free_port()
    with shared(_servicer(tmp_path_factory, test_model_dir, "tokenspeed", "--data-parallel-size", "2",
                          "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))) as running:
        running.ts, running.bootstrap_port = ts_grpc.TokenSpeedSchedulerStub(running.channel), port
        yield running


def sgl_request(rid: str, ids: list[int], *, room: int | None = None, pin: int | None = None,
                max_new_tokens: int = 4, stream: bool = False) -> sg.GenerateRequest:
    request = sg.GenerateRequest(request_id=rid, tokenized=sg.TokenizedInput(input_ids=ids), stream=stream,
                                 sampling_params=sg.SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                                                                   ignore_eos=True))
    if room is not None:
        request.disaggregated_params.CopyFrom(sg.DisaggregatedParams(bootstrap_host="127.0.0.1",
                                                                     bootstrap_port=8998, bootstrap_room=room))
    if pin is not None:
        request.data_parallel_rank = pin
    return request


def ts_request(rid: str, ids: list[int], *, room: int | None = None, pin: int | None = None,
               max_new_tokens: int = 4) -> ts.GenerateRequest:
    request = ts.GenerateRequest(request_id=rid, tokenized=ts.TokenizedInput(input_ids=ids),
                                 sampling_params=ts.SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                                                                   ignore_eos=True))
    if room is not None:
        request.kv_bootstrap_info.CopyFrom(ts.KvBootstrapInfo(bootstrap_host="127.0.0.1", bootstrap_port=8998,
                                                              bootstrap_room=room))
    if pin is not None:
        request.data_parallel_rank = pin
    return request


def completes(replies) -> list:
    return [r.complete for r in replies if r.WhichOneof("response") == "complete"]


def refusal(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    return caught.value


def sglang_ranks(servicer, rid: str) -> set:
    """The ranks whose outputs named ``rid`` (the scheduler's own ``dp_ranks`` column), from the journal."""
    ranks = set()
    for _, _, kind, payload in journal(servicer):
        if kind != "engine.frame":
            continue
        message = sglang.decode_message([payload])
        if type(message).__name__ == "BatchTokenIDOutput" and rid in message.rids:
            ranks.add(message.dp_ranks[message.rids.index(rid)])
    return ranks


def rooms_taken(servicer) -> dict[str, tuple[str, int, int]]:
    """rid -> (leg, rank, room): the sim's line for each request a leg took (its relayed log)."""
    lines = re.findall(r"pd (\w+) leg: rank (\d+) took (\S+) \(bootstrap \S+ room (\d+)\)", servicer.log())
    return {rid: (leg, int(rank), int(room)) for leg, rank, rid, room in lines}


# -- SGLang data parallelism ------------------------------------------------------------------


def test_sglang_dp_ranks_are_served_and_advertised(sgl_dp):
    info = sgl_dp.sgl.GetServerInfo(sg.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.server_args["dp_size"] == 2
    assert info.server_args["disaggregation_mode"] == "null"
    loads = sgl_dp.sgl.GetLoads(sg.GetLoadsRequest(), timeout=CALL_TIMEOUT_S)
    assert loads.dp_rank_count == 2 and sorted(load.dp_rank for load in loads.loads) == [0, 1]


def test_sglang_dp_pin_runs_on_its_rank_and_out_of_range_is_refused(sgl_dp):
    for rank in (1, 0, 1):
        rid = new_id(f"pin{rank}")
        (complete,) = completes(sgl_dp.sgl.Generate(sgl_request(rid, prompt(6), pin=rank), timeout=CALL_TIMEOUT_S))
        assert complete.finish_reason == "length" and len(complete.output_ids) == 4
        wait_until(lambda: sglang_ranks(sgl_dp, rid), 5, "the request's frames in the journal")
        assert sglang_ranks(sgl_dp, rid) == {rank}
    error = refusal(sgl_dp.sgl, sgl_request(new_id("pin2"), prompt(6), pin=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "data_parallel_rank: 2 is out of range [0, 2)"


def test_sglang_dp_unpinned_requests_spread_and_a_flush_reaches_every_rank(sgl_dp):
    rids = [new_id("spread") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda rid: completes(sgl_dp.sgl.Generate(
            sgl_request(rid, prompt(5), max_new_tokens=40), timeout=CALL_TIMEOUT_S)), rids))
    assert all(len(c[0].output_ids) == 40 for c in replies)
    wait_until(lambda: all(sglang_ranks(sgl_dp, rid) for rid in rids), 5, "both requests' frames")
    assert sglang_ranks(sgl_dp, rids[0]) | sglang_ranks(sgl_dp, rids[1]) == {0, 1}
    flushed = sgl_dp.sgl.FlushCache(common_pb2.FlushCacheRequest(), timeout=CALL_TIMEOUT_S)
    assert flushed.success, flushed.message


# -- SGLang PD legs --------------------------------------------------------------------------


def test_sglang_prefill_leg_says_its_role_and_warms_up_with_the_stand_in_bootstrap(sgl_prefill):
    args = sgl_prefill.sgl.GetServerInfo(sg.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).server_args
    assert (args["disaggregation_mode"], args["disaggregation_bootstrap_port"], args["load_balance_method"],
            args["dp_size"]) == ("prefill", sgl_prefill.bootstrap_port, "follow_bootstrap_room", 2)
    assert args["pairing_protocol"] == ""
    # Every warm-up request ran on the leg (SGLang's stand-in host, room = the rank it was pinned to).
    assert re.search(r"warm-up done .* requests \d+ ok, 0 failed", sgl_prefill.log()), sgl_prefill.log()[-2000:]
    taken = [v for rid, v in rooms_taken(sgl_prefill).items() if rid.startswith("smg-warmup-")]
    assert {(rank, room) for _, rank, room in taken} == {(0, 0), (1, 1)}
    assert sgl_prefill.sgl.HealthCheck(sg.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).healthy


def test_sglang_prefill_leg_runs_on_the_rooms_residue_and_prefills_only(sgl_prefill):
    for room, pin in ((7, 0), (10, 1), (12, None)):
        rid = new_id(f"room{room}")
        (complete,) = completes(sgl_prefill.sgl.Generate(
            sgl_request(rid, prompt(9), room=room, pin=pin, max_new_tokens=16), timeout=CALL_TIMEOUT_S))
        # A prefill leg: one token, then done (the decode leg generates the rest).
        assert complete.finish_reason == "length" and len(complete.output_ids) == 1, complete
        wait_until(lambda: rid in rooms_taken(sgl_prefill), 5, "the sim's line for the request")
        assert rooms_taken(sgl_prefill)[rid] == ("prefill", room % 2, room)
    assert "data_parallel_rank 0 yields to rank 1" in sgl_prefill.log()


def test_sglang_leg_refuses_a_request_without_a_bootstrap(sgl_prefill):
    error = refusal(sgl_prefill.sgl, sgl_request(new_id("nobs"), prompt(4)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == ("disaggregated_params: this worker is a prefill leg: the bootstrap host, port and "
                               "room are required")
    bad = sgl_request(new_id("badroom"), prompt(4), room=3)
    bad.disaggregated_params.bootstrap_room = -1
    assert refusal(sgl_prefill.sgl, bad).details() == "disaggregated_params.bootstrap_room: must be >= 0, got -1"


def test_sglang_decode_leg_generates_with_the_bootstrap_and_a_whole_engine_refuses_one(sgl_decode, sgl_dp):
    args = sgl_decode.sgl.GetServerInfo(sg.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).server_args
    assert (args["disaggregation_mode"], args["load_balance_method"]) == ("decode", "round_robin")
    rid = new_id("decode")
    (complete,) = completes(sgl_decode.sgl.Generate(sgl_request(rid, prompt(9), room=41, max_new_tokens=8),
                                                    timeout=CALL_TIMEOUT_S))
    assert complete.finish_reason == "length" and len(complete.output_ids) == 8
    wait_until(lambda: rid in rooms_taken(sgl_decode), 5, "the sim's line for the request")
    assert rooms_taken(sgl_decode)[rid] == ("decode", 0, 41)
    error = refusal(sgl_dp.sgl, sgl_request(new_id("whole"), prompt(4), room=3))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "disaggregated_params: this worker is not a prefill/decode leg" in error.details()


# -- TokenSpeed: attention DP under PD -------------------------------------------------------


def test_tokenspeed_prefill_leg_places_by_residue_and_skips_the_warm_up(ts_prefill):
    args = ts_prefill.ts.GetServerInfo(ts.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).server_args
    assert (args["disaggregation_mode"], args["disaggregation_bootstrap_port"], args["dp_size"]) == (
        "prefill", ts_prefill.bootstrap_port, 2)
    assert "warm-up skipped: a prefill leg of an engine with no stand-in bootstrap" in ts_prefill.log()
    for room, pin in ((5, 0), (8, 1), (3, None)):
        rid = new_id(f"tsroom{room}")
        (complete,) = completes(ts_prefill.ts.Generate(ts_request(rid, prompt(7), room=room, pin=pin),
                                                       timeout=CALL_TIMEOUT_S))
        assert complete.finish_reason == "length" and len(complete.output_ids) == 1, complete
        wait_until(lambda: rid in rooms_taken(ts_prefill), 5, "the sim's line for the request")
        assert rooms_taken(ts_prefill)[rid] == ("prefill", room % 2, room)
    error = refusal(ts_prefill.ts, ts_request(new_id("tsnobs"), prompt(4)))
    assert error.details() == ("kv_bootstrap_info: this worker is a prefill leg: the bootstrap host, port and "
                               "room are required")


# -- KV events from every rank: SGLang DP, a TokenSpeed PD leg under DP ------------------------


def _launch_kv_config(servicer) -> dict:
    """The ``--kv-events-config`` enginelink launched the engine with (the journal's launch record)."""
    import json

    (argv,) = [p["message"]["argv"] for _, _, kind, p in journal(servicer)
               if kind == "engine.handshake" and p["step"] == "launch"]
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def _stored_by_rank(servicer, stub, generate) -> None:
    """Each rank's request is stored by that rank's own publisher, relayed with its ``dp_rank``."""
    from types import SimpleNamespace

    from tests.kv.kv_client import KvSubscription

    with KvSubscription(SimpleNamespace(stub=stub)) as sub:
        sub.caught_up()
        seen = len(sub.kv_batches())
        for rank in (0, 1):
            (complete,) = completes(generate(rank))
            assert complete.finish_reason == "length", complete

        def stored_ranks(s) -> bool:
            return {b.dp_rank for b in s.kv_batches()[seen:]
                    if any(e.WhichOneof("data") == "stored" for e in b.events)} == {0, 1}

        sub.wait(stored_ranks, CALL_TIMEOUT_S, "stored blocks from rank 0 and from rank 1")
        sub.wait(lambda s: {b.dp_rank for b in s.snapshot() if b.load.load_only} == {0, 1}, CALL_TIMEOUT_S,
                 "load records of both ranks")


def test_sglang_dp_relays_each_ranks_kv_events_in_sglangs_dialect(sgl_dp):
    # SGLang's own form (no vLLM switch); each DP rank offsets the port by its rank (select_kv_publisher_dp_rank).
    config = _launch_kv_config(sgl_dp)
    assert config["publisher"] == "zmq" and "enable_kv_cache_events" not in config
    _stored_by_rank(sgl_dp, sgl_dp.sgl, lambda rank: sgl_dp.sgl.Generate(
        sgl_request(new_id(f"kv{rank}"), prompt(300 + rank, 40), pin=rank), timeout=CALL_TIMEOUT_S))


def test_tokenspeed_prefill_leg_under_dp_relays_each_ranks_kv_events(ts_prefill):
    config = _launch_kv_config(ts_prefill)
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"  # TokenSpeed's dialect
    # A prefill leg runs a request on its room's residue: room 4 on rank 0, room 5 on rank 1.
    _stored_by_rank(ts_prefill, ts_prefill.ts, lambda rank: ts_prefill.ts.Generate(
        ts_request(new_id(f"tskv{rank}"), prompt(310 + rank, 40), room=4 + rank), timeout=CALL_TIMEOUT_S))

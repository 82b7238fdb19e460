"""DP 2 and a PD pair through the real SMG router 1.13.0, on SGLang's and TokenSpeed's contracts (issue 33).

All on the sim's personalities (``--wire sglang`` / ``--wire tokenspeed``):

- DP: one worker whose engine runs two ranks (SGLang's DP controller; two
  TokenSpeed ranks, each its own handshake). The router registers it with
  ``dp_size`` 2 and traffic reaches both ranks (the engine's own output
  frames, journaled, name the rank that produced them);
- PD: ``smg launch --pd-disaggregation --prefill grpc://P BOOTSTRAP_PORT
  --decode grpc://D``, the prefill leg with two ranks. The router sends each
  request to both legs with one bootstrap (host, port, room); the decode
  leg's tokens reach the client (the prefill leg makes one), both legs'
  engines took the same room (the sim's log lines), and the prefill leg ran
  it on the room's residue rank. The router's registration probe of the
  prefill's bootstrap port finds the sim's bootstrap server.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from enginelink.wire import sglang, tokenspeed
from tests.harness import Router, Servicer, free_port, wait_until
from tests.router.openai_http import post, stream
from tests.router.test_router_e2e import COMPLETIONS, journal, ok, streamed

pytestmark = pytest.mark.router

SERVICES = {"sglang": "sglang.grpc.scheduler.SglangScheduler",
            "tokenspeed": "tokenspeed.grpc.scheduler.TokenSpeedScheduler"}
DP_FLAG = {"sglang": "--dp-size", "tokenspeed": "--data-parallel-size"}


def _servicer(tmp: Path, model_dir: Path, wire: str, *engine_args: str) -> Servicer:
    return Servicer(tmp, model_dir=model_dir, extra=["--engine", "sim", "--wire", wire],
                    engine_args=["--step-us", "3000", *engine_args], health_service=SERVICES[wire],
                    env={"ENGINELINK_WARMUP": "fast"}).start()


def _pd_router(tmp: Path, model_dir: Path, prefill: Servicer, bootstrap_port: int, decode: Servicer) -> Router:
    router = Router(tmp, prefill.port, model_dir)
    at = router.argv.index("--worker-urls")
    del router.argv[at:at + 2]
    router.argv += ["--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill.port}", str(bootstrap_port),
                    "--decode", f"grpc://127.0.0.1:{decode.port}"]
    return router.start(timeout_s=60)


def frame_ranks(servicer: Servicer, wire: str) -> dict[str, set[int]]:
    """rid -> the ranks whose output frames named it (SGLang's ``dp_ranks``, TokenSpeed's ``engine_index``)."""
    ranks: dict[str, set[int]] = {}
    for _, _, kind, payload in journal(servicer):
        if kind != "engine.frame":
            continue
        if wire == "sglang":
            message = sglang.decode_message([payload])
            if type(message).__name__ != "BatchTokenIDOutput":
                continue
            pairs = zip(message.rids, message.dp_ranks or [None] * len(message.rids))
        else:
            message = tokenspeed.decode_batch([payload])
            if not isinstance(message, tokenspeed.BatchTokenIDOutSlim):
                continue
            pairs = ((rid, message.engine_index) for rid in message.rids or [])
        for rid, rank in pairs:
            ranks.setdefault(rid, set()).add(rank)
    return ranks


def rooms_taken(servicer: Servicer) -> dict[str, tuple[str, int, int]]:
    lines = re.findall(r"pd (\w+) leg: rank (\d+) took (\S+) \(bootstrap \S+ room (\d+)\)", servicer.log())
    return {rid: (leg, int(rank), int(room)) for leg, rank, rid, room in lines}


@pytest.fixture(scope="module", params=["sglang", "tokenspeed"])
def dp_stack(request, tmp_path_factory, test_model_dir):
    wire = request.param
    tmp = tmp_path_factory.mktemp(f"router-dp-{wire}")
    servicer = _servicer(tmp, test_model_dir, wire, DP_FLAG[wire], "2")
    try:
        router = Router(tmp, servicer.port, test_model_dir).start()
    except BaseException:
        servicer.stop()
        raise
    try:
        yield SimpleNamespace(wire=wire, servicer=servicer, router=router, model=test_model_dir.name)
    finally:
        router.stop()
        servicer.stop()


@pytest.fixture(scope="module", params=["sglang", "tokenspeed"])
def pd_stack(request, tmp_path_factory, test_model_dir):
    wire = request.param
    tmp = tmp_path_factory.mktemp(f"router-pd-{wire}")
    bootstrap_port = free_port()
    prefill = _servicer(tmp, test_model_dir, wire, DP_FLAG[wire], "2", "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(bootstrap_port))
    decode = None
    try:
        decode = _servicer(tmp, test_model_dir, wire, "--disaggregation-mode", "decode")
        router = _pd_router(tmp, test_model_dir, prefill, bootstrap_port, decode)
    except BaseException:
        prefill.stop()
        if decode is not None:
            decode.stop()
        raise
    try:
        yield SimpleNamespace(wire=wire, prefill=prefill, decode=decode, router=router, model=test_model_dir.name)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


def test_dp_worker_is_registered_and_traffic_reaches_both_ranks(dp_stack):
    body = {"model": dp_stack.model, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    prompts = [f"def f{i}(x):" for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: ok(post(dp_stack.router.url, COMPLETIONS, {**body, "prompt": p})), prompts))
    for reply in replies:
        assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 30
    wait_until(lambda: len(frame_ranks(dp_stack.servicer, dp_stack.wire)) >= len(prompts), 10, "the frames")
    used = set().union(*(ranks for rid, ranks in frame_ranks(dp_stack.servicer, dp_stack.wire).items()
                         if not rid.startswith("smg-")))
    assert used == {0, 1}


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_pd_pair_generates_on_the_decode_leg_with_one_room_on_both(pd_stack, streaming):
    body = {"model": pd_stack.model, "prompt": "def foo(x):", "max_tokens": 12, "ignore_eos": True,
            "temperature": 0}
    if streaming:
        chunks, _ = streamed(stream(pd_stack.router.url, COMPLETIONS, {**body, "stream": True}))
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        rid = chunks[0]["id"]
    else:
        reply = ok(post(pd_stack.router.url, COMPLETIONS, body))
        assert reply["usage"]["completion_tokens"] == 12 and reply["choices"][0]["finish_reason"] == "length"
        text, rid = reply["choices"][0]["text"], reply["id"]
    assert text
    wait_until(lambda: rid in rooms_taken(pd_stack.prefill) and rid in rooms_taken(pd_stack.decode), 10,
               "both legs' lines for the request")
    prefill_leg, prefill_rank, room = rooms_taken(pd_stack.prefill)[rid]
    decode_leg, _, decode_room = rooms_taken(pd_stack.decode)[rid]
    assert (prefill_leg, decode_leg) == ("prefill", "decode") and room == decode_room
    assert prefill_rank == room % 2  # the prefill leg ran it on its room's residue
    assert "Bootstrap port did not accept a connection" not in pd_stack.router.log()

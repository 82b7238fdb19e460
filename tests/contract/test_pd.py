"""PD disaggregation through the contract: KV-transfer params in, to the engine, back in the complete.

The sim engine runs with ``--kv-transfer-config`` (a NIXL-like connector): it
echoes each request's ``kv_transfer_params`` on the finishing output, with
what a connector adds (the other leg's block ids, its engine id and request
id; for a prefill leg the flags flipped and its side channel). So a complete
carrying the echo shows the engine saw the params. A second servicer, with no
connector, shows the engine's silence passes through as silence.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from tests.contract.helpers import (
    CALL_TIMEOUT_S,
    SLOW_ENGINE_ARGS,
    Outcome,
    call,
    engine_request_ids,
    journal_rows,
    new_id,
    prompt,
    refusal,
    wait_journal,
)
from tests.harness import Servicer, free_port, generate_request, scrape, shared

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

ENGINE_ID = "pd-engine-1"
KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": ENGINE_ID}
SIM_BLOCK_SIZE = 16  # the sim's default
KV_PORT = 14579  # vLLM's default kv_port, what the sim's prefill leg advertises


@pytest.fixture(scope="module")
def pd_servicer(tmp_path_factory, test_model_dir):
    metrics_port = free_port()
    with shared(Servicer(tmp_path_factory.mktemp("pd"), model_dir=test_model_dir,
                         extra=["--metrics-port", str(metrics_port)],
                         engine_args=[*SLOW_ENGINE_ARGS, "--kv-transfer-config", json.dumps(KV_CONFIG)])) as running:
        running.metrics_port = metrics_port
        yield running


def _pd_request(rid: str, ids: list[int], *, params: dict | None = None, legacy: tuple[str, int] | None = None,
                stream: bool = False, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    request = generate_request(rid, ids, stream=stream, temperature=0.0, ignore_eos=True, **sampling)
    if params is not None:
        request.kv_transfer_params_json = json.dumps(params)
    if legacy is not None:
        request.kv_transfer_params.remote_host, request.kv_transfer_params.remote_port = legacy
    return request


def _echo(params: dict, engine_id: str, prompt_tokens: int) -> dict:
    """What the sim's connector answers (machines/sim_core.py ``sim_kv_params``)."""
    out = {**params, "remote_block_ids": list(range(-(-prompt_tokens // SIM_BLOCK_SIZE))),
           "remote_engine_id": ENGINE_ID, "remote_request_id": engine_id}
    if params.get("do_remote_decode"):
        out.update(do_remote_decode=False, do_remote_prefill=True, remote_host="127.0.0.1", remote_port=KV_PORT)
    return out


def _kv_out(complete: pb.GenerateComplete) -> tuple[dict | None, tuple[str, int] | None]:
    params = json.loads(complete.kv_transfer_params_json) if complete.HasField("kv_transfer_params_json") else None
    legacy = complete.kv_transfer_params
    return params, ((legacy.remote_host, legacy.remote_port) if complete.HasField("kv_transfer_params") else None)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_prefill_leg_params_reach_the_engine_and_its_answer_comes_back(pd_servicer, stream):
    rid, ids = new_id("pd-prefill"), prompt(1, 40)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "transfer_id": "t-1"}
    outcome = call(pd_servicer.stub, _pd_request(rid, ids, params=params, stream=stream, max_tokens=1))
    complete = outcome.complete(0)
    assert complete.finish_reason == "length" and len(complete.output_ids) == 1
    assert _kv_out(complete) == (_echo(params, rid, 40), ("127.0.0.1", KV_PORT))


def test_decode_leg_params_pass_verbatim_and_the_legacy_mirror_follows_the_engine(pd_servicer):
    rid, ids = new_id("pd-decode"), prompt(2, 20)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
              "remote_engine_id": "p0", "remote_request_id": "p-req-9", "remote_host": "10.0.0.1",
              "remote_port": 5600, "nested": {"list": [1, 2.5, "x", None, True]}}
    outcome = call(pd_servicer.stub, _pd_request(rid, ids, params=params, max_tokens=3))
    complete = outcome.complete(0)
    assert complete.finish_reason == "length" and len(complete.output_ids) == 3
    echoed, legacy = _kv_out(complete)
    assert echoed == _echo(params, rid, 20)
    assert echoed["nested"] == params["nested"], "params reach the engine unchanged"
    assert legacy == ("10.0.0.1", 5600)


def test_legacy_message_in_becomes_host_and_port_for_the_engine(pd_servicer):
    rid, ids = new_id("pd-legacy"), prompt(3, 17)
    outcome = call(pd_servicer.stub, _pd_request(rid, ids, legacy=("10.9.8.7", 7000)))
    assert _kv_out(outcome.complete(0)) == (
        _echo({"remote_host": "10.9.8.7", "remote_port": 7000}, rid, 17), ("10.9.8.7", 7000))


def test_json_field_wins_over_the_legacy_message(pd_servicer):
    rid, ids = new_id("pd-both"), prompt(4, 8)
    params = {"do_remote_prefill": True, "remote_host": "json-host", "remote_port": 1234}
    outcome = call(pd_servicer.stub, _pd_request(rid, ids, params=params, legacy=("legacy-host", 4321)))
    assert _kv_out(outcome.complete(0)) == (_echo(params, rid, 8), ("json-host", 1234))


def test_each_choice_carries_its_own_engine_answer(pd_servicer):
    rid, ids = new_id("pd-n2"), prompt(5, 12)
    params = {"do_remote_decode": True}
    outcome: Outcome = call(pd_servicer.stub, _pd_request(rid, ids, params=params, n=2, stream=True))
    for index in (0, 1):
        assert _kv_out(outcome.complete(index))[0] == _echo(params, f"{rid}#{index}", 12)


def test_a_request_without_params_gets_none_back(pd_servicer):
    outcome = call(pd_servicer.stub, _pd_request(new_id("pd-none"), prompt(6, 8)))
    assert _kv_out(outcome.complete(0)) == (None, None)


BAD = [
    ("json-array", dict(params=None), "[1, 2]", r"kv_transfer_params_json: must be a JSON object"),
    ("json-string", dict(params=None), '"x"', r"kv_transfer_params_json: must be a JSON object"),
    ("json-broken", dict(params=None), "{do_remote_prefill: true", r"kv_transfer_params_json: is not valid JSON"),
    ("legacy-no-host", dict(legacy=("", 5600)), None, r"remote_host must be set and remote_port must be in"),
    ("legacy-port-0", dict(legacy=("h", 0)), None, r"remote_port must be in \[1, 65535\]"),
    ("legacy-port-65536", dict(legacy=("h", 65536)), None, r"remote_port must be in \[1, 65535\]"),
]


@pytest.mark.parametrize("name, fields, json_text, message", BAD, ids=[b[0] for b in BAD])
def test_bad_params_are_invalid_argument_and_never_reach_the_engine(pd_servicer, name, fields, json_text, message):
    rid = new_id(f"pd-bad-{name}")
    request = _pd_request(rid, prompt(7, 8), **fields)
    if json_text is not None:
        request.kv_transfer_params_json = json_text
    error = refusal(pd_servicer.stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.details()), error.details()
    wait_journal(pd_servicer.journal, lambda rows: any(r.kind == "error" and r.payload.get("id") == rid for r in rows),
                 "the refusal journaled")
    assert rid not in engine_request_ids(pd_servicer.journal)
    assert not [r for r in journal_rows(pd_servicer.journal, ("engine.kv_release",)) if r.payload["request_id"] == rid]


def _kv_releases(servicer) -> float:
    """The servicer's ``link_kv_releases`` gauge, whatever its labels."""
    (value,) = [v for k, v in scrape(servicer.metrics_port).items() if k.startswith("smg_servicer_link_kv_releases")]
    return value


def _releases(journal, rid: str) -> list[dict]:
    return [r.payload for r in journal_rows(journal, ("engine.kv_release",)) if r.payload["request_id"] == rid]


def test_a_refused_decode_leg_is_released_to_the_engine(pd_servicer):
    """The prefill side holds this request's KV: the engine is told at once, pre-aborted, never run."""
    rid = new_id("pd-release")
    released_before = _kv_releases(pd_servicer)
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "p-1", "remote_block_ids": [1]}
    error = refusal(pd_servicer.stub, _pd_request(rid, prompt(8, 8), params=params, max_tokens=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in error.details()
    wait_journal(pd_servicer.journal, lambda rows: any(
        r.kind == "engine.kv_release" and r.payload["request_id"] == rid for r in rows), "the release journaled")
    (release,) = _releases(pd_servicer.journal, rid)
    assert release["sent"] is True and release["engine_id"].startswith("smg-kv-release-")
    assert rid not in engine_request_ids(pd_servicer.journal), "no call was admitted for it"
    assert _kv_releases(pd_servicer) == released_before + 1
    # The servicer and the engine go on serving.
    assert call(pd_servicer.stub, _pd_request(new_id("pd-after"), prompt(9, 8))).complete(0).finish_reason == "length"


def test_a_decode_leg_refused_as_a_duplicate_is_released_and_the_original_runs_on(pd_servicer):
    rid = new_id("pd-dup")
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "p-2"}
    stream = pd_servicer.stub.Generate(_pd_request(rid, prompt(12, 8), params=params, stream=True, max_tokens=40),
                                       timeout=CALL_TIMEOUT_S)
    messages = [next(stream)]  # in flight now
    error = refusal(pd_servicer.stub, _pd_request(rid, prompt(13, 8), params=params))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    messages += list(stream)
    original = Outcome(messages).complete(0)
    assert original.finish_reason == "length" and _kv_out(original)[0] == _echo(params, rid, 8)
    wait_journal(pd_servicer.journal, lambda rows: any(
        r.kind == "engine.kv_release" and r.payload["request_id"] == rid for r in rows), "the release journaled")
    (release,) = _releases(pd_servicer.journal, rid)
    assert release["sent"] and release["engine_id"] != rid, "the release never takes the live call's engine id"


def test_refusals_that_hold_no_prefill_kv_release_nothing(pd_servicer):
    cases = {
        new_id("pd-norelease-prefill"): dict(params={"do_remote_decode": True}),
        new_id("pd-norelease-false"): dict(params={"do_remote_prefill": False}),
        new_id("pd-norelease-legacy"): dict(legacy=("h", 5600)),
        new_id("pd-norelease-none"): dict(),
    }
    for rid, fields in cases.items():
        assert refusal(pd_servicer.stub, _pd_request(rid, prompt(10, 8), max_tokens=0, **fields)).code() == (
            grpc.StatusCode.INVALID_ARGUMENT)
    last = list(cases)[-1]
    wait_journal(pd_servicer.journal, lambda rows: any(r.kind == "error" and r.payload.get("id") == last for r in rows),
                 "the refusals journaled")
    for rid in cases:
        assert _releases(pd_servicer.journal, rid) == []


def test_server_info_advertises_the_connector_role_and_engine_id(pd_servicer, servicer):
    info = pd_servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.kv_connector, info.kv_role, info.kv_engine_id) == ("NixlConnector", "kv_both", ENGINE_ID)
    plain = servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (plain.kv_connector, plain.kv_role, plain.kv_engine_id) == ("", "", "")


def test_an_engine_without_a_connector_answers_no_params(servicer):
    """vLLM without a KV connector ignores the params; the complete says nothing of them."""
    rid = new_id("pd-noconnector")
    outcome = call(servicer.stub, _pd_request(rid, prompt(11, 8), params={"do_remote_decode": True}))
    assert outcome.complete(0).finish_reason == "length"
    assert _kv_out(outcome.complete(0)) == (None, None)

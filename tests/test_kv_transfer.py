"""PD pass-through, unit by unit: params in, params out, the release ADD, the pairing identity."""

from __future__ import annotations

import json

import msgspec
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.states import LinkState
from enginelink.machines.link import KV_RELEASE_REQUEST_PREFIX
from enginelink.machines.sim_core import SimConfig, SimEngineCore
from enginelink.runtime.contracts.vllm import kv_transfer
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.inputs import InputLimits, check_request_id
from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from tests.harness import ListJournal

LIMITS = InputLimits()


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[5, 6]), **fields)


def _legacy(host: str, port: int) -> pb.GenerateRequest:
    return _request(kv_transfer_params=pb.KvTransferParams(remote_host=host, remote_port=port))


# -- in ------------------------------------------------------------------------------


def test_json_params_pass_verbatim_and_win_over_the_legacy_message():
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p0", "x": {"y": None}}
    both = _request(kv_transfer_params_json=json.dumps(params),
                    kv_transfer_params=pb.KvTransferParams(remote_host="h", remote_port=9))
    assert kv_transfer.params_from_request(both, LIMITS) == params
    # An empty object is still the client's choice: it is passed, not dropped.
    assert kv_transfer.params_from_request(_request(kv_transfer_params_json="{}"), LIMITS) == {}
    assert kv_transfer.params_from_request(_request(), LIMITS) is None


@pytest.mark.parametrize("text, problem", [
    ("[1, 2]", "must be a JSON object"),
    ('"a string"', "must be a JSON object"),
    ("null", "must be a JSON object"),
    ("7", "must be a JSON object"),
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
])
def test_json_params_that_are_not_an_object_are_the_clients_fault(text, problem):
    with pytest.raises(ClientError, match=problem) as refused:
        kv_transfer.params_from_request(_request(kv_transfer_params_json=text), LIMITS)
    assert refused.value.field == "kv_transfer_params_json"
    assert refused.value.status.name == "INVALID_ARGUMENT"


def test_legacy_message_becomes_host_and_port():
    assert kv_transfer.params_from_request(_legacy("10.0.0.7", 65535), LIMITS) == {
        "remote_host": "10.0.0.7", "remote_port": 65535}
    assert kv_transfer.params_from_request(_legacy("h", 1), LIMITS) == {"remote_host": "h", "remote_port": 1}


@pytest.mark.parametrize("host, port", [("", 5600), ("h", 0), ("h", 65536), ("h", 2**32 - 1), ("", 0)])
def test_legacy_message_needs_a_host_and_a_port_in_range(host, port):
    with pytest.raises(ClientError, match=r"remote_host must be set and remote_port must be in \[1, 65535\]"):
        kv_transfer.params_from_request(_legacy(host, port), LIMITS)


def test_params_are_bounded_in_size_and_depth_both_ways_in():
    small = InputLimits(kv_transfer_params_bytes=64, json_depth=3)
    with pytest.raises(ClientError, match="ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES"):
        kv_transfer.params_from_request(_request(kv_transfer_params_json=json.dumps({"k": "v" * 64})), small)
    with pytest.raises(ClientError, match="ENGINELINK_MAX_JSON_DEPTH"):
        kv_transfer.params_from_request(_request(kv_transfer_params_json='{"a": {"b": {"c": {}}}}'), small)
    with pytest.raises(ClientError, match="ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES") as refused:
        kv_transfer.params_from_request(_legacy("h" * 65, 5600), small)
    assert "hhhh" not in str(refused.value), "a refusal never echoes the value"


def test_only_a_readable_decode_side_request_is_released():
    decode = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "x"}
    assert kv_transfer.params_for_release(_request(kv_transfer_params_json=json.dumps(decode)), LIMITS) == decode
    for params in ({"do_remote_decode": True}, {"do_remote_prefill": False}, {"do_remote_prefill": 0}, {}):
        assert kv_transfer.params_for_release(_request(kv_transfer_params_json=json.dumps(params)), LIMITS) is None
    assert kv_transfer.params_for_release(_request(kv_transfer_params_json="[1]"), LIMITS) is None
    assert kv_transfer.params_for_release(_legacy("h", 5600), LIMITS) is None
    assert kv_transfer.params_for_release(_request(), LIMITS) is None


# -- out -----------------------------------------------------------------------------


def test_engine_params_fill_the_json_field_and_the_legacy_message_when_it_fits():
    complete = pb.GenerateComplete()
    params = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 14579, "remote_block_ids": [0, 1]}
    kv_transfer.fill_complete(complete, params)
    assert json.loads(complete.kv_transfer_params_json) == params
    assert (complete.kv_transfer_params.remote_host, complete.kv_transfer_params.remote_port) == ("10.1.2.3", 14579)


@pytest.mark.parametrize("host, port", [("h", "5600"), ("h", True), ("", 5600), (7, 5600), ("h", 0), ("h", 70000),
                                        ("h", None)])
def test_legacy_message_is_left_out_unless_host_is_a_string_and_port_an_int_in_range(host, port):
    complete = pb.GenerateComplete()
    kv_transfer.fill_complete(complete, {"remote_host": host, "remote_port": port})
    assert json.loads(complete.kv_transfer_params_json) == {"remote_host": host, "remote_port": port}
    assert not complete.HasField("kv_transfer_params")


def test_no_or_empty_or_unserializable_engine_params_leave_the_complete_bare():
    for params in (None, {}):
        complete = pb.GenerateComplete()
        kv_transfer.fill_complete(complete, params)
        assert not complete.HasField("kv_transfer_params_json") and not complete.HasField("kv_transfer_params")
    complete = pb.GenerateComplete()
    kv_transfer.fill_complete(complete, {"blob": b"\x00\x01", "remote_host": "h", "remote_port": 1})
    assert not complete.HasField("kv_transfer_params_json")
    assert complete.kv_transfer_params.remote_host == "h", "the legacy mirror does not need JSON"


# -- identity ------------------------------------------------------------------------


@pytest.mark.parametrize("connector, engine_id, children, expected", [
    ("NixlConnector", "d0", None, ("NixlConnector", "d0")),
    ("ExampleConnector", "e", [["NixlConnector", "x"]], ("ExampleConnector", "e")),  # only MultiConnector unwraps
    ("MultiConnector", "m", [["NixlConnector", "n"], ["OffloadingConnector", None]], ("NixlConnector", "n")),
    ("MultiConnector", "m", [["OffloadingConnector", None], ["MooncakeConnector", None]], ("MooncakeConnector", "m")),
    ("MultiConnector", "m", [["NixlConnector", "n"], ["SharedStorageConnector", "s"]], ("NixlConnector", "n")),
    ("MultiConnector", "m", [["SharedStorageConnector", "s"]], ("SharedStorageConnector", "s")),
    ("MultiConnector", "m", [["FlexKVConnectorV1", None], ["LMCacheConnectorV1", None]], ("FlexKVConnectorV1", "m")),
    ("MultiConnector", "m", [["HF3FSKVConnector", "h"]], ("HF3FSKVConnector", "h")),
    ("MultiConnector", "m", [["MoRIIOConnector", "r"], ["MooncakeStoreConnector", "s"]],
     ("MooncakeStoreConnector", "s")),
    ("MultiConnector", "m", [["MoRIIOConnector", "r"]], ("MoRIIOConnector", "r")),
    # Ambiguous or malformed: the wrapper as itself, so the router does not guess.
    ("MultiConnector", "m", [["MoRIIOConnector", "r"], ["MooncakeStoreConnector", "s"], ["HF3FSKV", "t"]],
     ("MultiConnector", "m")),
    ("MultiConnector", "m", [["NixlConnector", "a"], ["MooncakeConnector", "b"]], ("MultiConnector", "m")),
    ("MultiConnector", "m", [["SharedStorageConnector", "a"], ["MooncakeStoreConnector", "b"]],
     ("MultiConnector", "m")),
    ("MultiConnector", "m", [["OffloadingConnector", None]], ("MultiConnector", "m")),
    ("MultiConnector", "m", [None, ["NixlConnector", "n"]], ("MultiConnector", "m")),
    ("MultiConnector", "m", [["", "n"]], ("MultiConnector", "m")),
    ("MultiConnector", "m", "not a list", ("MultiConnector", "m")),
    ("MultiConnector", "m", [["NixlConnector", 5]], ("MultiConnector", "m")),
    ("MultiConnector", "", [["NixlConnector", None]], ("MultiConnector", "")),
])
def test_the_connector_the_router_pairs_on(connector, engine_id, children, expected):
    assert kv_transfer.resolve_connector(connector, engine_id, children) == expected


def test_server_fields_say_nothing_without_a_connector():
    assert kv_transfer.server_fields({"kv_role": "kv_both", "kv_engine_id": "x"}, {}) == {
        "kv_connector": "", "kv_role": "", "kv_engine_id": "", "attention_backend": "", "pairing_protocol": ""}


def test_server_fields_from_the_engine_facts_and_the_pairing_protocol_env():
    facts = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_engine_id": "top",
             "kv_connector_children": [["NixlConnector", None], ["OffloadingConnector", None]],
             "attention_backend": "FLASH_ATTN"}
    assert kv_transfer.server_fields(facts, {"SMG_PAIRING_PROTOCOL": " nixl-v2 "}) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_engine_id": "top",
        "attention_backend": "FLASH_ATTN", "pairing_protocol": "nixl-v2"}


# -- the release ADD ---------------------------------------------------------------------


class _Link:
    name = "engine"

    def __init__(self, state: LinkState) -> None:
        self.state = state


def _hub(state: LinkState, sent: list, fail: bool = False) -> tuple[RequestHub, ListJournal]:
    def send(frames, rank=0):
        if fail:
            raise ConnectionError("gone")
        sent.append(frames)

    journal = ListJournal()
    return RequestHub(link=_Link(state), codec=vllm.VllmCodec(), send_frames=send, journal=journal), journal


def test_release_sends_a_pre_aborted_add_carrying_the_params():
    sent: list = []
    hub, journal = _hub(LinkState.SERVING, sent)
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "abc"}
    assert hub.release_kv("abc", params, 1.5)
    assert hub.release_kv("abc", params, 1.6), "a second refusal of the same id gets its own engine id"
    adds = [vllm.decode_input(frames[0], frames[1]).request for frames in sent]
    assert [a.request_id for a in adds] == [f"{KV_RELEASE_REQUEST_PREFIX}1-abc", f"{KV_RELEASE_REQUEST_PREFIX}2-abc"]
    add = adds[0]
    assert add.abort_immediately is True
    assert add.prompt_token_ids == [0] and add.sampling_params.max_tokens == 1
    assert add.sampling_params.extra_args == {"kv_transfer_params": params}
    assert [(kind, payload["request_id"], payload["sent"]) for _, _, kind, payload in journal.records] == [
        ("engine.kv_release", "abc", True), ("engine.kv_release", "abc", True)]
    assert hub.active_requests == 0 and not hub.by_engine_id, "a release is never a call"


def test_release_waits_for_an_engine_that_is_up_and_survives_one_that_is_gone():
    for state in (LinkState.STARTING, LinkState.STOPPED, LinkState.FAILED):
        sent: list = []
        hub, journal = _hub(state, sent)
        assert not hub.release_kv("r", {"do_remote_prefill": True}, 0.0)
        assert sent == [] and journal.records == []
    hub, journal = _hub(LinkState.DRAINING, [], fail=True)
    assert not hub.release_kv("r", {"do_remote_prefill": True}, 0.0)
    assert journal.records[-1][3]["sent"] is False and hub.send_errors == 1


def test_no_client_id_may_take_the_release_prefix():
    with pytest.raises(ClientError, match="reserved"):
        check_request_id("request_id", f"{KV_RELEASE_REQUEST_PREFIX}1-x", LIMITS)


# -- the sim engine's connector ------------------------------------------------------------


def _add(core: SimEngineCore, rid: str, prompt: list[int], params: dict | None, **extra) -> None:
    spec = GenerateSpec(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=2, ignore_eos=True),
                        kv_transfer_params=params, **extra)
    frames = vllm.VllmCodec().encode_add(spec)
    assert core.handle_input(frames[0], frames[1], 0.0) == []


def _run(core: SimEngineCore) -> list:
    outputs = []
    now = 0.0
    while core.has_work:
        messages, _ = core.step(now)
        for message in messages:
            outputs += msgspec.msgpack.decode(message[0], type=vllm.EngineCoreOutputs).outputs
        now += 0.01
    return outputs


def test_sim_connector_echoes_params_on_the_finishing_output_only():
    core = SimEngineCore(SimConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_engine_id="p0", block_size=4))
    _add(core, "prefill", list(range(3, 13)), {"do_remote_decode": True, "tag": 1})
    _add(core, "plain", [5, 6], None)
    outputs = _run(core)
    finished = {o.request_id: o.kv_transfer_params for o in outputs if o.finish_reason is not None}
    assert [o.kv_transfer_params for o in outputs if o.finish_reason is None] == [None, None]
    assert finished == {
        "prefill": {"do_remote_decode": False, "do_remote_prefill": True, "tag": 1, "remote_block_ids": [0, 1, 2],
                    "remote_engine_id": "p0", "remote_request_id": "prefill", "remote_host": "127.0.0.1",
                    "remote_port": 14579},
        "plain": None,
    }


def test_sim_without_a_connector_ignores_params_as_vllm_does():
    core = SimEngineCore(SimConfig())
    _add(core, "r", [5, 6, 7], {"do_remote_decode": True})
    assert all(o.kv_transfer_params is None for o in _run(core))


def test_sim_runs_nothing_for_a_pre_aborted_add():
    core = SimEngineCore(SimConfig(kv_connector="NixlConnector", kv_role="kv_consumer"))
    _add(core, "release", [0], {"do_remote_prefill": True}, abort_immediately=True)
    assert not core.has_work and core.kv_releases == 1
    assert _run(core) == []


def test_sim_engine_reads_kv_transfer_config_as_vllm_does():
    import argparse

    from enginelink.tools.sim_engine import _kv_transfer_config

    assert _kv_transfer_config('{"password": "x"}') is None, "no kv_connector: no connector, as in vLLM"
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "e"}
    assert _kv_transfer_config(json.dumps(config)) == config
    for bad in ('{"kv_connector": "NixlConnector"}', '{"kv_connector": "N", "kv_role": "boss"}', "[1]", "{nope",
                '{"kv_connector": 7, "kv_role": "kv_both"}'):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            _kv_transfer_config(bad)
        assert "nope" not in str(refused.value)


class _ReleaseHub:
    def __init__(self) -> None:
        self.released: list[tuple[str, dict]] = []

    def release_kv(self, request_id: str, params: dict, now: float) -> bool:
        self.released.append((request_id, params))
        return True


def test_only_final_refusals_release_the_prefill_sides_kv():
    from types import SimpleNamespace

    from enginelink.runtime.errors import DuplicateRequest, Unavailable
    from enginelink.runtime.contracts.vllm.edge import VLLM_EDGE
    from enginelink.runtime.requests.generate import release_refused_kv

    params = {"do_remote_prefill": True, "remote_request_id": "p"}
    request = _request(kv_transfer_params_json=json.dumps(params))
    final = [ClientError("sampling_params.max_tokens", "must be at least 1"), DuplicateRequest("in flight")]
    retry = [Unavailable("4096 requests in flight", reason="capacity"), Unavailable("starting"),
             ClientError("request_id", "must not start with 'smg-kv-release-'")]
    for error in final + retry:
        app = SimpleNamespace(hub=_ReleaseHub())
        release_refused_kv(app, request, error, 0.0, VLLM_EDGE)
        assert app.hub.released == ([("r", params)] if error in final else []), error

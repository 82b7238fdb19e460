"""PD params as an attack surface: the release prefix, the legacy message, and releases a client provokes.

Attacked several ways each: the early release's reserved engine-id prefix
through Generate and Abort (as it is, with a choice suffix, as a release's
exact id); the legacy ``KvTransferParams`` with an oversized host (ASCII,
multi-byte, 8 MB), ports out of range, and alongside a valid JSON field; and
the releases themselves: a client that sends many refused decode legs gets
one pre-aborted ADD per refusal, each under its own id, never one that names
a call, and never a release for params that are not a readable object.
"""

from __future__ import annotations

import json

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.states import LinkState
from enginelink.machines.link import KV_RELEASE_REQUEST_PREFIX
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.inputs import InputLimits, validate_abort_ids
from enginelink.runtime.contracts.vllm.kv_transfer import params_for_release
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import vllm
from tests.harness import ListJournal, generate_request

LIMITS = InputLimits()
ENGINE = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))


def _refused(request: pb.GenerateRequest) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate_generate(request, ENGINE, 0.0)
    return error.value


@pytest.mark.parametrize("request_id", [KV_RELEASE_REQUEST_PREFIX, KV_RELEASE_REQUEST_PREFIX + "1-x",
                                        KV_RELEASE_REQUEST_PREFIX + "7-victim#0"])
def test_the_release_prefix_is_refused_in_generate_and_abort(request_id):
    error = _refused(generate_request(request_id, [5, 6], max_tokens=2))
    assert error.field == "request_id" and "reserved" in str(error)
    with pytest.raises(ClientError, match="reserved"):
        validate_abort_ids(["fine", request_id], LIMITS)


@pytest.mark.parametrize("host", ["h" * (LIMITS.kv_transfer_params_bytes + 1),
                                  "é" * (LIMITS.kv_transfer_params_bytes // 2 + 1), "x" * (8 << 20)])
def test_an_oversized_legacy_host_is_refused_without_echoing_it(host):
    request = generate_request("r", [5, 6], max_tokens=2)
    request.kv_transfer_params.remote_host, request.kv_transfer_params.remote_port = host, 5600
    error = _refused(request)
    assert error.field == "kv_transfer_params.remote_host"
    assert "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES" in str(error) and len(str(error)) < 200


@pytest.mark.parametrize("port", [0, 65536, 2**32 - 1])
def test_a_legacy_port_out_of_range_is_refused_but_a_valid_json_field_wins_over_it(port):
    request = generate_request("r", [5, 6], max_tokens=2)
    request.kv_transfer_params.remote_host, request.kv_transfer_params.remote_port = "h", port
    assert _refused(request).field == "kv_transfer_params"
    request.kv_transfer_params_json = '{"remote_host": "h", "remote_port": 1}'
    (spec,) = validate_generate(request, ENGINE, 0.0).specs
    assert spec.kv_transfer_params == {"remote_host": "h", "remote_port": 1}


class _Link:
    name = "engine"
    state = LinkState.SERVING


def test_a_flood_of_refused_decode_legs_costs_one_add_each_under_distinct_ids():
    sent: list = []
    hub = RequestHub(link=_Link(), codec=vllm.VllmCodec(), send_frames=lambda frames, rank=0: sent.append(frames), journal=ListJournal())
    params = {"do_remote_prefill": True}
    for _ in range(1000):
        hub.release_kv("same-id", params, 0.0)
    ids = [vllm.decode_input(frames[0], frames[1]).request.request_id for frames in sent]
    assert len(ids) == len(set(ids)) == 1000 == hub.kv_releases
    assert all(i.startswith(KV_RELEASE_REQUEST_PREFIX) for i in ids)
    assert not hub.by_engine_id and not hub.calls, "no release becomes a call the hub tracks"


@pytest.mark.parametrize("text", ["[{\"do_remote_prefill\": true}]", '"do_remote_prefill"', "{bad",
                                  '{"do_remote_prefill": true' + " " * LIMITS.kv_transfer_params_bytes + "}",
                                  '{"a":' * 100 + '{"do_remote_prefill": true}' + "}" * 100])
def test_unreadable_or_oversized_params_provoke_no_release(text):
    request = generate_request("r", [5, 6], max_tokens=2)
    request.kv_transfer_params_json = text
    assert params_for_release(request, LIMITS) is None
    request.kv_transfer_params_json = json.dumps({"do_remote_prefill": True})
    assert params_for_release(request, LIMITS) == {"do_remote_prefill": True}
